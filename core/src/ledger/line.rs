//! The fair-retry line: a refused request's place (its claim), the bytes set aside for the
//! active places as they free up, and what is lent to the line's front (see the module header).

use super::*;

/// A refused request's place in line (see the module header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Hash of the caller and the request body: the retry of the same request has the same key.
    pub key: u64,
    /// What the request needs.
    pub bytes: u64,
    /// Freed bytes set aside for it so far (≤ `bytes`).
    pub held: u64,
    pub first_ms: u64,
    /// Dropped (bytes returned) when its client has not retried by then.
    pub expires_ms: u64,
    /// Its client has come back at least once. Only active claims hold bytes: a client that
    /// never retries (or gives up at once) never keeps bytes from anyone.
    pub active: bool,
    /// Its client waits at the gateway (a `queue` class): it takes what is set aside for it as
    /// soon as it is there. Otherwise its client was sent away with a Retry-After and is back
    /// no earlier than `expires_ms` less the patience, so what is set aside for it until then
    /// sits idle, and a backfill done by then may use it.
    pub waits: bool,
}

/// How a request takes part in fair retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimTicket {
    pub key: u64,
    /// A claim left by a refusal expires this long after the refusal unless retried.
    pub patience_ms: u64,
    /// How long the request is expected to run once admitted, from the backend's decode rate
    /// and the output it reserves (0: unknown). With it, a request may go ahead of the line
    /// when it is expected to be done before the line's front could start (a backfill).
    pub run_ms: u64,
    /// A refusal takes a new place in line only while what the line ahead still lacks is at
    /// most this many thousandths of the capacity (0: no bound).
    pub max_line_permille: u32,
    /// The request waits at the gateway when refused (its class queues): see [`Claim::waits`].
    pub waits: bool,
    /// The most it may come to hold: an elastic reservation grows past its bytes from free
    /// blocks, up to its cap, and the line does not take that growth back. A backfill that
    /// leaves the line room beside it must leave it at this size. 0: its reservation.
    pub grows_to: u64,
}

/// Whether a refusal may take a new place in line: what the line ahead of it still lacks
/// (`ahead`, its active places: a client that has not come back holds nothing, and a caller
/// that sends a new body every time never comes back, so its places must not close the line to
/// everyone else) is within the ticket's bound on the line. A line longer than the pool turns over
/// while its clients wait makes bytes wait, set aside, for clients who give up before their
/// turn (docs/design/012-a-bound-on-the-line.md). The request's own need is not counted: a
/// request bigger than the bound would never get a place, and would starve among small ones
/// that keep taking every freed byte (issue 11, section 5).
pub(super) fn line_has_room(capacity: u64, ahead: u64, t: ClaimTicket) -> bool {
    let bound = u128::from(capacity) * u128::from(t.max_line_permille) / 1000;
    t.max_line_permille == 0 || u128::from(ahead) <= bound
}

/// The claim key of a request: a stable hash (FNV-1a) of who sent it and what it asks, so its
/// retry (same caller, same body) finds its place in line.
pub fn claim_key(caller: &[u8], path: &[u8], body: &[u8]) -> u64 {
    let mut h = crate::spec::Fnv1a::new();
    for part in [caller, path, body] {
        h.write(&(part.len() as u64).to_le_bytes());
        h.write(part);
    }
    h.finish().max(1)
}

/// Most claims kept; past this, refusals leave none (the oldest keep their place).
pub const MAX_CLAIMS: usize = 256;

impl Ledger {
    /// Forget the claim with this key (its request was admitted elsewhere): what it held is
    /// free again.
    pub fn drop_claim(&mut self, key: u64) -> bool {
        let before = self.claims.len();
        self.claims.retain(|c| c.key != key);
        self.claims.len() != before
    }

    /// The client of the request with this claim went away while it waited (it closed its
    /// stream in a gateway's queue): its claim stops holding bytes, which go at once to the
    /// places behind it, but keeps its place in line until it expires, should the same request
    /// come back (a client's own retry after its timeout). Returns whether it held any.
    pub fn leave_line(&mut self, key: u64, now_ms: u64) -> bool {
        let Some(c) = self.claims.iter_mut().find(|c| c.key == key) else {
            return false;
        };
        let held = c.held > 0;
        c.active = false;
        c.held = 0;
        self.settle_claims(now_ms);
        held
    }

    pub(super) fn claim(&self, key: u64) -> Option<&Claim> {
        self.claims.iter().find(|c| c.key == key)
    }

