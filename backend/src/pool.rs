//! The KV block pool: the backend's allocator for KV cache, with a hard byte budget.
//!
//! Design: `total` blocks of `block_tokens` tokens each; a flat `Vec<u32>` links free blocks by
//! index (`next[i]` is the free block after `i`), so allocation and release are O(blocks moved)
//! with no per-block heap objects. An `Allocation` owns its block ids and returns them to the
//! pool when dropped, so a sequence that ends for any reason (finished, cancelled, client gone,
//! error) frees its KV.
//!
//! Costs: `allocate(n)` O(n), all-or-nothing; `grow(n)` O(n); drop and `release` O(held);
//! stats O(1).
//! Invariant (checked by `check` in tests, `debug_assert!` on every operation): the free list
//! has exactly `free` entries, no block is both free and held.

use std::sync::{Arc, Mutex, MutexGuard};

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct State {
    next: Vec<u32>,
    free_head: u32,
    free: u32,
}

/// Shared handle to the pool. Cloning shares the same blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    state: Arc<Mutex<State>>,
    total: u32,
    pub block_tokens: u32,
    pub block_bytes: u64,
}

/// The pool's state as the lease report carries it (one type for the wire and the pool).
pub use kvgate_core::wire::PoolReport as PoolStats;

/// Blocks held by one sequence; returned to the pool on drop.
#[derive(Debug)]
pub struct Allocation {
    pool: BlockPool,
    blocks: Vec<u32>,
}

