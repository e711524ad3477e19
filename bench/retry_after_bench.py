#!/usr/bin/env python3
"""Retry-After accuracy: the advertised wait vs the real one, two arms, one run.

The real stack (kvgate-backend with the real model, slowed with --step-delay-ms, a small KV
pool; Envoy with the filter polling the backend every 200 ms). Each probe round:
  1. fillers: 2–4 streaming requests (greedy, so their lengths are deterministic) that stop
     early by themselves or run to their cap, admitted together and left running 0.5–3 s;
  2. a probe that needs more than is free gets 429 with its advertised wait
     (`retry-after-ms`) and the bytes it needs (`need_bytes`); it does not retry;
  3. the real wait is the time until the ledger first has that many bytes free (nothing else
     competes for them), read from /kvgate/status every 50 ms;
  4. the fillers finish; the next round starts once the probe's place in the fair-retry line
     (kept for its Retry-After plus the patience: it never retries) has expired, so no probe
     is told to wait behind an earlier one that is not coming back.
A real wait shorter than the configured floor (`min_ms`) counts as the floor. The fillers of
earlier rounds are the finished requests the estimator learns the usual output length from.

Arms (a fresh gateway + backend each, interleaved over rounds):
  progress  retry_after.from_progress = true (the default): expected ends from each lease's
            reported progress, the backend's decode rate and the usual output length.
  lifetime  from_progress = false: the mean lifetime of past leases (the earlier estimator).
  elastic   as progress, but the fillers' class is elastic (a prior of 16 output tokens, the
            0.9 quantile once 3 outputs are known), so a filler that runs long holds blocks
            past its reservation (held back by the gateway until the report after it ends),
            and the probe (its own worst-case class, by API key) lacks 48–320 tokens more than
            is free: more than the fillers' reservations alone free.
  cold      as progress, but every probe round starts a fresh backend and gateway (a restarted
            gateway alone relearns the outputs the backend still reports): the probe is refused
            before any request has finished, so the gateway knows at most the backend's decode
            rate (from its first polls) and no output lengths.

`--baseline-wasm PATH` runs every arm a second time, as `ARM@baseline`, with that filter module
(an earlier build) in the same run, interleaved.

Usage: .venv/bin/python bench/retry_after_bench.py [--probes 12] [--rounds 1]
       [--arms progress,lifetime,elastic,cold] [--baseline-wasm PATH]
"""

import argparse
import json
import math
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
from harness import (BLOCK_BYTES, Backend, Envoy, api_key_entry,  # noqa: E402
                     shipped_plugin_config, unclaimed_bytes)

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    # Stops early by itself (short answers).
    ("What is the capital of France? Answer in one word.", [64, 256, 400]),
    ("Name a primary colour.", [64, 256]),
    # Runs long (to its cap, usually).
    ("Count from 1 to 500, separated by commas: 1, 2, 3,", [120, 250, 400]),
    ("Write a long story about a dragon who learns to cook.", [200, 400]),
]
# More than any filler's prompt takes once the chat template has wrapped it.
FILLER_PROMPT_TOKENS = 96
RETRY = {"min_ms": 500, "max_ms": 20000, "jitter": 0.1, "default_lease_ms": 3000}
# The elastic arm's probe class, chosen by this API key (its SHA-256 in the config).
PROBE_KEY = "kvgate-probe"
ARMS = {  # name: (from_progress, elastic fillers, a fresh gateway every round)
    "progress": (True, False, False),
    "lifetime": (False, False, False),
    "elastic": (True, True, False),
    "cold": (True, False, True),
}


def elastic_policy():
    return {"default_class": "default", "api_keys": {api_key_entry(PROBE_KEY): "probe"}, "classes": {
        "default": {"action": "reject", "reservation": "elastic", "elastic_quantile": 0.9,
                    "elastic_min_samples": 3, "elastic_prior_tokens": 16},
        "probe": {"action": "reject"}}}


