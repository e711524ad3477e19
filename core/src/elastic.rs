//! Elastic reservations: a class may reserve, instead of its whole output cap, a high quantile
//! of the output lengths its requests actually produced.
//!
//! Worst-case pricing is what makes a mid-decode KV OOM impossible, and its cost is every request
//! that stops early: a 4,000-token cap that ends after 200 tokens held 3,800 tokens of KV nobody
//! used. An elastic class reserves `prompt + min(cap, q-quantile of its recent outputs)` instead.
//! The guarantee moves to the backend: a sequence past its reservation grows only from blocks
//! nobody reserved, and when a reservation needs them back (a new request the ledger admitted, or
//! a worst-case sequence) the backend preempts the youngest sequence that outgrew its reservation
//! and recomputes it later. A worst-case request still never fails mid-decode; an elastic one is
//! at worst delayed. The gateway learns the growth from the backend's report (its use beyond the
//! ledger is held back from admission), so it stops admitting into borrowed blocks within a poll.
//!
//! This module holds the class's rule ([`ElasticPolicy`]) and what a worker learned of a class's
//! outputs ([`OutputLengths`]). Pure; no I/O.

use std::collections::VecDeque;

use crate::error::ConfigError;

/// What a request's lease reserves for its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reservation {
    /// Its whole cap: the request can never run out of KV mid-decode (the default).
    #[default]
    WorstCase,
    /// A learned high quantile of the output lengths this class actually produced, never above
    /// the cap. The backend lets the sequence grow past it from free blocks and takes those
    /// blocks back first when a reservation needs them: recomputed later, its client sees a
    /// delay, never an error.
    Elastic(ElasticPolicy),
}

/// A class's reservation fields as configured (`policy.classes.<name>`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RawReservation<'a> {
    pub reservation: Option<&'a str>,
    pub quantile: Option<f64>,
    pub min_samples: Option<u32>,
    pub prior_tokens: Option<u64>,
    pub by_prompt: Option<bool>,
}

/// An elastic class's rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticPolicy {
    /// The quantile reserved, in thousandths (900: the 0.9 quantile).
    pub quantile_permille: u16,
    /// Finished outputs needed before the quantile is trusted.
    pub min_samples: u32,
    /// Output tokens reserved until then; `None`: the whole cap (worst case) until learned.
    pub prior_tokens: Option<u64>,
    /// Reserve the quantile of the outputs that answered prompts of about the request's length
    /// once `min_samples` of them are kept (else the class's): a class that mixes tasks (a
    /// fan-out whose branches mostly answer in a few tokens, a few of which run to their caps)
    /// does not price every request at its long mode.
    pub by_prompt: bool,
}

impl Default for ElasticPolicy {
    fn default() -> Self {
        ElasticPolicy {
            quantile_permille: 900,
            min_samples: 20,
            prior_tokens: None,
            by_prompt: false,
        }
    }
}

impl ElasticPolicy {
    /// The class's reservation from its raw config; `at` names a field for errors.
    pub(crate) fn from_raw(
        c: &RawReservation<'_>,
        at: &dyn Fn(&str) -> String,
    ) -> Result<Reservation, ConfigError> {
        let elastic = match c.reservation {
            None | Some("worst_case") => false,
            Some("elastic") => true,
            Some(other) => {
                return Err(ConfigError::new(
                    at("reservation"),
                    format!("{other:?}"),
                    "must be \"worst_case\" or \"elastic\"",
                ))
            }
        };
        if !elastic {
            for (f, set) in [
                ("elastic_quantile", c.quantile.is_some()),
                ("elastic_min_samples", c.min_samples.is_some()),
                ("elastic_prior_tokens", c.prior_tokens.is_some()),
                ("elastic_by_prompt", c.by_prompt.is_some()),
            ] {
                if set {
                    return Err(ConfigError::new(
                        at(f),
                        "set",
                        "applies only to reservation \"elastic\"",
                    ));
                }
            }
            return Ok(Reservation::WorstCase);
        }
        let mut p = ElasticPolicy::default();
        if let Some(q) = c.quantile {
            if !(0.5..=1.0).contains(&q) {
                return Err(ConfigError::new(
                    at("elastic_quantile"),
                    q,
                    "must be in 0.5..=1.0",
                ));
            }
            p.quantile_permille = (q * 1000.0).round() as u16;
        }
        if let Some(n) = c.min_samples {
            if !(1..=OUTPUTS_KEPT as u32).contains(&n) {
                return Err(ConfigError::new(
                    at("elastic_min_samples"),
                    n,
                    format!("must be in 1..={OUTPUTS_KEPT}"),
                ));
            }
            p.min_samples = n;
        }
        if let Some(t) = c.prior_tokens {
            if t == 0 {
                return Err(ConfigError::new(
                    at("elastic_prior_tokens"),
                    0,
                    "must be at least 1",
                ));
            }
            p.prior_tokens = Some(t);
        }
        if let Some(b) = c.by_prompt {
            p.by_prompt = b;
        }
        Ok(Reservation::Elastic(p))
    }

