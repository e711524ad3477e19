//! The engine's view of a model: per-sequence KV state, a prefill, and one batched decode step.
//! `Llama` is the real implementation; the scheduler's tests use a tiny stand-in.

use candle_core::Tensor;

use crate::model::{Llama, SeqKv};

pub trait Forward {
    type Kv: KvState + Send;
    /// A cache for `capacity` tokens in the KV blocks `blocks` (the pool's ids), holding
    /// `cached`: the tokens its first blocks already hold (a shared prefix; empty unless
    /// `shares_blocks`).
    fn new_kv(&self, blocks: &[u32], capacity: usize, cached: &[u32]) -> anyhow::Result<Self::Kv>;
    /// Whether a block written for one sequence can be read by another (the paged arena): what
    /// prefix caching needs.
    fn shares_blocks(&self) -> bool;
    /// Grow to `capacity` tokens in `blocks` (the blocks it had, then new ones).
    fn grow_kv(&self, kv: &mut Self::Kv, blocks: &[u32], capacity: usize) -> anyhow::Result<()>;
    /// Cut back to the first `blocks` of those it had and `capacity` tokens, keeping the
    /// positions before that (what a sequence's own blocks hold when it gives back borrowed ones).
    fn shrink_kv(&self, kv: &mut Self::Kv, blocks: &[u32], capacity: usize) -> anyhow::Result<()>;
    /// Feed `tokens` into the cache after what it holds (a whole prompt, or the next chunk of
    /// one); logits of the last token fed.
    fn prefill(&self, tokens: &[u32], kv: &mut Self::Kv) -> anyhow::Result<Vec<f32>>;
    /// Logits, one row per sequence.
    fn decode(&self, tokens: &[u32], kvs: &mut [&mut Self::Kv]) -> anyhow::Result<Vec<Vec<f32>>>;
}

pub trait KvState {
    /// Tokens cached.
    fn len(&self) -> usize;
    /// Tokens the cache may hold (what the sequence's KV blocks pay for).
    fn capacity(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl KvState for SeqKv {
    fn len(&self) -> usize {
        SeqKv::len(self)
    }
    fn capacity(&self) -> usize {
        SeqKv::capacity(self)
    }
}

impl Forward for Llama {
    type Kv = SeqKv;
    fn new_kv(&self, blocks: &[u32], capacity: usize, cached: &[u32]) -> anyhow::Result<SeqKv> {
        Llama::new_kv(self, blocks, capacity)?.starting_at(cached.len())
    }
    fn shares_blocks(&self) -> bool {
        self.is_paged()
    }
    fn grow_kv(&self, kv: &mut SeqKv, blocks: &[u32], capacity: usize) -> anyhow::Result<()> {
        Llama::grow_kv(self, kv, blocks, capacity)
    }
    fn shrink_kv(&self, kv: &mut SeqKv, blocks: &[u32], capacity: usize) -> anyhow::Result<()> {
        Llama::shrink_kv(self, kv, blocks, capacity)
    }
    fn prefill(&self, tokens: &[u32], kv: &mut SeqKv) -> anyhow::Result<Vec<f32>> {
        Ok(Llama::prefill(self, tokens, kv)?.to_vec1::<f32>()?)
    }
    fn decode(&self, tokens: &[u32], kvs: &mut [&mut SeqKv]) -> anyhow::Result<Vec<Vec<f32>>> {
        let logits: Tensor = Llama::decode(self, tokens, kvs)?;
        Ok(logits.to_vec2::<f32>()?)
    }
}
