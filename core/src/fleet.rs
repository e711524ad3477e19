//! Several backends behind one gateway: one ledger per backend endpoint, and the choice of the
//! endpoint a request is reserved on.
//!
//! Each endpoint's leases live under their own shared-data key, so one admission reads, decides
//! and writes one ledger: its cost does not grow with the number of endpoints or with the leases
//! of the others. What the choice needs of the others is a [`View`] per endpoint that the caller
//! keeps (eligible, capacity, room), refreshed from each ledger it touches and from a cheap
//! header-only [`peek`] on its tick. A stale view only costs a wasted try: the CAS on the
//! chosen ledger decides.
//!
//! [`admit`] tries endpoints in two passes:
//! 1. *plain*: the endpoints whose viewed room fits the request, in the order of the rule
//!    ([`Choice`]), each with the class's policy switched off (no degrade, no preemption), so a
//!    request never degrades or preempts on one endpoint while another has room. A try that
//!    does not fit changes nothing. Admitted away from its home, a request's claim there (if
//!    any) is dropped at once.
//! 2. *policy*: one endpoint, decided with the full policy (claims, degrade, preemption) and its
//!    outcome answered as it is. It is the request's *home* (a hash of its claim key over the
//!    eligible endpoints: a refused request keeps its place in one endpoint's line across
//!    retries), or, without a claim, the endpoint with the most room.

use crate::gate::SharedPrefix;
use crate::ledger::Ledger;
use crate::store::{self, SharedStore, StoreError};

pub use crate::config::{Choice, MAX_ENDPOINTS};

/// What the caller last knew of one endpoint. Possibly stale; never trusted for the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct View {
    /// Up, not marked full by a backend refusal, model known.
    pub eligible: bool,
    pub capacity: u64,
    /// Bytes a request may still reserve there.
    pub room: u64,
    pub committed: u64,
    pub held_back: u64,
    /// What its decoding leases will never all hold at once ([`Ledger::slack`]).
    pub slack: u64,
    pub leases: u64,
    /// Bytes claims set aside there (as last decoded; a peek keeps the last value).
    pub claimed: u64,
    /// Claims (places in the fair-retry line) there, holding bytes or not (as last decoded; a
    /// peek keeps the last value).
    pub claims: u64,
    /// The endpoint's [`endpoint_name`], which [`home`] hashes, so a home does not move when
    /// the list's order does; 0: its index in the list.
    pub name: u64,
    /// Shared prefixes its live leases pay (`Lease::prefix`; as last decoded, at most
    /// [`PREFIXES_SEEN`]; 0: none): a request starting with one needs less there.
    pub prefixes: [u64; PREFIXES_SEEN],
}

/// Shared prefixes a view remembers per endpoint (the first found).
pub const PREFIXES_SEEN: usize = 8;

impl View {
    pub fn observe(&mut self, ledger: &Ledger) {
        self.capacity = ledger.capacity();
        self.room = ledger.free();
        self.committed = ledger.committed();
        self.held_back = ledger.held_back();
        self.slack = ledger.slack();
        self.leases = ledger.leases().len() as u64;
        self.claimed = ledger.claimed();
        self.claims = ledger.claims().len() as u64;
        self.prefixes = [0; PREFIXES_SEEN];
        let paid = ledger
            .leases()
            .iter()
            .filter(|l| l.prefix != 0 && l.credit == 0 && l.bytes > 0);
        for (slot, l) in self.prefixes.iter_mut().zip(paid) {
            *slot = l.prefix;
        }
    }

    /// What a request needing `need` bytes, starting with `prefix`, needs here.
    pub fn need(&self, need: u64, prefix: Option<SharedPrefix>) -> u64 {
        match prefix {
            Some(p) if p.key != 0 && self.prefixes.contains(&p.key) => need.saturating_sub(p.bytes),
            _ => need,
        }
    }

