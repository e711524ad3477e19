//! What the engine publishes for the HTTP layer to read without waiting on the engine: the live
//! leases after every step and the leases that finished, numbered by a cursor. The admission API
//! turns it into the wire report (`kvgate_core::wire::LeaseReport`) the filter polls.
//!
//! `arrived` is written by the HTTP layer: a lease is acknowledged the moment its request
//! arrives, before the engine sees it, so the filter never mistakes a request on its way for a
//! lost one. Nothing here schedules or allocates.

use std::collections::{HashSet, VecDeque};

use kvgate_core::wire::{FinishReason, FinishedEntry, LeaseEntry, LeaseState};

/// How many finished leases are kept for pollers that fall behind.
const FINISHED_KEPT: usize = 4096;

#[derive(Debug, Default)]
pub struct Published {
    /// Waiting and running sequences, as of the engine's last step.
    pub leases: Vec<LeaseEntry>,
    pub finished: VecDeque<FinishedEntry>,
    pub cursor: u64,
    pub arrived: HashSet<String>,
    /// Blocks promised to live sequences and not taken yet (`--lazy-blocks`), in bytes.
    pub promised_bytes: u64,
    /// What the allocator held when `leases` were published, in bytes: the lease report counts
    /// no more than that (see `EngineHandle::pool_report`).
    pub allocated_bytes: u64,
}

impl Published {
    /// Record that a lease ended (under the lock, so a report never shows it both gone and not
    /// finished).
    pub fn record_finished(
        &mut self,
        id: &str,
        reason: FinishReason,
        prompt: u64,
        completion: u64,
        class: Option<String>,
        gateway_prompt_tokens: u64,
    ) {
        self.cursor += 1;
        let cursor = self.cursor;
        self.finished.push_back(FinishedEntry {
            cursor,
            id: id.to_string(),
            reason,
            prompt_tokens: prompt,
            completion_tokens: completion,
            class: class.unwrap_or_default(),
            gateway_prompt_tokens,
        });
        while self.finished.len() > FINISHED_KEPT {
            self.finished.pop_front();
        }
    }

    /// Is a request holding this lease id in flight (arrived, waiting or running)?
    pub fn is_live(&self, id: &str) -> bool {
        self.arrived.contains(id) || self.leases.iter().any(|l| l.id == id)
    }

    /// The live leases (with those acknowledged at arrival that the engine has not taken yet),
    /// the leases finished after `since`, and the cursor to ask from next.
    pub fn since(&self, since: u64) -> (Vec<LeaseEntry>, Vec<FinishedEntry>, u64) {
        let finished = self
            .finished
            .iter()
            .filter(|f| f.cursor > since)
            .cloned()
            .collect();
        let mut leases = self.leases.clone();
        for id in &self.arrived {
            if !leases.iter().any(|l| &l.id == id) {
                leases.push(LeaseEntry {
                    id: id.clone(),
                    state: LeaseState::Arrived,
                    ..LeaseEntry::default()
                });
            }
        }
        (leases, finished, self.cursor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrived_leases_are_listed_and_finished_ones_are_numbered() {
        let mut p = Published::default();
        p.arrived.insert("a".into());
        p.record_finished("b", FinishReason::Refused, 0, 0, None, 0);
        p.record_finished("c", FinishReason::Stop, 3, 2, Some("batch".into()), 4);
        let (leases, finished, cursor) = p.since(1);
        assert_eq!(cursor, 2);
        assert_eq!(
            leases
                .iter()
                .map(|l| (l.id.as_str(), l.state))
                .collect::<Vec<_>>(),
            vec![("a", LeaseState::Arrived)]
        );
        assert_eq!(
            finished.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(),
            vec!["c"]
        );
        // The gateway's count of the prompt goes back to it beside the backend's own.
        assert_eq!(
            (finished[0].prompt_tokens, finished[0].gateway_prompt_tokens),
            (3, 4)
        );
        assert!(p.is_live("a") && !p.is_live("c"));
    }
}
