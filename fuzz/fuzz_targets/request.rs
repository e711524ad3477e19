//! Request bodies: parse (both endpoints) → validate → count → price.
//!
//! Properties, on any bytes:
//! - nothing panics;
//! - a parsed request re-serialised with `write_cap` still parses, to the same request with the
//!   cap written, and validates the same way;
//! - the admission counter never counts fewer tokens than tiktoken (the reference), counts
//!   exactly as tiktoken when no piece can be long, and its capped form stops exactly past
//!   the limit;
//! - a priced request fits its context: every prompt + cap ≤ context, cap ≥ 1, and it was priced
//!   at no fewer prompt tokens than counted: text at its padded count (`padded_count`: the
//!   multiplier, and the runs unless `pad_runs` is off; the count itself with an exact
//!   tokenizer), token arrays at their length.
#![no_main]

use std::sync::OnceLock;

use kvgate_core::config::Config;
use kvgate_core::gate::price;
use kvgate_core::request::{Input, PromptItem};
use kvgate_core::tokenize::{padded_count, Capped, LONG_PIECE_BYTES};
use kvgate_core::{
    parse_request, validate, write_cap, Encoding, Endpoint, ParsedRequest, Served, TokenCounter,
    TokenizerSpec,
};
use libfuzzer_sys::fuzz_target;

/// The shipped filter configuration (envoy/envoy.yaml: an approximate tokenizer, its counts
/// padded by the multiplier and the runs it merges), one padded by its multiplier alone, and an
/// exact one with a small context so pricing errors are reachable too.
const CONFIGS: [&str; 3] = [
    r#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
        "kv_budget_bytes":1073741824,"tokenizer":{"encoding":"cl100k_base","multiplier":1.6}}"#,
    r#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
        "kv_budget_bytes":1073741824,
        "tokenizer":{"encoding":"cl100k_base","multiplier":1.25,"pad_runs":false}}"#,
    r#"{"model":{"layers":1,"kv_heads":1,"head_dim":1,"kv_dtype_bytes":1,"context_tokens":64},
        "kv_budget_bytes":100000,"safety_fraction":1.0}"#,
];

struct Fixture {
    counter: TokenCounter,
    configs: Vec<Config>,
    served: [Served; 2],
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let counter = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase))
            .unwrap_or_else(|e| panic!("cl100k_base: {e}"));
        let configs = CONFIGS
            .iter()
            .map(|c| Config::from_json(c.as_bytes()).unwrap_or_else(|e| panic!("config: {e}")))
            .collect();
        let strict = Served {
            model: Some("smollm2".into()),
            vocab: Some(49_152),
            max_choices: 1,
            batched_prompts: false,
        };
        Fixture {
            counter,
            configs,
            served: [Served::default(), strict],
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        let Ok((req, obj)) = parse_request(endpoint, data) else {
            continue;
        };
        let validated: Vec<bool> = f
            .served
            .iter()
            .map(|s| validate(&req, &obj, s).is_ok())
            .collect();
        check_counts(&f.counter, &req);
        let mut cap = req.requested_cap().unwrap_or(16);
        for cfg in &f.configs {
            if let Ok(p) = price(cfg, &f.counter, &req) {
                check_price(cfg, &f.counter, &req, &p);
                cap = p.price.cap.cap;
            }
        }
        rewrite(endpoint, &req, obj, cap, &validated, f);
    }
});

/// `write_cap` gives a body that parses to the same request with `cap` as its cap.
fn rewrite(
    endpoint: Endpoint,
    req: &ParsedRequest,
    mut obj: serde_json::Map<String, serde_json::Value>,
    cap: u64,
    validated: &[bool],
    f: &Fixture,
) {
    let body = write_cap(&mut obj, Some(cap));
    let (again, obj2) = match parse_request(endpoint, &body) {
        Ok(r) => r,
        Err(e) => panic!(
            "rewritten body does not parse: {e:?}\nbody: {}",
            String::from_utf8_lossy(&body)
        ),
    };
    assert_eq!(again.requested_cap(), Some(cap), "cap not written");
    assert_eq!(again.input, req.input);
    assert_eq!(again.model, req.model);
    assert_eq!(again.n, req.n);
    assert_eq!(again.best_of, req.best_of);
    assert_eq!(again.stream, req.stream);
    for (s, ok) in f.served.iter().zip(validated) {
        assert_eq!(
            validate(&again, &obj2, s).is_ok(),
            *ok,
            "validation changed after write_cap"
        );
    }
}

