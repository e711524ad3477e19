//! The gateways that poll this backend's lease report (`GET /v1/admission/leases`).
//!
//! A gateway admits into the room its last poll found free, and shares that room with the other
//! gateways in front of the same backend until its next poll. It used to learn of them only from
//! the gateway number in their lease ids, so two gateways that had no lease here yet (a fleet
//! just started, or idle) each took all the room, and this backend refused what they
//! over-admitted. Each poll now names its Envoy (`instance`, drawn once per Envoy), its
//! `gateway` number and its `poll_ms`; the report tells the asker the numbers of the others.
//!
//! With an admission secret configured, only the gateways (which hold it) reach the lease report,
//! so clients cannot add entries: every Envoy that polls counts. Without one (the backend then
//! listens on loopback only) an entry costs the real gateways room, so a poll alone buys little:
//! a gateway is told of one other per gateway number that holds a lease here, and of at most one
//! that holds none (a newcomer: two gateways just started still split the room). A thousand
//! made-up instances then make each real gateway hold back at most one extra share.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// At most this many Envoys are remembered; a new one beyond that is not registered (it still
/// gets its report) until an entry expires.
pub const MAX_POLLERS: usize = 1024;

/// A poller counts for this many of its own poll periods after its last poll: a missed poll or
/// two does not make it vanish, and a gateway that is gone stops counting within seconds.
const PERIODS: u32 = 3;
const MIN_TTL: Duration = Duration::from_secs(1);
const MAX_TTL: Duration = Duration::from_secs(180);

/// What one poll says of its gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Poll {
    /// Drawn once per Envoy: every worker of one Envoy polls under the same instance.
    pub instance: u64,
    /// Its `gateway_id`: the top bits of its lease ids.
    pub gateway: u64,
    pub poll_ms: u64,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    gateway: u64,
    until: Instant,
}

#[derive(Debug, Default)]
pub struct Pollers {
    seen: HashMap<u64, Seen>,
}

impl Pollers {
    /// Record `poll` (when it names its instance) at `now`, and return the numbers of the other
    /// gateways still counted, sorted. `holding`: `None` where the pollers are trusted (they
    /// hold the admission secret): one per Envoy. Else the gateway numbers of the leases live
    /// here: one per such number, and at most one whose number holds none.
    pub fn polled(
        &mut self,
        poll: Option<Poll>,
        now: Instant,
        holding: Option<&BTreeSet<u64>>,
    ) -> Vec<u64> {
        self.seen.retain(|_, s| s.until > now);
        if let Some(p) = poll {
            let ms = p.poll_ms.saturating_mul(u64::from(PERIODS));
            let ttl = Duration::from_millis(ms).clamp(MIN_TTL, MAX_TTL);
            if self.seen.len() < MAX_POLLERS || self.seen.contains_key(&p.instance) {
                self.seen.insert(
                    p.instance,
                    Seen {
                        gateway: p.gateway,
                        until: now + ttl,
                    },
                );
            }
        }
        let asker = poll.map(|p| p.instance);
        let others = self
            .seen
            .iter()
            .filter(|(instance, _)| Some(**instance) != asker)
            .map(|(_, s)| s.gateway);
        let mut counted: Vec<u64> = match holding {
            None => others.collect(),
            Some(holding) => {
                let (with_leases, without): (BTreeSet<u64>, BTreeSet<u64>) =
                    others.partition(|g| holding.contains(g));
                let newcomer = without.into_iter().next();
                with_leases.into_iter().chain(newcomer).collect()
            }
        };
        counted.sort_unstable();
        counted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll(instance: u64, gateway: u64) -> Option<Poll> {
        Some(Poll {
            instance,
            gateway,
            poll_ms: 500,
        })
    }

    #[test]
    fn each_gateway_is_told_of_the_others_until_they_stop_polling() {
        let mut p = Pollers::default();
        let t0 = Instant::now();
        assert!(p.polled(poll(1, 10), t0, None).is_empty(), "alone");
        assert_eq!(p.polled(poll(2, 20), t0, None), [10]);
        assert_eq!(p.polled(poll(1, 10), t0, None), [20], "not told of itself");
        // Another Envoy that drew the same number as the first is another gateway.
        assert_eq!(p.polled(poll(3, 10), t0, None), [10, 20]);
        // A poll that does not name its instance (an older gateway) is told of every one.
        assert_eq!(p.polled(None, t0, None), [10, 10, 20]);
        // Three periods (1.5 s) after its last poll a gateway no longer counts.
        let later = t0 + Duration::from_millis(1_400);
        assert_eq!(p.polled(poll(1, 10), later, None), [10, 20]);
        let gone = t0 + Duration::from_millis(1_600);
        assert!(p.polled(poll(1, 10), gone, None).is_empty());
    }

    #[test]
    fn untrusted_made_up_pollers_without_leases_count_as_one_newcomer() {
        let mut p = Pollers::default();
        let t0 = Instant::now();
        let holding: BTreeSet<u64> = [0, 5].into();
        // A thousand polls, each naming a new instance and a number that holds nothing here.
        for i in 0..1_000 {
            p.polled(poll(100 + i, 1 + i % 1_000), t0, Some(&holding));
        }
        p.polled(poll(1, 5), t0, Some(&holding));
        // The real gateway 0 is told of gateway 5 (it holds leases) and of one newcomer.
        let others = p.polled(poll(2, 0), t0, Some(&holding));
        assert_eq!(others.len(), 2, "{others:?}");
        assert!(others.contains(&5));
        // With none holding leases (a fleet just started), two gateways still see each other.
        let mut fresh = Pollers::default();
        let none = BTreeSet::new();
        fresh.polled(poll(1, 3), t0, Some(&none));
        assert_eq!(fresh.polled(poll(2, 4), t0, Some(&none)), [3]);
        assert_eq!(fresh.polled(poll(1, 3), t0, Some(&none)), [4]);
    }

    #[test]
    fn a_poller_counts_for_three_of_its_periods_within_one_second_and_three_minutes() {
        let t0 = Instant::now();
        let lasts = |poll_ms: u64| {
            let mut p = Pollers::default();
            let poll = |instance| {
                Some(Poll {
                    instance,
                    gateway: 1,
                    poll_ms,
                })
            };
            p.polled(poll(1), t0, None);
            // The first whole second at which it no longer counts.
            (1..=200u64).map(|s| s * 1_000).find(|ms| {
                p.polled(poll(2), t0 + Duration::from_millis(*ms), None)
                    .is_empty()
            })
        };
        assert_eq!(lasts(100), Some(1_000), "3 × 100 ms, raised to 1 s");
        assert_eq!(lasts(1_000), Some(3_000));
        assert_eq!(lasts(60_000), Some(180_000), "3 × 60 s");
        assert_eq!(lasts(600_000), Some(180_000), "at most 3 minutes");
    }

    #[test]
    fn the_table_is_bounded() {
        let mut p = Pollers::default();
        let t0 = Instant::now();
        for i in 0..MAX_POLLERS as u64 + 10 {
            p.polled(poll(i, 1), t0, None);
        }
        assert_eq!(p.seen.len(), MAX_POLLERS);
        // One already known is still refreshed; once entries expire, new ones are taken.
        assert_eq!(p.polled(poll(0, 1), t0, None).len(), MAX_POLLERS - 1);
        let later = t0 + Duration::from_secs(2);
        assert!(p.polled(poll(5_000, 2), later, None).is_empty());
        assert_eq!(p.seen.len(), 1);
    }
}
