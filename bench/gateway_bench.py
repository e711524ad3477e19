#!/usr/bin/env python3
"""Gateway overhead: Envoy with the kvgate filter vs the same Envoy without it, same run.

Both gateways proxy to one fast upstream (a third Envoy answering with direct_response, so the
upstream is never the bottleneck). wrk drives each gateway in turn with OpenAI completions of
~100, ~1k and ~8k prompt tokens; requests/s and p50/p99 latency are compared as ratios. The
filter's added p50 latency is set beside native tiktoken-rs counting of the same prompt size
(criterion, `make bench-core`) to show where the time goes.

Usage: .venv/bin/python bench/gateway_bench.py [--duration 10] [--connections 16]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import ENVOY, WASM, free_port, shipped_bootstrap, shipped_plugin_config, wasm_filter  # noqa: E402

COUNT = ROOT / "target" / "release" / "examples" / "count"

WORDS = ("the model cache request token memory server admission budget stream decode prompt and "
         "of to in is that for with as on by this be are from at or an which gateway envoy latency "
         "throughput capacity reservation client policy queue class worst case allowed reach Paris "
         "France capital question answer 2026 42 (see below) e.g., it's don't we'll").split()


def text(n_words):
    out, x = [], 7
    for i in range(n_words):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(WORDS[(x >> 33) % len(WORDS)])
    return " ".join(out)


def start(cfg, workdir, name, concurrency):
    path = Path(workdir) / f"{name}.json"
    path.write_text(json.dumps(cfg))
    log = open(Path(workdir) / f"{name}.log", "w")
    p = subprocess.Popen([str(ENVOY), "-c", str(path), "--concurrency", str(concurrency), "-l", "warning",
                          "--base-id", str(free_port())], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return p


def wait_ready(admin_port, proc):
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError("envoy exited")
        try:
            if requests.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError("envoy not ready")


def upstream_config(port, admin):
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [{
            "name": "up", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "up",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string":
                            '{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'}}}]}]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}]},
    }


def gateway_config(port, admin, upstream_port, with_filter):
    boot = shipped_bootstrap()
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = boot["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    boot["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["port_value"] = upstream_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if with_filter:
        f = wasm_filter(boot)
        f["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(WASM)
        cfg = shipped_plugin_config()
        cfg["model"]["context_tokens"] = 32768
        cfg["kv_budget_bytes"] = 1 << 50  # never full: this measures the admission path itself
        f["typed_config"]["config"]["configuration"]["value"] = json.dumps(cfg)
    else:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    return boot


def start_gateways(work, concurrency):
    """A direct-response upstream and two gateways in front of it, one with the kvgate filter
    ("kvgate") and one without ("plain"), all ready. Returns (processes, {name: port})."""
    up_port, up_admin = free_port(), free_port()
    ports = {name: (free_port(), free_port()) for name in ("plain", "kvgate")}
    procs = [start(upstream_config(up_port, up_admin), work, "upstream", 1)]
    try:
        wait_ready(up_admin, procs[0])
        for name, (port, admin) in ports.items():
            procs.append(start(gateway_config(port, admin, up_port, name == "kvgate"), work, name, concurrency))
            wait_ready(admin, procs[-1])
    except Exception:
        stop(procs)
        raise
    return procs, {name: port for name, (port, _) in ports.items()}


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def wrk(url, body_file, duration, connections):
    lua = Path(body_file).with_suffix(".lua")
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["content-type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(lua),
                          url + "/v1/completions"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def pct(p):
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)", out)
        v, unit = float(m.group(1)), m.group(2)
        return v * {"us": 0.001, "ms": 1, "s": 1000}[unit]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50": pct(50), "p99": pct(99), "non2xx": int(non2xx.group(1)) if non2xx else 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.md"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvgate-bench-")
    procs, ports = start_gateways(work, 1)
    try:
        rows = []
        for target in (100, 1000, 8000):
            # Calibrate the prompt to the filter's own count: with no cap, max_tokens = context - prompt.
            words = target
            for _ in range(6):
                body = {"model": "m", "prompt": text(words)}
                r = requests.post(f"http://127.0.0.1:{ports['kvgate']}/v1/completions", json=body, timeout=10)
                prompt = 32768 - int(r.headers["x-kvgate-max-tokens"])
                words = max(1, round(words * target / prompt))
            body = {"model": "m", "prompt": text(words), "max_tokens": 64}
            body_file = Path(work) / f"body{target}.json"
            body_file.write_text(json.dumps(body))
            prompt_file = Path(work) / f"prompt{target}.txt"
            prompt_file.write_text(body["prompt"])
            native = subprocess.run([str(COUNT), "cl100k_base", str(prompt_file), "200"],
                                    capture_output=True, text=True, check=True).stdout.split()
            native_us = float(native[1])
            res = {}
            for name, port in ports.items():
                res[name] = wrk(f"http://127.0.0.1:{port}", body_file, args.duration, args.connections)
            rows.append((prompt, len(body_file.read_bytes()), res, native_us))
            print(f"prompt {prompt} tokens: {json.dumps(res)}", flush=True)
        size = WASM.stat().st_size
        lines = [
            f"Envoy 1.40 (`--concurrency 1` each), wrk -t2 -c{args.connections} -d{args.duration}s, "
            f"upstream: Envoy direct_response. kvgate.wasm {size / 1e6:.1f} MB.",
            "",
            "`filter µs/req` is the worker time the filter adds per request (1/rps with the filter "
            "minus 1/rps without, one worker saturated); `native count µs` is tiktoken-rs counting the "
            "same prompt natively in the same run (`core/examples/count.rs`).",
            "",
            "| prompt tokens | body bytes | plain rps | kvgate rps | rps ratio | plain p50 ms | kvgate p50 ms "
            "| plain p99 ms | kvgate p99 ms | filter µs/req | native count µs | filter / native | non-2xx |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for prompt, nbytes, r, native_us in rows:
            p, k = r["plain"], r["kvgate"]
            added_us = 1e6 / k["rps"] - 1e6 / p["rps"]
            lines.append(
                f"| {prompt} | {nbytes} | {p['rps']:.0f} | {k['rps']:.0f} | {k['rps'] / p['rps']:.2f} "
                f"| {p['p50']:.2f} | {k['p50']:.2f} | {p['p99']:.2f} | {k['p99']:.2f} "
                f"| {added_us:.0f} | {native_us:.0f} | {added_us / native_us:.2f} | {p['non2xx'] + k['non2xx']} |")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
