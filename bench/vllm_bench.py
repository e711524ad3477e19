#!/usr/bin/env python3
"""A real vLLM alone against the same vLLM behind kvgate (issue 50): the same seeded requests, the
same pool, arms interleaved by round; a fresh vLLM per arm and round (its prefix cache starts
empty in each).

Arms:
  vllm           clients straight to vLLM (it admits on prompt blocks and preempts by recompute)
  vllm-envoy     the shipped Envoy without the filter in front of it (the proxy's CPU on both sides)
  kvgate         Envoy + the filter (`backend.api: vllm`, the model's exact tokenizer from
                 `kvgate-backend --describe`, the shipped classes and keys; `vip` does not preempt:
                 a vLLM cannot be asked to demote)
  kvgate-elastic as kvgate, every class reserving elastically: the 0.9 quantile of the output
                 lengths vLLM's `vllm:request_generation_tokens` histogram shows (a prior of 64
                 tokens until 5 have finished); vLLM preempts if they outgrow it

Workloads (admission_bench's seeded mix, scaled to the served context):
  moderate       `--clients` closed-loop clients
  overload       open-loop Poisson arrivals at `--rate` jobs a second, for as long as the jobs last

Every client streams, honours Retry-After, and gives up on a request with no first token
`--give-up-s` after its first try (admission_bench's `send`). Per arm: completed, preemptions
(vLLM's `vllm:num_preemptions_total`), goodput (output tokens of completed requests / makespan),
goodput within the objective (completed requests whose first token came within `--slo-s`, per
second of makespan), TTFT p50, latency p50/p99, 429s.

Usage: .venv/bin/python bench/vllm_bench.py [--rounds N] [--jobs N] [--workload moderate|overload]
       [--rate R] [--arms vllm,kvgate] [--blocks 45] [--no-write]
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import admission_bench as ab  # noqa: E402
from harness import Envoy, Vllm, vllm_plugin_config  # noqa: E402

HEADING = "## In front of vLLM"
ab.MODEL = "smollm2"  # the name tools/vllm-serve.sh serves


def filter_config(vllm, elastic=False):
    """The shipped policy (envoy/kvgate-filter.yaml) in front of `vllm`, no class preempting;
    `elastic`: every class reserving the 0.9 quantile of what it has learned."""
    doc = yaml.safe_load((ROOT / "envoy" / "kvgate-filter.yaml").read_text())
    shipped = json.loads(doc["resources"][0]["typed_config"]["config"]["configuration"]["value"])
    policy = shipped["policy"]
    for c in policy["classes"].values():
        c.pop("preempts", None)
        if elastic:
            c.update({"reservation": "elastic", "elastic_quantile": 0.9, "elastic_min_samples": 5,
                      "elastic_prior_tokens": 64})
    return vllm_plugin_config(vllm, policy=policy, retry_after=shipped["retry_after"],
                              backend={"api": "vllm", "cluster": "kvgate_backend", "poll_ms": 500})


def run_arm(arm, rnd, workload, a, work):
    d = Path(work) / f"{arm}-{rnd}"
    d.mkdir()
    vllm = Vllm(d, blocks=a.blocks).start()
    procs = [vllm]
    try:
        url = vllm.url
        if arm in ("kvgate", "kvgate-elastic", "vllm-envoy"):
            envoy = Envoy(d, vllm.port, filter_config(vllm, elastic=arm == "kvgate-elastic"),
                          plain=arm == "vllm-envoy").start()
            procs.append(envoy)
            url = envoy.url
        before = vllm.metrics()
        run = ab.Run()
        t0 = time.monotonic()
        ab.drive(url, workload, a, run, progress=lambda: print(
            f"  [{arm} r{rnd} {time.monotonic() - t0:5.0f}s] {len(run.results)} done", flush=True))
        makespan = time.monotonic() - t0
        after = vllm.metrics()
        gated = arm.startswith("kvgate")
        gstats = procs[1].stats() if gated else {}
        committed = procs[1].status()["committed_bytes"] if gated else 0
    finally:
        for p in reversed(procs):
            p.stop()
    rs = list(run.results.values())
    ok = [x for x in rs if x["outcome"] == "ok"]
    within = [x for x in ok if x["ttft"] <= a.slo_s]
    row = {
        "arm": arm, "round": rnd, "requests": len(rs), "completed": len(ok),
        "gave_up": sum(x["outcome"] == "gave up" for x in rs),
        "failed": sum(x["outcome"] in ("kv oom", "preempted", "other") for x in rs),
        "too_large": sum(x["outcome"] == "413" for x in rs),
        "preemptions": int(after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)),
        "makespan_s": makespan,
        "goodput": sum(x["tokens"] for x in ok) / makespan,
        "slo_goodput": len(within) / makespan,
        "ttft_p50": ab.pct([x["ttft"] for x in ok], 50),
        "lat_p50": ab.pct([x["latency"] for x in ok], 50),
        "lat_p99": ab.pct([x["latency"] for x in ok], 99),
        "r429": run.r429,
        "gateway_preemption_alarms": gstats.get("kvgate.backend_preemptions"),
        "committed_after": committed,
    }
    print(f"  {arm} r{rnd}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)
    return row


def table(rows, arms, a):
    out = ["| arm | completed | failed | preemptions | goodput tok/s | within "
           f"{a.slo_s:.0f} s TTFT, req/s | TTFT p50 s | latency p50 / p99 s | 429s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        cell = lambda k, d=1: " / ".join(ab.fmt(r[k], d) for r in rs)  # noqa: E731
        out.append(f"| {arm} | {' / '.join(str(r['completed']) + ' of ' + str(r['requests']) for r in rs)} "
                   f"| {cell('failed', 0)} | {cell('preemptions', 0)} | {cell('goodput')} | {cell('slo_goodput', 2)} "
                   f"| {cell('ttft_p50')} | {' / '.join(ab.fmt(r['lat_p50']) + ', ' + ab.fmt(r['lat_p99']) for r in rs)} "
                   f"| {cell('r429', 0)} |")
    return "\n".join(out)


def ratios(rows, arms, base="vllm"):
    """Pooled over rounds, each arm against `base`: goodput, goodput within the objective, TTFT
    p50 (of every completed request's TTFT), latency p99."""
    def pooled(arm, k):
        rs = [r for r in rows if r["arm"] == arm]
        return statistics.mean(r[k] for r in rs) if rs else float("nan")
    lines = []
    for arm in arms:
        if arm == base:
            continue
        parts = [f"{k} {pooled(arm, k) / pooled(base, k):.2f}×" for k in ("goodput", "slo_goodput", "ttft_p50", "lat_p99")
                 if pooled(base, k)]
        lines.append(f"- {arm} against {base} (mean of rounds): " + ", ".join(parts))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--workload", choices=["moderate", "overload"], default="moderate")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rate", type=float, help="overload: jobs a second (open loop)")
    p.add_argument("--blocks", type=int, default=45, help="vLLM's pool in 128-token blocks")
    p.add_argument("--give-up-s", type=float, default=120)
    p.add_argument("--slo-s", type=float, default=10.0, help="the TTFT objective")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--arms", default="vllm,kvgate")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    a.patience, a.max_tries = "first-token", None
    if a.workload == "moderate":
        a.rate = None
    elif not a.rate:
        p.error("--workload overload needs --rate")
    arms = a.arms.split(",")
    context = (a.blocks - 1) * 128
    workload = ab.make_workload(a.seed, a.jobs, context)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for rnd in range(1, a.rounds + 1):
            for arm in arms:
                rows.append(run_arm(arm, rnd, workload, a, work))
    n = sum(len(j) for j in workload)
    cmd = "bench/vllm_bench.py " + " ".join(sys.argv[1:])
    head = (f"{a.workload}: {n} requests ({a.jobs} jobs), "
            + (f"{a.rate}/s open loop" if a.rate else f"{a.clients} closed-loop clients")
            + f", vLLM pool {a.blocks} × 128 tokens, rounds {a.rounds} (cells: round 1 / round 2 …)")
    text = "\n".join([head, "", table(rows, arms, a), "", ratios(rows, arms)])
    print(text)
    if not a.no_write:
        out = ROOT / "bench" / "results" / f"vllm-{a.workload}-{datetime.date.today()}.md"
        out.write_text(f"`{cmd}` at {ab.git_hash()}, {ab.machine()}\n\n{text}\n")
        print(f"written {out}")


if __name__ == "__main__":
    main()
