#!/usr/bin/env python3
"""An agent swarm through the shipped stack, with the backend's prefix caching on and off.

`--agents` agents (default 12) send the same system prompt (60 tool descriptions, about 3,000
tokens) and a short task of their own (`max_tokens` 64), all at once, each `--tasks` times in a
row (a fan-out burst), retrying a 429 after its Retry-After. One real backend (the real model,
the shipped 256 MiB pool, its defaults) behind one Envoy with the filter configuration `make up`
runs (envoy/fleet-filter.yaml). Arms, interleaved over `--rounds`:

  caching      the backend's defaults: prefix caching on (the paged KV arena)
  no caching   `--kv-layout host` (the host KV layout, as before: no prefix caching)

Measured per round: wall time, peak sequences decoding at once (the backend's lease report,
sampled every 100 ms), time to first token (streamed, from the first try) p50 / p90, completion
tokens per second, gateway 429s, prompt tokens the backend did not prefill (cached), and
mid-decode KV OOMs (must be 0).

Usage: .venv/bin/python bench/swarm_bench.py [--agents 12] [--tasks 1] [--rounds 2] [--out FILE]
"""

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from admission_bench import pct  # noqa: E402
from harness import BLOCK_BYTES, Backend, Envoy, fleet_bootstrap, fleet_plugin_config  # noqa: E402
from test_prefix import POOL_BLOCKS, agent_body  # noqa: E402

ARMS = {"caching": [], "no caching": ["--kv-layout", "host"]}


def start(workdir, flags):
    secret = "swarm-bench"
    b = Backend(workdir, "--kv-cache-bytes", POOL_BLOCKS * BLOCK_BYTES, *flags, secret=secret)
    b.start(timeout=120)
    cfg = fleet_plugin_config()
    cfg.update({"kv_budget_bytes": POOL_BLOCKS * BLOCK_BYTES, "gateway_id": 1})
    cfg["backend"] = {**cfg["backend"], "endpoints": [b.address], "secret": secret}
    d = Path(workdir) / "gw"
    d.mkdir()
    e = Envoy(d, [b.port], cfg, bootstrap=fleet_bootstrap())
    try:
        e.start()
        e.wait_for(lambda s: all(x["up"] and x["polled"] for x in s["endpoints"])
                   and s["model"]["tokenizer"] == "custom", 60, "the descriptor")
    except BaseException:
        e.stop()
        b.stop()
        raise
    return e, b


def measure(gw, b, a):
    lock = threading.Lock()
    out = {"ttft": [], "tokens": 0, "429": 0, "errors": 0}
    stop, peak = threading.Event(), {"running": 0}

    def watch():
        while not stop.is_set():
            try:
                leases = b.leases()["leases"]
            except requests.RequestException:
                continue
            peak["running"] = max(peak["running"], sum(l["state"] == "running" for l in leases))
            time.sleep(0.1)

    def agent(k):
        for t in range(a.tasks):
            body = {**agent_body(k * a.tasks + t), "stream": True,
                    "stream_options": {"include_usage": True}}
            first = time.monotonic()
            for _ in range(1000):
                r = requests.post(gw.url + "/v1/chat/completions", json=body, stream=True, timeout=900)
                if r.status_code == 429:
                    with lock:
                        out["429"] += 1
                    time.sleep(int(r.headers.get("retry-after-ms", "1000")) / 1000)
                    continue
                if r.status_code != 200:
                    with lock:
                        out["errors"] += 1
                    break
                ttft = None
                for line in r.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        with lock:
                            out["errors"] += 1
                    if ttft is None and any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                        ttft = time.monotonic() - first
                    if ev.get("usage"):
                        with lock:
                            out["tokens"] += ev["usage"]["completion_tokens"]
                with lock:
                    out["ttft"].append(ttft or 0.0)
                break

    before = b.metrics()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=agent, args=(k,)) for k in range(a.agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    watcher.join()
    after = b.metrics()
    delta = lambda m: after.get(m, 0) - before.get(m, 0)
    gw.assert_drained(timeout=60)
    return {"wall": wall, "running": peak["running"], "ttft50": pct(out["ttft"], 50),
            "ttft90": pct(out["ttft"], 90), "tok_s": out["tokens"] / wall, "429": out["429"],
            "errors": out["errors"], "cached": delta("kvgate_backend_prefix_cached_tokens_total"),
            "oom": delta("kvgate_backend_kv_oom_total"), "served": len(out["ttft"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--agents", type=int, default=12)
    p.add_argument("--tasks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench/results/swarm.md"))
    a = p.parse_args()
    rows = []
    for rnd in range(1, a.rounds + 1):
        for name, flags in ARMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                gw, b = start(tmp, flags)
                try:
                    m = measure(gw, b, a)
                finally:
                    gw.stop()
                    b.stop()
            rows.append((rnd, name, m))
            print(rnd, name, json.dumps(m), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    lines = [f"# Swarm: {a.agents} agents x {a.tasks} task(s), one ~3,000-token system prompt",
             "", f"`.venv/bin/python bench/swarm_bench.py --agents {a.agents} --tasks {a.tasks} "
             f"--rounds {a.rounds}` at {commit}, {cpu}, {platform.machine()}; one backend "
             "(defaults, 256 MiB pool) behind Envoy with envoy/fleet-filter.yaml.", "",
             "| round | arm | served | wall s | peak decoding | TTFT p50 / p90 s | tok/s | 429s | "
             "cached prompt tokens | KV OOMs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rnd, name, m in rows:
        lines.append(f"| {rnd} | {name} | {m['served']} | {m['wall']:.0f} | {m['running']} | "
                     f"{m['ttft50']:.1f} / {m['ttft90']:.1f} | {m['tok_s']:.1f} | {m['429']} | "
                     f"{m['cached']:.0f} | {m['oom']:.0f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
