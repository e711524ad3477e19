//! Criterion benchmarks of the request hot path's pure parts: token counting (1k and 8k
//! tokens, each built-in encoding) and one ledger transition (decode + admit + encode, the work
//! done inside each CAS) at 10, 100 and 1,000 live leases; the worst case per MB (no whitespace)
//! and ordinary text, before (tiktoken-rs) and after (the capped, linear counter) in one run;
//! one admission + release across 1, 8 and 64 endpoints against one ledger without a fleet; a
//! chat of 8k tokens counted with the built-in ChatML and with a Jinja chat template (SmolLM2's).
#![allow(clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvgate_core::fleet;
use kvgate_core::request::ChatMessage;
use kvgate_core::retry::{splitmix64, RetryAfterConfig};
use kvgate_core::store::{self, MemoryStore};
use kvgate_core::tokenize::{ChatTemplate, CustomBpe, GPT2_STYLE_PATTERN};
use kvgate_core::{AdmitOutcome, AdmitRequest, Encoding, Ledger, TokenCounter, TokenizerSpec};

const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "request",
    "token",
    "memory",
    "server",
    "admission",
    "budget",
    "stream",
    "decode",
    "prompt",
    "and",
    "of",
    "to",
    "in",
    "is",
    "that",
    "for",
    "with",
    "as",
    "on",
    "by",
    "this",
    "be",
    "are",
    "from",
    "at",
    "or",
    "an",
    "which",
    "gateway",
    "envoy",
    "latency",
    "throughput",
    "capacity",
    "reservation",
    "client",
    "policy",
    "queue",
    "class",
    "worst",
    "case",
    "allowed",
    "reach",
    "Paris",
    "France",
    "capital",
    "question",
    "answer",
    "2026",
    "42",
    "(see",
    "below)",
    "e.g.,",
    "it's",
    "don't",
    "we'll",
    "naïve",
    "café",
];

/// Deterministic English-like text of `n_words` words.
fn text(n_words: usize) -> String {
    let mut s = String::new();
    let mut x = 7u64;
    for i in 0..n_words {
        x = splitmix64(x);
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(if i % 17 == 16 { '.' } else { ' ' });
        if i % 97 == 96 {
            s.push('\n');
        }
    }
    s
}

/// Text of about `tokens` tokens for this counter.
fn text_of_tokens(counter: &TokenCounter, tokens: u64) -> String {
    let mut words = tokens as usize;
    loop {
        let t = text(words);
        let n = counter.count_text(&t);
        if n >= tokens {
            return t;
        }
        words += ((tokens - n) as usize).max(1);
    }
}

fn counting(c: &mut Criterion) {
    let mut g = c.benchmark_group("count_tokens");
    for enc in [
        Encoding::Cl100kBase,
        Encoding::O200kBase,
        Encoding::R50kBase,
    ] {
        let counter = TokenCounter::new(&TokenizerSpec::Builtin(enc)).expect("encoding");
        for tokens in [1_000u64, 8_000] {
            let t = text_of_tokens(&counter, tokens);
            g.throughput(Throughput::Elements(counter.count_text(&t)));
            g.bench_with_input(BenchmarkId::new(enc.name(), tokens), &t, |b, t| {
                b.iter(|| counter.count_text(black_box(t)))
            });
        }
    }
    g.finish();
}

fn ledger_with(leases: u64) -> Ledger {
    let mut l = Ledger::new(u64::MAX / 2, 1);
    for i in 0..leases {
        let class = if i % 3 == 0 { "batch" } else { "interactive" };
        l.try_admit(
            &AdmitRequest {
                id: None,
                bytes: 1 << 20,
                class,
                priority: 1,
                now_ms: i,
                owner: 1,
                claim: None,
            },
            &RetryAfterConfig::default(),
            i,
        );
    }
    l
}

/// The admission every ledger benchmark measures: 1 MiB, class interactive, as id `id`.
fn probe(id: u64) -> AdmitRequest<'static> {
    AdmitRequest {
        id: Some(id),
        bytes: 1 << 20,
        class: "interactive",
        priority: 1,
        now_ms: 5_000,
        owner: 1,
        claim: None,
    }
}

