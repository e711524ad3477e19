//! The scheduler's state transitions without a model: a stand-in `Forward` whose "model"
//! emits token `a` until it is told to stop, so admission, KV growth, OOM, cancel, abandon
//! and batching are tested exactly and fast.
use super::*;
use kvgate_core::tokenize::{CustomBpe, GPT2_STYLE_PATTERN};
use kvgate_core::{TokenCounter, TokenizerSpec};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

struct Fake {
    /// Emit EOS after this many generated tokens (usize::MAX: never).
    stop_after: usize,
}
struct FakeKv {
    len: usize,
    cap: usize,
    generated: usize,
}
impl KvState for FakeKv {
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.cap
    }
}
const VOCAB: usize = 3; // 0 = EOS, 1 = "a", 2 = "b"
fn one_hot(id: usize) -> Vec<f32> {
    (0..VOCAB)
        .map(|i| if i == id { 1.0 } else { 0.0 })
        .collect()
}
impl Forward for Fake {
    type Kv = FakeKv;
    fn new_kv(&self, capacity: usize) -> anyhow::Result<FakeKv> {
        Ok(FakeKv {
            len: 0,
            cap: capacity,
            generated: 0,
        })
    }
    fn grow_kv(&self, kv: &mut FakeKv, capacity: usize) -> anyhow::Result<()> {
        kv.cap = kv.cap.max(capacity);
        Ok(())
    }
    fn prefill(&self, tokens: &[u32], kv: &mut FakeKv) -> anyhow::Result<Vec<f32>> {
        anyhow::ensure!(tokens.len() <= kv.cap, "prefill past capacity");
        kv.len = tokens.len();
        Ok(one_hot(1))
    }
    fn decode(&self, tokens: &[u32], kvs: &mut [&mut FakeKv]) -> anyhow::Result<Vec<Vec<f32>>> {
        anyhow::ensure!(tokens.len() == kvs.len(), "batch mismatch");
        kvs.iter_mut()
            .map(|kv| {
                anyhow::ensure!(kv.len < kv.cap, "decode past capacity");
                kv.len += 1;
                kv.generated += 1;
                Ok(one_hot(if kv.generated >= self.stop_after {
                    0
                } else {
                    1
                }))
            })
            .collect()
    }
}

