//! How the engine makes room: taking borrowed blocks back from elastic sequences, preempting
//! (recompute) or demoting a sequence, dropping an idle cache. The rules, not the loop: the
//! loop in `engine` calls these when a step needs a block that is not free.

use super::*;

impl<M: Forward> Engine<M> {
    /// Take back borrowed blocks (youngest overgrown sequence first, running or waiting) until
    /// `blocks` are free or none is borrowed.
    pub(super) fn reclaim_borrowed(&mut self, blocks: u32) {
        while self.pool.stats().blocks_free < blocks {
            let free_before = self.pool.stats().blocks_free;
            let running = self
                .youngest_overgrown()
                .and_then(|i| Some((i, self.running.get(i)?.order)));
            let waiting = self
                .waiting
                .iter_mut()
                .filter(|s| s.overgrown())
                .max_by_key(|s| s.order);
            match (running, waiting) {
                (Some((_, ro)), Some(w)) if w.order > ro => {
                    Self::give_back_borrowed(&self.model, w)
                }
                (Some((i, _)), _) => {
                    let seq = self.running.remove(i);
                    self.requeue_for_recompute(seq);
                }
                (None, Some(w)) => Self::give_back_borrowed(&self.model, w),
                (None, None) => return,
            }
            // Each step gives back at least one block; never spin if one did not.
            if self.pool.stats().blocks_free <= free_before {
                return;
            }
        }
    }

    /// Blocks elastic sequences (running or waiting) hold past their reservations: what
    /// `reclaim_borrowed` can free at most.
    pub(super) fn borrowed_blocks(&self) -> u32 {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .filter(|s| s.overgrown())
            .map(|s| s.alloc.blocks().saturating_sub(s.promised_blocks))
            .fold(0, u32::saturating_add)
    }

