//! The engine driven on the caller's thread, one step at a time: the code `spawn`'s thread runs,
//! without the thread or the channel (the simulator, `backend/examples/sim/`, runs the real
//! scheduler this way).

use super::*;

pub struct Stepper<M: Forward> {
    engine: Engine<M>,
    handle: EngineHandle,
}

impl<M: Forward> Stepper<M> {
    pub fn new(model: M, tok: Arc<Tokenizer>, pool: BlockPool, cfg: EngineConfig) -> Self {
        let metrics = Arc::new(Metrics::default());
        let (engine, handle, _) = Engine::with_handle(model, tok, pool, cfg, metrics);
        Stepper { engine, handle }
    }

    /// A request arrives (admitted or refused at once, as `spawn`'s loop does between steps).
    pub fn submit(&mut self, s: Submit) {
        self.engine.admit(s);
    }

    /// Stop a lease's sequence (`DELETE /v1/admission/leases/{id}`); whether it was here.
    pub fn cancel(&mut self, id: &str) -> bool {
        self.engine.preempt(id)
    }

    /// The gateway preempted a lease for a higher class.
    pub fn demote(&mut self, id: String) -> Demoted {
        self.engine.demote(id)
    }

    /// One scheduler iteration: prefill within the budget, one batched decode step.
    pub fn step(&mut self) {
        self.engine.step();
    }

    /// Sequences waiting or running.
    pub fn busy(&self) -> bool {
        !self.engine.waiting.is_empty() || !self.engine.running.is_empty()
    }

    pub fn model(&self) -> &M {
        &self.engine.model
    }

    /// What the HTTP layer reads: the published leases, the pool, the metrics. Its commands
    /// (`submit`, `cancel`, `demote`) go nowhere: call this `Stepper`'s own.
    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }
}
