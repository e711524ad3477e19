//! Polling the backends: their lease reports (or a vLLM's metrics) reconciled into the ledger,
//! their descriptors followed, and what a backend that stops answering strands.

use super::*;

impl Root {
    pub(super) fn poll_backends(&mut self, rt: &Runtime, now: u64) {
        let Some(b) = &rt.cfg.backend else { return };
        // One poll at a time carries the (large) descriptor.
        let mut asking = self.polls.iter().any(|p| p.asked_descriptor);
        for i in 0..self.polls.len() {
            let Some(p) = self.polls.get_mut(i) else {
                continue;
            };
            if p.in_flight.is_some() || now < p.next_ms {
                continue;
            }
            p.next_ms = now + b.poll_ms;
            let ask = self.want_descriptor && !asking;
            let include = if ask { "&include=tokenizer" } else { "" };
            // Naming this Envoy, so the backend tells it of the other gateways that poll (a
            // vLLM's metrics take no query).
            let path = if !b.keeps_leases() {
                b.leases_path.clone()
            } else {
                format!(
                    "{}?since={}&gateway={}&instance={:016x}&poll_ms={}{include}",
                    b.leases_path,
                    p.cursor,
                    self.worker.gateway(),
                    self.worker.instance(),
                    b.poll_ms
                )
            };
            match host::call_backend(b, p.address.as_deref(), "GET", &path) {
                Ok(token) => {
                    p.in_flight = Some(token);
                    p.asked_descriptor = ask;
                    asking |= ask;
                }
                Err(s) => self.poll_failed(rt, i, &format!("dispatch failed: {s:?}"), true),
            }
        }
    }

    pub(super) fn endpoint_of(&self, i: usize) -> Option<Rc<Endpoint>> {
        let p = self.polls.get(i)?;
        self.worker.endpoint(p.address.as_deref())
    }

    /// A poll failed (`unreachable`: no answer from the backend at all — Envoy's own 503 or
    /// 504, a failed dispatch — rather than an answer it did not like).
    pub(super) fn poll_failed(&mut self, rt: &Runtime, i: usize, why: &str, unreachable: bool) {
        if let Some(e) = self.endpoint_of(i) {
            e.unreachable.set(unreachable);
        }
        let Some(b) = &rt.cfg.backend else { return };
        if let Some(p) = self.polls.get_mut(i) {
            p.asked_descriptor = false;
        }
        let Some(e) = self.endpoint_of(i) else { return };
        self.worker.metrics.backend_poll_failures.inc();
        e.refresh_health();
        let mut h = e.health();
        h.polled = true;
        h.failures += 1;
        // One line when it goes down (also when it was never up), not one per failed poll.
        if h.failures == b.down_after_failures {
            host::warn(&format!(
                "kvgate: backend {} is down after {} failed polls: {why}; no new request goes there, its leases end with their requests",
                e.name(&rt.cfg),
                h.failures
            ));
        }
        if h.failures >= b.down_after_failures {
            h.up = false;
        }
        e.set_health(&h);
        self.observe_backends(rt);
    }

    /// The fleet-wide backend gauges, from every endpoint's health.
    pub(super) fn observe_backends(&self, rt: &Runtime) {
        let (mut up, mut used, mut drift) = (false, 0u64, 0u64);
        let (mut unseen_leases, mut unseen_bytes) = (0u64, 0u64);
        for e in self.worker.endpoints() {
            let h = e.health();
            up |= !h.down();
            used = used.saturating_add(h.used_bytes);
            drift = drift
                .saturating_add(u64::try_from(h.drift_bytes.unsigned_abs()).unwrap_or(u64::MAX));
            unseen_leases = unseen_leases.saturating_add(h.unseen_leases);
            unseen_bytes = unseen_bytes.saturating_add(h.unseen_bytes);
        }
        // Totals over every endpoint, from each one's last poll: one endpoint's poll does not
        // hide what another's found.
        let m = &self.worker.metrics;
        m.backend_up.set(u64::from(up));
        m.backend_used_bytes.set(used);
        m.drift_bytes.set(drift);
        m.unseen_leases.set(unseen_leases);
        m.unseen_bytes.set(unseen_bytes);
        self.worker.observe_metrics(&rt.cfg);
    }