impl BlockPool {
    /// A pool of `budget_bytes / block_bytes` blocks.
    pub fn new(budget_bytes: u64, block_tokens: u32, bytes_per_token: u64) -> BlockPool {
        let block_bytes = bytes_per_token
            .saturating_mul(u64::from(block_tokens))
            .max(1);
        let total = u32::try_from(budget_bytes / block_bytes).unwrap_or(NIL - 1);
        let next = (0..total)
            .map(|i| if i + 1 < total { i + 1 } else { NIL })
            .collect();
        BlockPool {
            state: Arc::new(Mutex::new(State {
                next,
                free_head: if total > 0 { 0 } else { NIL },
                free: total,
            })),
            total,
            block_tokens,
            block_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the free list itself is still consistent
        // (every mutation below completes before it can panic).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn blocks_for(&self, tokens: u64) -> u32 {
        u32::try_from(tokens.div_ceil(u64::from(self.block_tokens))).unwrap_or(u32::MAX)
    }

    pub fn stats(&self) -> PoolStats {
        let free = self.lock().free;
        let used = self.total - free;
        PoolStats {
            blocks_total: self.total,
            blocks_free: free,
            block_tokens: self.block_tokens,
            block_bytes: self.block_bytes,
            capacity_bytes: u64::from(self.total) * self.block_bytes,
            used_bytes: u64::from(used) * self.block_bytes,
            free_bytes: u64::from(free) * self.block_bytes,
            promised_bytes: 0,
        }
    }

    /// Take `n` blocks, all or nothing.
    pub fn allocate(&self, n: u32) -> Option<Allocation> {
        let mut a = Allocation {
            pool: self.clone(),
            blocks: Vec::new(),
        };
        if self.take(n, &mut a.blocks) {
            Some(a)
        } else {
            None
        }
    }

    fn take(&self, n: u32, out: &mut Vec<u32>) -> bool {
        let mut s = self.lock();
        if s.free < n {
            return false;
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let b = s.free_head;
            s.free_head = s.next.get(b as usize).copied().unwrap_or(NIL);
            out.push(b);
        }
        s.free -= n;
        debug_assert!(s.free > 0 || s.free_head == NIL);
        true
    }

    fn give_back(&self, blocks: &[u32]) {
        let mut s = self.lock();
        for &b in blocks {
            let head = s.free_head;
            if let Some(slot) = s.next.get_mut(b as usize) {
                *slot = head;
                s.free_head = b;
                s.free += 1;
            }
        }
        debug_assert!(s.free <= self.total);
    }

    /// Walk the free list: its length must equal the free count and hold no duplicates.
    #[cfg(test)]
    pub fn check(&self) -> Result<(), String> {
        let s = self.lock();
        let mut seen = vec![false; self.total as usize];
        let mut n = 0;
        let mut at = s.free_head;
        while at != NIL {
            let slot = seen
                .get_mut(at as usize)
                .ok_or("free list points outside the pool")?;
            if *slot {
                return Err(format!("block {at} twice in the free list"));
            }
            *slot = true;
            n += 1;
            at = s.next[at as usize];
        }
        if n != s.free {
            return Err(format!("free list has {n} blocks, count says {}", s.free));
        }
        Ok(())
    }
}

impl Allocation {
    pub fn blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Its block ids, in the order it took them (a sequence's block table).
    pub fn ids(&self) -> &[u32] {
        &self.blocks
    }

    /// Tokens these blocks can hold.
    pub fn tokens(&self) -> u64 {
        u64::from(self.blocks()) * u64::from(self.pool.block_tokens)
    }

    pub fn bytes(&self) -> u64 {
        u64::from(self.blocks()) * self.pool.block_bytes
    }

    /// Take `n` more blocks, all or nothing.
    pub fn grow(&mut self, n: u32) -> bool {
        let pool = self.pool.clone();
        pool.take(n, &mut self.blocks)
    }

    /// Make room for `tokens` tokens, taking blocks as needed.
    pub fn ensure_tokens(&mut self, tokens: u64) -> bool {
        let want = self.pool.blocks_for(tokens);
        want <= self.blocks() || self.grow(want - self.blocks())
    }

    /// Give back the blocks beyond those `tokens` tokens need (an elastic sequence returning
    /// what it borrowed past its reservation).
    pub fn shrink_to_tokens(&mut self, tokens: u64) {
        let keep = self.pool.blocks_for(tokens) as usize;
        if keep < self.blocks.len() {
            let extra = self.blocks.split_off(keep);
            self.pool.give_back(&extra);
        }
    }

    /// Give every block back now and keep an empty allocation (a sequence preempted to be
    /// recomputed later holds no KV while it waits).
    pub fn release(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.pool.give_back(&blocks);
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.pool.give_back(&self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn budget_sets_the_block_count() {
        // SmolLM2 f32: 46,080 B/token x 16 = 737,280 B per block.
        let p = BlockPool::new(10 * 737_280 + 5, 16, 46_080);
        let s = p.stats();
        assert_eq!(
            (s.blocks_total, s.blocks_free, s.block_bytes),
            (10, 10, 737_280)
        );
        assert_eq!(p.blocks_for(0), 0);
        assert_eq!(p.blocks_for(16), 1);
        assert_eq!(p.blocks_for(17), 2);
    }

    #[test]
    fn exhaustion_is_all_or_nothing_and_drop_frees() {
        let p = BlockPool::new(4 * 16, 16, 1);
        let a = p.allocate(3).unwrap();
        assert!(p.allocate(2).is_none(), "all or nothing");
        assert_eq!(p.stats().blocks_free, 1);
        let mut b = p.allocate(1).unwrap();
        assert!(!b.grow(1));
        assert_eq!(b.blocks(), 1, "a failed grow takes nothing");
        drop(a);
        assert!(b.ensure_tokens(40));
        assert_eq!((b.blocks(), b.tokens()), (3, 48));
        assert_eq!(p.stats().blocks_free, 1);
        b.release();
        assert_eq!((b.blocks(), p.stats().blocks_free), (0, 4));
        assert!(b.ensure_tokens(16), "a released allocation grows again");
        drop(b);
        assert_eq!(p.stats().blocks_free, 4);
        p.check().unwrap();
    }

    proptest! {
        #[test]
        fn invariants_under_random_sequences(ops in proptest::collection::vec((0u8..3, 0u32..6), 1..200)) {
            let p = BlockPool::new(32 * 16, 16, 1);
            let mut held: Vec<Allocation> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => if let Some(a) = p.allocate(n) { held.push(a) },
                    1 => if !held.is_empty() { held.swap_remove(n as usize % held.len()); },
                    _ => if let Some(a) = held.last_mut() { a.grow(n); },
                }
                let in_use: u32 = held.iter().map(|a| a.blocks()).sum();
                prop_assert_eq!(p.stats().blocks_free, 32 - in_use);
                prop_assert!(p.check().is_ok());
            }
            held.clear();
            prop_assert_eq!(p.stats().blocks_free, 32);
        }
    }
}