    /// Output tokens to reserve for a request capped at `cap`: the learned quantile once there
    /// are enough samples, else the prior, never above the cap and never below one token.
    pub fn allowance(&self, learned: Option<&OutputLengths>, cap: u64) -> u64 {
        let q = learned
            .filter(|l| l.len() >= self.min_samples as usize)
            .and_then(|l| l.quantile(self.quantile_permille));
        q.or(self.prior_tokens).unwrap_or(cap).clamp(1, cap.max(1))
    }

    /// [`Self::allowance`] for a request whose prompt is `prompt_tokens` long (as the gateway
    /// counts it): with `by_prompt`, from the outputs that answered prompts of about that
    /// length once there are `min_samples` of them; else from all the class's.
    pub fn allowance_for(
        &self,
        learned: Option<&OutputLengths>,
        prompt_tokens: u64,
        cap: u64,
    ) -> u64 {
        let like = learned
            .filter(|_| self.by_prompt)
            .map(|l| l.answering(prompt_tokens))
            .filter(|l| l.len() >= self.min_samples as usize);
        self.allowance(like.as_ref().or(learned), cap)
    }
}

/// Finished outputs kept per class.
pub const OUTPUTS_KEPT: usize = 512;

/// The output lengths of a class's most recent finished requests: ones that stopped by
/// themselves, and ones cut at their cap (`at_cap`). A cut-short request (an error, a client
/// abort) says nothing of how long it would have run and is not pushed.
///
/// An output cut at its cap is *censored*: it would have run at least that long. Counting it as
/// if it had stopped there pulls the quantile down whenever a class mixes small and big caps (a
/// hundred requests capped at 16 would make a 0.9 quantile of 16 for the class's 2,000-token
/// requests too). The quantile is therefore read from the Kaplan–Meier estimate of the output
/// length distribution, which lets a censored output count only while it is still running;
/// without censored samples that is exactly the empirical (nearest-rank) quantile.
///
/// Kept in arrival order (to drop the oldest) and sorted (so a quantile, read on every request
/// of an elastic class, is an index without censored samples and one pass over at most
/// [`OUTPUTS_KEPT`] samples with them, not a sort).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputLengths {
    recent: VecDeque<Sample>,
    /// The prompt each of `recent` answered, in tokens as the gateway counted it (0: not known).
    prompts: VecDeque<u64>,
    /// Ascending; at equal lengths an output that stopped by itself comes before one cut at its
    /// cap (an event before a censoring, as Kaplan–Meier counts ties).
    sorted: Vec<Sample>,
    censored: usize,
}

/// (tokens, cut at the cap): ordered as [`OutputLengths::sorted`] needs.
type Sample = (u64, bool);

impl OutputLengths {
    /// An output that stopped by itself after `tokens`.
    pub fn push(&mut self, tokens: u64) {
        self.push_output(tokens, false);
    }

    /// One finished output; `at_cap`: it was cut at its cap (it would have run at least this
    /// long). O(kept): learned at each poll, off the request path.
    pub fn push_output(&mut self, tokens: u64, at_cap: bool) {
        self.push_answer(tokens, at_cap, 0);
    }

    /// [`Self::push_output`] of an output that answered a prompt of `prompt_tokens` (0: not
    /// known).
    pub fn push_answer(&mut self, tokens: u64, at_cap: bool, prompt_tokens: u64) {
        if self.recent.len() == OUTPUTS_KEPT {
            self.prompts.pop_front();
            if let Some(old) = self.recent.pop_front() {
                if let Ok(i) = self.sorted.binary_search(&old) {
                    self.sorted.remove(i);
                    self.censored = self.censored.saturating_sub(usize::from(old.1));
                }
            }
        }
        let sample = (tokens, at_cap);
        self.recent.push_back(sample);
        self.prompts.push_back(prompt_tokens);
        let at = self.sorted.partition_point(|s| *s <= sample);
        self.sorted.insert(at, sample);
        self.censored += usize::from(at_cap);
    }

    pub fn len(&self) -> usize {
        self.recent.len()
    }

