//! The KV block pool: the backend's allocator for KV cache, with a hard byte budget, and its
//! prefix cache.
//!
//! Design: `total` blocks of `block_tokens` tokens each; a flat `Vec<u32>` links free blocks by
//! index (`next[i]` is the free block after `i`), so allocation and release are O(blocks moved)
//! with no per-block heap objects. An `Allocation` owns references to its block ids and gives
//! them back when dropped, so a sequence that ends for any reason (finished, cancelled, client
//! gone, error) frees its KV.
//!
//! Prefix cache: a full block of a prompt is keyed by a hash chained over the token ids of every
//! block up to it ([`BlockPool::prefix_hashes`], keyed per process so no client can aim at
//! another's hash). Once written, a block is registered under its hash (`Allocation::register`);
//! a later prompt that starts with the same blocks takes references to them
//! (`Allocation::adopt`) and skips their prefill. A block is given back to the pool when its
//! last reference goes: unregistered, to the free list; registered, to the cached list, where it
//! still counts as free and is taken (least recently used first, its hash forgotten) only when
//! the free list is empty. A shared block is never written again: a sequence writes only past
//! the prompt blocks it adopted.
//!
//! Costs: `allocate(n)` O(n), all-or-nothing; `grow(n)` O(n log c) (c cached blocks); drop and
//! `release` O(held log c); `adopt` O(hit blocks log c); stats O(1).
//! Invariant (checked by `check` in tests): the free list has exactly `free` entries, no block
//! is both free and held, cached blocks are registered and unreferenced.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct State {
    next: Vec<u32>,
    free_head: u32,
    /// Blocks on the free list (cached blocks are free too: `free + cached.len()`).
    free: u32,
    meta: Vec<Meta>,
    index: HashMap<u64, u32>,
    /// Registered blocks nobody references, by when they were last given back (oldest first).
    cached: BTreeMap<u64, u32>,
    tick: u64,
}

/// One block's sharing.
#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    /// Sequences holding it.
    refs: u32,
    /// The prefix hash it is registered under (0: none).
    hash: u64,
    /// Its key in `cached`, while cached.
    cached_at: u64,
}

/// Shared handle to the pool. Cloning shares the same blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    state: Arc<Mutex<State>>,
    total: u32,
    pub block_tokens: u32,
    pub block_bytes: u64,
    keys: RandomState,
}

/// The pool's state as the lease report carries it (one type for the wire and the pool).
pub use kvgate_core::wire::PoolReport as PoolStats;