    /// Requests sent to an endpoint before it was known to be down (its polls get no answer at
    /// all) get their answer now: a 503 with a Retry-After, as a request sent after would
    /// (their leases end with them). An endpoint that answers its polls, if wrongly, may still
    /// be serving them: they are left alone.
    pub(super) fn answer_stranded(&self, rt: &Runtime) {
        for t in self.worker.stranded() {
            if hostcalls::set_effective_context(t.context_id).is_err() {
                continue;
            }
            let err = kvgate_core::ApiError::new(
                kvgate_core::ErrorKind::BackendUnavailable,
                "The model server stopped answering after this request was sent to it. Retry \
                 after the time in the Retry-After header.",
            )
            .with_retry_after_ms(
                rt.cfg
                    .retry_after
                    .max_ms
                    .min(5_000)
                    .max(rt.cfg.retry_after.min_ms),
            );
            self.worker.metrics.stranded.inc();
            host::send_error(&err, kvgate_core::Level::Red.as_str());
        }
    }

    pub(super) fn poll_answered(&mut self, rt: &Runtime, i: usize, body_size: usize) {
        let Some(b) = &rt.cfg.backend else { return };
        let Some(e) = self.endpoint_of(i) else { return };
        let status = abi_status();
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        if status != Some(200) {
            let unreachable = matches!(status, None | Some(503) | Some(504));
            return self.poll_failed(rt, i, &format!("status {status:?}"), unreachable);
        }
        let parsed = if b.keeps_leases() {
            BackendReport::parse(&body)
        } else {
            self.read_vllm(rt, i, &e, &body)
        };
        let report = match parsed {
            Ok(r) => r,
            Err(err) => return self.poll_failed(rt, i, &err, false),
        };
        // Answered by the host it named? Else that host is not in the cluster and Envoy fell
        // back to another: its pool is not this endpoint's, which is then down.
        if let (Some(named), Some(at)) = (&e.address, &report.served_at) {
            if !kvgate_core::fleet::same_host(named, at) {
                self.worker.metrics.upstream_mismatch.inc();
                return self.poll_failed(rt, i, &format!("answered by {at}, not {named}"), false);
            }
        }
        e.unreachable.set(false);
        let mismatch = self.follow_descriptor(i, &e, &body, &report);
        // The runtime may have changed (a descriptor applied).
        let Some(rt) = self.worker.runtime() else {
            return;
        };
        // A backend that allocates larger KV blocks than the margin covers (restarted with
        // another --block-size) needs that margin on every reservation: take it now. The margin
        // only grows here, so a fleet ends priced at its largest.
        // A vLLM publishes its block size, so its margin too.
        let published = rt.cfg.from_backend || !b.keeps_leases();
        let rt = match report.scratch_margin_bytes {
            Some(m) if published && m > rt.cfg.pricing.scratch_margin_bytes => {
                self.raise_margin(&rt, m).unwrap_or(rt)
            }
            _ => rt,
        };
        // Each endpoint's capacity follows its own pool once the model is known.
        let capacity = ((rt.cfg.from_backend && self.descriptor_fingerprint.is_some())
            || !b.keeps_leases())
        .then(|| usable_capacity(report.capacity_bytes, rt.cfg.pricing.safety_fraction));
        let now = host::now_ms();
        let progress = self
            .polls
            .get_mut(i)
            .and_then(|p| p.progress.observe(&report, now))
            .filter(|_| rt.cfg.retry_from_progress);
        // No rate for run estimates (no decode rate measured yet, fewer than 5 outputs seen —
        // `Progress::warm` — or Retry-After not estimated from progress): no backfills.
        e.tokens_per_s.set(
            progress
                .as_ref()
                .filter(|p| p.warm())
                .map_or(0.0, |p| p.tokens_per_s),
        );
        // Expected ends from the ledger as it is now, outside the CAS (a retry does not redo
        // the Monte Carlo); applied by id inside it.
        let etas = match progress
            .as_ref()
            .map(|_| store::read(&EnvoyStore, &e.ledger_key))
        {
            Some(Ok(ledger)) => own_etas(&ledger, &report, progress.as_ref(), now),
            _ => Default::default(),
        };
        let done = store::transact(&EnvoyStore, &e.ledger_key, CAS_ATTEMPTS, |l| {
            if let Some(c) = capacity {
                l.set_capacity(c);
            }
            reconcile(
                l,
                &report,
                now,
                b.lost_grace_ms,
                &etas,
                self.worker.gateway(),
            )
        });
        let (rec, ledger) = match done {
            Ok(v) => v,
            Err(err) => {
                self.worker.metrics.ledger_errors.inc();
                return host::warn(&format!("kvgate: reconcile at {}: {err}", e.name(&rt.cfg)));
            }
        };
        e.observe(&ledger);
        let Some(p) = self.polls.get_mut(i) else {
            return;
        };
        p.cursor = report.cursor;
        // One line per lease when it first counts as unseen; it stays in the ledger.
        p.unseen_warned
            .retain(|id| rec.unseen.iter().any(|l| l.id == *id));
        for l in &rec.unseen {
            if !p.unseen_warned.contains(&l.id) {
                p.unseen_warned.push(l.id);
                host::warn(&format!(
                    "kvgate: drift: lease {} ({} B, class {}) is unknown to the backend {} {} ms after admission; kept until its request ends",
                    l.id,
                    l.bytes,
                    l.class,
                    e.name(&rt.cfg),
                    now.saturating_sub(l.created_ms)
                ));
            }
        }
        self.worker
            .metrics
            .released_by_backend
            .add(rec.released.len() as u64);
        // Elastic sequences grown past their reservations hold more than the ledger counts,
        // and other gateways' leases are their ledgers': expected (and held back from
        // admission), not drift.
        let d = unexplained_drift(&ledger, &report, &rec);
        e.grown.set(rec.grown_bytes);
        // An older backend in reserve mode reads elastic reservations only from a header this
        // gateway no longer sends: worst case in front of it.
        e.lends
            .set(report.admission == "reserve" && report.gateway_note);
        self.worker.learn_outputs(&rt.cfg, &report.class_outputs);
        let before = e.health();
        let was_over = before.drift_bytes.unsigned_abs() > u128::from(b.drift_warn_bytes);
        // Edge-triggered: one line when the gap crosses the threshold, not one per poll.
        if d.unsigned_abs() > u128::from(b.drift_warn_bytes) && !was_over {
            host::warn(&format!(
                "kvgate: drift {d} B between the ledger ({} B committed) and the backend {} ({} B used) exceeds {} B",
                ledger.committed(),
                e.name(&rt.cfg),
                report.used_bytes,
                b.drift_warn_bytes
            ));
        }
        if before.down() {
            host::info(&format!("kvgate: backend {} is up again", e.name(&rt.cfg)));
        }
        e.set_health(&BackendHealth {
            polled: true,
            up: true,
            full: false,
            mismatch,
            failures: 0,
            used_bytes: report.used_bytes,
            capacity_bytes: report.capacity_bytes,
            drift_bytes: d,
            last_ok_ms: now,
            unseen_bytes: rec.unseen_bytes(),
            unseen_leases: rec.unseen.len() as u64,
            foreign_bytes: rec.foreign_bytes,
            foreign_leases: rec.foreign_leases as u64,
            other_gateways: rec.other_gateways,
        });
        self.observe_backends(&rt);
    }