    /// Take a [`peek`] (eligibility stays).
    pub fn observe_peek(&mut self, p: &View) {
        *self = View {
            eligible: self.eligible,
            claimed: self.claimed,
            claims: self.claims,
            name: self.name,
            prefixes: self.prefixes,
            ..*p
        };
    }
}

/// The totals of a stored ledger from its fixed header, without decoding its leases (claims are
/// not counted: the room is an upper bound). `None` if the bytes are not a ledger this build
/// reads.
pub fn peek(bytes: &[u8]) -> Option<View> {
    let t = crate::codec::totals(bytes)?;
    Some(View {
        eligible: false,
        capacity: t.capacity,
        room: t
            .capacity
            .saturating_add(t.slack)
            .saturating_sub(t.committed)
            .saturating_sub(t.held_back),
        committed: t.committed,
        held_back: t.held_back,
        slack: t.slack,
        leases: u64::from(t.leases),
        claimed: 0,
        claims: 0,
        name: 0,
        prefixes: [0; PREFIXES_SEEN],
    })
}

/// The eligible endpoints whose room fits `need` (less a shared `prefix` their live leases pay),
/// best first: those that hold the prefix, then by `rule`.
pub fn plan(views: &[View], need: u64, rule: Choice, prefix: Option<SharedPrefix>) -> Vec<usize> {
    let mut fit: Vec<usize> = (0..views.len())
        .filter(|&i| {
            views
                .get(i)
                .is_some_and(|v| v.eligible && v.room >= v.need(need, prefix))
        })
        .collect();
    let holds = |i: usize| views.get(i).is_some_and(|v| v.need(need, prefix) < need);
    // Ties go to the lower index, so a fleet with equal room fills in a stable order.
    match rule {
        Choice::MostRoom => fit.sort_by_key(|&i| (!holds(i), std::cmp::Reverse(room(views, i)), i)),
        Choice::BestFit => fit.sort_by_key(|&i| (!holds(i), room(views, i), i)),
    }
    fit
}

fn room(views: &[View], i: usize) -> u64 {
    views.get(i).map_or(0, |v| v.room)
}

/// The endpoint a request's claim lives on: among the eligible endpoints that could hold it at
/// all (capacity ≥ `need`), the one whose hash with its key is highest (rendezvous hashing). A
/// home moves only when that endpoint itself drops out: another endpoint marked full or down
/// for a poll, or a list that gains, loses or reorders endpoints (named by [`View::key`]),
/// leaves every other request's place in line where it was.
pub fn home(views: &[View], need: u64, claim_key: u64) -> Option<usize> {
    use crate::retry::splitmix64;
    let able = |v: &View| v.eligible && v.capacity >= need;
    (0..views.len())
        .filter_map(|i| views.get(i).filter(|v| able(v)).map(|v| (i, v)))
        .max_by_key(|(i, v)| {
            let name = if v.name == 0 { *i as u64 } else { v.name };
            splitmix64(claim_key ^ splitmix64(name))
        })
        .map(|(i, _)| i)
}

/// A stable, non-zero name for the endpoint at `address` ([`View::name`]).
pub fn endpoint_name(address: &str) -> u64 {
    let mut h = crate::spec::Fnv1a::new();
    h.write(address.as_bytes());
    h.finish().max(1)
}

/// Did the host at `named` (an endpoint's `ip:port`) answer, if the backend's socket saw the
/// connection reach `served_at`? The ports must agree, and the addresses too (IPv4-mapped IPv6
/// taken as IPv4) unless the backend saw a loopback or unspecified one (a sidecar in front of it
/// forwards to localhost). An answer from elsewhere means the named host is not in the cluster
/// (override_host fell back to another host): that endpoint is not up, whatever the answer
/// says. A name that is not an IP address (or a report without `served_at`) cannot be compared:
/// taken as the same. Endpoints are the addresses the backends listen on (no port mapping).
pub fn same_host(named: &str, served_at: &str) -> bool {
    match (crate::addr::parse(named), crate::addr::parse(served_at)) {
        (Some((ip, port)), Some((at_ip, at_port))) => {
            port == at_port && (ip == at_ip || at_ip.is_loopback() || at_ip.is_unspecified())
        }
        _ => true,
    }
}

