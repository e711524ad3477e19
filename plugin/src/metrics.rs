//! The filter's Envoy stats (`kvgate.*`): defined once per worker, set on the request path and
//! at each tick from the worker's views, never read back.

use kvgate_core::ErrorKind;

use crate::host::Metric;

pub struct Metrics {
    /// Admitted requests answered 503 because their backend stopped answering after they were
    /// sent (not counted as rejected).
    pub stranded: Metric,
    /// Callers that dropped a request at once after admission (no place in line for a while).
    pub forfeited: Metric,
    pub admitted: Metric,
    pub degraded: Metric,
    pub preempted: Metric,
    /// Demotions not sent, or not answered 200.
    pub demote_failed: Metric,
    /// Demotions sent and not answered yet, of requests still waiting for them.
    pub demotions_pending: Metric,
    pub released: Metric,
    pub released_by_backend: Metric,
    pub reaped: Metric,
    pub unseen_leases: Metric,
    pub unseen_bytes: Metric,
    pub held_back_bytes: Metric,
    pub slack_bytes: Metric,
    pub release_unknown: Metric,
    pub ledger_errors: Metric,
    pub backend_poll_failures: Metric,
    rejected: Vec<(ErrorKind, Metric)>,
    would_reject: Vec<(ErrorKind, Metric)>,
    pub would_queue: Metric,
    pub would_degrade: Metric,
    pub would_preempt: Metric,
    pub queued: Metric,
    pub committed_bytes: Metric,
    pub capacity_bytes: Metric,
    pub level: Metric,
    pub live_leases: Metric,
    pub backend_up: Metric,
    pub backend_used_bytes: Metric,
    pub drift_bytes: Metric,
    pub backend_refused: Metric,
    pub upstream_mismatch: Metric,
    /// Sequences the vLLM backends preempted since they started (their
    /// `vllm:num_preemptions_total`, as last polled).
    pub backend_preemptions: Metric,
    pub elastic_admitted: Metric,
    /// Admitted ahead of the fair-retry line: expected to be done before its front could start.
    pub backfilled: Metric,
    /// Backfills that ended after their expected end, and by how much in all (ms).
    pub backfill_overran: Metric,
    pub backfill_overrun_ms: Metric,
    pub grown_bytes: Metric,
    /// Clients gone from the queue while their place in line held bytes (given to the places
    /// behind at once).
    pub left_line_holding: Metric,
    /// Queued requests behind a waiting front admitted where they fit at once, tried while some
    /// endpoint has nobody in line (fleets).
    pub passed_in_queue: Metric,
}

impl Metrics {
    pub(crate) fn define() -> Metrics {
        let per_kind = |prefix: &str| -> Vec<(ErrorKind, Metric)> {
            ErrorKind::ALL
                .iter()
                .map(|k| (*k, Metric::counter(&format!("{prefix}.{}", k.code()))))
                .collect()
        };
        let rejected = per_kind("kvgate.rejected");
        let would_reject = per_kind("kvgate.shadow.would_reject");
        Metrics {
            admitted: Metric::counter("kvgate.admitted"),
            degraded: Metric::counter("kvgate.degraded"),
            preempted: Metric::counter("kvgate.preempted"),
            demote_failed: Metric::counter("kvgate.demote_failed"),
            demotions_pending: Metric::gauge("kvgate.demotions_pending"),
            released: Metric::counter("kvgate.released"),
            released_by_backend: Metric::counter("kvgate.released_by_backend"),
            reaped: Metric::counter("kvgate.reaped"),
            unseen_leases: Metric::gauge("kvgate.unseen_leases"),
            unseen_bytes: Metric::gauge("kvgate.unseen_bytes"),
            held_back_bytes: Metric::gauge("kvgate.held_back_bytes"),
            slack_bytes: Metric::gauge("kvgate.slack_bytes"),
            release_unknown: Metric::counter("kvgate.release_unknown"),
            ledger_errors: Metric::counter("kvgate.ledger_errors"),
            backend_poll_failures: Metric::counter("kvgate.backend_poll_failures"),
            rejected,
            would_reject,
            would_queue: Metric::counter("kvgate.shadow.would_queue"),
            would_degrade: Metric::counter("kvgate.shadow.would_degrade"),
            would_preempt: Metric::counter("kvgate.shadow.would_preempt"),
            queued: Metric::gauge("kvgate.queued"),
            committed_bytes: Metric::gauge("kvgate.committed_bytes"),
            capacity_bytes: Metric::gauge("kvgate.capacity_bytes"),
            level: Metric::gauge("kvgate.level"),
            live_leases: Metric::gauge("kvgate.live_leases"),
            backend_up: Metric::gauge("kvgate.backend_up"),
            backend_used_bytes: Metric::gauge("kvgate.backend_used_bytes"),
            drift_bytes: Metric::gauge("kvgate.drift_bytes"),
            backend_refused: Metric::counter("kvgate.backend_refused"),
            upstream_mismatch: Metric::counter("kvgate.upstream_mismatch"),
            backend_preemptions: Metric::gauge("kvgate.backend_preemptions"),
            stranded: Metric::counter("kvgate.stranded"),
            forfeited: Metric::counter("kvgate.forfeited"),
            elastic_admitted: Metric::counter("kvgate.elastic_admitted"),
            backfilled: Metric::counter("kvgate.backfilled"),
            backfill_overran: Metric::counter("kvgate.backfill_overran"),
            backfill_overrun_ms: Metric::counter("kvgate.backfill_overrun_ms"),
            grown_bytes: Metric::gauge("kvgate.grown_bytes"),
            left_line_holding: Metric::counter("kvgate.left_line_holding"),
            passed_in_queue: Metric::counter("kvgate.passed_in_queue"),
        }
    }

    pub fn rejected(&self, kind: ErrorKind) {
        if let Some((_, m)) = self.rejected.iter().find(|(k, _)| *k == kind) {
            m.inc();
        }
    }

    /// Shadow mode: a refusal that was not sent.
    pub fn would_reject(&self, kind: ErrorKind) {
        if let Some((_, m)) = self.would_reject.iter().find(|(k, _)| *k == kind) {
            m.inc();
        }
    }
}

/// An endpoint's own stats: `kvgate.endpoint.<address, '.' and ':' as '_'>.<name>`.
pub struct EndpointMetrics {
    pub committed_bytes: Metric,
    pub capacity_bytes: Metric,
    pub foreign_bytes: Metric,
    pub up: Metric,
    pub admitted: Metric,
    pub backend_refused: Metric,
}

impl EndpointMetrics {
    pub(crate) fn define(address: &str) -> EndpointMetrics {
        let tag: String = address
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let name = |n: &str| format!("kvgate.endpoint.{tag}.{n}");
        EndpointMetrics {
            committed_bytes: Metric::gauge(&name("committed_bytes")),
            capacity_bytes: Metric::gauge(&name("capacity_bytes")),
            foreign_bytes: Metric::gauge(&name("foreign_bytes")),
            up: Metric::gauge(&name("up")),
            admitted: Metric::counter(&name("admitted")),
            backend_refused: Metric::counter(&name("backend_refused")),
        }
    }
}