    /// A vLLM's metrics as a report (its pool and use, no leases), priced per token as this
    /// filter prices, and the output lengths it finished since the last poll, learned by the
    /// elastic classes. A preemption counter that moved is an alarm: priced at their worst case,
    /// requests behind this gateway alone never make it preempt; it does when requests bypass
    /// the gateway, when its pool is smaller than it says, or when elastic reservations turn out
    /// short.
    pub(super) fn read_vllm(
        &mut self,
        rt: &Runtime,
        i: usize,
        e: &Endpoint,
        body: &[u8],
    ) -> Result<BackendReport, String> {
        let m = kvgate_core::vllm::Metrics::parse(body)?;
        let report = m.report(rt.cfg.pricing.bytes_per_token);
        if let Some(p) = self.polls.get_mut(i) {
            let (moved, outputs) = m.since(p.vllm.as_ref(), kvgate_core::elastic::OUTPUTS_KEPT);
            // For the elastic classes (vLLM does not say which class a request was: every
            // elastic class learns every output).
            let learned: Vec<(String, kvgate_core::reconcile::Output)> = rt
                .cfg
                .policy
                .classes()
                .iter()
                .filter(|c| matches!(c.reservation, kvgate_core::Reservation::Elastic(_)))
                .flat_map(|c| outputs.iter().map(|o| (c.name.clone(), *o)))
                .collect();
            self.worker.learn_outputs(&rt.cfg, &learned);
            if moved > 0 {
                host::warn(&format!(
                    "kvgate: the vLLM {} preempted {moved} sequences ({} running, {} waiting, {} of {} blocks used): it serves more than this gateway admitted",
                    e.name(&rt.cfg),
                    m.running,
                    m.waiting,
                    m.used_blocks,
                    m.blocks
                ));
            }
            p.vllm = Some(m);
            // Every worker polls: the gauge is the servers' own counters (each worker sets the
            // same), not a count of what each worker saw move.
            let total = self
                .polls
                .iter()
                .filter_map(|p| p.vllm.as_ref())
                .fold(0u64, |t, m| t.saturating_add(m.preemptions));
            self.worker.metrics.backend_preemptions.set(total);
        }
        Ok(report)
    }