fn transition(c: &mut Criterion) {
    let mut g = c.benchmark_group("ledger_transition");
    let retry = RetryAfterConfig::default();
    for leases in [10u64, 100, 1_000] {
        let bytes = ledger_with(leases).encode();
        g.bench_with_input(
            BenchmarkId::new("decode_admit_encode", leases),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let mut l = Ledger::decode(black_box(bytes)).expect("ledger");
                    let out = l.try_admit(&probe(u64::MAX - 1), &retry, 9);
                    black_box(out);
                    black_box(l.encode())
                })
            },
        );
    }
    g.finish();
}

/// One admission and its release across a fleet of 1, 8 and 64 endpoints with 10 and 1,000 live
/// leases each (`fleet::admit`: the choice from the views, one CAS on the chosen ledger): the
/// cost must follow the chosen ledger's size only, never the number of endpoints. The baseline
/// in the same run is the same admit + release on one ledger of that size, without the fleet.
fn fleet_admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("fleet_admit_release");
    let retry = RetryAfterConfig::default();
    let request = probe;
    for leases in [10u64, 1_000] {
        let base = ledger_with(leases);
        // Baseline: one ledger, no fleet.
        let one = MemoryStore::default();
        store::seed(&one, "l", || base.clone()).expect("seed");
        g.bench_function(
            BenchmarkId::new(format!("{leases}_leases"), "no_fleet"),
            |b| {
                b.iter(|| {
                    let (out, _) = store::transact(&one, "l", 4, |l| {
                        l.try_admit(&request(u64::MAX - 1), &retry, 9)
                    })
                    .expect("admit");
                    black_box(out);
                    store::transact(&one, "l", 4, |l| l.release(u64::MAX - 1, 6_000))
                        .expect("release");
                })
            },
        );
        for endpoints in [1usize, 8, 64] {
            let s = MemoryStore::default();
            let mut views = Vec::new();
            for i in 0..endpoints {
                store::seed(&s, &format!("e{i}"), || base.clone()).expect("seed");
                let mut v = fleet::View {
                    eligible: true,
                    ..fleet::View::default()
                };
                v.observe(&base);
                views.push(v);
            }
            let id = BenchmarkId::new(format!("{leases}_leases"), format!("{endpoints}_endpoints"));
            g.bench_function(id, |b| {
                b.iter(|| {
                    let placed = fleet::admit(
                        &s,
                        |i| format!("e{i}"),
                        &mut views,
                        1 << 20,
                        fleet::Choice::MostRoom,
                        None,
                        None,
                        4,
                        |l| match l.try_admit(&request(u64::MAX - 1), &retry, 9) {
                            AdmitOutcome::Admitted { .. } => Some(()),
                            AdmitOutcome::Rejected { .. } => None,
                        },
                        |_| (),
                    )
                    .expect("admit");
                    let fleet::Placed::At { index, .. } = placed else {
                        panic!("nowhere")
                    };
                    let key = format!("e{index}");
                    let (_, l) = store::transact(&s, &key, 4, |l| l.release(u64::MAX - 1, 6_000))
                        .expect("release");
                    views[index].observe(&l);
                })
            });
        }
    }
    g.finish();
}

/// The adversarial prompts of issue 9: one megabyte with no whitespace (one regex piece).
fn worst_case_texts() -> Vec<(&'static str, String)> {
    const MB: usize = 1 << 20;
    let mut x = 11u64;
    let mut next = || {
        x = splitmix64(x);
        x
    };
    let letters: String = (0..MB)
        .map(|_| char::from(b'a' + (next() % 26) as u8))
        .collect();
    let bytes: Vec<u8> = (0..MB).map(|_| next() as u8).collect();
    // Invalid bytes become U+FFFD (3 bytes): cut back to one MB at a char boundary.
    let mut lossy = String::from_utf8_lossy(&bytes).into_owned();
    let mut end = MB;
    while !lossy.is_char_boundary(end) {
        end -= 1;
    }
    lossy.truncate(end);
    vec![
        ("random_letters", letters),
        ("repeated_char", "a".repeat(MB)),
        ("random_bytes_lossy", lossy),
    ]
}

