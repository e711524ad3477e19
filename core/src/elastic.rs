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
use crate::policy::{RawClass, Reservation};

/// An elastic class's rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticPolicy {
    /// The quantile reserved, in thousandths (900: the 0.9 quantile).
    pub quantile_permille: u16,
    /// Finished outputs needed before the quantile is trusted.
    pub min_samples: u32,
    /// Output tokens reserved until then; `None`: the whole cap (worst case) until learned.
    pub prior_tokens: Option<u64>,
}

impl Default for ElasticPolicy {
    fn default() -> Self {
        ElasticPolicy {
            quantile_permille: 900,
            min_samples: 20,
            prior_tokens: None,
        }
    }
}

impl ElasticPolicy {
    /// The class's reservation from its raw config; `at` names a field for errors.
    pub(crate) fn from_raw(
        c: &RawClass,
        at: &dyn Fn(&str) -> String,
    ) -> Result<Reservation, ConfigError> {
        let elastic = match c.reservation.as_deref() {
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
                ("elastic_quantile", c.elastic_quantile.is_some()),
                ("elastic_min_samples", c.elastic_min_samples.is_some()),
                ("elastic_prior_tokens", c.elastic_prior_tokens.is_some()),
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
        if let Some(q) = c.elastic_quantile {
            if !(0.5..=1.0).contains(&q) {
                return Err(ConfigError::new(
                    at("elastic_quantile"),
                    q,
                    "must be in 0.5..=1.0",
                ));
            }
            p.quantile_permille = (q * 1000.0).round() as u16;
        }
        if let Some(n) = c.elastic_min_samples {
            if !(1..=OUTPUTS_KEPT as u32).contains(&n) {
                return Err(ConfigError::new(
                    at("elastic_min_samples"),
                    n,
                    format!("must be in 1..={OUTPUTS_KEPT}"),
                ));
            }
            p.min_samples = n;
        }
        if let Some(t) = c.elastic_prior_tokens {
            if t == 0 {
                return Err(ConfigError::new(
                    at("elastic_prior_tokens"),
                    0,
                    "must be at least 1",
                ));
            }
            p.prior_tokens = Some(t);
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
}

/// Finished outputs kept per class.
pub const OUTPUTS_KEPT: usize = 512;

/// The output lengths of a class's most recent finished requests (ones that stopped by
/// themselves or at their cap; a cut-short request says nothing of how long it would have run).
/// Kept in arrival order (to drop the oldest) and sorted (so a quantile, read on every request
/// of an elastic class, is an index, not a sort).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputLengths {
    recent: VecDeque<u64>,
    sorted: Vec<u64>,
}

impl OutputLengths {
    /// O(kept): learned at each poll, off the request path.
    pub fn push(&mut self, tokens: u64) {
        if self.recent.len() == OUTPUTS_KEPT {
            if let Some(old) = self.recent.pop_front() {
                if let Ok(i) = self.sorted.binary_search(&old) {
                    self.sorted.remove(i);
                }
            }
        }
        self.recent.push_back(tokens);
        let at = self.sorted.partition_point(|t| *t <= tokens);
        self.sorted.insert(at, tokens);
    }

    pub fn len(&self) -> usize {
        self.recent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The `permille`/1000 quantile (nearest rank, rounding up: at least that share of the
    /// samples are at or below it). `None` without samples.
    pub fn quantile(&self, permille: u16) -> Option<u64> {
        let n = self.sorted.len();
        let rank = (n * usize::from(permille.min(1000))).div_ceil(1000).max(1);
        self.sorted.get(rank.checked_sub(1)?).copied()
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
    fn the_allowance_is_the_prior_until_learned_and_never_above_the_cap() {
        let p = ElasticPolicy {
            quantile_permille: 900,
            min_samples: 4,
            prior_tokens: Some(64),
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
}