    /// `"model": "from_backend"`: take the descriptor when a poll asked for it. Returns whether
    /// this endpoint serves another model than the one priced with: with one endpoint that
    /// means fetching its descriptor again (live leases keep the fingerprint that priced them);
    /// in a fleet the endpoint is left out of the choice, and the descriptor is fetched again
    /// only when no endpoint serves the priced model any more.
    pub(super) fn follow_descriptor(
        &mut self,
        i: usize,
        e: &Endpoint,
        body: &[u8],
        report: &BackendReport,
    ) -> bool {
        if !self.configured.as_ref().is_some_and(|c| c.from_backend) {
            return false;
        }
        if let Some(p) = self.polls.get_mut(i) {
            if std::mem::take(&mut p.asked_descriptor) {
                match Descriptor::parse(body) {
                    Ok(Some(d)) => {
                        if let Err(err) = self.apply_descriptor(d, e) {
                            host::warn(&format!("kvgate: model descriptor refused: {err}"));
                        }
                    }
                    Ok(None) => {}
                    Err(err) => host::warn(&format!("kvgate: model descriptor unreadable: {err}")),
                }
                return false;
            }
        }
        let single = self.polls.len() <= 1;
        let differs = self.descriptor_fingerprint.is_some()
            && if single {
                // One backend: any change (a new pool size changes its served context too)
                // means pricing with its new descriptor.
                report.fingerprint.is_some() && report.fingerprint != self.descriptor_fingerprint
            } else {
                // A fleet: backends may hold different pools (and advertise different
                // contexts); only another KV shape or model name is another model.
                self.worker.runtime().is_some_and(|rt| {
                    !report.serves(
                        &rt.cfg.pricing.spec,
                        rt.cfg.served.model.as_deref(),
                        self.descriptor_fingerprint.as_deref(),
                    )
                })
            };
        if !differs {
            return false;
        }
        let others_serve_it = self.worker.endpoints().iter().any(|o| {
            let h = o.health();
            o.address != e.address && !h.down() && !h.mismatch && h.polled
        });
        if !e.health().mismatch {
            host::info(&format!(
                "kvgate: the backend {} serves model fingerprint {:?}, not {:?}{}",
                e.address.as_deref().unwrap_or("backend"),
                report.fingerprint,
                self.descriptor_fingerprint,
                if others_serve_it {
                    "; left out of the choice"
                } else {
                    "; fetching its descriptor"
                }
            ));
        }
        if !others_serve_it && !self.want_descriptor {
            self.want_descriptor = true;
            if let Some(p) = self.polls.get_mut(i) {
                p.next_ms = 0;
            }
        }
        others_serve_it
    }
}