/// Worst case per MB, before (tiktoken-rs `encode_ordinary`, what admission used) and after
/// (the capped counter: uncapped, and capped at an 8,192-token context as admission runs it).
fn worst_case(c: &mut Criterion) {
    let mut g = c.benchmark_group("worst_case_per_mb");
    g.sample_size(10);
    for enc in [Encoding::Cl100kBase, Encoding::R50kBase] {
        let counter = TokenCounter::new(&TokenizerSpec::Builtin(enc)).expect("encoding");
        for (name, t) in worst_case_texts() {
            g.throughput(Throughput::Bytes(t.len() as u64));
            let id = |how: &str| BenchmarkId::new(format!("{}/{how}", enc.name()), name);
            g.bench_with_input(id("before_tiktoken"), &t, |b, t| {
                b.iter(|| counter.count_text_tiktoken(black_box(t)))
            });
            g.bench_with_input(id("after_uncapped"), &t, |b, t| {
                b.iter(|| counter.count_text(black_box(t)))
            });
            g.bench_with_input(id("after_capped_8192"), &t, |b, t| {
                b.iter(|| counter.count_text_capped(black_box(t), 8192))
            });
        }
        // Just under the filter's 4 MiB body limit: refused by the byte-length bound alone.
        let big = worst_case_texts()[0].1.repeat(4);
        g.throughput(Throughput::Bytes(big.len() as u64));
        g.bench_with_input(
            BenchmarkId::new(
                format!("{}/after_capped_8192", enc.name()),
                "random_letters_4MiB",
            ),
            &big,
            |b, t| b.iter(|| counter.count_text_capped(black_box(t), 8192)),
        );
    }
    g.finish();
}

/// Ordinary text through both paths: the capped counter must not slow the common case.
fn ordinary_before_after(c: &mut Criterion) {
    let mut g = c.benchmark_group("ordinary_8k_tokens");
    for enc in [Encoding::Cl100kBase, Encoding::R50kBase] {
        let counter = TokenCounter::new(&TokenizerSpec::Builtin(enc)).expect("encoding");
        let t = text_of_tokens(&counter, 8_000);
        g.throughput(Throughput::Bytes(t.len() as u64));
        g.bench_with_input(
            BenchmarkId::new(enc.name(), "before_tiktoken"),
            &t,
            |b, t| b.iter(|| counter.count_text_tiktoken(black_box(t))),
        );
        g.bench_with_input(BenchmarkId::new(enc.name(), "after"), &t, |b, t| {
            b.iter(|| counter.count_text(black_box(t)))
        });
    }
    g.finish();
}

/// SmolLM2-135M-Instruct's GGUF chat template.
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The chat benchmarks' vocabulary (the 256 bytes, then each word and " word", then `extra`)
/// with ChatML's special tokens: as ChatML, and with SmolLM2's Jinja template.
fn chatml_and_smollm2(extra: &[Vec<u8>]) -> [(&'static str, CustomBpe); 2] {
    let mut ranks: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], u32::from(b))).collect();
    let words = WORDS
        .iter()
        .flat_map(|w| [w.to_string().into_bytes(), format!(" {w}").into_bytes()]);
    for t in words.chain(extra.iter().cloned()) {
        let r = ranks.len() as u32;
        ranks.push((t, r));
    }
    let base = CustomBpe {
        ranks,
        pattern: GPT2_STYLE_PATTERN.into(),
        special_tokens: vec![
            ("<|im_start|>".to_string(), 1000),
            ("<|im_end|>".to_string(), 1001),
        ],
        ..CustomBpe::default()
    };
    let jinja = CustomBpe {
        chat_template: ChatTemplate::Jinja {
            source: SMOLLM2_TEMPLATE.into(),
            bos_token: "<|im_start|>".into(),
            eos_token: "<|im_end|>".into(),
        },
        ..base.clone()
    };
    [("chatml", base), ("jinja_smollm2", jinja)]
}

