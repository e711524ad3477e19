#!/usr/bin/env python3
"""A fleet against one backend: the same burst through kvgate into one backend, into two, and
through two gateways racing for two.

Every run starts its own real backends (the real model, `--admission reserve`, the same small KV
pool each, a per-step delay so a sequence holds its blocks for a while) and Envoy gateways built
from envoy/fleet.yaml + envoy/fleet-filter.yaml (the same filter config in every run, polling
every `--poll-ms`). The burst: `--clients` closed-loop clients, each sending `--requests`
completions that run to `--max-tokens`, retrying a 429 after its Retry-After until served.

  one backend          1 gateway  -> 1 backend
  two backends         1 gateway  -> 2 backends
  two gateways         2 gateways -> 2 backends (half the clients on each)

Measured per run: peak admitted requests in flight (the gateways' live leases, sampled every
50 ms), wall time, completion tokens/s, gateway 429s, backend 429s (the backend refused what a
gateway admitted: two gateways raced for its last blocks) as a share of admissions, upstream
mismatches and mid-decode KV OOMs (both must be 0). Both backends share this machine's cores.

With `--queue MS`, the default class queues (`max_wait_ms` MS) instead of answering 429, and
with `--max-tokens A,B,...` the requests' caps cycle through the list (client i's j-th request
takes entry i + j): a big request at the front of the queue then waits for room while small ones
behind it could fit. Each row adds the latency of a served request, from its first try to its
last byte (p50 / p99), and the requests the queue timed out.

Usage: .venv/bin/python bench/fleet_bench.py [--blocks 64] [--clients 24] [--requests 2]
       [--max-tokens 64[,N...]] [--step-delay-ms 30] [--poll-ms 500] [--queue MS] [--wasm PATH]
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
import harness  # noqa: E402
from admission_bench import pct  # noqa: E402
from harness import BLOCK_BYTES, Backend, Envoy, fleet_bootstrap, fleet_plugin_config  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPT = "1, 2, 3, 4,"  # greedy SmolLM2 keeps counting: every request runs to max_tokens


def start_fleet(workdir, n_backends, n_gateways, a):
    secret = "fleet-bench"
    bs = [Backend(workdir, "--kv-cache-bytes", a.blocks * BLOCK_BYTES, "--admission", "reserve",
                  "--step-delay-ms", a.step_delay_ms, secret=secret) for _ in range(n_backends)]
    started = []
    try:
        for b in bs:
            started.append(b)
            b.start(timeout=120)
        for j in range(n_gateways):
            cfg = fleet_plugin_config()
            cfg.update({"kv_budget_bytes": a.blocks * BLOCK_BYTES, "scratch_margin_bytes": BLOCK_BYTES,
                        "gateway_id": j + 1})
            if a.queue:
                policy = cfg["policy"]
                policy["classes"][policy["default_class"]] = {
                    "action": "queue", "max_wait_ms": a.queue, "max_depth": 256, "priority": 1}
            cfg["backend"] = {**cfg["backend"], "poll_ms": a.poll_ms, "endpoints": [b.address for b in bs],
                              "secret": secret}
            d = Path(workdir) / f"gw{j}"
            d.mkdir()
            e = Envoy(d, [b.port for b in bs], cfg, bootstrap=fleet_bootstrap())
            started.append(e)
            e.start()
            e.wait_for(lambda s: all(x["up"] and x["polled"] for x in s["endpoints"])
                       and s["model"]["tokenizer"] == "custom", 60, "every endpoint polled, descriptor in")
    except BaseException:
        for p in reversed(started):
            p.stop()
        raise
    return [p for p in started if isinstance(p, Envoy)], bs


def run(name, n_backends, n_gateways, a):
    with tempfile.TemporaryDirectory() as tmp:
        gws, bs = start_fleet(tmp, n_backends, n_gateways, a)
        try:
            return measure(name, gws, bs, a)
        finally:
            for p in (*gws, *bs):
                p.stop()


def measure(name, gws, bs, a):
    lock = threading.Lock()
    out = {"ok": 0, "gateway_429": 0, "backend_429_seen": 0, "errors": 0, "tokens": 0, "backend_429_at": [],
           "latencies": [], "queue_timeouts": 0}
    stop, peak = threading.Event(), {"in_flight": 0, "queued": 0}

    def watch():
        while not stop.is_set():
            try:
                st = [gw.status() for gw in gws]
            except requests.RequestException:
                continue
            peak["in_flight"] = max(peak["in_flight"], sum(x["leases"] for x in st))
            peak["queued"] = max(peak["queued"], sum(x.get("queued", 0) for x in st))
            time.sleep(0.05)

    def client(i):
        gw = gws[i % len(gws)]
        for j in range(a.requests):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": a.caps[(i + j) % len(a.caps)],
                    "temperature": 0}
            first = time.monotonic()
            for _ in range(500):
                r = requests.post(gw.url + "/v1/completions", json=body, timeout=600)
                if r.status_code == 200:
                    with lock:
                        out["ok"] += 1
                        out["tokens"] += r.json()["usage"]["completion_tokens"]
                        out["latencies"].append(time.monotonic() - first)
                    break
                if r.status_code != 429:
                    with lock:
                        out["errors"] += 1
                    break
                # A backend's own refusal, passed through by the gateway, says so in its message.
                with lock:
                    if "The backend's KV cache" in r.text:
                        out["backend_429_seen"] += 1
                        out["backend_429_at"].append(time.time() - t0)
                    else:
                        out["gateway_429"] += 1
                        out["queue_timeouts"] += "kv_queue_timeout" in r.text
                time.sleep(min(int(r.headers.get("retry-after-ms", "1000")) / 1000, 2.0))

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.time()
    watcher.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.time() - t0
    stop.set()
    watcher.join()
    stats = [gw.stats() for gw in gws]
    metrics = [b.metrics() for b in bs]
    admitted = sum(s.get("kvgate.admitted", 0) for s in stats)
    backend_429 = int(sum(m["kvgate_backend_rejected_kv_total"] for m in metrics))
    row = {
        "run": name, "gateways": len(gws), "backends": len(bs), "requests": out["ok"],
        "peak_in_flight": peak["in_flight"], "wall_s": round(wall, 1), "tokens": out["tokens"],
        "tokens_per_s": round(out["tokens"] / wall, 1), "admitted": admitted,
        "gateway_429": out["gateway_429"], "backend_429": backend_429,
        "backend_429_share": round(backend_429 / admitted, 4) if admitted else 0.0,
        "backend_refused_stat": sum(s.get("kvgate.backend_refused", 0) for s in stats),
        # When clients saw them: the first poll interval (no gateway knows the other's leases
        # yet) against the rest of the run.
        "backend_429_first_poll": sum(1 for t in out["backend_429_at"] if t < a.poll_ms / 1000),
        "backend_429_later": sum(1 for t in out["backend_429_at"] if t >= a.poll_ms / 1000),
        "upstream_mismatch": sum(s.get("kvgate.upstream_mismatch", 0) for s in stats),
        "kv_oom": int(sum(m["kvgate_backend_kv_oom_total"] for m in metrics)),
        "served_per_backend": [int(m["kvgate_backend_requests_total"]) for m in metrics],
        "errors": out["errors"],
        "lat_p50": round(pct(out["latencies"], 50), 2),
        "lat_p99": round(pct(out["latencies"], 99), 2),
        "queue_timeouts": out["queue_timeouts"],
        # Queued requests admitted from behind a waiting front (tried while an endpoint has nobody in line).
        "passed_in_queue": sum(s.get("kvgate.passed_in_queue", 0) for s in stats),
        "peak_queued": peak["queued"],
    }
    print(json.dumps(row), flush=True)
    return row


def table(rows, a):
    one = rows[0]
    lines = [
        f"Burst: {a.clients} clients x {a.requests} completions of `{PROMPT}` running to their caps ({a.max_tokens} tokens) "
        f"(each retries a 429 after its Retry-After, at most 2 s"
        f"{f'; the default class queues, max_wait_ms {a.queue}' if a.queue else ''}); every backend `--admission reserve`, "
        f"`--kv-cache-bytes` {a.blocks} blocks ({a.blocks * BLOCK_BYTES / 2**20:.1f} MiB), "
        f"`--step-delay-ms {a.step_delay_ms}`; gateways Envoy 1.40 `--concurrency 2`, envoy/fleet.yaml + "
        f"envoy/fleet-filter.yaml, poll {a.poll_ms} ms.",
        "",
        "| run | gateways → backends | served | peak in flight | vs one backend | wall s | tokens/s | vs one backend "
        "| gateway 429s | backend 429s (in the first poll / later) | backend 429s / admissions | served per backend "
        "| mismatches | KV OOMs | latency p50 / p99 s (nearest rank) | queue timeouts | passed in the queue |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['gateways']} → {r['backends']} | {r['requests']} | {r['peak_in_flight']} | "
            f"{r['peak_in_flight'] / max(one['peak_in_flight'], 1):.2f}× | {r['wall_s']} | {r['tokens_per_s']} | "
            f"{r['tokens_per_s'] / max(one['tokens_per_s'], 1e-9):.2f}× | {r['gateway_429']} | {r['backend_429']} "
            f"({r['backend_429_first_poll']} / {r['backend_429_later']}) | "
            f"{100 * r['backend_429_share']:.1f} % ({r['backend_429']}/{r['admitted']}) | "
            f"{' / '.join(map(str, r['served_per_backend']))} | {r['upstream_mismatch']} | {r['kv_oom']} | "
            f"{r['lat_p50']} / {r['lat_p99']} | {r['queue_timeouts']} | {r['passed_in_queue']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks per backend (16 tokens each)")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--requests", type=int, default=2, help="completions per client")
    ap.add_argument("--max-tokens", default="64", help="a cap, or caps to cycle through (comma-separated)")
    ap.add_argument("--step-delay-ms", type=int, default=30)
    ap.add_argument("--poll-ms", type=int, default=500)
    ap.add_argument("--queue", type=int, default=0, metavar="MS",
                    help="the default class queues with this max_wait_ms (0: it answers 429)")
    ap.add_argument("--wasm", help="the filter to load (default: the `make wasm` build)")
    ap.add_argument("--only", choices=["one-backend", "two-backends", "two-gateways"], action="append",
                    help="run only these (repeatable); ratios are against the first run listed")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fleet.md"))
    a = ap.parse_args()
    a.caps = [int(c) for c in a.max_tokens.split(",")]
    if a.wasm:
        harness.WASM = Path(a.wasm).resolve()
    for p in (harness.WASM, harness.BACKEND, harness.MODEL):
        if not p.exists():
            sys.exit(f"{p} missing: run `make wasm backend-build model`")
    runs = {"one-backend": ("one backend", 1, 1), "two-backends": ("two backends", 2, 1),
            "two-gateways": ("two gateways", 2, 2)}
    rows = [run(*runs[k], a) for k in (a.only or runs)]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    header = (f"kvgate {git}, {platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} "
              f"CPUs, filter {harness.WASM.relative_to(ROOT) if harness.WASM.is_relative_to(ROOT) else harness.WASM}\n\n")
    Path(a.out).write_text(header + table(rows, a))
    print("\n" + table(rows, a))


if __name__ == "__main__":
    main()