/// The admission counter against tiktoken and against itself capped.
fn check_counts(counter: &TokenCounter, req: &ParsedRequest) {
    let counts = counter.count_input(&req.input);
    match &req.input {
        Input::Prompts(items) => {
            assert_eq!(counts.len(), items.len());
            for (item, &n) in items.iter().zip(&counts) {
                match item {
                    PromptItem::Tokens(t) => assert_eq!(n, *t),
                    PromptItem::Text(t) => {
                        let exact = counter.count_text_tiktoken(t);
                        assert!(n >= exact, "under-counted {t:?}: {n} < {exact}");
                        if t.len() <= LONG_PIECE_BYTES {
                            assert_eq!(n, exact, "inexact count of {t:?}");
                        }
                        assert_eq!(counter.count_text_capped(t, n), Capped::Within(n));
                        if n > 0 {
                            assert_eq!(counter.count_text_capped(t, n - 1), Capped::Over);
                        }
                    }
                }
            }
        }
        Input::Chat(messages) => {
            assert_eq!(counts.len(), 1);
            let n = counts[0];
            // What the template renders, plus the messages' other fields (`extra`), which are
            // counted on top and not rendered by kvgate-backend.
            let extra: u64 = messages
                .iter()
                .map(|m| counter.count_text_tiktoken(&m.extra))
                .sum();
            let exact = counter
                .encode_chat(messages)
                .map_or(0, |ids| ids.len() as u64)
                + extra;
            assert!(n >= exact, "under-counted chat: {n} < {exact}");
            if messages.iter().all(|m| {
                m.role.len() + 1 + m.content.len() <= LONG_PIECE_BYTES
                    && m.extra.len() <= LONG_PIECE_BYTES
            }) {
                assert_eq!(n, exact, "inexact chat count");
            }
            assert_eq!(counter.count_chat_capped(messages, n), Capped::Within(n));
            if n > 0 {
                assert_eq!(counter.count_chat_capped(messages, n - 1), Capped::Over);
            }
        }
    }
}

fn check_price(
    cfg: &Config,
    counter: &TokenCounter,
    req: &ParsedRequest,
    p: &kvgate_core::gate::Priced,
) {
    let context = cfg.pricing.spec.context_tokens;
    let cap = p.price.cap.cap;
    assert!(cap >= 1, "zero cap admitted");
    if let Some(r) = req.requested_cap() {
        assert!(cap <= r, "cap {cap} above the requested {r}");
    }
    assert_eq!(p.choices, req.choices());
    let counted = counter.count_input(&req.input);
    assert_eq!(p.prompt_tokens.len(), counted.len());
    // Text is priced at its padded count (exactly the count with an exact tokenizer); token
    // arrays at their length.
    let m = cfg.token_multiplier;
    let expected: Vec<u64> = match &req.input {
        Input::Prompts(items) => items
            .iter()
            .zip(&counted)
            .map(|(i, &n)| match i {
                PromptItem::Text(t) => padded_count(n, m, cfg.pad_runs, [t.as_str()]),
                PromptItem::Tokens(_) => n,
            })
            .collect(),
        Input::Chat(messages) => {
            let texts = messages
                .iter()
                .flat_map(|x| [x.role.as_str(), x.content.as_str(), x.extra.as_str()]);
            counted
                .iter()
                .map(|&n| padded_count(n, m, cfg.pad_runs, texts.clone()))
                .collect()
        }
    };
    assert_eq!(p.prompt_tokens, expected, "priced against padded");
    for (&priced, &n) in p.prompt_tokens.iter().zip(&counted) {
        assert!(priced >= n, "priced {priced} prompt tokens, counted {n}");
        assert!(
            priced.saturating_add(cap) <= context,
            "prompt {priced} + cap {cap} past the context {context}"
        );
    }
}
