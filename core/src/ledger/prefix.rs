//! Shared prefixes: one live lease pays a chat prefix's bytes, the others are credited, and
//! the payment passes to the oldest credited lease when the payer's reservation ends.

use super::*;

impl Ledger {
    /// What a request starting with the shared prefix `key` (`bytes` of it) does not pay:
    /// all of it while a live lease with that key pays it, else nothing.
    pub fn prefix_credit(&self, key: u64, bytes: u64) -> u64 {
        let paid = key != 0
            && self
                .leases
                .iter()
                .any(|l| l.prefix == key && l.credit == 0 && l.bytes > 0);
        if paid {
            bytes
        } else {
            0
        }
    }

    /// Lease `id` starts with the shared prefix `key` and was admitted `credit` bytes below
    /// its price for it ([`Ledger::prefix_credit`]).
    pub fn set_prefix(&mut self, id: u64, key: u64, credit: u64) {
        if let Some(l) = self.leases.iter_mut().find(|l| l.id == id) {
            l.prefix = key;
            l.credit = credit;
        }
    }

    /// `gone` (out of the leases, or demoted) reserves its bytes no more. If it paid a shared
    /// prefix, the oldest other live lease with the same key pays it from now on (the backend
    /// holds the prefix while any of them lives): that part stays committed, and only the rest
    /// is taken off the slack (it may have been all slack).
    pub(super) fn end_reservation(&mut self, gone: &Lease) {
        let paid = gone.prefix != 0 && gone.credit == 0;
        let next = self
            .leases
            .iter_mut()
            .filter(|l| paid && l.prefix == gone.prefix && l.credit > 0 && l.bytes > 0)
            .min_by_key(|l| (l.created_ms, l.id));
        let moved = next.map_or(0, |l| {
            let credit = std::mem::take(&mut l.credit);
            l.bytes = l.bytes.saturating_add(credit);
            credit
        });
        self.committed = self
            .committed
            .saturating_sub(gone.bytes)
            .saturating_add(moved);
        self.slack = self.slack.saturating_sub(gone.bytes.saturating_sub(moved));
    }
}
