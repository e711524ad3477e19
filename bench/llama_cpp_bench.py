#!/usr/bin/env python3
"""Single-stream decode on CPU: llama.cpp (through llama-cpp-python, built from its PyPI sdist)
against kvgate-backend, same GGUF, same prompt, same run (issue 12: "what a CPU user would pick
instead").

llama.cpp runs the GGUF as stored (SmolLM2's Q4_1: 4-bit weights, its quantized matmul kernels);
kvgate-backend dequantizes every weight to f32 (FACTS.md: Q4_1 arithmetic drifts from the
reference), so this compares the two programs as a user would run them, not the same arithmetic.
The prompt is decode_bench's question in SmolLM2's chat format (88 tokens); both decode 64 greedy
tokens on 2 threads. kvgate-backend's figures come from `decode_bench` (built by the Makefile
target) run right after llama.cpp's; with `--rounds N` they alternate N times.

Usage: make bench-llama-cpp   (installs llama-cpp-python into .venv-llama-cpp: 3 min 49 s on 2 cores)
       .venv-llama-cpp/bin/python bench/llama_cpp_bench.py [--rounds 2] [--model PATH]
"""

import argparse
import re
import subprocess
import time
from pathlib import Path

from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
QUESTION = (
    "Explain in detail how a key-value cache speeds up transformer decoding, and why its memory "
    "grows with every generated token. Give a worked example with numbers for a small model, then "
    "discuss what a server should do when many users send long prompts with large max_tokens at "
    "the same time."
)
STEPS = 64


def llama_cpp_round(llm):
    """Time to first token (prompt eval + first greedy token) and decode tok/s over STEPS."""
    # SmolLM2's chat template with its default system message, as kvgate-backend renders it.
    text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()
    t0 = time.perf_counter()
    gen = llm.generate(tokens, top_k=1, top_p=1.0, temp=0.0, reset=True)
    next(gen)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(STEPS):
        next(gen)
    return len(tokens), ttft, STEPS / (time.perf_counter() - t1)


def ours_round():
    """decode_bench's single-stream row and time to first token (ms)."""
    out = subprocess.run([str(ROOT / "target/release/examples/decode_bench")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    tps = float(re.search(r"\| single-stream decode tok/s \| [\d.]+ \| ([\d.]+) \|", out).group(1))
    ttft = float(re.search(r"\| time to first token \((\d+) tokens\), ms \| [\d.]+ \| ([\d.]+) \|", out).group(2))
    streams8 = float(re.search(r"\| 8 \| ([\d.]+) \|", out).group(1))
    return tps, ttft / 1e3, streams8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    a = p.parse_args()
    llm = Llama(model_path=a.model, n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=256,
                verbose=False)
    rows = []
    for r in range(a.rounds):
        n, ttft, tps = llama_cpp_round(llm)
        o_tps, o_ttft, o_8 = ours_round()
        rows.append((r, n, tps, ttft, o_tps, o_ttft, o_8))
        print(f"round {r}: llama.cpp {tps:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms; "
              f"kvgate-backend {o_tps:.1f} tok/s, TTFT {o_ttft * 1e3:.0f} ms, 8 streams {o_8:.1f} tok/s",
              flush=True)
    print("\n| round | prompt tokens | llama.cpp (Q4_1) tok/s | kvgate-backend (f32) tok/s | kvgate / llama.cpp "
          "| llama.cpp TTFT ms | kvgate TTFT ms | kvgate 8 streams tok/s | vs llama.cpp one stream |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, n, tps, ttft, o_tps, o_ttft, o_8 in rows:
        print(f"| {r} | {n} | {tps:.1f} | {o_tps:.1f} | {o_tps / tps:.2f}× | {ttft * 1e3:.0f} | "
              f"{o_ttft * 1e3:.0f} | {o_8:.1f} | {o_8 / tps:.2f}× |")


if __name__ == "__main__":
    main()