    /// The outputs kept that answered prompts of about `prompt_tokens` tokens
    /// ([`crate::reconcile::prompts_alike`]), oldest first. O(kept log kept): read at every
    /// try of an elastic request.
    pub fn answering(&self, prompt_tokens: u64) -> OutputLengths {
        let mut like = OutputLengths::default();
        for (&sample, &p) in self.recent.iter().zip(&self.prompts) {
            if crate::reconcile::prompts_alike(p, prompt_tokens) {
                like.recent.push_back(sample);
                like.prompts.push_back(p);
            }
        }
        like.sorted = like.recent.iter().copied().collect();
        like.sorted.sort_unstable();
        like.censored = like.sorted.iter().filter(|s| s.1).count();
        like
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The `permille`/1000 quantile: the shortest length that at least that share of the
    /// outputs are estimated not to run past (Kaplan–Meier; without censored samples the
    /// nearest rank, rounding up). `None` without samples. When more than the rest of the share
    /// was cut at caps longer than every output that stopped by itself, the estimate never
    /// reaches the share: the longest output kept, a lower bound of the quantile.
    pub fn quantile(&self, permille: u16) -> Option<u64> {
        let n = self.sorted.len();
        let permille = usize::from(permille.min(1000));
        if self.censored == 0 {
            let rank = (n * permille).div_ceil(1000).max(1);
            return self.sorted.get(rank.checked_sub(1)?).map(|s| s.0);
        }
        crate::reconcile::kaplan_meier(self.sorted.iter().copied())
            .map(|law| law.quantile(permille as f64 / 1000.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lengths(v: &[u64]) -> OutputLengths {
        let mut l = OutputLengths::default();
        for t in v {
            l.push(*t);
        }
        l
    }

    #[test]
    fn the_quantile_covers_at_least_its_share_of_the_samples() {
        let l = lengths(&(1..=100).collect::<Vec<_>>());
        assert_eq!(l.quantile(900), Some(90));
        assert_eq!(l.quantile(1000), Some(100));
        assert_eq!(l.quantile(500), Some(50));
        assert_eq!(lengths(&[7]).quantile(900), Some(7));
        assert_eq!(OutputLengths::default().quantile(900), None);
        // 0.9 of 3 samples: rank 3 (two of three would be only 67 %).
        assert_eq!(lengths(&[5, 1, 9]).quantile(900), Some(9));
    }

    #[test]
    fn only_the_latest_outputs_are_kept() {
        let mut l = lengths(&[10_000; OUTPUTS_KEPT]);
        for _ in 0..OUTPUTS_KEPT {
            l.push(3);
        }
        assert_eq!(l.len(), OUTPUTS_KEPT);
        assert_eq!(l.quantile(1000), Some(3));
        // Arrival order and sorted order agree on what is kept.
        let mut l = lengths(&[5, 1, 9]);
        for t in 0..OUTPUTS_KEPT as u64 - 2 {
            l.push(100 + t);
        }
        assert_eq!(
            l.quantile(0),
            Some(1),
            "5 was dropped first, 1 is still kept"
        );
        l.push(1_000);
        assert_eq!(l.quantile(0), Some(9), "then 1");
    }

    #[test]
    fn outputs_cut_at_small_caps_do_not_pull_down_the_quantile_of_long_ones() {
        // 80 requests capped at 16, all cut there; 20 with big caps that stopped at 200..=219.
        let mut l = OutputLengths::default();
        for _ in 0..80 {
            l.push_output(16, true);
        }
        for t in 200..220 {
            l.push(t);
        }
        // Counted as stops, the 0.9 quantile would be 209; counted as "at least 16", every
        // output that stopped by itself stopped at 200 or later, so the estimate is theirs:
        // the 0.9 quantile of 200..=219 (nearest rank 18 of 20).
        assert_eq!(l.quantile(900), Some(217));
        assert_eq!(l.quantile(500), Some(209));
        let naive = lengths(
            &std::iter::repeat_n(16, 80)
                .chain(200..220)
                .collect::<Vec<_>>(),
        );
        assert_eq!(naive.quantile(500), Some(16), "what the old estimate said");
    }

    #[test]
    fn kaplan_meier_counts_a_censored_output_while_it_runs_and_stops_there() {
        // Stops at 1, 3, 5; one cut at 2, one at 4 (the classic worked example):
        // S(1) = 4/5, S(3) = 4/5 * 2/3 = 8/15, S(5) = 0.
        let mut l = OutputLengths::default();
        for (t, cut) in [(1, false), (2, true), (3, false), (4, true), (5, false)] {
            l.push_output(t, cut);
        }
        assert_eq!(l.quantile(200), Some(1), "F(1) = 0.2");
        assert_eq!(l.quantile(201), Some(3), "F(3) = 7/15 = 0.467");
        assert_eq!(l.quantile(467), Some(5));
        assert_eq!(l.quantile(466), Some(3));
        assert_eq!(l.quantile(1000), Some(5));
        // A tie: at equal lengths the stop counts before the cut.
        let mut l = OutputLengths::default();
        for (t, cut) in [(4, true), (4, false)] {
            l.push_output(t, cut);
        }
        assert_eq!(l.quantile(500), Some(4), "S(4) = 1/2");
    }

    #[test]
    fn when_most_outputs_run_to_their_caps_the_quantile_is_the_longest_kept() {
        let mut l = OutputLengths::default();
        for t in [10, 20] {
            l.push(t);
        }
        for t in [300, 350, 399] {
            l.push_output(t, true);
        }
        // F never passes 0.4 (two stops of five at risk from the start).
        assert_eq!(l.quantile(400), Some(20));
        assert_eq!(
            l.quantile(900),
            Some(399),
            "a lower bound: the longest kept"
        );
        // Without censoring the same lengths give the same nearest-rank answer as ever.
        let plain = lengths(&[10, 20, 300, 350, 399]);
        assert_eq!(plain.quantile(900), Some(399));
        assert_eq!(plain.quantile(400), Some(20));
    }

    #[test]
    fn a_censored_output_dropped_from_the_window_is_forgotten() {
        let mut l = OutputLengths::default();
        l.push_output(8, true);
        for t in 0..OUTPUTS_KEPT as u64 - 1 {
            l.push(100 + t % 10);
        }
        assert_eq!(l.censored, 1);
        l.push(100);
        assert_eq!(l.censored, 0);
        assert_eq!(l.len(), OUTPUTS_KEPT);
        assert!(l.sorted.iter().all(|s| !s.1));
    }

    #[test]
    fn the_allowance_is_the_prior_until_learned_and_never_above_the_cap() {
        let p = ElasticPolicy {
            quantile_permille: 900,
            min_samples: 4,
            prior_tokens: Some(64),
            by_prompt: true,
        };
        assert_eq!(p.allowance(None, 1000), 64);
        assert_eq!(p.allowance(Some(&lengths(&[5, 6, 7])), 1000), 64);
        assert_eq!(p.allowance(Some(&lengths(&[5, 6, 7, 300])), 1000), 300);
        assert_eq!(p.allowance(Some(&lengths(&[5, 6, 7, 300])), 100), 100);
        assert_eq!(p.allowance(None, 10), 10);
        let worst = ElasticPolicy {
            prior_tokens: None,
            ..p
        };
        assert_eq!(worst.allowance(None, 1000), 1000);
        assert_eq!(worst.allowance(Some(&lengths(&[0, 0, 0, 0])), 1000), 1);
    }

    #[test]
    fn a_prompt_like_those_that_answered_short_reserves_their_quantile_not_the_classs() {
        // A fan-out class: 34–36-token questions answer in a few tokens, 120-token stories run
        // to their caps; together the class's 0.9 quantile is the long mode.
        let mut l = OutputLengths::default();
        for (prompt, tokens) in [(34, 3), (35, 12), (36, 22), (35, 5), (34, 8), (35, 2)] {
            l.push_answer(tokens, false, prompt);
        }
        for _ in 0..4 {
            l.push_answer(350, true, 120);
        }
        let p = ElasticPolicy {
            quantile_permille: 900,
            min_samples: 5,
            prior_tokens: Some(64),
            by_prompt: true,
        };
        assert_eq!(p.allowance(Some(&l), 1000), 350, "the class's long mode");
        assert_eq!(p.allowance_for(Some(&l), 35, 1000), 22);
        let mut built = OutputLengths::default();
        for (prompt, tokens) in [(34, 3), (35, 12), (36, 22), (35, 5), (34, 8), (35, 2)] {
            built.push_answer(tokens, false, prompt);
        }
        assert_eq!(l.answering(35), built, "as if pushed one by one");
        // Four long answers are not five: the class's quantile, not a guess from fewer.
        assert_eq!(p.allowance_for(Some(&l), 118, 1000), 350);
        // A length nobody asked at: the class's quantile.
        assert_eq!(p.allowance_for(Some(&l), 60, 1000), 350);
        // Unknown prompt lengths (0) are never alike.
        assert_eq!(p.allowance_for(Some(&l), 0, 1000), 350);
        let mut unknown = OutputLengths::default();
        for t in [3, 4, 5, 6, 7] {
            unknown.push_output(t, false);
        }
        assert_eq!(unknown.answering(5).len(), 0);
        // Off: the class's quantile whatever the prompt.
        let off = ElasticPolicy {
            by_prompt: false,
            ..p
        };
        assert_eq!(off.allowance_for(Some(&l), 35, 1000), 350);
        // The prompts leave the window with their outputs.
        for _ in 0..OUTPUTS_KEPT {
            l.push_answer(9, false, 500);
        }
        assert_eq!(l.answering(35).len(), 0);
        assert_eq!(l.answering(500).len(), OUTPUTS_KEPT);
        assert_eq!(l.prompts.len(), OUTPUTS_KEPT);
    }
}
