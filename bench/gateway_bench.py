#!/usr/bin/env python3
"""Gateway overhead: Envoy with the kvgate filter vs the same Envoy without it, same run.

Both gateways proxy to one fast upstream (a third Envoy answering with direct_response, so the
upstream is never the bottleneck). wrk drives each gateway in turn with OpenAI completions of
~100, ~1k and ~8k prompt tokens; requests/s and p50/p99 latency are compared as ratios. The
filter's added p50 latency is set beside native tiktoken-rs counting of the same prompt size
(criterion, `make bench-core`) to show where the time goes.

Usage: .venv/bin/python bench/gateway_bench.py [--duration 10] [--connections 16]
       [--baseline-wasm PATH]   a third gateway with another build of the filter (before/after)
       [--rounds N]             N rounds of every workload, arms interleaved
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


def gateway_config(port, admin, upstream_port, wasm):
    boot = shipped_bootstrap()
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = boot["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    boot["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["port_value"] = upstream_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if wasm:
        f = wasm_filter(boot)
        f["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm)
        cfg = shipped_plugin_config()
        cfg["model"]["context_tokens"] = 32768
        cfg["kv_budget_bytes"] = 1 << 50  # never full: this measures the admission path itself
        f["typed_config"]["config"]["configuration"]["value"] = json.dumps(cfg)
    else:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    return boot


def start_gateways(work, concurrency, baseline=None):
    """A direct-response upstream and gateways in front of it: one with the kvgate filter
    ("kvgate"), one without ("plain"), and one with the `baseline` build of the filter when
    given ("baseline"), all ready. Returns (processes, {name: port})."""
    wasms = {"plain": None, "kvgate": WASM, **({"baseline": baseline} if baseline else {})}
    up_port, up_admin = free_port(), free_port()
    ports = {name: (free_port(), free_port()) for name in wasms}
    procs = [start(upstream_config(up_port, up_admin), work, "upstream", 1)]
    try:
        wait_ready(up_admin, procs[0])
        for name, (port, admin) in ports.items():
            procs.append(start(gateway_config(port, admin, up_port, wasms[name]), work, name, concurrency))
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


def wrk(url, body_file, duration, connections, path="/v1/completions"):
    """`body_file` None: GETs of `path` (an unpriced request; the filter only sets the level)."""
    args = ["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--latency"]
    if body_file is not None:
        lua = Path(body_file).with_suffix(".lua")
        lua.write_text(
            'wrk.method = "POST"\nwrk.headers["content-type"] = "application/json"\n'
            f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')
        args += ["-s", str(lua)]
    out = subprocess.run(args + [url + path], capture_output=True, text=True, check=True).stdout
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
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline-wasm", help="another build of the filter, run beside it (before/after)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.md"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvgate-bench-")
    procs, ports = start_gateways(work, 1, args.baseline_wasm)
    try:
        workloads = []  # (label, prompt tokens, body file or None, native count µs)
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
            workloads.append((f"{prompt}-token prompt", body_file, float(native[1])))
        workloads.append(("GET /v1/models (unpriced)", None, None))
        runs = {(w[0], name): [] for w in workloads for name in ports}
        for rnd in range(args.rounds):
            for label, body_file, _ in workloads:
                # Arms interleaved, their order turned each round.
                names = list(ports)[rnd % len(ports):] + list(ports)[:rnd % len(ports)]
                for name in names:
                    path = "/v1/completions" if body_file else "/v1/models"
                    runs[(label, name)].append(
                        wrk(f"http://127.0.0.1:{ports[name]}", body_file, args.duration, args.connections, path))
                print(f"round {rnd + 1} {label}: " + json.dumps({n: runs[(label, n)][-1] for n in ports}), flush=True)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        size = WASM.stat().st_size
        base = "baseline" in ports
        lines = [
            f"Envoy 1.40 (`--concurrency 1` each), wrk -t2 -c{args.connections} -d{args.duration}s, "
            f"{args.rounds} round(s), arms interleaved, medians; upstream: Envoy direct_response. "
            f"kvgate.wasm {size / 1e6:.1f} MB" + (f"; baseline: {args.baseline_wasm}." if base else "."),
            "",
            "`filter µs/req` is the worker time the filter adds per request (1/rps with the filter "
            "minus 1/rps without, one worker saturated); `native count µs` is tiktoken-rs counting the "
            "same prompt natively in the same run (`core/examples/count.rs`).",
            "",
            "| workload | plain rps | kvgate rps | kvgate / plain | " + ("baseline rps | kvgate / baseline | " if base else "")
            + "plain p99 ms | kvgate p99 ms | filter µs/req | native count µs | non-2xx |",
            "|---|---|---|---|" + ("---|---|" if base else "") + "---|---|---|---|---|",
        ]
        for label, _, native_us in workloads:
            p = {k: med([r[k] for r in runs[(label, "plain")]]) for k in ("rps", "p99")}
            k = {k: med([r[k] for r in runs[(label, "kvgate")]]) for k in ("rps", "p99")}
            non2xx = sum(r["non2xx"] for n in ports for r in runs[(label, n)])
            added_us = 1e6 / k["rps"] - 1e6 / p["rps"]
            row = f"| {label} | {p['rps']:.0f} | {k['rps']:.0f} | {k['rps'] / p['rps']:.2f} | "
            if base:
                b = med([r["rps"] for r in runs[(label, "baseline")]])
                row += f"{b:.0f} | {k['rps'] / b:.2f} | "
            row += (f"{p['p99']:.2f} | {k['p99']:.2f} | {added_us:.0f} | "
                    f"{'' if native_us is None else f'{native_us:.0f}'} | {non2xx} |")
            lines.append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
