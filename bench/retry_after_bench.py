#!/usr/bin/env python3
"""Retry-After accuracy under saturation: the advertised wait vs the real one, two arms, one run.

The real stack (kvgate-backend with the real model, slowed with --step-delay-ms, a small KV
pool; Envoy with the filter polling the backend every 200 ms) is kept saturated by closed-loop
clients that honour Retry-After. Their requests mix output caps and prompts that stop early or
run to the cap, so leases end at very different times.

For every 429 the client records when it came, the advertised wait (`retry-after-ms`) and the
bytes it needs (`need_bytes` in the error body). A poller reads /kvgate/status every 50 ms; the
real wait of a 429 is the time until the ledger first had that many bytes free (capacity −
committed − held back; claims are not subtracted: they are the fair-retry line, not a
shortage). A wait shorter than the configured floor counts as the floor (no hint can be lower).

Arms, interleaved in rounds over the same stack shape (a fresh gateway + backend per arm):
  progress  retry_after.from_progress = true (the default): expected ends from each lease's
            reported progress, the backend's decode rate and the usual output length.
  lifetime  from_progress = false: the mean lifetime of past leases (the earlier estimator).

Usage: .venv/bin/python bench/retry_after_bench.py [--seconds 45] [--rounds 2] [--clients 8]
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import BLOCK_BYTES, Backend, Envoy, shipped_plugin_config  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    # Stops early by itself (short answers).
    ("What is the capital of France? Answer in one word.", [64, 256, 400]),
    ("Name a primary colour.", [64, 256]),
    # Runs long (to its cap, usually).
    ("Count from 1 to 500, separated by commas: 1, 2, 3,", [120, 250, 400]),
    ("Write a long story about a dragon who learns to cook.", [200, 400]),
]
RETRY = {"min_ms": 500, "max_ms": 20000, "jitter": 0.1, "default_lease_ms": 3000}


def run_arm(name, from_progress, seconds, clients, blocks, seed, workdir):
    d = Path(workdir) / name
    d.mkdir(parents=True, exist_ok=True)
    b = Backend(d, "--kv-cache-bytes", blocks * BLOCK_BYTES, "--step-delay-ms", 25).start()
    cfg = shipped_plugin_config()
    cfg.update({
        "kv_budget_bytes": blocks * BLOCK_BYTES,
        "scratch_margin_bytes": BLOCK_BYTES,
        "retry_after": {**RETRY, "from_progress": from_progress},
        "backend": {"poll_ms": 200, "timeout_ms": 1000, "lost_grace_ms": 5000,
                    "down_after_failures": 2, "secret": b.secret},
    })
    gw = Envoy(d, b.port, cfg).start()
    samples, free_log = [], []
    stop = threading.Event()
    lock = threading.Lock()

    def poll_status():
        while not stop.is_set():
            try:
                s = gw.status()
                free = s["capacity_bytes"] - s["committed_bytes"] - s["held_back_bytes"]
                free_log.append((time.monotonic(), free))
            except requests.RequestException:
                pass
            time.sleep(0.05)

    def client(i):
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            prompt, caps = rng.choice(PROMPTS)
            body = {"model": MODEL, "max_tokens": rng.choice(caps), "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}
            try:
                r = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=300)
            except requests.RequestException:
                continue
            if r.status_code == 429:
                ra = int(r.headers.get("retry-after-ms", "0"))
                need = r.json().get("error", {}).get("need_bytes")
                with lock:
                    samples.append((time.monotonic(), ra, need))
                stop.wait(ra / 1000)

    threads = [threading.Thread(target=poll_status)] + [
        threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=310)
    gw.assert_drained(timeout=60)
    gw.stop()
    b.stop()
    return evaluate(samples, free_log)


def evaluate(samples, free_log):
    ratios, unresolved = [], 0
    for t0, ra, need in samples:
        if not need:
            continue
        real = next((t - t0 for t, free in free_log if t >= t0 and free >= need), None)
        if real is None:
            unresolved += 1
            continue
        real_ms = max(real * 1000, RETRY["min_ms"])
        ratios.append(ra / real_ms)
    within = sum(1 for r in ratios if 0.5 <= r <= 2.0)
    return {
        "refusals": len(samples),
        "measured": len(ratios),
        "unresolved": unresolved,
        "within_0.5_2x": within / len(ratios) if ratios else 0.0,
        "median_ratio": statistics.median(ratios) if ratios else 0.0,
        "p10_ratio": sorted(ratios)[len(ratios) // 10] if ratios else 0.0,
        "p90_ratio": sorted(ratios)[len(ratios) * 9 // 10] if ratios else 0.0,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=int, default=45)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64)
    a = p.parse_args()
    results = {"progress": [], "lifetime": []}
    with tempfile.TemporaryDirectory() as work:
        for rnd in range(a.rounds):
            for name, flag in (("progress", True), ("lifetime", False)):
                r = run_arm(f"{name}{rnd}", flag, a.seconds, a.clients, a.blocks, rnd, work)
                results[name].append(r)
                print(f"round {rnd} {name}: {json.dumps(r)}", flush=True)
    print("\n| arm | refusals | measured | within 0.5–2× | median advertised/real | p10 | p90 |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        n = sum(r["measured"] for r in rs)
        w = sum(r["within_0.5_2x"] * r["measured"] for r in rs) / n if n else 0
        print(f"| {name} | {sum(r['refusals'] for r in rs)} | {n} | {w:.0%} | "
              f"{statistics.median(r['median_ratio'] for r in rs):.2f} | "
              f"{min(r['p10_ratio'] for r in rs):.2f} | {max(r['p90_ratio'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
