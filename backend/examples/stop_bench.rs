//! The stop-string search of one streamed sequence: the engine's `TextStream`, which searches
//! only the text a token added (and the held-back tail before it), against the search of the
//! whole text after every token that it replaced, in the same run.
//!
//! The worst case the API allows: 4 stop strings of 1,024 bytes each (`validate::MAX_STOP_BYTES`)
//! that never occur, and an output of `--tokens` tokens of about 4 bytes each.
//!
//! `cargo run --release -p kvgate-backend --example stop_bench [-- --tokens 8192 --rounds 5]`
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)]

use std::hint::black_box;
use std::time::Instant;

use kvgate_backend::tokenizer::{find_stop, TextStream};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

/// The search this replaced: every stop string over the whole text, after every token.
fn whole_text(tokens: &[String], stops: &[String]) -> usize {
    let mut text = String::new();
    let mut found = 0;
    for t in tokens {
        text.push_str(t);
        if find_stop(&text, stops).is_some() {
            found += 1;
        }
    }
    found
}

fn streamed(tokens: &[String], stops: &[String]) -> usize {
    let mut stream = TextStream::new(stops);
    let mut found = 0;
    for t in tokens {
        if stream.push(t.as_bytes()) {
            found += 1;
        }
        black_box(stream.ready());
    }
    found
}

fn main() {
    let n = arg("--tokens", 8192);
    let rounds = arg("--rounds", 5);
    // Words of the text itself, and stops that share their start with them but never occur.
    let words = ["the ", "cat ", "sat ", "on ", "a ", "mat", ".\n"];
    let tokens: Vec<String> = (0..n)
        .map(|i| words[i * 7 % words.len()].to_string())
        .collect();
    let stops: Vec<String> = (0..4)
        .map(|k| format!("the cat{}", "!".repeat(1024 - 7 - k)))
        .collect();
    let bytes: usize = tokens.iter().map(String::len).sum();
    println!("{n} tokens ({bytes} bytes), 4 stop strings of ~1,024 bytes, {rounds} rounds");
    let mut best = [f64::MAX; 2];
    for _ in 0..rounds {
        for (arm, f) in [whole_text as fn(&[String], &[String]) -> usize, streamed]
            .into_iter()
            .enumerate()
        {
            let start = Instant::now();
            let found = black_box(f(black_box(&tokens), black_box(&stops)));
            assert_eq!(found, 0, "no stop string occurs");
            best[arm] = best[arm].min(start.elapsed().as_secs_f64());
        }
    }
    let [whole, window] = best;
    println!(
        "whole text after every token: {:.3} ms; new text only: {:.3} ms; {:.1}x faster",
        whole * 1e3,
        window * 1e3,
        whole / window
    );
}