/// A chat of about 8k tokens (four turns), counted as ChatML and through a Jinja template, with
/// the same vocabulary (the 256 bytes, then each word and " word"): what rendering costs.
fn chat_templates(c: &mut Criterion) {
    let mut g = c.benchmark_group("chat_8k_tokens");
    for (name, spec) in chatml_and_smollm2(&[]) {
        let counter = TokenCounter::new(&TokenizerSpec::Custom(spec)).expect("tokenizer");
        let turn = text_of_tokens(&counter, 1_250);
        let msgs: Vec<ChatMessage> = ["system", "user", "assistant", "user"]
            .iter()
            .map(|r| ChatMessage {
                role: r.to_string(),
                content: turn.clone(),
                ..ChatMessage::default()
            })
            .collect();
        g.throughput(Throughput::Elements(counter.count_chat(&msgs)));
        g.bench_with_input(BenchmarkId::new(name, "count"), &msgs, |b, m| {
            b.iter(|| counter.count_chat(black_box(m)))
        });
        g.bench_with_input(BenchmarkId::new(name, "encode"), &msgs, |b, m| {
            b.iter(|| counter.encode_chat(black_box(m)).expect("renders"))
        });
    }
    g.finish();
}

/// A hostile chat: about 4 MiB of empty messages, counted on the admission path against an
/// 8,192-token context, as ChatML and through SmolLM2's template. The vocabulary of
/// `chat_templates` plus one 128-byte token, as real vocabularies have (r50k's longest is 128
/// bytes): with only short tokens the messages' bytes alone would prove the chat over.
fn chat_flood(c: &mut Criterion) {
    let mut g = c.benchmark_group("chat_140k_empty_messages");
    let flood: Vec<ChatMessage> = (0..140_000)
        .map(|_| ChatMessage {
            role: "user".into(),
            ..ChatMessage::default()
        })
        .collect();
    for (name, spec) in chatml_and_smollm2(&[vec![b' '; 128]]) {
        let counter = TokenCounter::new(&TokenizerSpec::Custom(spec)).expect("tokenizer");
        g.bench_with_input(BenchmarkId::new(name, "count"), &flood, |b, m| {
            b.iter(|| counter.count_chat_capped(black_box(m), 8192))
        });
    }
    g.finish();
}

/// Pricing an agent's chat (a ~3,000-token system prompt and a short task, SmolLM2's template)
/// behind a kvgate backend: with the shared prefix priced (its messages counted a second time)
/// and without (`share_prefixes` off); and a flood of 16,000 empty messages (about what the
/// parser's bound of 16,384 objects lets through) the same way.
fn price_shared_prefix(c: &mut Criterion) {
    use kvgate_core::gate;
    use kvgate_core::request::{parse_request, Endpoint};
    let mut g = c.benchmark_group("price_chat");
    let cfg = kvgate_core::config::Config::from_json(
        br#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
            "kv_budget_bytes":268435456,"backend":{}}"#,
    )
    .expect("config");
    let [_, (_, spec)] = chatml_and_smollm2(&[vec![b' '; 128]]);
    let counter = TokenCounter::new(&TokenizerSpec::Custom(spec)).expect("tokenizer");
    let system = text_of_tokens(&counter, 3000);
    let swarm = serde_json::json!({"messages": [{"role": "system", "content": system},
        {"role": "user", "content": "Agent 7: which tool reads shelf 21?"}], "max_tokens": 64})
    .to_string();
    let flood = serde_json::json!({"messages": vec![serde_json::json!({"role": "user", "content": ""}); 16_000]})
        .to_string();
    for (name, body) in [("swarm_3k", swarm), ("flood_16k", flood)] {
        let (req, _) = parse_request(Endpoint::ChatCompletions, body.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        for share in [false, true] {
            let cfg = kvgate_core::config::Config {
                share_prefixes: share,
                ..cfg.clone()
            };
            let arm = if share { "shared_prefix" } else { "whole" };
            g.bench_with_input(BenchmarkId::new(name, arm), &req, |b, r| {
                b.iter(|| gate::price(&cfg, &counter, black_box(r)))
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    price_shared_prefix,
    chat_templates,
    chat_flood,
    counting,
    transition,
    fleet_admission,
    worst_case,
    ordinary_before_after
);
criterion_main!(benches);