/// The policy pass's endpoint when the request has no home: the most room among the eligible
/// endpoints that could hold it at all, else the largest eligible one (it answers "too large").
fn fallback(views: &[View], need: u64) -> Option<usize> {
    let eligible = || (0..views.len()).filter(|&i| views.get(i).is_some_and(|v| v.eligible));
    eligible()
        .filter(|&i| views.get(i).is_some_and(|v| v.capacity >= need))
        .max_by_key(|&i| (room(views, i), std::cmp::Reverse(i)))
        .or_else(|| {
            eligible()
                .max_by_key(|&i| (views.get(i).map_or(0, |v| v.capacity), std::cmp::Reverse(i)))
        })
}

/// Where a request was decided.
#[derive(Debug)]
pub enum Placed<T> {
    /// Decided on endpoint `index` (admitted or refused, as `out` says); `ledger` is that
    /// endpoint's ledger after the decision.
    At {
        index: usize,
        out: T,
        ledger: Ledger,
    },
    /// No endpoint is eligible.
    Nowhere,
}

/// Decide a request needing `need` bytes across the endpoints (see the module's two passes).
/// `plain` runs with the policy switched off and must return `None`, changing nothing, when the
/// request does not fit; `full` runs the whole policy. Each runs inside one endpoint's CAS
/// transaction and may run more than once. `views` are refreshed from every ledger touched.
/// A ledger that cannot be read is skipped in the plain pass; in the policy pass its error is
/// returned with its index.
#[allow(clippy::too_many_arguments)]
pub fn admit<S: SharedStore + ?Sized, T>(
    store: &S,
    key: impl Fn(usize) -> String,
    views: &mut [View],
    need: u64,
    rule: Choice,
    prefix: Option<SharedPrefix>,
    claim_key: Option<u64>,
    attempts: u32,
    mut plain: impl FnMut(&mut Ledger) -> Option<T>,
    mut full: impl FnMut(&mut Ledger) -> T,
) -> Result<Placed<T>, (usize, StoreError)> {
    let home = claim_key.and_then(|k| home(views, need, k));
    for index in plan(views, need, rule, prefix) {
        if let Ok((out, ledger)) = store::transact(store, &key(index), attempts, &mut plain) {
            if let Some(v) = views.get_mut(index) {
                v.observe(&ledger);
            }
            if let Some(out) = out {
                // Admitted away from its home, where a claim of an earlier refusal may still
                // be in line: drop it now rather than at its expiry. Whether or not it holds
                // bytes yet: an active claim at the front of the line would take the next bytes
                // freed there and hold them, idle, for a request already served.
                if let (Some(h), Some(k)) = (home.filter(|h| *h != index), claim_key) {
                    if views.get(h).is_some_and(|v| v.claims > 0) {
                        if let Ok((_, l)) =
                            store::transact(store, &key(h), attempts, |l| l.drop_claim(k))
                        {
                            if let Some(v) = views.get_mut(h) {
                                v.observe(&l);
                            }
                        }
                    }
                }
                return Ok(Placed::At { index, out, ledger });
            }
        }
    }
    let Some(index) = home.or_else(|| fallback(views, need)) else {
        return Ok(Placed::Nowhere);
    };
    let (out, ledger) =
        store::transact(store, &key(index), attempts, &mut full).map_err(|e| (index, e))?;
    if let Some(v) = views.get_mut(index) {
        v.observe(&ledger);
    }
    Ok(Placed::At { index, out, ledger })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AdmitOutcome, AdmitRequest};
    use crate::retry::RetryAfterConfig;
    use crate::store::MemoryStore;

    #[test]
    fn an_answer_from_another_host_is_told_apart() {
        assert!(same_host("127.0.0.1:8001", "127.0.0.1:8001"));
        assert!(
            !same_host("127.0.0.1:8009", "127.0.0.1:8000"),
            "fell back to another port"
        );
        assert!(
            !same_host("10.8.1.17:8000", "10.8.2.23:8000"),
            "another pod"
        );
        assert!(
            same_host("10.8.1.17:8000", "127.0.0.1:8000"),
            "a sidecar forwards to loopback"
        );
        assert!(same_host("[fd00::1]:8000", "[FD00::1]:8000"));
        assert!(
            same_host("backend:8000", "not an address"),
            "nothing to compare"
        );
        assert!(
            same_host("[fd00::1]:8000", "[fd00:0::1]:8000"),
            "spelled otherwise"
        );
        assert!(
            same_host("10.0.0.5:8000", "[::ffff:10.0.0.5]:8000"),
            "IPv4-mapped"
        );
        assert!(
            same_host("10.0.0.5:8000", "[::ffff:127.0.0.1]:8000"),
            "mapped loopback"
        );
        assert!(!same_host("10.0.0.5:8000", "[::ffff:10.0.0.6]:8000"));
        assert!(
            same_host("backend.svc:8000", "10.0.0.5:8000"),
            "a name: nothing to compare"
        );
    }

    fn req(id: u64, bytes: u64) -> AdmitRequest<'static> {
        AdmitRequest {
            id: Some(id),
            bytes,
            class: "c",
            priority: 0,
            now_ms: 0,
            owner: 1,
            claim: None,
        }
    }

    fn fleet(capacities: &[u64]) -> (MemoryStore, Vec<View>) {
        let s = MemoryStore::default();
        let mut views = Vec::new();
        for (i, c) in capacities.iter().enumerate() {
            let l = Ledger::new(*c, 1);
            store::seed(&s, &format!("e{i}"), || l.clone()).unwrap();
            let mut v = View {
                eligible: true,
                ..View::default()
            };
            v.observe(&l);
            views.push(v);
        }
        (s, views)
    }

    /// Admit `bytes` under `id` where it fits (plain: reserve; full: reserve or refuse).
    fn place(
        s: &MemoryStore,
        views: &mut [View],
        id: u64,
        bytes: u64,
        rule: Choice,
    ) -> Option<usize> {
        let cfg = RetryAfterConfig::default();
        let admitted = |l: &mut Ledger| {
            matches!(
                l.try_admit(&req(id, bytes), &cfg, 0),
                AdmitOutcome::Admitted { .. }
            )
        };
        let placed = admit(
            s,
            |i| format!("e{i}"),
            views,
            bytes,
            rule,
            None,
            None,
            8,
            |l| (l.free() >= bytes && admitted(l)).then_some(true),
            admitted,
        )
        .unwrap();
        match placed {
            Placed::At {
                index, out: true, ..
            } => Some(index),
            _ => None,
        }
    }

    #[test]
    fn most_room_spreads_and_best_fit_packs() {
        let (s, mut v) = fleet(&[1000, 1000]);
        let got: Vec<_> = (1..=4)
            .map(|id| place(&s, &mut v, id, 300, Choice::MostRoom))
            .collect();
        assert_eq!(got, [Some(0), Some(1), Some(0), Some(1)]);
        let (s, mut v) = fleet(&[1000, 1000]);
        let got: Vec<_> = (1..=4)
            .map(|id| place(&s, &mut v, id, 300, Choice::BestFit))
            .collect();
        assert_eq!(got, [Some(0), Some(0), Some(0), Some(1)]);
        // Best fit kept a whole endpoint's room for a big request; most room would not have.
        assert_eq!(place(&s, &mut v, 9, 700, Choice::BestFit), Some(1));
    }

    #[test]
    fn a_stale_view_costs_a_try_never_an_overcommit() {
        let (s, mut v) = fleet(&[1000, 1000]);
        // Another worker filled endpoint 0 behind this view's back.
        store::transact(&s, "e0", 4, |l| {
            l.try_admit(&req(50, 900), &RetryAfterConfig::default(), 0)
        })
        .unwrap();
        assert_eq!(v[0].room, 1000, "stale");
        assert_eq!(place(&s, &mut v, 1, 600, Choice::BestFit), Some(1));
        assert_eq!(v[0].room, 100, "refreshed by the try");
        let l0 = store::read(&s, "e0").unwrap();
        assert_eq!(l0.committed(), 900, "the failed try changed nothing");
        assert_eq!(l0.counters().rejected, 0);
        // Nothing fits anywhere: the policy pass refuses on the endpoint with the most room.
        assert_eq!(place(&s, &mut v, 2, 600, Choice::BestFit), None);
        assert_eq!(store::read(&s, "e1").unwrap().counters().rejected, 1);
        assert_eq!(store::read(&s, "e0").unwrap().counters().rejected, 0);
    }

    #[test]
    fn ineligible_endpoints_are_never_chosen() {
        let (s, mut v) = fleet(&[1000, 1000]);
        v[0].eligible = false;
        for id in 1..=3 {
            assert_eq!(place(&s, &mut v, id, 300, Choice::MostRoom), Some(1));
        }
        assert_eq!(store::read(&s, "e0").unwrap().committed(), 0);
        v[1].eligible = false;
        let placed = admit(
            &s,
            |i| format!("e{i}"),
            &mut v,
            1,
            Choice::MostRoom,
            None,
            None,
            8,
            |_| Some(()),
            |_| (),
        )
        .unwrap();
        assert!(matches!(placed, Placed::Nowhere));
    }

    #[test]
    fn a_request_goes_first_where_its_shared_prefix_is_paid_when_it_fits_there() {
        let s = MemoryStore::default();
        let mut ledgers: Vec<Ledger> = (0..3).map(|_| Ledger::new(1000, 1)).collect();
        // Endpoint 2 holds the swarm's prefix (400 bytes): a lease there pays it.
        assert!(matches!(
            ledgers[2].try_admit(&req(9, 500), &RetryAfterConfig::default(), 0),
            AdmitOutcome::Admitted { .. }
        ));
        ledgers[2].set_prefix(9, 77, 0);
        let mut v: Vec<View> = ledgers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                store::seed(&s, &format!("e{i}"), || l.clone()).unwrap();
                let mut view = View {
                    eligible: true,
                    ..View::default()
                };
                view.observe(l);
                view
            })
            .collect();
        let swarm = Some(SharedPrefix {
            key: 77,
            bytes: 400,
        });
        let other = Some(SharedPrefix {
            key: 78,
            bytes: 400,
        });
        // 600 bytes: it fits anywhere; where its prefix lives it needs 200, and goes there first.
        assert_eq!(plan(&v, 600, Choice::MostRoom, swarm), vec![2, 0, 1]);
        assert_eq!(plan(&v, 600, Choice::MostRoom, other), vec![0, 1]);
        assert_eq!(plan(&v, 600, Choice::MostRoom, None), vec![0, 1]);
        // 900: more than endpoint 2's room (500), but not beside its prefix.
        assert_eq!(plan(&v, 900, Choice::BestFit, swarm), vec![2, 0, 1]);
        v[2].eligible = false;
        assert_eq!(plan(&v, 900, Choice::BestFit, swarm), vec![0, 1]);
    }

    #[test]
    fn a_claim_has_one_home_among_the_endpoints_that_can_hold_it() {
        let mut v = vec![
            View {
                eligible: true,
                capacity: 1000,
                ..View::default()
            };
            4
        ];
        v[1].capacity = 10; // cannot hold it
        v[2].eligible = false; // down
        let homes = |v: &[View]| (0..1000).map(|k| home(v, 500, k)).collect::<Vec<_>>();
        let before = homes(&v);
        assert!(
            before.iter().all(|h| matches!(h, Some(0 | 3))),
            "eligible and able"
        );
        let on = |hs: &[Option<usize>], e| hs.iter().filter(|h| **h == Some(e)).count();
        assert!(on(&before, 0) > 400 && on(&before, 3) > 400, "spread");
        // An endpoint that comes back takes requests only from the others: none moves between
        // the others (with the key modulo the eligible count, about half would).
        v[2].eligible = true;
        let with_2 = homes(&v);
        for (k, (was, now)) in before.iter().zip(&with_2).enumerate() {
            assert!(now == was || *now == Some(2), "key {k}: {was:?} -> {now:?}");
        }
        assert!(on(&with_2, 2) > 200, "it takes its share");
        // One that drops out moves only its own.
        v[3].eligible = false;
        for (k, (was, now)) in with_2.iter().zip(homes(&v)).enumerate() {
            assert!(
                now == *was || *was == Some(3),
                "key {k}: {was:?} -> {now:?}"
            );
        }
        v[3].eligible = true;
        assert_eq!(home(&v, 5000, 1), None);
        // Too large for all: the largest answers (it says "too large", not "full").
        assert_eq!(fallback(&v, 5000), Some(0));
        // Endpoints named by their addresses keep their homes when the list is reordered.
        for (i, x) in v.iter_mut().enumerate() {
            x.name = endpoint_name(&format!("10.0.0.{i}:8000"));
        }
        let named = homes(&v);
        v.reverse();
        for (k, was) in named.iter().enumerate() {
            assert_eq!(home(&v, 500, k as u64).map(|i| 3 - i), *was, "key {k}");
        }
    }

    #[test]
    fn an_admission_away_from_home_drops_its_claim_there_even_one_holding_nothing() {
        let (s, mut v) = fleet(&[1000, 1000]);
        let cfg = RetryAfterConfig::default();
        for (e, id) in [("e0", 50), ("e1", 51)] {
            store::transact(&s, e, 4, |l| l.try_admit(&req(id, 900), &cfg, 0)).unwrap();
        }
        let key = (0..).find(|k| home(&v, 300, *k) == Some(0)).unwrap();
        let with_claim = AdmitRequest {
            claim: Some(crate::ledger::ClaimTicket {
                key,
                patience_ms: 60_000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(1, 300)
        };
        let try_once = |s: &MemoryStore, v: &mut [View]| {
            let admitted = |l: &mut Ledger| {
                matches!(
                    l.try_admit(&with_claim, &cfg, 0),
                    AdmitOutcome::Admitted { .. }
                )
            };
            let placed = admit(
                s,
                |i| format!("e{i}"),
                v,
                300,
                Choice::MostRoom,
                None,
                Some(key),
                8,
                |l| (l.free() >= 300 && admitted(l)).then_some(true),
                admitted,
            )
            .unwrap();
            match placed {
                Placed::At { index, out, .. } => (index, out),
                Placed::Nowhere => panic!("no endpoint"),
            }
        };
        // Refused at home (nothing is free anywhere): its claim is there, holding nothing.
        assert_eq!(try_once(&s, &mut v), (0, false));
        let l0 = store::read(&s, "e0").unwrap();
        assert_eq!((l0.claims().len(), l0.claimed()), (1, 0));
        // e1 frees room first: the request is admitted there, and leaves no place in e0's line
        // to take e0's next freed bytes for a request already served.
        store::transact(&s, "e1", 4, |l| Some(l.release(51, 0))).unwrap();
        v[1].observe(&store::read(&s, "e1").unwrap()); // the next tick's view
        assert_eq!(try_once(&s, &mut v), (1, true));
        assert!(store::read(&s, "e0").unwrap().claims().is_empty());
    }

    #[test]
    fn peek_reads_room_from_the_header() {
        let mut l = Ledger::new(1000, 1);
        l.try_admit(&req(1, 300), &RetryAfterConfig::default(), 0);
        l.set_held_back(100);
        let mut v = View::default();
        v.observe(&l);
        assert_eq!(peek(&l.encode()), Some(v));
        assert_eq!(
            (v.room, v.committed, v.held_back, v.leases),
            (600, 300, 100, 1)
        );
        assert_eq!(peek(b"KVGL"), None);
        assert_eq!(peek(b"nope nope nope"), None);
    }
}
