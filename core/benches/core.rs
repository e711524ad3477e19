//! Criterion benchmarks of the request hot path's pure parts: token counting (1k and 8k
//! tokens, each built-in encoding) and one ledger transition (decode + admit + encode, the work
//! done inside each CAS) at 10, 100 and 1,000 live leases.
#![allow(clippy::expect_used, clippy::indexing_slicing)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvgate_core::retry::{splitmix64, RetryAfterConfig};
use kvgate_core::{AdmitRequest, Encoding, Ledger, TokenCounter, TokenizerSpec};

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
                fingerprint: 0xabc,
                now_ms: i,
                ttl_ms: 60_000,
                owner: 1,
            },
            &RetryAfterConfig::default(),
            i,
        );
    }
    l
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
                    let out = l.try_admit(
                        &AdmitRequest {
                            id: Some(u64::MAX - 1),
                            bytes: 1 << 20,
                            class: "interactive",
                            priority: 1,
                            fingerprint: 0xabc,
                            now_ms: 5_000,
                            ttl_ms: 60_000,
                            owner: 1,
                        },
                        &retry,
                        9,
                    );
                    black_box(out);
                    black_box(l.encode())
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, counting, transition);
criterion_main!(benches);
