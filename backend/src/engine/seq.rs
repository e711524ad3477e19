//! A sequence the engine holds: its request, its reservation, its blocks and its cache.

use super::*;

pub(super) struct Seq<K> {
    pub(super) id: String,
    pub(super) class: Option<String>,
    /// The prompt's length as the gateway counted it (0: not told), for the lease report.
    pub(super) gateway_prompt_tokens: u64,
    /// Tokens its reservation covers. Taken at admission, it holds at least `promised_blocks`
    /// from admission to end; with lazy blocks, at most that while it waits (and perhaps none).
    /// Blocks beyond are borrowed (elastic growth).
    pub(super) promised: u64,
    pub(super) promised_blocks: u32,
    /// Elastic: its reservation is below prompt + cap.
    pub(super) elastic: bool,
    pub(super) prompt: Vec<u32>,
    pub(super) generated: Vec<u32>,
    pub(super) params: GenParams,
    pub(super) kv: Option<K>,
    pub(super) alloc: Allocation,
    pub(super) text: TextStream,
    pub(super) sampler: Sampler,
    pub(super) events: UnboundedSender<Event>,
    pub(super) arrived: Instant,
    /// Arrival order at the engine: the youngest running sequence is preempted first.
    pub(super) order: u64,
    /// When its last token was sampled (inter-token latency).
    pub(super) last_token: Option<Instant>,
    /// Running but part-way through its prefill: its cache holds the first chunks of
    /// `prefill_tokens`, and it joins the decode batch once the last chunk is in.
    pub(super) prefilling: bool,
    /// Prompt tokens counted as prefilled so far (a prompt fed again after a preemption counts
    /// as recomputed).
    pub(super) prompt_fed: usize,
    /// The prefix hashes of its prompt's full blocks, all but the last token (a prefill feeds
    /// at least one token, for its logits); empty without prefix caching.
    pub(super) prefix: Vec<u64>,
}

impl<K: KvState> Seq<K> {
    pub(super) fn used_tokens(&self) -> u64 {
        self.kv.as_ref().map_or(0, |k| k.len() as u64)
    }

    /// `n` tokens from position `from` of what its prefill runs over: the prompt, and after a
    /// preemption the tokens it generated (all of them: the last one, never fed yet, is what the
    /// skipped decode step would feed).
    pub(super) fn prefill_chunk(&self, from: usize, n: usize) -> Vec<u32> {
        self.prompt
            .iter()
            .chain(&self.generated)
            .skip(from)
            .take(n)
            .copied()
            .collect()
    }

    pub(super) fn prefill_len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }

    /// Its prefix blocks within its reservation: each is promised once among all the live
    /// sequences whose reservations hold it (`Engine::promised_blocks`).
    pub(super) fn counted_prefix(&self) -> &[u64] {
        let n = self.prefix.len().min(self.promised_blocks as usize);
        self.prefix.get(..n).unwrap_or_default()
    }

    /// Give back every block and the cache they hold (recomputed when it runs again).
    pub(super) fn drop_cache(&mut self) {
        self.alloc.release();
        self.kv = None;
    }

    /// Its first blocks that are cached under their prefix hashes (adopted, or written and
    /// registered by it): their positions are written, and never written again.
    pub(super) fn cached_blocks(&self) -> usize {
        self.alloc.cached_prefix_blocks().min(self.prefix.len())
    }

    /// Holds blocks beyond its reservation (counted in blocks: the reservation's last block may
    /// be partly empty and is still its own).
    pub(super) fn overgrown(&self) -> bool {
        self.elastic && self.alloc.blocks() > self.promised_blocks
    }
}
