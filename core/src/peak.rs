//! The time-aware worst case (issue 49; docs/admission.md, "Priced over time";
//! docs/design/015-time-aware-worst-case.md).
//!
//! A lease is priced at prompt + cap, the most it can ever hold. But a sequence that is
//! decoding grows by at most one token per engine step, and one with `r` tokens left to its cap
//! has ended within `r` steps: the most the decoding sequences can hold *at once* is the peak,
//! over the steps to come, of what each can hold by then. Sequences far from their caps are far
//! from them for as long as the ones about to end still hold theirs, so the peak is often well
//! below the sum of the caps, and the difference can be promised to new requests without
//! giving up the guarantee: even if every admitted request runs to its cap, nothing runs out.
//!
//! What this assumes, and who keeps it:
//! - Every decoding sequence decodes in every step until it ends (one batch, no step skipped
//!   for it): the backend decodes all of its running sequences each step and starts a new one
//!   only below its batch limit; it never preempts one within its reservation.
//! - Sequences not decoding (waiting, part-way through a prefill, preempted, elastic ones that
//!   may be preempted) are counted at the most they may hold, for ever: callers leave them out
//!   of [`peak`] and add their whole reservations.
//! - Progress read from a report is as of the report: what has run since only brings the ends
//!   closer, so a peak computed then bounds every later step.

/// One decoding sequence as [`peak`] reads it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Growth {
    /// What it may hold now (with the rounding of its last block).
    pub now: u64,
    /// What one more token adds.
    pub per_step: u64,
    /// The most it can hold (its reservation: prompt + cap, rounded to blocks).
    pub most: u64,
    /// Steps until it has ended at the latest (tokens left to its cap). It holds its bytes
    /// through step `steps_left` and nothing after.
    pub steps_left: u64,
}

impl Growth {
    /// What it may hold `k` steps from now.
    pub fn at(&self, k: u64) -> u64 {
        if k > self.steps_left {
            return 0;
        }
        self.now
            .saturating_add(k.saturating_mul(self.per_step))
            .min(self.most)
    }
}

/// More sequences than this are priced at the sum of what each can hold (no time-awareness):
/// [`peak`] is quadratic, and runs where a report is applied and where a backend admits.
pub const MAX_SEQUENCES: usize = 1024;

/// The most `seqs` can hold at once from now on. Exact for the [`Growth`] model: between two
/// ends every sequence still there only grows, so the peak is at one of the ends (the step a
/// sequence holds the most, just before it is gone), and those are all evaluated.
/// Never above the sum of `most`.
pub fn peak(seqs: &[Growth]) -> u64 {
    let whole = seqs.iter().map(|g| g.most).fold(0u64, u64::saturating_add);
    if seqs.len() > MAX_SEQUENCES {
        return whole;
    }
    // Each distinct end once: sequences never counted on to end share one (`u64::MAX`).
    let mut ends: Vec<u64> = seqs.iter().map(|g| g.steps_left).collect();
    ends.sort_unstable();
    ends.dedup();
    ends.iter()
        .map(|&k| seqs.iter().map(|g| g.at(k)).fold(0u64, u64::saturating_add))
        .max()
        .unwrap_or(0)
        .min(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn g(now: u64, most: u64, steps_left: u64) -> Growth {
        Growth {
            now,
            per_step: 1,
            most,
            steps_left,
        }
    }

    #[test]
    fn one_about_to_end_makes_room_for_one_far_from_its_cap() {
        // 700 tokens ending in 10 steps, and a chat at 30 of 700: at most 740 at once (step 10),
        // or 700 later, never 1,400.
        let seqs = [g(700, 700, 10), g(30, 700, 670)];
        assert_eq!(peak(&seqs), 740);
        assert_eq!(1_400 - peak(&seqs), 660);
    }

    #[test]
    fn sequences_alike_save_nothing() {
        let seqs = [g(100, 200, 100), g(100, 200, 100)];
        assert_eq!(peak(&seqs), 400);
        assert_eq!(peak(&[]), 0);
    }

    #[test]
    fn too_many_sequences_are_priced_whole() {
        let seqs = vec![g(1, 10, 9); MAX_SEQUENCES + 1];
        assert_eq!(peak(&seqs), 10 * (MAX_SEQUENCES as u64 + 1));
    }

    proptest! {
        /// Lockstep: every sequence gains a token each step (some stop early, and those that
        /// stop early free what they held); what they hold never exceeds the peak computed at
        /// the start, and the peak never exceeds the sum of the reservations.
        #[test]
        fn what_lockstep_sequences_hold_never_exceeds_the_peak(
            seqs in prop::collection::vec((0u64..300, 1u64..300, 1u64..8, 0u64..400), 0..12),
            block in 1u64..17,
        ) {
            // (prompt, cap, bytes per token, stops after this many steps)
            let blocks = |tokens: u64| tokens.div_ceil(block) * block;
            let growths: Vec<Growth> = seqs.iter().map(|&(prompt, cap, per, _)| Growth {
                now: (prompt + block - 1) * per,
                per_step: per,
                most: blocks(prompt + cap) * per,
                steps_left: cap,
            }).collect();
            let p = peak(&growths);
            prop_assert!(p <= growths.iter().map(|g| g.most).sum::<u64>());
            for k in 0..=300u64 {
                let held: u64 = seqs.iter().map(|&(prompt, cap, per, stop)| {
                    if k > cap || k > stop { 0 } else { blocks(prompt + k) * per }
                }).sum();
                prop_assert!(held <= p, "step {k}: {held} > {p}");
            }
        }
    }
}