fn tokenizer() -> Tokenizer {
    let tokens: Vec<String> = ["<|endoftext|>", "a", "b"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let bpe = CustomBpe::from_gpt2_vocab(&tokens, &[3, 1, 1], GPT2_STYLE_PATTERN).unwrap();
    let counter = TokenCounter::new(&TokenizerSpec::Custom(bpe.clone())).unwrap();
    Tokenizer {
        counter,
        bpe,
        stop_ids: vec![0],
        vocab: 3,
    }
}

/// An engine over `blocks` KV blocks of 16 tokens (1 byte per token).
fn engine(blocks: u64, admission: Admission, stop_after: usize, max_batch: usize) -> Engine<Fake> {
    Engine::new(
        Fake { stop_after },
        Arc::new(tokenizer()),
        BlockPool::new(blocks * 16, 16, 1),
        EngineConfig {
            admission,
            max_batch,
            prefill_token_budget: 64,
            step_delay: Duration::ZERO,
        },
        Arc::new(Metrics::default()),
        Arc::new(Mutex::new(Published::default())),
    )
}

fn submit(
    e: &mut Engine<Fake>,
    id: &str,
    prompt: usize,
    max_tokens: u64,
) -> UnboundedReceiver<Event> {
    let (tx, rx) = unbounded_channel();
    e.admit(Submit {
        lease: Some(id.into()),
        prompt: vec![1; prompt],
        params: GenParams {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop: vec![],
        },
        events: tx,
    });
    rx
}

fn events(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

fn finished(evs: &[Event]) -> Option<(FinishReason, u64, bool)> {
    evs.iter().find_map(|e| match e {
        Event::Finished {
            reason,
            completion_tokens,
            error,
            ..
        } => Some((*reason, *completion_tokens, error.is_some())),
        _ => None,
    })
}

#[test]
fn reserve_holds_the_worst_case_and_rejects_what_does_not_fit() {
    let mut e = engine(4, Admission::Reserve, usize::MAX, 8);
    let mut a = submit(&mut e, "a", 10, 40); // 50 tokens: 4 blocks
    assert!(matches!(events(&mut a).first(), Some(Event::Admitted { id }) if id == "a"));
    assert_eq!(
        e.pool.stats().blocks_free,
        0,
        "the whole worst case is reserved up front"
    );
    let mut b = submit(&mut e, "b", 1, 1);
    assert!(matches!(events(&mut b).first(), Some(Event::Rejected(err)) if err.status == 429));
    for _ in 0..60 {
        e.step();
    }
    let evs = events(&mut a);
    assert_eq!(finished(&evs), Some((FinishReason::Length, 40, false)));
    let text: String = evs
        .iter()
        .filter_map(|ev| match ev {
            Event::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "a".repeat(40));
    assert_eq!(
        e.pool.stats().blocks_free,
        4,
        "finished: every block is back"
    );
    assert_eq!(e.metrics.kv_oom.get(), 0);
}

#[test]
fn admission_none_grows_by_blocks_and_fails_mid_decode_when_none_are_left() {
    let mut e = engine(2, Admission::None, usize::MAX, 8);
    let mut a = submit(&mut e, "a", 10, 40);
    assert_eq!(e.pool.stats().blocks_free, 2, "nothing taken at arrival");
    e.step();
    assert_eq!(
        e.pool.stats().blocks_free,
        1,
        "the prompt's block on prefill"
    );
    for _ in 0..40 {
        e.step();
    }
    let evs = events(&mut a);
    // 32 tokens fit in 2 blocks: 10 prompt + 22 fed back; the next token finds no block.
    assert_eq!(finished(&evs), Some((FinishReason::Error, 23, true)));
    assert_eq!(e.metrics.kv_oom.get(), 1);
    assert_eq!(e.pool.stats().blocks_free, 2);
}

#[test]
fn eos_stops_and_cancel_preempts_and_a_gone_client_frees_at_once() {
    let mut e = engine(24, Admission::Reserve, 5, 8); // 7 blocks each
    let mut a = submit(&mut e, "a", 4, 100);
    let mut b = submit(&mut e, "b", 4, 100);
    let c = submit(&mut e, "c", 4, 100);
    e.step();
    assert!(e.preempt("b"));
    assert!(!e.preempt("b"), "unknown now");
    drop(c); // the client went away
    for _ in 0..10 {
        e.step();
    }
    assert_eq!(
        finished(&events(&mut a)),
        Some((FinishReason::Stop, 5, false))
    );
    assert_eq!(
        finished(&events(&mut b)).map(|f| (f.0, f.2)),
        Some((FinishReason::Preempted, true))
    );
    assert_eq!(e.pool.stats().blocks_free, 24);
    let p = e.published.lock().unwrap();
    let reasons: Vec<_> = p
        .finished
        .iter()
        .map(|f| (f.id.as_str(), f.reason))
        .collect();
    assert!(
        reasons.contains(&("c", FinishReason::Cancelled)),
        "{reasons:?}"
    );
    assert_eq!(p.cursor, 3);
}

#[test]
fn batching_respects_max_batch_and_decodes_all_running_together() {
    let mut e = engine(64, Admission::Reserve, usize::MAX, 2);
    let mut rxs: Vec<_> = (0..3)
        .map(|i| submit(&mut e, &format!("s{i}"), 4, 10))
        .collect();
    e.step();
    assert_eq!((e.running.len(), e.waiting.len()), (2, 1));
    let ls = e.published.lock().unwrap().leases.clone();
    assert_eq!(
        ls.iter().filter(|l| l.state == LeaseState::Running).count(),
        2
    );
    for _ in 0..30 {
        e.step();
    }
    for rx in rxs.iter_mut() {
        assert_eq!(
            finished(&events(rx)),
            Some((FinishReason::Length, 10, false))
        );
    }
    assert_eq!(e.metrics.decode_steps.get(), 18, "9 steps for each pair");
}