    /// What the claim with this key holds for its request now (0 without one).
    pub fn held_for(&self, key: u64) -> u64 {
        self.claim(key).map_or(0, |c| c.held)
    }

    /// When the request with this claim key was first refused (its place in line), if it still
    /// has one: a retry's age, which a gateway queue orders by instead of the retry's arrival.
    pub fn waiting_since(&self, key: u64) -> Option<u64> {
        self.claim(key).map(|c| c.first_ms)
    }

    /// What the active places in line still lack.
    pub(super) fn active_need(&self) -> u64 {
        self.claims
            .iter()
            .filter(|c| c.active)
            .map(|c| c.bytes.saturating_sub(c.held))
            .fold(0, u64::saturating_add)
    }

    pub fn claims(&self) -> &[Claim] {
        &self.claims
    }

    /// Pour the room into the live claims again, oldest first (`settle_claims` without
    /// dropping expired ones): after a transition that took room (a demotion's slack).
    pub(super) fn pour_claims(&mut self) {
        let mut spare = self.unclaimed();
        let mut lend = self.lendable_now().min(self.lendable_to_line);
        for c in &mut self.claims {
            if !c.active {
                c.held = 0;
                continue;
            }
            let from_spare = c.bytes.min(spare);
            let from_lend = (c.bytes - from_spare).min(lend);
            spare -= from_spare;
            lend -= from_lend;
            c.held = from_spare + from_lend;
        }
    }

    /// What the claim at index `i` holds beyond the spare: the part `settle_claims` poured
    /// into it from what is lent to the line (the spare goes first, oldest claim first).
    pub(super) fn lent_to_claim(&self, i: usize) -> u64 {
        let mut spare = self.unclaimed();
        for c in self.claims.iter().take(i) {
            spare = spare.saturating_sub(c.held);
        }
        self.claims
            .get(i)
            .map_or(0, |c| c.held.saturating_sub(spare))
    }

    /// `lendable_now` were `committed` bytes committed.
    pub(super) fn lendable_now_at(&self, committed: u64) -> u64 {
        let lendable = self.lendable.min(self.held_back);
        let firm = self.held_back - lendable;
        lendable.min(
            self.admits()
                .saturating_sub(committed)
                .saturating_sub(firm)
                .saturating_sub(self.unclaimed_at(committed)),
        )
    }

    /// What [`Ledger::admit_into_lent`] finds room for were `committed` bytes committed, for a
    /// request whose own claim holds `own_held`: what is uncommitted then, less held back's
    /// firm part and what the other claims hold. The lendable part of held back counts as room:
    /// borrowed growth the backend takes back from the borrower, which resumes later (resume
    /// room lent to older claims is theirs: `reconcile` settles the claims with it).
    pub(super) fn lent_room_at(&self, committed: u64, own_held: u64) -> u64 {
        self.unclaimed_at(committed)
            .saturating_add(self.lendable_now_at(committed))
            .saturating_sub(self.claimed())
            .saturating_add(own_held)
    }

    /// What [`Ledger::admit_into_lent`] will find room for once leases holding `demoted`
    /// bytes reserve nothing ([`Ledger::demote`]). Their bytes are room at once, whatever
    /// elastic sequences have borrowed: what was borrowed is taken back from the borrowers,
    /// not paid for with more demoted leases.
    pub fn lent_room_after_demoting(&self, demoted: u64, own_held: u64) -> u64 {
        self.lent_room_at(self.committed.saturating_sub(demoted), own_held)
    }

    /// A request of a class that may preempt, refused for room: admitted into what elastic
    /// sequences have borrowed, when that covers it, so no lease is demoted (the backend
    /// takes the blocks back from the borrower, which resumes later). What claims hold, spare
    /// or lent, stays theirs. `None` (nothing changed) when it does not fit that way either.
    pub fn admit_into_lent(&mut self, req: &AdmitRequest<'_>) -> Option<Lease> {
        let own = req
            .claim
            .and_then(|t| self.claims.iter().position(|c| c.key == t.key));
        let own_held = own.and_then(|i| self.claims.get(i)).map_or(0, |c| c.held);
        let room = self.lent_room_at(self.committed, own_held);
        if req.bytes > room || req.id.is_some_and(|id| id == 0 || self.lease(id).is_some()) {
            return None;
        }
        // bytes ≤ room ≤ capacity − committed: committed stays within the capacity.
        Some(self.grant(req, own))
    }

    /// The earliest claim expiry, if any (lets a caller skip a reap that would do nothing).
    pub fn next_claim_expiry(&self) -> Option<u64> {
        self.claims.iter().map(|c| c.expires_ms).min()
    }
}
