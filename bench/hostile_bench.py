#!/usr/bin/env python3
"""Hostile prompts inside Envoy (issue 9, finding 3): the filter's worst-case counting cost per MB,
and a small request's latency beside four multi-megabyte prompts, against the same Envoy without
the filter, in one run.

Three Envoys as in bench/gateway_bench.py: a fast upstream (direct_response), a gateway with the
kvgate filter (the shipped config, 2 workers, a 32k-token context so nothing is refused for the
pool) and the same gateway without it. Bodies are OpenAI completions whose prompt is one piece
without whitespace (a repeated letter, or random letters): the worst case for BPE counting.
  1. per size (1, 2 and 3.5 MB) and kind: the median of 5 sequential requests' wall time
     (the filter answers 413: the prompt is far past the context; the plain gateway proxies it),
     reported per MB;
  2. four clients keep sending 3.5 MB random-letter prompts for --seconds; meanwhile a fifth
     sends a one-word request every 100 ms: its latency (p50, p99, max).

Usage: .venv/bin/python bench/hostile_bench.py [--seconds 10]
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from gateway_bench import start_gateways, stop  # noqa: E402

MB = 1 << 20


def body(size, kind, seed=1):
    if kind == "repeated":
        prompt = "a" * size
    else:
        rnd = random.Random(seed)
        prompt = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(size))
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16}).encode()


def post(url, data, timeout=60):
    t = time.perf_counter()
    r = requests.post(url + "/v1/completions", data=data, headers={"content-type": "application/json"},
                      timeout=timeout)
    return r.status_code, time.perf_counter() - t


def per_mb(url, bodies):
    out = {}
    for (size, kind), data in bodies.items():
        times, statuses = [], set()
        for _ in range(5):
            s, dt = post(url, data)
            statuses.add(s)
            times.append(dt)
        out[(size, kind)] = (statistics.median(times), sorted(statuses))
    return out


def beside_big_prompts(url, big, seconds):
    stop = threading.Event()
    sent = [0]

    def hammer():
        while not stop.is_set():
            try:
                post(url, big, timeout=120)
                sent[0] += 1
            except requests.RequestException:
                pass
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the four are in flight
    small = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 4}).encode()
    lat, statuses, t0 = [], set(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        s, dt = post(url, small, timeout=60)
        statuses.add(s)
        lat.append(dt)
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join()
    lat.sort()
    return {"n": len(lat), "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "max": lat[-1], "statuses": sorted(statuses), "big_sent": sent[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvgate-hostile-")
    procs, ports = start_gateways(work, 2)
    try:
        sizes = [1 * MB, 2 * MB, int(3.5 * MB)]
        bodies = {(s, k): body(s, k) for s in sizes for k in ("repeated", "random")}
        res = {name: per_mb(f"http://127.0.0.1:{port}", bodies) for name, port in ports.items()}
        big = bodies[(int(3.5 * MB), "random")]
        side = {name: beside_big_prompts(f"http://127.0.0.1:{port}", big, a.seconds)
                for name, port in ports.items()}
    finally:
        stop(procs)
    print("| prompt | size | without the filter: ms (status) | with it: ms (status) | with it, ms per MB | added ms per MB |")
    print("|---|---|---|---|---|---|")
    for (size, kind) in bodies:
        (tp, sp), (tk, sk) = res["plain"][(size, kind)], res["kvgate"][(size, kind)]
        mb = size / MB
        print(f"| {kind} letters, one piece | {mb:.1f} MB | {tp * 1000:.1f} ({sp}) | {tk * 1000:.1f} ({sk}) | "
              f"{tk * 1000 / mb:.1f} | {(tk - tp) * 1000 / mb:.1f} |")
    print()
    print("| gateway | small requests | status | p50 ms | p99 ms | max ms | 3.5 MB prompts sent meanwhile |")
    print("|---|---|---|---|---|---|---|")
    for name, s in side.items():
        print(f"| {name} | {s['n']} | {s['statuses']} | {s['p50'] * 1000:.1f} | {s['p99'] * 1000:.1f} | "
              f"{s['max'] * 1000:.1f} | {s['big_sent']} |")


if __name__ == "__main__":
    main()