/// Blocks held by one sequence; given back to the pool on drop.
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
                meta: vec![Meta::default(); total as usize],
                index: HashMap::new(),
                cached: BTreeMap::new(),
                tick: 0,
            })),
            total,
            block_tokens,
            block_bytes,
            keys: RandomState::new(),
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

    /// The prefix hashes of `tokens`' first `blocks` full blocks: each over its block's token
    /// ids and the hash before it, so equal hashes mean equal prefixes (never 0: 0 is "none").
    pub fn prefix_hashes(&self, tokens: &[u32], blocks: usize) -> Vec<u64> {
        let mut parent = 0u64;
        tokens
            .chunks_exact(self.block_tokens.max(1) as usize)
            .take(blocks)
            .map(|chunk| {
                parent = self.keys.hash_one((parent, chunk)) | 1;
                parent
            })
            .collect()
    }

    pub fn stats(&self) -> PoolStats {
        let free = {
            let s = self.lock();
            s.free + s.cached.len() as u32
        };
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

    /// Blocks kept for their prefix that nobody holds (free, taken last).
    pub fn cached_blocks(&self) -> u32 {
        self.lock().cached.len() as u32
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

    /// Take `n` blocks, all or nothing: from the free list, then the least recently used cached
    /// blocks (their prefixes are forgotten).
    fn take(&self, n: u32, out: &mut Vec<u32>) -> bool {
        let mut s = self.lock();
        if s.free.saturating_add(s.cached.len() as u32) < n {
            return false;
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let b = if s.free_head != NIL {
                let b = s.free_head;
                s.free_head = s.next.get(b as usize).copied().unwrap_or(NIL);
                s.free -= 1;
                b
            } else {
                let Some((_, b)) = s.cached.pop_first() else {
                    break;
                };
                let h = s
                    .meta
                    .get_mut(b as usize)
                    .map_or(0, |m| std::mem::take(&mut m.hash));
                s.index.remove(&h);
                b
            };
            if let Some(m) = s.meta.get_mut(b as usize) {
                m.refs = 1;
            }
            out.push(b);
        }
        debug_assert!(s.free > 0 || s.free_head == NIL);
        true
    }

    /// Take a reference to each cached block `hashes` name, in order, up to the first that is
    /// not cached; their ids.
    fn adopt(&self, hashes: &[u64], out: &mut Vec<u32>) -> usize {
        let mut s = self.lock();
        let mut n = 0;
        for h in hashes {
            let Some(&b) = s.index.get(h) else {
                break;
            };
            let Some(m) = s.meta.get_mut(b as usize) else {
                break;
            };
            m.refs += 1;
            if m.refs == 1 {
                let at = m.cached_at;
                s.cached.remove(&at);
            }
            out.push(b);
            n += 1;
        }
        n
    }

    /// Whether a written block is cached under `hash` (for a sequence deciding whether to wait
    /// for a prefix another one is writing).
    pub fn is_cached(&self, hash: u64) -> bool {
        self.lock().index.contains_key(&hash)
    }

    /// Give references back, last block first: of a cached prefix the tail is then the least
    /// recently used, and taken first, and what is kept still starts the prompt (vLLM frees in
    /// the same order).
    fn give_back(&self, blocks: &[u32]) {
        let mut s = self.lock();
        for &b in blocks.iter().rev() {
            let i = b as usize;
            s.tick += 1;
            let (tick, head) = (s.tick, s.free_head);
            let Some(m) = s.meta.get_mut(i) else {
                continue;
            };
            m.refs = m.refs.saturating_sub(1);
            if m.refs > 0 {
                continue;
            }
            if m.hash != 0 {
                m.cached_at = tick;
                s.cached.insert(tick, b);
            } else if let Some(slot) = s.next.get_mut(i) {
                *slot = head;
                s.free_head = b;
                s.free += 1;
            }
        }
        debug_assert!(s.free + s.cached.len() as u32 <= self.total);
    }

    /// Walk the free list: its length must equal the free count and hold no duplicates; cached
    /// blocks are registered and unreferenced; held blocks are on neither list.
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
            let m = s.meta[at as usize];
            if m.refs != 0 || m.hash != 0 {
                return Err(format!("free block {at} is held or registered"));
            }
            at = s.next[at as usize];
        }
        if n != s.free {
            return Err(format!("free list has {n} blocks, count says {}", s.free));
        }
        for &b in s.cached.values() {
            let i = b as usize;
            let m = s.meta[i];
            if seen[i] || m.refs != 0 || s.index.get(&m.hash) != Some(&b) {
                return Err(format!("cached block {b} is free, held or unregistered"));
            }
            seen[i] = true;
        }
        for (i, seen) in seen.iter().enumerate() {
            if !seen && s.meta[i].refs == 0 {
                return Err(format!("block {i} is neither free, cached nor held"));
            }
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

    /// Take references to the cached blocks that start `hashes` (as many as are cached, in
    /// order) after the blocks it holds; how many. Only an allocation holding nothing but
    /// adopted blocks adopts more (a block's position is its place in the prompt).
    pub fn adopt(&mut self, hashes: &[u64]) -> usize {
        let pool = self.pool.clone();
        pool.adopt(hashes, &mut self.blocks)
    }

    /// Its `i`th block now holds the prompt block `hash` names: cached under it, unless another
    /// block is already (this one then stays its own).
    pub fn register(&self, i: usize, hash: u64) {
        let Some(&b) = self.blocks.get(i) else {
            return;
        };
        let mut s = self.pool.lock();
        if s.index.contains_key(&hash) {
            return;
        }
        if let Some(m) = s.meta.get_mut(b as usize).filter(|m| m.hash == 0) {
            m.hash = hash;
            s.index.insert(hash, b);
        }
    }

    /// Its first blocks that are cached under a prefix hash (written once, shared with every
    /// sequence whose prompt starts with them).
    pub fn cached_prefix_blocks(&self) -> usize {
        let s = self.pool.lock();
        self.blocks
            .iter()
            .take_while(|b| s.meta.get(**b as usize).is_some_and(|m| m.hash != 0))
            .count()
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

    #[test]
    fn a_registered_prefix_is_shared_kept_as_free_room_and_evicted_last_used_first() {
        let p = BlockPool::new(6 * 4, 4, 1);
        let prompt: Vec<u32> = (0..13).collect();
        let hashes = p.prefix_hashes(&prompt, 3);
        assert_eq!(hashes.len(), 3);
        assert_eq!(
            p.prefix_hashes(&prompt[..8], 9),
            hashes[..2],
            "chained, full blocks only"
        );
        let mut other = prompt.clone();
        other[0] = 99;
        assert_ne!(
            p.prefix_hashes(&other, 3)[2],
            hashes[2],
            "a block's hash covers the prefix"
        );

        let mut a = p.allocate(0).unwrap();
        assert_eq!(a.adopt(&hashes), 0, "nothing cached yet");
        assert!(a.grow(4));
        for (i, h) in hashes.iter().enumerate() {
            a.register(i, *h);
        }
        let mut b = p.allocate(0).unwrap();
        assert_eq!(b.adopt(&hashes), 3, "the same prompt shares all three");
        assert!(b.grow(1));
        assert_eq!(b.ids()[..3], a.ids()[..3]);
        assert_eq!(
            p.stats().blocks_free,
            1,
            "4 + 1 blocks held, 3 of them shared"
        );
        drop(a);
        assert_eq!(p.stats().blocks_free, 2, "only a's own block went back");
        drop(b);
        assert_eq!((p.stats().blocks_free, p.cached_blocks()), (6, 3));
        p.check().unwrap();

        // Cached blocks are free room, taken after the free list, least recently used first.
        let c = p.allocate(4).unwrap();
        assert_eq!(
            p.cached_blocks(),
            2,
            "three free blocks, then one cached one"
        );
        let mut d = p.allocate(0).unwrap();
        assert_eq!(
            d.adopt(&hashes),
            2,
            "the last block went first; the prefix's head is kept"
        );
        assert!(!p.is_cached(hashes[2]));
        drop((c, d));
        p.check().unwrap();
    }

    proptest! {
        #[test]
        fn invariants_with_shared_prefixes(ops in proptest::collection::vec((0u8..4, 0u32..6), 1..200)) {
            let p = BlockPool::new(16 * 2, 2, 1);
            let prompts: Vec<Vec<u32>> = (0..3u32).map(|k| (0..12).map(|i| i / (4 + k)).collect()).collect();
            let mut held: Vec<Allocation> = Vec::new();
            for (op, n) in ops {
                let hashes = p.prefix_hashes(&prompts[n as usize % 3], 6);
                match op {
                    0 => {
                        let mut a = p.allocate(0).unwrap();
                        let k = a.adopt(&hashes);
                        if a.grow(6 - k as u32) {
                            for (i, h) in hashes.iter().enumerate() {
                                a.register(i, *h);
                            }
                            held.push(a);
                        }
                    }
                    1 => if !held.is_empty() { held.swap_remove(n as usize % held.len()); },
                    2 => if let Some(a) = held.last_mut() { a.grow(n); },
                    _ => if let Some(a) = held.first_mut() { a.shrink_to_tokens(u64::from(n)); },
                }
                prop_assert!(p.check().is_ok(), "{:?}", p.check());
            }
            held.clear();
            prop_assert_eq!(p.stats().blocks_free, 16);
            prop_assert!(p.check().is_ok());
        }
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
