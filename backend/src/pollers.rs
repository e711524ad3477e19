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
//! so clients cannot add entries. Without one the whole admission API is open to whoever reaches
//! the port (the backend warns at start), and so is this table: fake entries would make real
//! gateways hold back room for gateways that do not exist. The table is bounded either way.

use std::collections::HashMap;
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
    /// gateways still counted: one per Envoy, sorted.
    pub fn polled(&mut self, poll: Option<Poll>, now: Instant) -> Vec<u64> {
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
        let mut others: Vec<u64> = self
            .seen
            .iter()
            .filter(|(instance, _)| Some(**instance) != asker)
            .map(|(_, s)| s.gateway)
            .collect();
        others.sort_unstable();
        others
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
        assert!(p.polled(poll(1, 10), t0).is_empty(), "alone");
        assert_eq!(p.polled(poll(2, 20), t0), [10]);
        assert_eq!(p.polled(poll(1, 10), t0), [20], "not told of itself");
        // Another Envoy that drew the same number as the first is another gateway.
        assert_eq!(p.polled(poll(3, 10), t0), [10, 20]);
        // A poll that does not name its instance (an older gateway) is told of every one.
        assert_eq!(p.polled(None, t0), [10, 10, 20]);
        // Three periods (1.5 s) after its last poll a gateway no longer counts.
        let later = t0 + Duration::from_millis(1_400);
        assert_eq!(p.polled(poll(1, 10), later), [10, 20]);
        let gone = t0 + Duration::from_millis(1_600);
        assert!(p.polled(poll(1, 10), gone).is_empty());
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
            p.polled(poll(1), t0);
            // The first whole second at which it no longer counts.
            (1..=200u64).map(|s| s * 1_000).find(|ms| {
                p.polled(poll(2), t0 + Duration::from_millis(*ms))
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
            p.polled(poll(i, 1), t0);
        }
        assert_eq!(p.seen.len(), MAX_POLLERS);
        // One already known is still refreshed; once entries expire, new ones are taken.
        assert_eq!(p.polled(poll(0, 1), t0).len(), MAX_POLLERS - 1);
        let later = t0 + Duration::from_secs(2);
        assert!(p.polled(poll(5_000, 2), later).is_empty());
        assert_eq!(p.seen.len(), 1);
    }
}
