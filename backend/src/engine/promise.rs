//! What the live reservations promise: the most blocks they can hold at any one step to come
//! (the time-aware worst case, a shared prefix block counted once), which lazy blocks admit
//! against; and the wait that keeps a shared prefix block written once.

use super::*;

impl<M: Forward> Engine<M> {
    /// Blocks the live sequences' reservations will never need at any one step (what
    /// `--lazy-blocks` admits into): the pool less [`Self::promised_blocks`].
    pub(super) fn unpromised_blocks(&self) -> u32 {
        let held = self.promised_blocks(None);
        self.pool.stats().blocks_total.saturating_sub(held)
    }

    /// The most blocks the live sequences' reservations (and `newcomer`'s: its prefix hashes
    /// and reservation) can hold at any one step to come: for the sequences decoding within
    /// their reservations, the peak of what they can hold as each grows a token a step to its
    /// cap and ends (the time-aware worst case, `kvgate_core::peak`: every running sequence
    /// decodes in every step, and none within its reservation is preempted), plus every other
    /// sequence's whole reservation (waiting, part-way through a prefill, elastic ones, which
    /// may stop decoding before they end). Not the newcomer and the waiting ones by their
    /// growth too: live, against the sum of caps in the same run, it made 1.13x the goodput but
    /// completed 50 of 88 requests against 73 (this rule, in another run: 70 against 73; docs/
    /// design/015-time-aware-worst-case.md).
    ///
    /// A prefix block that several reservations hold is counted once, on the holder that may
    /// hold it longest: one counted whole if any, else the decoding one furthest from its end.
    pub(super) fn promised_blocks(&self, newcomer: Option<(&[u64], u32)>) -> u32 {
        let b = u64::from(self.pool.block_tokens.max(1));
        let decoding = |s: &&Seq<M::Kv>| !s.prefilling && !s.elastic && s.kv.is_some();
        let steps_left =
            |s: &Seq<M::Kv>| s.params.max_tokens.saturating_sub(s.generated.len() as u64);
        let mut counted: HashSet<u64> = HashSet::new();
        // Of a reservation's prefix blocks, those another holder counts.
        let mut shared =
            |prefix: &[u64]| prefix.iter().filter(|h| !counted.insert(**h)).count() as u32;
        let mut held: u32 = 0;
        let whole = self
            .running
            .iter()
            .filter(|s| !decoding(s))
            .chain(self.waiting.iter())
            .map(|s| (s.counted_prefix(), s.promised_blocks))
            .chain(newcomer);
        for (prefix, promised) in whole {
            held = held.saturating_add(promised.saturating_sub(shared(prefix)));
        }
        let mut decoders: Vec<&Seq<M::Kv>> = self.running.iter().filter(decoding).collect();
        decoders.sort_by_key(|s| std::cmp::Reverse(steps_left(s)));
        // In tokens, each with its last block's rounding: their sum over B bounds the blocks.
        let growth: Vec<Growth> = decoders
            .into_iter()
            .map(|s| {
                let elsewhere = u64::from(shared(s.counted_prefix())) * b;
                Growth {
                    now: (s.prefill_len() as u64 + 1 + (b - 1)).saturating_sub(elsewhere),
                    per_step: 1,
                    most: (u64::from(s.promised_blocks) * b).saturating_sub(elsewhere),
                    steps_left: steps_left(s),
                }
            })
            .collect();
        let decoding_peak = u32::try_from(peak(&growth) / b).unwrap_or(u32::MAX);
        held.saturating_add(decoding_peak)
    }

    /// Whether waiting sequence `i`, about to start, waits for an older live sequence to write
    /// the next block of its prefix: written twice, it would be held twice where lazy blocks
    /// promised it once and a gateway charged it once. First it takes the blocks of its prefix
    /// cached since it arrived, as long as it holds nothing else (a block's place is its place
    /// in the prompt; a sequence that took blocks at admission writes its prefix itself).
    pub(super) fn waits_for_its_prefix(&mut self, i: usize) -> bool {
        let Some(s) = self.waiting.get_mut(i) else {
            return false;
        };
        let held = s.alloc.blocks() as usize;
        if s.kv.is_some() || held != s.cached_blocks() {
            return false;
        }
        let rest = s.prefix.get(held..).unwrap_or_default();
        let at = held + s.alloc.adopt(rest);
        let order = s.order;
        let Some(&next) = s.prefix.get(at) else {
            return false;
        };
        self.running
            .iter()
            .chain(self.waiting.iter())
            .any(|o| o.order < order && o.prefix.get(at) == Some(&next))
    }

    /// A waiting sequence that does not start now gives back the cached prefix blocks it took
    /// beyond its reservation (all of them under `--admission none`). Held while it waits they
    /// would be blocks no reservation counts, which a running sequence may need to finish:
    /// under `--on-kv-exhaustion recompute` one alone then ended in a KV OOM (found by the
    /// simulator running this engine). They stay cached, to be taken again when it starts.
    pub(super) fn give_back_unreserved(&mut self, i: usize) {
        let b = u64::from(self.pool.block_tokens.max(1));
        if let Some(s) = self.waiting.get_mut(i).filter(|s| s.kv.is_none()) {
            s.alloc.shrink_to_tokens(u64::from(s.promised_blocks) * b);
        }
    }
}
