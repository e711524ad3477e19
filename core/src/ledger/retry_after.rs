//! Retry-After from a ledger: how long until enough bytes are likely free.
//!
//! Each live lease is expected to end at its `eta_ms` when the backend's reports gave it one
//! (its progress, its cap and the usual output length at the backend's decode rate: see
//! `reconcile::Progress`); otherwise when it reaches the ledger's running mean lifetime. Leases
//! are taken in order of expected end until the bytes they free cover the deficit — their
//! reservations, and what the backend held for them beyond (an elastic sequence's growth, a
//! demoted lease's blocks: held back until they end); the wait is that lease's expected
//! remaining time, turned into a hint by `retry::hint`.

use super::{Lease, Ledger};
use crate::retry::{hint, wait_for, RetryAfter, RetryAfterConfig};

/// Estimate the wait before `need` bytes are likely free.
pub fn estimate_retry_after(
    ledger: &Ledger,
    need: u64,
    now_ms: u64,
    cfg: &RetryAfterConfig,
    jitter_seed: u64,
) -> RetryAfter {
    hint(
        expected_wait_ms(ledger, need, now_ms, cfg),
        cfg,
        jitter_seed,
    )
}

fn expected_wait_ms(ledger: &Ledger, need: u64, now_ms: u64, cfg: &RetryAfterConfig) -> u64 {
    if need > ledger.capacity() {
        return cfg.max_ms;
    }
    let deficit = need.saturating_sub(ledger.free());
    if deficit == 0 {
        return 0;
    }
    wait_to_free(ledger, deficit, now_ms, cfg).unwrap_or(cfg.max_ms)
}

/// How long until the live leases, ending in the order they are expected to, have freed
/// `bytes`: the expected remaining time of the lease that completes it. `None`: all of them
/// together hold less.
///
/// A lease's end frees its reservation and what the backend held for it beyond that (held
/// back, so not free now; `Ledger::release` gives it back) — but only held bytes nobody else
/// has been given since: what was lent from held back to a reservation (`committed + held_back` past
/// the capacity: the backend takes those blocks back from their borrower, for a class that
/// preempts) is not freed again when the borrower ends. That comes out of the leases' `held`
/// (their growth), never out of the rest of held back (foreign use, other gateways' share,
/// rounding), so at most the leases' `held` (within held back) less what was lent is counted,
/// taken in the order the leases are expected to end. What claims hold past the room not held
/// back is room held for a resume (`Ledger::lendable_to_line`), in no lease's `held`: it takes
/// nothing from what the leases free.
fn wait_to_free(ledger: &Ledger, bytes: u64, now_ms: u64, cfg: &RetryAfterConfig) -> Option<u64> {
    let lent = ledger
        .committed()
        .saturating_add(ledger.held_back())
        .saturating_sub(ledger.admits());
    let mut held_room = ledger.held_by_leases().saturating_sub(lent);
    let ends = expected_ends(ledger, now_ms, cfg, |l| (l.bytes, l.held))
        .into_iter()
        .map(|(wait, (reserved, held))| {
            let held = held.min(held_room);
            held_room -= held;
            (wait, reserved.saturating_add(held))
        });
    wait_for(ends, bytes)
}

