//! The gateway arms: the filter's passes over kvgate-core's own pricing, decisions, ledger,
//! queue and reconciliation.

use super::*;

pub(super) struct Gateway {
    pub(super) cfg: Config,
    pub(super) ledgers: Vec<Ledger>,
    pub(super) views: Vec<View>,
    pub(super) queue: AdmissionQueue<usize>,
    pub(super) learned: HashMap<String, OutputLengths>,
    pub(super) next_lease: u64,
    /// Live lease id → (request, endpoint).
    pub(super) leases: HashMap<u64, (usize, usize)>,
    /// Per backend, output tokens a second of one decoding sequence as the polls see it (the
    /// filter's `Endpoint::tokens_per_s`; 0 until its tracker's model is warm).
    pub(super) tokens_per_s: Vec<f64>,
    /// Per backend, the filter's `ProgressTracker`.
    pub(super) progress: Vec<ProgressTracker>,
    /// Requests carry their expected run (`ClaimTicket::run_ms`) and the queue is tried behind
    /// its front (`--backfill`).
    pub(super) backfill: bool,
}

pub(super) enum Attempt {
    Forward { cmds: Vec<(usize, Cmd)> },
    Queued { deadline_ms: u64 },
    Refused { status: u32, retry_ms: Option<u64> },
}

impl Gateway {
    pub(super) fn new(cfg: Config, backends: usize, backfill: bool) -> Self {
        let cap = cfg.pricing.capacity_bytes;
        let on = cfg.backfill;
        let ledgers: Vec<Ledger> = (0..backends)
            .map(|i| {
                Ledger::new(
                    cap,
                    ((i as u64 + 1) << 32) | kvgate_core::lease_id::compose(GATEWAY, 0),
                )
            })
            .collect();
        let views = ledgers
            .iter()
            .map(|l| {
                let mut v = View {
                    eligible: true,
                    ..View::default()
                };
                v.observe(l);
                v
            })
            .collect();
        let mut queue = AdmissionQueue::default();
        queue.set_aging_ms(cfg.policy.queue_aging_ms);
        Gateway {
            cfg,
            ledgers,
            views,
            queue,
            learned: HashMap::new(),
            tokens_per_s: vec![0.0; backends],
            progress: vec![ProgressTracker::default(); backends],
            backfill: backfill && on,
            next_lease: 1,
            leases: HashMap::new(),
        }
    }

    pub(super) fn class(&self, name: &str) -> ClassPolicy {
        self.cfg.policy.resolve(Some(name)).clone()
    }

    /// What request `r` reserves now: as the filter's `Ticket::reprice`, at every try (the
    /// allowance of an elastic class moves as it learns).
    pub(super) fn priced(
        &self,
        r: &ReqState,
    ) -> Result<(ClassPolicy, Priced), kvgate_core::ApiError> {
        let cfg = &self.cfg;
        let prompt = vec![r.req.prompt];
        let price = price_request(&cfg.pricing, &prompt, r.cap, 1)?;
        let class = self.class(r.req.class);
        let mut priced = Priced {
            prompt_tokens: prompt,
            choices: 1,
            price,
            elastic: None,
            prefix: None,
        };
        if let Reservation::Elastic(p) = class.reservation {
            let a = p.allowance_for(self.learned.get(&class.name), r.req.prompt, u64::MAX);
            if a < u64::MAX {
                priced = priced.with_allowance(cfg, a);
            }
        }
        Ok((class, priced))
    }

    /// The filter's `Ticket::claim_active`: request `r`'s place in line at some endpoint is
    /// active (the ledger sets bytes aside for it).
    pub(super) fn claim_active(&self, r: &ReqState) -> bool {
        let key = claim_key_of(&r.req);
        self.ledgers
            .iter()
            .any(|l| l.claims().iter().any(|c| c.key == key && c.active))
    }

    /// `Ticket::run_ms`: how long request `r` is expected to decode (0: unknown).
    pub(super) fn run_ms_of(&self, r: &ReqState) -> u64 {
        match self.priced(r) {
            // To its cap, as the filter's: the line does not take back what a backfill grows
            // past an elastic allowance.
            Ok((_, p)) if self.backfill => {
                reconcile::run_ms(self.tokens_per_s.iter().copied(), p.price.cap.cap)
            }
            _ => 0,
        }
    }