def run_arm(name, from_progress, elastic, cold, probes, blocks, seed, workdir, wasm=None):
    d = Path(workdir) / name
    d.mkdir(parents=True, exist_ok=True)
    def backend():
        return Backend(d, "--kv-cache-bytes", blocks * BLOCK_BYTES, "--step-delay-ms", 25).start()

    b = backend()
    cfg = shipped_plugin_config()
    cfg.update({
        "kv_budget_bytes": blocks * BLOCK_BYTES,
        "scratch_margin_bytes": BLOCK_BYTES,
        "retry_after": {**RETRY, "from_progress": from_progress},
        "backend": {"poll_ms": 200, "timeout_ms": 1000, "lost_grace_ms": 5000,
                    "down_after_failures": 2, "secret": b.secret},
    })
    if elastic:
        cfg["policy"] = elastic_policy()
    gw = None
    patience_ms = cfg.get("fair_retry_patience_ms", 2000)
    rng = random.Random(seed)
    # The elastic arm's extra deficit, from its own stream: the fillers are the same in every arm.
    extra = random.Random(seed + 1000)
    samples = []

    def stream(body, out):
        try:
            with requests.post(gw.url + "/v1/chat/completions", json={**body, "stream": True},
                               stream=True, timeout=300) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        out["chunks"] = out.get("chunks", 0) + 1
            out["end"] = time.monotonic()
        except requests.RequestException as e:
            out["error"] = str(e)

    # The first two rounds only teach the usual output length, but for a cold gateway.
    taught = 0 if cold else 2
    for i in range(probes + taught):
        if gw is None or cold:
            if gw is not None:
                gw.assert_drained(timeout=60)
                gw.stop()
                b.stop()
                b = backend()
                cfg["backend"]["secret"] = b.secret
            (d / f"gw{i}").mkdir(exist_ok=True)
            gw = Envoy(d / f"gw{i}", b.port, cfg, wasm=wasm).start()
        fillers = []
        for _ in range(rng.randint(2, 4)):
            prompt, caps = rng.choice(PROMPTS)
            body = {"model": MODEL, "max_tokens": rng.choice(caps), "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}
            # Only fillers that fit what is free: a refused filler would leave a claim in the
            # fair-retry line that the probe's Retry-After rightly waits for, but that nobody
            # comes back for (it expires instead), so the probe's real wait would not be the one
            # it was told about.
            s = gw.status()
            free = unclaimed_bytes(s)
            per_token = s["model"]["kv_bytes_per_token"]
            if (FILLER_PROMPT_TOKENS + body["max_tokens"]) * per_token + BLOCK_BYTES > free:
                continue
            out = {"cap": body["max_tokens"], "kind": prompt[:12]}
            t = threading.Thread(target=stream, args=(body, out))
            t.start()
            fillers.append((t, out))
            time.sleep(0.05)
        time.sleep(rng.uniform(0.5, 3.0))
        s = gw.status()
        free = unclaimed_bytes(s)
        per_token = s["model"]["kv_bytes_per_token"]
        cap_tokens = s["capacity_bytes"] // per_token
        lack = extra.randint(48, 320) if elastic else 48
        want = min(free // per_token + lack, cap_tokens - 40)
        if i >= taught and s["leases"] > 0 and want * per_token > free:
            body = {"model": MODEL, "max_tokens": int(want), "temperature": 0,
                    "messages": [{"role": "user", "content": "Hi"}]}
            headers = {"authorization": f"Bearer {PROBE_KEY}"} if elastic else {}
            t0 = time.monotonic()
            r = requests.post(gw.url + "/v1/chat/completions", json=body, headers=headers,
                              timeout=60)
            if r.status_code == 429:
                ra = int(r.headers.get("retry-after-ms", "0"))
                err = r.json().get("error", {})
                need = err.get("need_bytes", 0)
                real = None
                while real is None and time.monotonic() - t0 < 120:
                    if unclaimed_bytes(gw.status()) >= need:
                        real = time.monotonic() - t0
                    else:
                        time.sleep(0.05)
                samples.append((ra, real))
                probe = (ra, real, t0, need, err.get("free_bytes"), s["leases"])
            else:
                probe = None
        else:
            probe = None
        for t, _ in fillers:
            t.join(timeout=300)
        if probe and not cold:
            # The probe keeps a place in the fair-retry line until its Retry-After plus the
            # patience; it never comes back, so the next probe would be told to wait behind a
            # place that then expires: start the next round once it has.
            ra, t0 = probe[0], probe[2]
            time.sleep(max(0.0, t0 + (ra + patience_ms) / 1000 + 0.25 - time.monotonic()))
        if probe:
            ra, real, t0, need, free_then, leases = probe
            ends = ", ".join(
                f"{o['kind']}… cap {o['cap']}: HTTP {o.get('status')}, {o.get('chunks', 0)} chunks, ends "
                f"{o['end'] - t0:+.1f} s" if "end" in o else f"{o['kind']}… {o}"
                for _, o in fillers)
            print(f"  {name} probe {i - taught + 1}: advertised {ra} ms, real "
                  f"{'-' if real is None else f'{real * 1000:.0f} ms'}; need {need} B, free "
                  f"{free_then} B, {leases} leases ({ends})", flush=True)
    gw.assert_drained(timeout=60)
    gw.stop()
    b.stop()
    return evaluate(samples)


def evaluate(samples):
    ratios = [ra / max(real * 1000, RETRY["min_ms"]) for ra, real in samples if real is not None]
    within = sum(1 for r in ratios if 0.5 <= r <= 2.0)
    ordered = sorted(ratios)
    return {
        "probes": len(samples),
        "measured": len(ratios),
        "within_0.5_2x": within / len(ratios) if ratios else 0.0,
        "median_ratio": statistics.median(ratios) if ratios else 0.0,
        "p10_ratio": ordered[len(ordered) // 10] if ratios else 0.0,
        "p90_ratio": ordered[len(ordered) * 9 // 10] if ratios else 0.0,
        "min_ratio": ordered[0] if ratios else 0.0,
        # A client that honours each Retry-After (told the same each time) comes back this many
        # times before the room is there: what an estimate that undershoots costs.
        "tries": sum(tries(r) for r in ratios),
    }


def tries(ratio):
    return max(1, math.ceil(1 / ratio - 1e-9)) if ratio > 0 else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--probes", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--arms", default="progress,lifetime",
                   help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--baseline-wasm", type=Path,
                   help="also run every arm with this filter module, as ARM@baseline")
    a = p.parse_args()
    names = a.arms.split(",")
    if unknown := [n for n in names if n not in ARMS]:
        p.error(f"unknown arms {unknown}; known: {','.join(ARMS)}")
    modules = [("", None)] + ([("@baseline", a.baseline_wasm)] if a.baseline_wasm else [])
    arms = [(n + tag, *ARMS[n], wasm) for n in names for tag, wasm in modules]
    results = {n: [] for n, *_ in arms}
    with tempfile.TemporaryDirectory() as work:
        for rnd in range(a.rounds):
            for name, from_progress, elastic, cold, wasm in arms:
                r = run_arm(f"{name}{rnd}", from_progress, elastic, cold, a.probes, a.blocks,
                            rnd, work, wasm)
                results[name].append(r)
                print(f"round {rnd} {name}: {json.dumps(r)}", flush=True)
    print("\n| arm | probes | measured | within 0.5–2× of the real wait | median advertised/real | p10 | p90 | lowest | tries to get in (honouring) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        n = sum(r["measured"] for r in rs)
        w = sum(r["within_0.5_2x"] * r["measured"] for r in rs) / n if n else 0
        print(f"| {name} | {sum(r['probes'] for r in rs)} | {n} | {w:.0%} | "
              f"{statistics.median(r['median_ratio'] for r in rs):.2f} | "
              f"{min(r['p10_ratio'] for r in rs):.2f} | {max(r['p90_ratio'] for r in rs):.2f} | "
              f"{min(r['min_ratio'] for r in rs):.2f} | {sum(r['tries'] for r in rs)} |")


if __name__ == "__main__":
    main()