/// Each live lease's expected remaining time and what its end frees (`frees`: its `bytes`,
/// or with its `held`), soonest first: its `eta_ms` when it has one, else when it reaches the
/// running mean lifetime.
pub(crate) fn expected_ends<T>(
    ledger: &Ledger,
    now_ms: u64,
    cfg: &RetryAfterConfig,
    frees: impl Fn(&Lease) -> T,
) -> Vec<(u64, T)> {
    let mean = match ledger.mean_lease_ms() {
        0 => cfg.default_lease_ms,
        m => m,
    };
    let mut ends: Vec<(u64, T)> = ledger
        .leases()
        .iter()
        .map(|l| {
            if l.eta_ms > 0 {
                return (l.eta_ms.saturating_sub(now_ms), frees(l));
            }
            let age = now_ms.saturating_sub(l.created_ms);
            // A lease older than the mean is expected to end "soon": a quarter of the mean.
            (mean.checked_sub(age).unwrap_or(mean / 4), frees(l))
        })
        .collect();
    ends.sort_unstable_by_key(|(wait, _)| *wait);
    ends
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AdmitOutcome, AdmitRequest};
    use proptest::prelude::*;

    fn request(bytes: u64, now: u64) -> AdmitRequest<'static> {
        AdmitRequest {
            id: None,
            bytes,
            class: "c",
            priority: 0,
            now_ms: now,
            owner: 1,
            claim: None,
        }
    }

    fn admit(l: &mut Ledger, bytes: u64, now: u64) {
        assert!(matches!(
            l.try_admit(&request(bytes, now), &RetryAfterConfig::default(), 0),
            AdmitOutcome::Admitted { .. }
        ));
    }

    /// A pool of 100 with one lease of `bytes`, admitted at 0 and expected to end at `eta_ms`;
    /// and its id.
    fn one_lease(bytes: u64, eta_ms: u64) -> (Ledger, u64) {
        let mut l = Ledger::new(100, 1);
        admit(&mut l, bytes, 0);
        let id = l.leases()[0].id;
        l.set_eta(id, eta_ms);
        (l, id)
    }

    fn no_jitter() -> RetryAfterConfig {
        RetryAfterConfig {
            min_ms: 100,
            max_ms: 60_000,
            jitter: 0.0,
            default_lease_ms: 10_000,
        }
    }

    #[test]
    fn waits_for_the_lease_that_covers_the_deficit() {
        let mut l = Ledger::new(100, 1);
        admit(&mut l, 50, 0); // expected to end at 10 s
        admit(&mut l, 50, 6_000); // expected to end at 16 s
        let cfg = no_jitter();
        // At t = 8 s: the first lease ends in ~2 s and frees 50.
        assert_eq!(estimate_retry_after(&l, 40, 8_000, &cfg, 1).ms, 2_000);
        // Needing 80 waits for both: the second ends in ~8 s.
        assert_eq!(estimate_retry_after(&l, 80, 8_000, &cfg, 1).ms, 8_000);
    }

    #[test]
    fn a_reported_expected_end_comes_before_the_mean() {
        let mut l = Ledger::new(100, 1);
        admit(&mut l, 50, 0); // by the mean: ends at 10 s
        admit(&mut l, 50, 0);
        let cfg = no_jitter();
        assert_eq!(estimate_retry_after(&l, 40, 1_000, &cfg, 1).ms, 9_000);
        // The backend's progress says the second ends at 18 s (a long output), the first at 3 s.
        let ids: Vec<u64> = l.leases().iter().map(|x| x.id).collect();
        l.set_eta(ids[0], 18_000);
        l.set_eta(ids[1], 3_000);
        assert_eq!(estimate_retry_after(&l, 40, 1_000, &cfg, 1).ms, 2_000);
        assert_eq!(estimate_retry_after(&l, 80, 1_000, &cfg, 1).ms, 17_000);
        // Past its expected end and still there: "any moment now" (the floor).
        assert_eq!(estimate_retry_after(&l, 40, 5_000, &cfg, 1).ms, cfg.min_ms);
    }

    #[test]
    fn what_the_backend_holds_beyond_a_reservation_frees_with_the_lease() {
        let cfg = no_jitter();
        // An elastic lease reserved 30 of 100 and grew to hold 70 at the backend: 40 held
        // back, free 30. It is expected to end at 5 s.
        let (mut l, _) = one_lease(30, 5_000);
        l.set_held_back(40);
        // Needing 80 (50 more than is free) waits for all 70 it holds to free at its end. Not
        // knowing what it holds, its 30 never cover the 50: the longest wait.
        assert_eq!(estimate_retry_after(&l, 80, 1_000, &cfg, 1).ms, cfg.max_ms);
        l.set_held(|_| 40);
        assert_eq!(estimate_retry_after(&l, 80, 1_000, &cfg, 1).ms, 4_000);
        // The whole pool: free now, the reservation and what it holds, 30 + 30 + 40.
        assert_eq!(estimate_retry_after(&l, 100, 1_000, &cfg, 1).ms, 4_000);

        // A demoted lease reserves nothing and holds what it had: that frees at its end too.
        let (mut d, id) = one_lease(50, 7_000);
        assert!(d.demote(id).is_some());
        assert_eq!(estimate_retry_after(&d, 80, 1_000, &cfg, 1).ms, 6_000);
    }

    /// A request of `bytes` admitted into lent bytes at 1 s, expected to end at `eta_ms`.
    fn lent_until(l: &mut Ledger, bytes: u64, eta_ms: u64) {
        let p = l
            .admit_into_lent(&request(bytes, 1_000))
            .expect("admitted into lent bytes");
        l.set_eta(p.id, eta_ms);
    }

    /// What requests of each of `needs` bytes are told at 1 s, without jitter.
    fn waits(l: &Ledger, needs: &[u64]) -> Vec<u64> {
        let cfg = no_jitter();
        needs
            .iter()
            .map(|n| estimate_retry_after(l, *n, 1_000, &cfg, 1).ms)
            .collect()
    }

    #[test]
    fn what_was_lent_since_the_report_is_not_counted_as_freed_twice() {
        // A lease of 50, expected to end at 7 s, is demoted for a preemptor of 80, admitted into
        // what the victim held: the backend takes the victim's blocks back for it, all but 20.
        let (mut l, victim) = one_lease(50, 7_000);
        assert!(l.demote(victim).is_some());
        lent_until(&mut l, 80, 20_000);
        // The victim's end frees 20 at most (its `held` says 50); 30 waits for the preemptor's.
        assert_eq!(waits(&l, &[20, 30]), [6_000, 19_000]);
    }

    /// A lease of 10, expected to end at 7 s, grown 40 past it, with `held_back` held back and
    /// `lendable` of that lendable.
    fn grown_40_past_10(held_back: u64, lendable: u64) -> (Ledger, u64) {
        let (mut l, grown) = one_lease(10, 7_000);
        l.set_held(|id| if id == grown { 40 } else { 0 });
        l.set_held_back(held_back);
        l.set_lendable(lendable);
        (l, grown)
    }

    #[test]
    fn what_was_lent_comes_out_of_the_leases_held_not_out_of_other_held_back_bytes() {
        // A lease of 10, expected to end at 7 s, has grown 40 past it (lendable); 30 more are
        // held back that no lease holds (another gateway's use). A request of 45 is admitted
        // into 20 spare and 25 of the growth: the backend takes those back from the grown one.
        let (mut l, grown) = grown_40_past_10(70, 40);
        lent_until(&mut l, 45, 20_000);
        // The grown one's end frees its 10 and the 15 of its growth not lent: 25, what the
        // ledger then has free (100 − 45 − 30), not 50.
        assert_eq!(waits(&l, &[25, 30]), [6_000, 19_000]);
        l.release(grown, 7_000);
        assert_eq!(l.free(), 25);
    }

    #[test]
    fn room_lent_to_the_line_takes_nothing_from_what_a_grown_lease_frees() {
        // A lease of 10, expected to end at 7 s, has grown 40 past it; 30 more are held back as
        // room for a preempted sequence to resume, lent to the line. A request in line for 60
        // holds the 20 spare and those 30.
        let (mut l, _) = grown_40_past_10(70, 70);
        l.set_lendable_to_line(30);
        let in_line = AdmitRequest {
            claim: Some(crate::ledger::ClaimTicket {
                key: 9,
                patience_ms: 60_000,
                run_ms: 0,
                max_line_permille: 0,
                waits: true,
                grows_to: 0,
            }),
            ..request(60, 1_000)
        };
        for _ in 0..2 {
            let r = l.try_admit(&in_line, &no_jitter(), 1);
            assert!(matches!(r, AdmitOutcome::Rejected { .. }));
        }
        assert_eq!((l.claimed(), l.free()), (50, 0));
        // The grown one's end frees its 10 and all 40 of its growth: 50 by 7 s.
        assert_eq!(waits(&l, &[50]), [6_000]);
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(RetryAfter::from_ms(1).seconds, 1);
        assert_eq!(RetryAfter::from_ms(1000).seconds, 1);
        assert_eq!(RetryAfter::from_ms(1001).seconds, 2);
    }

    #[test]
    fn jitter_spreads_clients() {
        let mut l = Ledger::new(100, 1);
        admit(&mut l, 100, 0);
        let cfg = RetryAfterConfig {
            jitter: 0.5,
            ..no_jitter()
        };
        let waits: std::collections::BTreeSet<u64> = (0..50)
            .map(|s| estimate_retry_after(&l, 10, 0, &cfg, s).ms)
            .collect();
        assert!(waits.len() > 40, "only {} distinct waits", waits.len());
        assert!(waits.iter().all(|w| (10_000..=15_000).contains(w)));
    }

    proptest! {
        #[test]
        fn always_within_bounds(need in 0u64..300, now in 0u64..100_000, seed: u64, jitter in 0.0f64..1.0) {
            let mut l = Ledger::new(200, 1);
            admit(&mut l, 120, 0);
            admit(&mut l, 60, 500);
            let cfg = RetryAfterConfig { min_ms: 250, max_ms: 20_000, jitter, default_lease_ms: 5_000 };
            let r = estimate_retry_after(&l, need, now, &cfg, seed);
            prop_assert!(r.ms >= 250 && r.ms <= 20_000);
            prop_assert_eq!(r.seconds, r.ms.div_ceil(1000));
        }
    }
}
