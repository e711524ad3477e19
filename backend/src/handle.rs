//! How the HTTP layer talks to the engine thread: a cloneable `EngineHandle` that sends
//! `Command`s down a channel, the `Submit` a request becomes, and the `Event`s the engine sends
//! back to that request. The handle never touches the engine's state; it reads only what the
//! engine publishes (`Published`), the pool's counters and the metrics.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use kvgate_core::wire::{FinishReason, FinishedEntry, LeaseEntry};
use kvgate_core::ApiError;
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use crate::metrics::Metrics;
use crate::pool::{BlockPool, PoolStats};
use crate::published::Published;

#[derive(Debug, Clone)]
pub struct GenParams {
    pub max_tokens: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stop: Vec<String>,
}

#[derive(Debug)]
pub enum Event {
    /// The request holds its KV and is queued for prefill.
    Admitted {
        id: String,
    },
    Rejected(ApiError),
    Text(String),
    Finished {
        reason: FinishReason,
        prompt_tokens: u64,
        completion_tokens: u64,
        /// Set when the sequence ended abnormally (KV OOM, preempted).
        error: Option<ApiError>,
    },
}

pub struct Submit {
    pub lease: Option<String>,
    /// The gateway's admission class (`x-kvgate-class`), echoed in the lease report.
    pub class: Option<String>,
    /// Elastic: the output tokens the gateway reserved (its body note's `reserve_output`, or
    /// `x-kvgate-reserve-output` from an older gateway); the sequence may grow past them from
    /// free blocks.
    pub reserve_output: Option<u64>,
    /// The prompt's length as the gateway counted it (its `kvgate.prompt_tokens`; 0: not
    /// told), echoed in the lease report when the sequence ends.
    pub gateway_prompt_tokens: u64,
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub events: UnboundedSender<Event>,
}

pub(crate) enum Command {
    Submit(Box<Submit>),
    Cancel(String, oneshot::Sender<bool>),
    Demote(String, oneshot::Sender<Demoted>),
}

/// What a demotion did (`POST /v1/admission/leases/{id}/demote`: the gateway preempted the
/// lease for a higher class).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demoted {
    /// Its sequence reserves nothing now: it goes on in borrowed blocks and is recomputed
    /// later when a reservation needs them.
    Lent,
    /// Not here yet: it will reserve nothing when it arrives.
    OnArrival,
    /// This backend does not lend (`--admission` other than `reserve`): stopped, as by a cancel.
    Cancelled,
    /// Already finished: it holds nothing, which is what the demotion asked (200, `finished`).
    Finished,
    /// Not here and this backend does not lend (a 404, as for any lease not held).
    Unknown,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    pub published: Arc<Mutex<Published>>,
    pub pool: BlockPool,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    pub(crate) fn new(
        tx: Sender<Command>,
        published: Arc<Mutex<Published>>,
        pool: BlockPool,
        metrics: Arc<Metrics>,
    ) -> EngineHandle {
        EngineHandle {
            tx,
            published,
            pool,
            metrics,
        }
    }

    pub fn submit(&self, s: Submit) -> bool {
        self.tx.send(Command::Submit(Box::new(s))).is_ok()
    }

    pub async fn cancel(&self, id: String) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Cancel(id, tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// `None`: the engine is gone.
    pub async fn demote(&self, id: String) -> Option<Demoted> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Demote(id, tx)).ok()?;
        rx.await.ok()
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// The lease report's pool, leases, leases finished after cursor `since`, and the cursor,
    /// all from one publish: read under one lock, so a report never pairs the pool of one step
    /// with the leases of another.
    pub fn lease_report(
        &self,
        since: u64,
    ) -> (PoolStats, Vec<LeaseEntry>, Vec<FinishedEntry>, u64) {
        let p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let pool = self.pool_as_published(&p);
        let (leases, finished, cursor) = p.since(since);
        (pool, leases, finished, cursor)
    }

    /// The pool as the lease report carries it, from published state `p` (read with its lock
    /// held): what the allocator holds, plus the blocks promised to sequences that have not
    /// taken them yet (`--lazy-blocks`), as used. The allocator is read under that lock too:
    /// `publish` reads it under the same lock, so the two agree on which blocks had been taken
    /// when `p` was written.
    ///
    /// Blocks the allocator took after the leases were published (a sequence growing in the
    /// step running now) are not counted until the next publish, with the lease that took
    /// them: counted now, they would be use no lease in the report holds, which the gateway
    /// holds back past that lease's end, until its next poll. Blocks given back since count
    /// at once.
    fn pool_as_published(&self, p: &Published) -> PoolStats {
        let (promised, allocated) = (p.promised_bytes, p.allocated_bytes);
        let s = self.pool.stats();
        let block = s.block_bytes.max(1);
        let unreported = s.used_bytes.saturating_sub(allocated);
        let promised_blocks = u32::try_from(promised / block).unwrap_or(u32::MAX);
        let unreported_blocks = u32::try_from(unreported / block).unwrap_or(u32::MAX);
        PoolStats {
            blocks_free: s
                .blocks_free
                .saturating_add(unreported_blocks)
                .saturating_sub(promised_blocks),
            used_bytes: s
                .used_bytes
                .saturating_sub(unreported)
                .saturating_add(promised),
            free_bytes: s
                .free_bytes
                .saturating_add(unreported)
                .saturating_sub(promised),
            promised_bytes: promised,
            ..s
        }
    }
}