    /// One try of request `r` (as the filter's `finish` and `Ticket::attempt`).
    pub(super) fn attempt(
        &mut self,
        r: &ReqState,
        idx: usize,
        now_ms: u64,
        jitter_seed: u64,
        from_queue: bool,
        behind: bool,
    ) -> Attempt {
        let (class, priced) = match self.priced(r) {
            Ok(v) => v,
            Err(e) => {
                let status = match e.kind {
                    ErrorKind::ContextLengthExceeded => self.cfg.context_error_status,
                    _ => e.status,
                };
                return Attempt::Refused {
                    status,
                    retry_ms: None,
                };
            }
        };
        let run_ms = self.run_ms_of(r);
        let cfg = &self.cfg;
        let lease_id = kvgate_core::lease_id::compose(GATEWAY, self.next_lease);
        self.next_lease += 1;
        let claim = (cfg.fair_retry_patience_ms > 0).then(|| ClaimTicket {
            key: claim_key_of(&r.req),
            patience_ms: cfg.fair_retry_patience_ms,
            run_ms,
            max_line_permille: cfg.max_line_permille(&class),
            waits: from_queue || self.queue.would_wait(&class),
            grows_to: priced.price.bytes,
        });
        let holder = Holder {
            lease_id: Some(lease_id),
            owner: 1,
            claim,
        };
        let need = priced.reserve_bytes();
        for (v, l) in self.views.iter_mut().zip(&self.ledgers) {
            v.observe(l);
        }
        // fleet::admit's plain pass: no degrade, no preemption, where the request fits.
        let plain_class = ClassPolicy {
            action: Action::Reject,
            preempts: Vec::new(),
            ..class.clone()
        };
        let claim_key = claim.map(|c| c.key);
        let home = claim_key.and_then(|k| fleet::home(&self.views, need, k));
        let mut placed = None;
        // A backfill try keeps only a backfill, which the plain pass never is.
        let plain = if behind {
            Vec::new()
        } else {
            fleet::plan(&self.views, need, fleet::Choice::MostRoom, None)
        };
        for index in plain {
            let Some(l) = self.ledgers.get_mut(index) else {
                continue;
            };
            let own = claim_key.map_or(0, |k| l.held_for(k));
            if l.free().saturating_add(own) < need {
                continue;
            }
            let before = l.clone();
            match gate::decide(l, cfg, &plain_class, &priced, holder, now_ms, jitter_seed) {
                d @ Decision::Admitted { .. } => {
                    if let (Some(h), Some(k)) = (home.filter(|h| *h != index), claim_key) {
                        if let Some(hl) = self.ledgers.get_mut(h) {
                            hl.drop_claim(k);
                        }
                    }
                    placed = Some((index, d));
                    break;
                }
                Decision::Rejected(_) => *l = before,
            }
        }
        let (index, decision) = match placed {
            Some(p) => p,
            None => {
                // The policy pass: the request's home, else the most room that could hold it.
                let index = home.unwrap_or_else(|| {
                    (0..self.views.len())
                        .max_by_key(|&i| {
                            let v = self.views.get(i).copied().unwrap_or_default();
                            (v.capacity >= need, v.room, Reverse(i))
                        })
                        .unwrap_or(0)
                });
                let Some(l) = self.ledgers.get_mut(index) else {
                    return Attempt::Refused {
                        status: 503,
                        retry_ms: Some(cfg.retry_after.min_ms),
                    };
                };
                if behind {
                    // Ticket::attempt_backfill: only what the ledger admits ahead of the line.
                    match gate::backfill(l, cfg, &class, &priced, holder, now_ms) {
                        Some(d) => (index, d),
                        None => {
                            return Attempt::Refused {
                                status: 429,
                                retry_ms: None,
                            }
                        }
                    }
                } else {
                    let d = gate::decide(l, cfg, &class, &priced, holder, now_ms, jitter_seed);
                    (index, d)
                }
            }
        };
        match decision {
            Decision::Admitted {
                lease,
                cap,
                preempted,
                ..
            } => {
                let mut cmds = Vec::new();
                // Demoted, not stopped: the victims keep their leases (reserving nothing) until
                // their requests end.
                for v in preempted {
                    if let Some((victim, at)) = self.leases.get(&v.id).copied() {
                        cmds.push((at, Cmd::Demote { req: victim }));
                    }
                }
                self.leases.insert(lease.id, (idx, index));
                cmds.push((
                    index,
                    Cmd::Submit {
                        req: idx,
                        lease: Some(lease.id),
                        max_tokens: cap,
                        reserve_output: priced.elastic.map(|e| e.output_tokens),
                        prompt: r.req.prompt,
                        true_len: r.req.true_len,
                    },
                ));
                Attempt::Forward { cmds }
            }
            Decision::Rejected(err) => {
                if let (
                    false,
                    ErrorKind::KvCapacityExceeded,
                    Action::Queue {
                        max_wait_ms,
                        max_depth,
                    },
                ) = (from_queue, err.kind, &class.action)
                {
                    let deadline_ms = now_ms + max_wait_ms;
                    // A retry keeps the age of its first refusal (the filter's waiting_since).
                    let arrived_ms = claim_key
                        .and_then(|k| self.ledgers.get(index)?.waiting_since(k))
                        .map_or(now_ms, |w| w.min(now_ms));
                    let pushed = self.queue.push(
                        idx,
                        Waiting {
                            class: &class.name,
                            priority: class.priority,
                            arrived_ms,
                            deadline_ms,
                            max_depth: *max_depth,
                        },
                    );
                    if pushed.is_ok() {
                        return Attempt::Queued { deadline_ms };
                    }
                    return Attempt::Refused {
                        status: 429,
                        retry_ms: Some(err.retry_after_ms.unwrap_or(cfg.retry_after.min_ms)),
                    };
                }
                Attempt::Refused {
                    status: err.status,
                    retry_ms: err.retry_after_ms,
                }
            }
        }
    }

    /// The end of a request's stream (or the backend's refusal): its lease goes back.
    pub(super) fn release(&mut self, lease: u64, now_ms: u64) {
        if let Some((_, at)) = self.leases.remove(&lease) {
            if let Some(l) = self.ledgers.get_mut(at) {
                l.release(lease, now_ms);
            }
        }
    }
}
