//! The tick's queue pass: queued requests retried in line, those behind the front tried as
//! backfills.

use super::*;

impl Root {
    /// Try a queued request again, its stream made the effective context first. `Waiting(e)`:
    /// refused for lack of budget (`e`), it stays where it is; `Done`: admitted (resumed, or
    /// waiting for its preemption demotions), answered with another refusal, or its stream is gone
    /// — it leaves the queue.
    pub(super) fn retry_queued(&self, ticket: &Rc<Ticket>, rt: &Runtime) -> Retried {
        self.retry_queued_with(ticket, rt, |t| t.attempt(&self.worker, rt))
    }

    /// [`Self::retry_queued`] with another kind of try (`attempt`).
    pub(super) fn retry_queued_with(
        &self,
        ticket: &Rc<Ticket>,
        rt: &Runtime,
        attempt: impl Fn(&Rc<Ticket>) -> Attempt,
    ) -> Retried {
        if hostcalls::set_effective_context(ticket.context_id).is_err() {
            return Retried::Done;
        }
        match attempt(ticket) {
            Attempt::Admitted { ready } => {
                if ready {
                    let _ = hostcalls::resume_http_request();
                }
                Retried::Done
            }
            Attempt::Rejected(e) if e.kind == ErrorKind::KvCapacityExceeded => Retried::Waiting(e),
            Attempt::Rejected(e) => {
                self.worker.reply_error(&e, self.worker.level(&rt.cfg));
                Retried::Done
            }
        }
    }

    /// Answer queued requests whose wait ran out, then admit from the front while budget allows.
    pub(super) fn drain_queue(&self, rt: &Runtime, now: u64) {
        let expired = self.worker.queue.borrow_mut().expire(now);
        for e in expired {
            self.worker.metrics.queued.add_signed(-1);
            // One last try: it may fit now, and a refusal refreshes its place in the fair-retry
            // line and says how long the line ahead of it and its own need will likely take
            // (not the shortest wait, which would bring it back to find the same queue). Its
            // client is away from then on.
            e.item.sent_away.set(true);
            let Retried::Waiting(refused) = self.retry_queued(&e.item, rt) else {
                continue;
            };
            let err = ApiError::new(
                ErrorKind::QueueTimeout,
                format!(
                    "The request waited the class {} limit for KV cache budget without it freeing up. Retry after the time in the Retry-After header.",
                    e.class
                ),
            )
            .with_retry_after_ms(
                refused
                    .retry_after_ms
                    .unwrap_or(rt.cfg.retry_after.min_ms),
            );
            self.worker.reply_error(&err, self.worker.level(&rt.cfg));
        }
        // Strict order: the front waits for budget; nothing jumps ahead of it.
        loop {
            let Some(ticket) = self
                .worker
                .queue
                .borrow()
                .front()
                .map(|e| Rc::clone(&e.item))
            else {
                break;
            };
            if let Retried::Waiting(_) = self.retry_queued(&ticket, rt) {
                break;
            }
            self.worker.queue.borrow_mut().pop_front();
            self.worker.metrics.queued.add_signed(-1);
        }
        // A request whose claim is active (it was refused at the front twice, or it is a
        // client's retry that kept its place) but that is not at the front now keeps its place
        // in the fair-retry line across workers: the ledger sets freed bytes aside for it, which
        // nobody else may take. Retry it too, or those bytes sit idle while the front waits (seen
        // as an empty pool with requests queued until their max_wait ran out).
        let served: Vec<Rc<Ticket>> = self
            .worker
            .queue
            .borrow()
            .items()
            .skip(1)
            .filter(|t| t.claim_active.get())
            .cloned()
            .collect();
        for ticket in served {
            if let Retried::Done = self.retry_queued(&ticket, rt) {
                self.worker.unqueue(ticket.context_id);
            }
        }
        // In a fleet, a request behind the front that fits on an endpoint with nobody in line
        // goes there, as a newcomer would (the plain pass), rather than wait out its
        // `max_wait_ms` while newcomers take that room. With one endpoint the queue keeps its
        // order: trying the requests behind the front in spare room there was measured to
        // raise p99 latency (docs/design/011-queued-try-behind-the-front.md).
        let endpoints = self.worker.endpoints();
        let open_room = match endpoints.len() {
            0 | 1 => 0,
            _ => endpoints
                .iter()
                .map(|e| e.view.get())
                .filter(|v| v.eligible && v.claims == 0)
                .map(|v| v.room)
                .max()
                .unwrap_or(0),
        };
        if open_room > 0 {
            let elsewhere: Vec<Rc<Ticket>> = self
                .worker
                .queue
                .borrow()
                .items()
                .skip(1)
                .filter(|t| !t.claim_active.get())
                .inspect(|t| t.reprice(&self.worker, rt))
                .filter(|t| t.priced.borrow().reserve_bytes() <= open_room)
                .take(BACKFILL_TRIES)
                .cloned()
                .collect();
            self.try_behind(elsewhere, rt, |t| t.attempt_plain(&self.worker, rt));
        }
        // Behind a front that waits, a request expected to be done before the front could
        // start goes ahead of it (a backfill, see the ledger), where the bytes the line holds
        // would cover it at all. The others keep their places: a refused try changes nothing.
        let room = self
            .worker
            .endpoints()
            .iter()
            .map(|e| {
                let v = e.view.get();
                v.room.saturating_add(v.claimed)
            })
            .max()
            .unwrap_or(0);
        // The shortest runs first: they are the likeliest to be done in time.
        let mut behind: Vec<(u64, Rc<Ticket>)> = self
            .worker
            .queue
            .borrow()
            .items()
            .skip(1)
            .filter(|t| t.claim.is_some() && !t.claim_active.get())
            // Priced as of now, as the try itself will be: an elastic class may have learned
            // since this request's last try.
            .inspect(|t| t.reprice(&self.worker, rt))
            .filter(|t| t.priced.borrow().reserve_bytes() <= room)
            .map(|t| (t.run_ms(&self.worker, &rt.cfg), Rc::clone(t)))
            .filter(|(run_ms, _)| *run_ms > 0)
            .collect();
        behind.sort_by_key(|(run_ms, _)| *run_ms);
        self.try_behind(
            behind.into_iter().take(BACKFILL_TRIES).map(|(_, t)| t),
            rt,
            |t| t.attempt_backfill(&self.worker, rt),
        );
    }

    /// Try queued requests behind the front, each with `attempt` (a try whose refusal for
    /// room changes nothing): those admitted leave the queue and go on, those refused for
    /// another reason (a body that grew past the limit when written again) are answered and
    /// leave it, as do those whose stream is gone.
    pub(super) fn try_behind(
        &self,
        tickets: impl IntoIterator<Item = Rc<Ticket>>,
        rt: &Runtime,
        attempt: impl Fn(&Rc<Ticket>) -> Attempt,
    ) {
        for ticket in tickets {
            if let Retried::Done = self.retry_queued_with(&ticket, rt, &attempt) {
                self.worker.unqueue(ticket.context_id);
            }
        }
    }
}
