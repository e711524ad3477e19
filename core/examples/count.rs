//! Native token counting of a file's text, for side-by-side comparison with the filter's
//! per-request cost in bench/gateway_bench.py: `count <encoding> <file> <iterations>
//! [multiplier]` prints the token count and the mean microseconds per count, and with a
//! multiplier the count the filter pads it to (`tokenizer.multiplier`: bench/tokenizer_ratio.py)
//! and the mean microseconds the padding takes on top of the count.
#![allow(clippy::expect_used)]

use std::time::Instant;

use kvgate_core::tokenize::padded_count;
use kvgate_core::{Encoding, TokenCounter, TokenizerSpec};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(enc), Some(file), Some(iters)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: count <encoding> <file> <iterations> [multiplier]");
        std::process::exit(2);
    };
    let enc = Encoding::from_name(enc).expect("unknown encoding");
    let iters: u32 = iters.parse().expect("iterations");
    let text = std::fs::read_to_string(file).expect("read file");
    let counter = TokenCounter::new(&TokenizerSpec::Builtin(enc)).expect("tokenizer");
    let tokens = counter.count_text(&text);
    let us = mean_us(iters, || counter.count_text(std::hint::black_box(&text)));
    match args.get(4) {
        Some(m) => {
            let m: f64 = m.parse().expect("multiplier");
            let pad = || padded_count(tokens, m, true, [std::hint::black_box(&*text)]);
            println!("{tokens} {us:.1} {} {:.1}", pad(), mean_us(iters, pad));
        }
        None => println!("{tokens} {us:.1}"),
    }
}

/// The mean microseconds of `iters` calls of `f`.
fn mean_us<T>(iters: u32, f: impl Fn() -> T) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(f());
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(iters)
}