    /// The running sequence to give borrowed blocks back first: the youngest grown past its
    /// reservation that is decoding, else the youngest part-way through its prefill (a chunked
    /// recompute given back loses every chunk it was fed; one preempted while decoding loses
    /// no more than it already holds).
    pub(super) fn youngest_overgrown(&self) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .filter(|(_, s)| s.overgrown())
            .max_by_key(|(_, s)| (!s.prefilling, s.order))
            .map(|(i, _)| i)
    }

    pub(super) fn preempt(&mut self, id: &str) -> bool {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.swap_remove(i)
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            match self.waiting.remove(i) {
                Some(s) => s,
                None => return false,
            }
        } else {
            return false;
        };
        self.metrics.preempted.inc();
        let err = ApiError::new(
            ErrorKind::Preempted,
            "This generation was preempted to make room for higher-priority work. Retry the request.",
        )
        .with_retry_after_ms(1000);
        self.finish(seq, FinishReason::Preempted, Some(err));
        true
    }

    /// The gateway preempted lease `id` for a higher class: it reserves nothing from now on.
    /// Its sequence goes on in borrowed blocks (the blocks its reservation took and it has not
    /// written go back to the pool now), and like any elastic sequence grown past its
    /// reservation it gives them back, to be recomputed later, when a reservation needs them:
    /// its client is delayed, never failed. A backend that does not lend (`--admission`
    /// other than `reserve`) stops it instead, as a cancel does.
    pub(super) fn demote(&mut self, id: String) -> Demoted {
        if self.cfg.admission != Admission::Reserve {
            return match self.preempt(&id) {
                true => Demoted::Cancelled,
                false => Demoted::Unknown,
            };
        }
        let running = self.running.iter().position(|s| s.id == id);
        let seq = match running {
            Some(i) => self.running.get_mut(i),
            None => self.waiting.iter_mut().find(|s| s.id == id),
        };
        let Some(seq) = seq else {
            // A lease that already ended will not arrive again (lease ids are single-use): it
            // holds nothing, as the demotion asks, and is not remembered for an arrival that
            // never comes.
            let finished = {
                let p = self.published();
                !p.is_live(&id) && p.finished.iter().any(|f| f.id == id)
            };
            if finished {
                return Demoted::Finished;
            }
            if self.demoted_early.len() == DEMOTED_KEPT {
                self.demoted_early.pop_front();
            }
            self.demoted_early.push_back(id);
            return Demoted::OnArrival;
        };
        seq.promised = 0;
        seq.promised_blocks = 0;
        seq.elastic = true;
        match running {
            None => {
                // Waiting, it gives back everything it holds: with nothing promised, any block
                // it kept would be borrowed, and borrowers are taken back from only while they
                // run (decode_step), so a waiting one holding them could leave a sequence
                // within its reservation without one.
                seq.drop_cache();
            }
            Some(i) if !seq.prefilling => {
                // Decoding, it keeps what it has written; a cache that cannot be cut back is
                // recomputed from scratch.
                let written = seq.kv.as_ref().map_or(0, |kv| kv.len() as u64);
                if !Self::shrink_cache(&self.model, seq, written) {
                    let seq = self.running.remove(i);
                    self.requeue_for_recompute(seq);
                }
            }
            // Running part-way through a prefill it holds the blocks of its next chunks: it
            // keeps them (borrowed now) until it is taken back from or done.
            Some(_) => {}
        }
        self.metrics.demoted.inc();
        Demoted::Lent
    }

    /// Lazy blocks: the youngest waiting elastic sequence that holds blocks (a preempted
    /// borrower keeps its reservation's blocks and their cache) gives them all back, its cache
    /// dropped; its reservation stays a promise and it is recomputed whole when it runs. A
    /// running sequence that needs a block takes these before any running borrower is
    /// preempted: they serve nobody while their sequence waits, and without this, long
    /// sequences that each outgrow what the others leave take turns, none finishing, each turn
    /// recomputed. Blocks taken at admission are a sequence's own and are never given back
    /// so. False when there were none.
    pub(super) fn drop_an_idle_cache(&mut self) -> bool {
        if !self.lazy() {
            return false;
        }
        let Some(s) = self
            .waiting
            .iter_mut()
            .filter(|s| s.elastic && s.alloc.blocks() > 0)
            .max_by_key(|s| s.order)
        else {
            return false;
        };
        s.drop_cache();
        // Its blocks are promised and no longer held: published now, or a report read during
        // this step's forward pass would count them as neither.
        self.publish();
        true
    }

    /// A KV slot for the token running sequence `i` feeds next: a block from the pool when its
    /// blocks are full, and the model's cache grown to match.
    pub(super) fn make_room(&mut self, i: usize) -> Room {
        let Some(s) = self.running.get_mut(i) else {
            return Room::Ready;
        };
        if !s.alloc.ensure_tokens(s.used_tokens() + 1) {
            return Room::NoBlock;
        }
        let cap = s.alloc.tokens() as usize;
        if let Some(kv) = s.kv.as_mut() {
            if cap > kv.capacity() {
                if let Err(e) = self.model.grow_kv(kv, s.alloc.ids(), cap) {
                    eprintln!("kvgate-backend: growing a KV cache failed: {e:#}");
                }
            }
        }
        if s.kv.as_ref().is_some_and(|kv| kv.len() < kv.capacity()) {
            Room::Ready
        } else {
            Room::Failed
        }
    }

    /// Preempt a running sequence to be recomputed: its blocks go back to the pool now (an
    /// elastic one keeps its reservation's), and it waits first in line with what it generated
    /// (the lease report lists it as waiting).
    /// Its client sees only a pause in the stream.
    pub(super) fn requeue_for_recompute(&mut self, mut seq: Seq<M::Kv>) {
        self.metrics.recompute_preemptions.inc();
        seq.prefilling = false;
        if seq.elastic {
            // It keeps its reservation (the gateway counts it), and the cache its reservation's
            // blocks hold; it gives back what it borrowed. With lazy blocks those blocks are
            // given back too, but only when a running sequence needs one
            // (`drop_an_idle_cache`).
            Self::give_back_borrowed(&self.model, &mut seq);
        } else {
            // Everything goes back (vLLM's way): blocks held while waiting could be the ones a
            // running sequence needs to finish.
            seq.drop_cache();
        }
        self.waiting.push_front(seq);
    }

    /// An elastic sequence gives back the blocks it borrowed past its reservation. Its cache
    /// keeps what its own blocks hold (they stay its own, so discarding their contents would
    /// buy nothing), so when it runs again only the positions past them are recomputed, not its
    /// whole prompt and output. A cache that cannot be cut back is dropped: all of it is
    /// recomputed.
    pub(super) fn give_back_borrowed(model: &M, seq: &mut Seq<M::Kv>) {
        let promised = seq.promised;
        Self::shrink_cache(model, seq, promised);
    }

    /// Cut a sequence's blocks back to what `tokens` need, and its cache to match. False when
    /// the cache could not be cut back: it is dropped (recomputed whole when the sequence runs
    /// again).
    pub(super) fn shrink_cache(model: &M, seq: &mut Seq<M::Kv>, tokens: u64) -> bool {
        seq.alloc.shrink_to_tokens(tokens);
        let capacity = seq.alloc.tokens() as usize;
        let Some(kv) = seq.kv.as_mut() else {
            return true;
        };
        match model.shrink_kv(kv, seq.alloc.ids(), capacity) {
            Ok(()) => true,
            Err(e) => {
                eprintln!(
                    "kvgate-backend: cutting a KV cache back failed, recomputing it whole: {e:#}"
                );
                // Fed again after its cached prefix blocks (written, perhaps shared: never
                // written again), from its own blocks on.
                seq.kv = None;
                false
            }
        }
    }
}
