#!/usr/bin/env python3
"""Admission strategies side by side (issue 11, section 1): one seeded request sequence, the same
small KV pool, every strategy a user could run, interleaved over rounds.

Workload (seeded, identical in every arm; `make_workload`): the seed's adversarial mix scaled to
the pool — short prompts with big or unset caps that stop early by themselves, long prompts with
small caps (interactive class), a few requests that run to their cap (counting, long stories), a
prompt over the served context (kvgate should answer 413), agent fan-out bursts of 10–20 branches
in the batch class, and a steady chat mix beside them. Classes come from the shipped demo API
keys (`Authorization: Bearer kvgate-demo-batch|interactive|vip`; no key is the default class).
`--clients` closed-loop clients take jobs from the sequence in order (a fan-out job sends all its
branches at once and waits for them); with `--rate R` the jobs arrive open loop instead, R per
second (Poisson, seeded), however many are in flight: sustained overload when R is above what
the backend serves. Every request streams and honours Retry-After (`retry-after-ms`) on
429/503. Its client gives up when it has no first token `--give-up-s` seconds after its first
try, wherever the request waits: sleeping on a Retry-After, in the gateway's queue, or in the
backend's queue behind a `200 OK` (it closes the stream; the backend drops the sequence). The
same patience in every arm: a server that answers headers at once and the first token a minute
later has not served that client either. `--patience retries` is the rule before 2026-12-03
(only a Retry-After ending past the patience made a client give up; a request waiting in a
queue waited as long as it took). `--max-tries` adds a try limit, only when given: it penalises
arms with short Retry-After hints, whose clients come back more often for the same wait.

Arms (a fresh backend, and gateway where there is one, per arm and round; same pool, same
`--step-delay-ms`):
  none     backend --admission none, clients straight to it (KV taken as sequences grow)
  prompt   backend --admission prompt: admission on prompt length alone (the prompt's blocks
           held from arrival, 429 when they are not free; output takes blocks as it grows), what
           a server without kvgate does
  cap      backend --admission none --max-batch N: a concurrency cap, the operator's usual
           guard (N = the pool's tokens / the workload's mean worst case, prompt + max_tokens,
           estimated at 4 characters a token; `--cap N` sets it); the rest wait in its queue
  reserve  backend --admission reserve alone (prompt + max_tokens held from arrival, 429 else)
  kvgate   Envoy + the filter with the shipped policy (envoy/kvgate-filter.yaml) in front of
           backend --admission reserve
  elastic  as kvgate, with every class reserving elastically (`reservation: elastic`, the
           --elastic-quantile (0.9) of the class's learned outputs, a prior of --elastic-prior
           (64) tokens until 5 have finished; `elastic_by_prompt` is left at its default, off);
           the backend lends free blocks past a reservation and takes them back (recompute)
           when a reservation needs them
  queued   as elastic, with every class queued at the gateway (`action: queue`, up to
           --queue-wait-ms, in priority then arrival order per worker aged by the shipped
           `queue_aging_ms`, claims across workers) instead of refused or degraded: clients wait
           in Envoy rather than retry
  queued-strict  as queued with `queue_aging_ms: 0` (strict priority: no aging)
  queued-nobf    as queued with `fair_retry_backfill: false` (nobody goes ahead of the line)
  queued-lean    as queued with smaller elastic reservations: the --lean-quantile (0.5) of the
           learned outputs and a prior of --lean-prior (16) tokens (more sequences at once, more
           of them preempted and recomputed)
  oracle   as kvgate, but every request's max_tokens is its true output length, learned by a
           first greedy pass (temperature 0) against a backend with a large pool
  vllm     backend --admission none --on-kv-exhaustion recompute (only when the built backend
           has the flag): vLLM's recompute preemption, straight to the backend
  vllm-envoy  the same behind the shipped Envoy without the kvgate filter: what a mesh in
           front of such a server runs, so that the gateway's own CPU is in both sides of the
           comparison (this machine's two cores run clients, proxy and backend together)

Per arm: failures by reason (mid-decode KV OOM = a stream ending with an error event or cut
off; preempted by policy; 413/too large; gave up), goodput (output tokens of completed
requests / makespan), p50/p99 latency and time to first token (both from the first try, so they
include waiting for admission), 429s received, the longest admission wait (first try to the
response headers of the try that was admitted), mean KV written / capacity and, behind kvgate, mean
reserved − used (the ledger's committed bytes minus the KV the backend's sequences have really
written, prompt + output so far, `kvgate_backend_kv_written_bytes`, sampled every 0.5 s: what
worst-case pricing over-reserves; negative when elastic sequences have grown past their
reservations), and recomputed tokens (backend /metrics). Then every arm with its rounds pooled:
goodput over the summed makespans, latency p50/p95/p99 over every completed request, and each
beside vLLM's behaviour's when that arm ran (one round's p99 on a few dozen requests is its
slowest request). With --plots (and whenever it writes BENCHMARKS.md), three PNGs: goodput and
failures per arm; KV written and reserved over time; latency and TTFT CDFs.

Usage: .venv/bin/python bench/admission_bench.py [--full] [--rounds N] [--jobs N] [--arms a,b]
       [--no-write]

To see why a request waited: `--dump FILE` writes every request's outcome, with each refusal
(sent and answered at, status, code, advertised wait), and `--trace` adds the gateway's
/kvgate/status (claims, held back, lendable) and the backend's lease report (every sequence:
reserved, used, running / preempted) every 0.5 s. To compare two builds of the filter on the
same machine state: `--alt-wasm OTHER.wasm --arms queued,queued+alt` (arms ending in `+alt` run
with the other build, interleaved by round like any arms). Arms ending in `+lazy` run with the
backend's `--lazy-blocks true` (a reservation is a promise of blocks, taken as the sequence
grows; the backend's default since 2026-12-03), arms ending in `+eager` with `--lazy-blocks false`
(blocks taken at admission): `--arms queued,queued+eager,vllm`. Arms ending in `+line` run with the filter's
`fair_retry_max_line` at `--max-line` (default 0, no bound: the filter's default before
2026-12-03, 0.5 since): `--arms kvgate,kvgate+line`.
"""

import argparse
import datetime
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import harness  # noqa: E402
from harness import BLOCK_BYTES, Backend, Envoy  # noqa: E402

MODEL = "smollm2-135m-instruct"
HEADING = "## Admission strategies side by side (issue 11)"
FILLER = ("The gateway prices every request at the worst case it is allowed to reach, counting the "
          "prompt with the model's tokenizer and adding the whole output cap. ")
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Say hello in Spanish.", "What colour is the sky?", "Name a fruit.",
             "What is the largest planet?", "How many legs does a spider have?"]
STORIES = ["Write a long story about a dragon who learns to cook.",
           "Write a long story about a lighthouse keeper and a storm."]


# ----- the workload -----------------------------------------------------------------------------

def make_workload(seed, jobs, context_tokens):
    """A list of jobs; a job is a list of requests sent together (one, or a fan-out burst).
    A request: {"id", "kind", "cls", "path", "body"} (body without model/stream fields)."""
    rng = random.Random(seed)
    q = lambda: [{"role": "user", "content": rng.choice(QUESTIONS)}]  # noqa: E731
    big = lambda: rng.randint(context_tokens * 2 // 5, context_tokens * 3 // 4)  # noqa: E731
    kinds = [
        # (name, weight, maker) — big caps the short answers never use
        ("short prompt, big cap", 5, lambda: ("batch", "chat", {"messages": q(), "max_tokens": big()})),
        ("short prompt, big cap (strict)", 3, lambda: ("standard", "chat", {"messages": q(), "max_tokens": big()})),
        ("unset cap", 2, lambda: ("standard", "chat", {"messages": q()})),
        ("chat", 4, lambda: ("interactive", "chat", {"messages": q(), "max_tokens": 128})),
        ("vip chat", 1, lambda: ("vip", "chat", {"messages": q(), "max_tokens": 128})),
        ("long prompt, small cap", 3, lambda: ("interactive", "chat", {"messages": [{"role": "user", "content":
            FILLER * rng.randint(8, 14) + " Summarize in one sentence."}], "max_tokens": 40})),
        # run to their cap
        ("counting, to its cap", 2, lambda: ("batch", "completion", {"prompt": "1, 2, 3, 4,",
                                                                      "max_tokens": rng.randint(100, 200)})),
        ("long story", 1, lambda: ("standard", "chat", {"messages": [{"role": "user", "content": rng.choice(STORIES)}],
                                                         "max_tokens": rng.randint(150, 250)})),
    ]
    over = ("prompt over the context", "standard", "completion",
            {"prompt": [1] * (context_tokens + 64), "max_tokens": 16})
    out, n = [], 0

    def req(kind, cls, path, body):
        nonlocal n
        n += 1
        return {"id": n, "kind": kind, "cls": cls, "path": path, "body": body}

    # Fan-out bursts: one per 12 jobs (at least one); the prompt over the context once.
    fanouts = {int(jobs * (i + 0.5) / max(1, jobs // 12)) for i in range(max(1, jobs // 12))}
    over_at = next(j for j in range(jobs // 3, jobs) if j not in fanouts)
    # Every kind once (shuffled), then draws by weight: a short sequence still has the whole mix.
    deck = rng.sample(kinds, len(kinds))
    for j in range(jobs):
        if j in fanouts:
            k = rng.randint(10, 20)
            out.append([req("agent fan-out branch", "batch", "chat",
                            {"messages": q(), "max_tokens": rng.randint(200, 400), "stop": ["\n", "."]})
                        for _ in range(k)])
        elif j == over_at:
            out.append([req(*over)])
        else:
            name, _, make = deck.pop(0) if deck else rng.choices(kinds, weights=[k[1] for k in kinds])[0]
            cls, path, body = make()
            out.append([req(name, cls, path, body)])
    return out


# ----- one client request -----------------------------------------------------------------------

class Run:
    """Outcomes of one arm: per request, what happened (shared by the client threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.results = {}
        self.r429 = 0
        self.tries = 0

    def add(self, rid, res):
        with self.lock:
            self.results[rid] = res


def send(url, r, a, run, cap_override=None):
    body = {"model": MODEL, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **r["body"]}
    if cap_override is not None:
        body["max_tokens"] = cap_override
    headers = {}
    if r["cls"] in ("batch", "interactive", "vip"):
        headers["authorization"] = f"Bearer kvgate-demo-{r['cls']}"
    path = "/v1/chat/completions" if r["path"] == "chat" else "/v1/completions"
    t0 = time.monotonic()
    # --patience first-token: the client gives up on a request with no first token give_up_s
    # after its first try, wherever it waits (a Retry-After, the gateway's queue, the backend's
    # queue); its read timeout is what is left of that, until the first token comes.
    deadline = t0 + a.give_up_s
    patient = a.patience == "first-token"
    tries, n429 = 0, 0
    res = {"kind": r["kind"], "cls": r["cls"], "cap": body.get("max_tokens"), "outcome": None, "tokens": 0,
           "first_try": t0}
    while True:
        tries += 1
        ts = time.monotonic()
        read_timeout = max(0.01, deadline - ts) if patient else 300
        try:
            resp = requests.post(url + path, json=body, headers=headers, stream=True, timeout=(10, read_timeout))
        except requests.Timeout as e:
            if patient and time.monotonic() >= deadline - 0.05:
                res.update(outcome="gave up", detail=f"no response headers within {a.give_up_s:.0f} s")
            else:
                res.update(outcome="other", detail=f"connect: {type(e).__name__}")
            break
        except requests.RequestException as e:
            res.update(outcome="other", detail=f"connect: {type(e).__name__}")
            break
        if resp.status_code in (429, 503):
            n429 += resp.status_code == 429
            ra = resp.headers.get("retry-after-ms")
            wait = int(ra) / 1000 if ra else float(resp.headers.get("retry-after", 1))
            # Every refusal: when the try was sent and answered (s from the first try), the
            # status, the error code and the wait advertised.
            try:
                code = resp.json().get("error", {}).get("code")
            except (ValueError, AttributeError):
                code = None  # not an OpenAI-shaped body
            res.setdefault("refusals", []).append([round(ts - t0, 2), round(time.monotonic() - t0, 2),
                                                   resp.status_code, code, wait])
            resp.close()
            if (a.max_tries and tries >= a.max_tries) or time.monotonic() + wait - t0 > a.give_up_s:
                res["outcome"] = "gave up"
                break
            time.sleep(wait)
            continue
        if resp.status_code != 200:
            text = resp.text[:400]
            too_large = resp.status_code == 413 or "context" in text or "too_large" in text
            res.update(outcome="413" if too_large else "other", detail=f"{resp.status_code} {text[:160]}")
            break
        res["admitted_after"] = time.monotonic() - t0
        res["admit_try_start"] = ts - t0
        res["degraded"] = "x-kvgate-degraded" in resp.headers
        finish, err = None, None
        try:
            for line in resp.iter_lines():
                if patient and "ttft" not in res:
                    # The backend's SSE keep-alive comments come every 15 s: each read may wait
                    # only what is left of the client's patience.
                    left = deadline - time.monotonic()
                    if left <= 0:
                        err = {"message": "no first token in time"}
                        break
                    relax_read_timeout(resp, left)
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    err = ev["error"]
                    continue
                if ev.get("usage"):
                    res["tokens"] = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    text = c.get("text") or (c.get("delta") or {}).get("content")
                    if text and "ttft" not in res:
                        res["ttft"] = time.monotonic() - t0
                        if patient:
                            relax_read_timeout(resp, 300)
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
        except (requests.RequestException, ValueError) as e:
            err = {"message": f"stream cut: {type(e).__name__}"}
        resp.close()
        if patient and "ttft" not in res and err is not None and time.monotonic() >= deadline - 0.05:
            # The client's patience ran out before the first token: it closed the stream.
            res.update(outcome="gave up", detail=f"no first token within {a.give_up_s:.0f} s")
            break
        res["latency"] = time.monotonic() - t0
        res.setdefault("ttft", res["latency"])
        res["finish"] = finish
        if finish in ("stop", "length") and err is None:
            res["outcome"] = "ok"
        elif err and "preempt" in json.dumps(err):
            res["outcome"] = "preempted"
        else:
            res["outcome"] = "kv oom"
            res["detail"] = json.dumps(err)[:200] if err else f"finish {finish}"
        break
    res["end"] = time.monotonic()
    res["tries"] = tries
    with run.lock:
        run.r429 += n429
        run.tries += tries
    run.add(r["id"], res)


def relax_read_timeout(resp, seconds):
    """Once the first token came, the client waits for the rest as long as it takes (a stream
    whose sequence is preempted and recomputed pauses): the socket's read timeout is lifted."""
    try:
        resp.raw.connection.sock.settimeout(seconds)
    except AttributeError:
        pass  # no socket left to relax: the response is already read


def drive(url, workload, a, run, caps=None, progress=None):
    """Closed-loop clients over the job sequence, in order; with --rate, open-loop Poisson
    arrivals of the jobs instead (seeded), whatever is in flight."""
    if a.rate:
        return drive_open(url, workload, a, run, caps, progress)
    nxt = {"i": 0}
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if nxt["i"] >= len(workload):
                    return
                job = workload[nxt["i"]]
                nxt["i"] += 1
            ts = [threading.Thread(target=send, args=(url, r, a, run, (caps or {}).get(r["id"])))
                  for r in job]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    join_with_progress(threads, progress)


def drive_open(url, workload, a, run, caps, progress):
    rng = random.Random(a.seed ^ 0x5EEDA77E)
    threads = []
    t_next = time.monotonic()
    last_progress = 0.0
    for job in workload:
        while time.monotonic() < t_next:
            time.sleep(min(0.1, max(0.0, t_next - time.monotonic())))
            if progress and time.monotonic() - last_progress >= 5:
                last_progress = time.monotonic()
                progress()
        for r in job:
            t = threading.Thread(target=send, args=(url, r, a, run, (caps or {}).get(r["id"])))
            t.start()
            threads.append(t)
        t_next += rng.expovariate(a.rate)
    join_with_progress(threads, progress)


def join_with_progress(threads, progress):
    """Wait for the client threads, reporting progress every 5 s."""
    while any(t.is_alive() for t in threads):
        if progress:
            progress()
        for _ in range(50):
            if not any(t.is_alive() for t in threads):
                break
            time.sleep(0.1)
    for t in threads:
        t.join()


# ----- the arms ---------------------------------------------------------------------------------

def filter_config(blocks, secret, elastic_prior=None, queue_ms=None, quantile=0.9, aging_ms=None,
                  safety=None, backfill=True, max_line=None):
    """The shipped filter config (envoy/kvgate-filter.yaml: from_backend, the demo classes and
    keys) priced against this pool; with `elastic_prior`, every class reserves elastically; with
    `queue_ms`, every class waits in the gateway's queue up to that long instead of a 429."""
    doc = yaml.safe_load((ROOT / "envoy" / "kvgate-filter.yaml").read_text())
    cfg = json.loads(doc["resources"][0]["typed_config"]["config"]["configuration"]["value"])
    cfg["kv_budget_bytes"] = blocks * BLOCK_BYTES
    cfg["scratch_margin_bytes"] = BLOCK_BYTES
    cfg["backend"] = {**cfg["backend"], "secret": secret}
    if elastic_prior is not None:
        for c in cfg["policy"]["classes"].values():
            c.update({"reservation": "elastic", "elastic_quantile": quantile, "elastic_min_samples": 5,
                      "elastic_prior_tokens": elastic_prior})
    if queue_ms is not None:
        for c in cfg["policy"]["classes"].values():
            c.pop("min_output_tokens", None)
            c.update({"action": "queue", "max_wait_ms": queue_ms, "max_depth": 64})
    if aging_ms is not None:
        cfg["policy"]["queue_aging_ms"] = aging_ms
    if safety is not None:
        cfg["safety_fraction"] = safety
    if not backfill:
        cfg["fair_retry_backfill"] = False
    if max_line is not None:
        cfg["fair_retry_max_line"] = max_line
    return cfg


def concurrency_cap(workload, context):
    """The cap an operator would size from the mix: the pool's tokens over the mean worst case
    (prompt + max_tokens, the context when unset, at most the context), prompts estimated at 4
    characters a token."""
    def worst(body):
        if "messages" in body:
            prompt = sum(len(m["content"]) for m in body["messages"]) // 4
        else:
            prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"]) // 4
        return min(context, prompt + body.get("max_tokens", context))
    sizes = [worst(r["body"]) for job in workload for r in job]
    return max(1, round(context / statistics.mean(sizes)))


def learn_lengths(workload, a, work):
    """The oracle's first pass: every request once, greedy, against a backend with a large pool
    and no delay, serving the same context (--max-context) as the arms' pool. Returns id -> the
    completion tokens it produced (requests refused or failed are left out: they keep their cap)."""
    d = Path(work) / "learn"
    d.mkdir()
    ctx = a.blocks * 16
    b = Backend(d, "--kv-cache-bytes", 512 * 2**20, "--admission", "none", "--max-context", ctx).start(timeout=120)
    try:
        run = Run()
        t0 = time.time()
        flat = [[r] for job in workload for r in job]
        drive(b.url, flat, argparse.Namespace(**{**vars(a), "clients": 8, "rate": None}), run,
              progress=lambda: print(f"  [learn {time.time() - t0:5.1f}s] {len(run.results)}/{len(flat)}", flush=True))
    finally:
        b.stop()
    caps = {rid: max(1, res["tokens"]) for rid, res in run.results.items() if res["outcome"] == "ok"}
    if a.dump:
        with open(a.dump, "a") as fh:
            for rid, x in sorted(run.results.items()):
                fh.write(json.dumps({"arm": "learn", "id": rid, "outcome": x["outcome"], "tokens": x["tokens"],
                                     "finish": x.get("finish")}) + "\n")
    lost = [rid for rid, res in run.results.items() if res["outcome"] != "ok"]
    print(f"  learned {len(caps)} output lengths (not learned: {len(lost)}, keep their caps)", flush=True)
    return caps


def run_arm(label, rnd, workload, a, work, oracle_caps):
    # `ARM+alt`: the arm ARM with the filter built as --alt-wasm (an A/B of two builds of the
    # filter, interleaved in one run so that the machine's drift falls on both alike).
    # `ARM+lazy`: ARM with the backend's --lazy-blocks (reservations are promises of blocks, the
    # default); `ARM+eager`: with --lazy-blocks false (blocks taken at admission).
    # `ARM+line`: ARM with the filter's fair_retry_max_line at --max-line.
    # `ARM+altb`: ARM with the backend built as --alt-backend (an A/B of two backend builds).
    suffixes = label.split("+")[1:]
    arm, alt = label.split("+")[0], "alt" in suffixes
    max_line = a.max_line if "line" in suffixes else None
    d = Path(work) / f"{label}{rnd}"
    d.mkdir()
    flags = ["--kv-cache-bytes", a.blocks * BLOCK_BYTES, "--step-delay-ms", a.step_delay_ms]
    flags += {"none": ["--admission", "none"], "reserve": ["--admission", "reserve"],
              "prompt": ["--admission", "prompt"],
              "cap": ["--admission", "none", "--max-batch", a.cap],
              "kvgate": ["--admission", "reserve"], "oracle": ["--admission", "reserve"],
              "elastic": ["--admission", "reserve"], "queued": ["--admission", "reserve"],
              "queued-strict": ["--admission", "reserve"], "queued-nobf": ["--admission", "reserve"],
              "queued-lean": ["--admission", "reserve"],
              "vllm": ["--admission", "none", "--on-kv-exhaustion", "recompute"]}[arm.removesuffix("-envoy")]
    if "lazy" in suffixes or "eager" in suffixes:
        flags += ["--lazy-blocks", "false" if "eager" in suffixes else "true"]
    b = Backend(d, *flags)
    if "altb" in suffixes:
        b.args[0] = str(a.alt_backend)
    b.start(timeout=120)
    gw = None
    try:
        if arm in ("kvgate", "oracle", "elastic", "queued", "queued-strict", "queued-nobf", "queued-lean"):
            queue = arm in ("queued", "queued-strict", "queued-nobf", "queued-lean")
            lean = arm == "queued-lean"
            prior = (a.lean_prior if lean else a.elastic_prior) if arm == "elastic" or queue else None
            quantile = a.lean_quantile if lean else a.elastic_quantile
            queue_ms = a.queue_wait_ms if queue else None
            aging = 0 if arm == "queued-strict" else None
            gw = Envoy(d, b.port, filter_config(a.blocks, b.secret, prior, queue_ms, quantile,
                                                aging, a.safety_fraction, backfill=arm != "queued-nobf",
                                                max_line=max_line),
                       wasm=a.alt_wasm if alt else None, concurrency=a.gateway_workers).start()
            gw.wait_for(lambda s: s.get("model", {}).get("tokenizer") == "custom", 60,
                        "the backend's descriptor in the filter")
        elif arm == "vllm-envoy":
            gw = Envoy(d, b.port, None, plain=True).start()
        cpu0 = (b.cpu_seconds(), gw.cpu_seconds() if gw else None)
        url = gw.url if gw else b.url
        run = Run()
        samples = []  # (used/capacity, reserved - used, claimed, held back, t s, committed/capacity)
        trace = []  # with --trace: the gateway's status and the backend's lease report per sample
        stop = threading.Event()

        def sample():
            while not stop.wait(0.5):
                try:
                    m = b.metrics()
                    # What the cache really holds (prompt + output so far), not the blocks taken:
                    # under --admission reserve those are the whole reservation.
                    used = m.get("kvgate_backend_kv_written_bytes", m["kvgate_backend_kv_used_bytes"])
                    cap = m["kvgate_backend_kv_capacity_bytes"]
                    st = gw.status() if gw and not gw.plain else None
                    samples.append((used / cap,
                                    None if st is None else st["committed_bytes"] - used,
                                    None if st is None else st.get("claimed_bytes", 0),
                                    None if st is None else st.get("held_back_bytes", 0),
                                    time.monotonic() - t0,
                                    None if st is None else st["committed_bytes"] / cap))
                    if a.trace and a.dump:
                        trace.append({"t": time.monotonic() - t0, "gateway": st, "backend": b.leases()})
                except (requests.RequestException, KeyError):
                    pass

        n = sum(len(j) for j in workload)
        t0 = time.monotonic()

        def progress():
            with run.lock:
                rs = list(run.results.values())
                c = {o: sum(1 for x in rs if x["outcome"] == o) for o in ("ok", "kv oom", "413", "gave up")}
                r429 = run.r429
            kv = f"{samples[-1][0]:4.0%}" if samples else "  - "
            print(f"  [{label} r{rnd} {time.monotonic() - t0:5.1f}s] done {len(rs)}/{n}  ok {c['ok']}  "
                  f"kv oom {c['kv oom']}  413 {c['413']}  gave up {c['gave up']}  429s {r429}  KV used {kv}",
                  flush=True)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        drive(url, workload, a, run, caps=oracle_caps if arm == "oracle" else None, progress=progress)
        makespan = max(x["end"] for x in run.results.values()) - t0
        stop.set()
        sampler.join()
        progress()
        m = b.metrics()
        gstats = gw.stats() if gw else {}
        cpu = [None if x0 is None or x1 is None else x1 - x0
               for x0, x1 in zip(cpu0, (b.cpu_seconds(), gw.cpu_seconds() if gw else None))]
    finally:
        if gw:
            gw.stop()
        b.stop()
    if a.dump:
        with open(a.dump, "a") as fh:
            for rid, x in sorted(run.results.items()):
                fh.write(json.dumps({"arm": label, "round": rnd, "id": rid, **{k: v for k, v in x.items()
                                     if k not in ("first_try", "end")},
                                     "start_s": x["first_try"] - t0, "end_s": x["end"] - t0}) + "\n")
            # The KV series: (t s, written / capacity, reserved - written, claimed, held back,
            # committed / capacity), bytes where not a share.
            fh.write(json.dumps({"arm": label, "round": rnd, "series": [[s[4], s[0], s[1], s[2], s[3], s[5]]
                                                                       for s in samples]}) + "\n")
            if trace:
                fh.write(json.dumps({"arm": label, "round": rnd, "trace": trace}) + "\n")
    row = summarise(label, rnd, run, makespan, samples, m, oracle_caps if arm == "oracle" else None, gstats)
    row["backend_cpu_s"], row["gateway_cpu_s"] = cpu
    # For the plots: the KV series and every completed request's latency and TTFT.
    row["series"] = [(s[4], s[0], s[5], None if s[2] is None else s[2] / m["kvgate_backend_kv_capacity_bytes"])
                     for s in samples]
    row["latencies"] = sorted(x["latency"] for x in run.results.values() if x["outcome"] == "ok")
    row["ttfts"] = sorted(x["ttft"] for x in run.results.values() if x["outcome"] == "ok")
    return row


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def summarise(arm, rnd, run, makespan, samples, m, oracle_caps, gstats):
    rs = list(run.results.values())
    ok = [x for x in rs if x["outcome"] == "ok"]
    count = lambda o: sum(1 for x in rs if x["outcome"] == o)  # noqa: E731
    tokens = sum(x["tokens"] for x in ok)
    reserved = [s[1] for s in samples if s[1] is not None]
    claimed = [s[2] for s in samples if s[2] is not None]
    held = [s[3] for s in samples if s[3] is not None]
    row = {
        "arm": arm, "round": rnd, "requests": len(rs), "completed": len(ok),
        "kv_oom": count("kv oom"), "preempted": count("preempted"), "too_large": count("413"),
        "gave_up": count("gave up"), "other": count("other"),
        "tokens": tokens, "makespan_s": makespan, "goodput": tokens / makespan if makespan else 0.0,
        "lat_p50": pct([x["latency"] for x in ok], 50), "lat_p99": pct([x["latency"] for x in ok], 99),
        "ttft_p50": pct([x["ttft"] for x in ok], 50), "ttft_p99": pct([x["ttft"] for x in ok], 99),
        "r429": run.r429, "degraded": sum(1 for x in rs if x.get("degraded")),
        "max_admit_wait": max((x["admitted_after"] for x in rs if "admitted_after" in x), default=0.0),
        # A request that gave up waited at least this long without being admitted.
        "max_gave_up_wait": max((x["end"] - x["first_try"] for x in rs if x["outcome"] == "gave up"), default=0.0),
        "kv_written_mean": statistics.mean(s[0] for s in samples) if samples else float("nan"),
        "reserved_minus_used_mib": statistics.mean(reserved) / 2**20 if reserved else None,
        # Behind kvgate: budget poured into claims of refused requests (fair retries) and held
        # back for the backend's unreported use, mean and peak over the samples.
        "claimed_mib": statistics.mean(claimed) / 2**20 if claimed else None,
        "claimed_max_mib": max(claimed) / 2**20 if claimed else None,
        "held_back_mib": statistics.mean(held) / 2**20 if held else None,
        "backend_kv_oom": int(m.get("kvgate_backend_kv_oom_total", 0)),
        "recompute_preemptions": int(m.get("kvgate_backend_recompute_preemptions_total", 0)),
        # Leases a higher class demoted (their streams paused, not stopped).
        "demoted": int(m.get("kvgate_backend_demoted_total", 0)),
        "recomputed_tokens": int(m.get("kvgate_backend_recomputed_tokens_total", 0)),
        "details": sorted({x.get("detail", "") for x in rs if x["outcome"] in ("other", "kv oom")} - {""})[:4],
        # Behind kvgate: admissions ahead of the line, those that ran past their expected end,
        # and by how much in all.
        **{k: gstats.get(f"kvgate.{k}") for k in ("backfilled", "backfill_overran", "backfill_overrun_ms")},
    }
    if oracle_caps is not None:
        # Batching may change greedy outputs: completed requests whose output differs from the
        # learned length (ended at the learned cap with finish "length" where it had stopped).
        # (Degraded requests are left out: the batch class's policy shrank their cap.)
        row["oracle_mismatch"] = sum(1 for rid, x in run.results.items() if x["outcome"] == "ok"
                                     and not x.get("degraded") and rid in oracle_caps
                                     and x["tokens"] != oracle_caps[rid])
    print(f"  {arm} r{rnd}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                            for k, v in row.items()}), flush=True)
    return row


# ----- the table --------------------------------------------------------------------------------

def fmt(v, d=1):
    """A table cell: `v` to `d` decimals, or "–" when there is none (None or NaN)."""
    return "–" if v is None or v != v else f"{v:.{d}f}"


def table(rows, arms):
    f = fmt
    head = ("| arm | round | completed / sent | mid-decode KV OOM | stopped by preemption (demoted) | 413 | gave up | other | "
            "output tokens | makespan s | goodput tok/s | vs oracle | latency p50 / p99 s | TTFT p50 / p99 s | "
            "429s | degraded | longest admission wait s | mean KV written / capacity | mean reserved − written MiB | "
            "claimed MiB mean / peak | recomputed tokens (preemptions) | CPU s backend / gateway |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    oracle = {r["round"]: r["goodput"] for r in rows if r["arm"] == "oracle"}
    for arm in arms:
        for r in (x for x in rows if x["arm"] == arm):
            vs = f"{r['goodput'] / oracle[r['round']]:.2f}×" if oracle.get(r["round"]) else "–"
            wait = f(r["max_admit_wait"])
            if r["gave_up"]:
                wait += f" (gave up after ≥ {f(r['max_gave_up_wait'])})"
            lines.append(
                f"| {arm} | {r['round']} | {r['completed']} / {r['requests']} | {r['kv_oom']} | {r['preempted']} ({r.get('demoted', 0)}) | "
                f"{r['too_large']} | {r['gave_up']} | {r['other']} | {r['tokens']} | {f(r['makespan_s'])} | "
                f"{f(r['goodput'])} | {vs} | {f(r['lat_p50'])} / {f(r['lat_p99'])} | "
                f"{f(r['ttft_p50'], 2)} / {f(r['ttft_p99'], 2)} | {r['r429']} | {r['degraded']} | {wait} | "
                f"{r['kv_written_mean']:.0%} | {f(r['reserved_minus_used_mib'])} | "
                f"{f(r['claimed_mib'])} / {f(r['claimed_max_mib'])} | "
                f"{r['recomputed_tokens']} ({r['recompute_preemptions']}) | "
                f"{f(r.get('backend_cpu_s'), 0)} / {f(r.get('gateway_cpu_s'), 0)} |")
    return "\n".join(lines)


def pooled(rows, arms):
    """Every arm over all its rounds: goodput (output tokens over the summed makespans) and the
    latency percentiles of every completed request pooled, beside vLLM's behaviour's when that
    arm ran. On a few dozen requests a round, one round's p99 is its slowest request; pooled
    over the rounds it is less a matter of which request was unlucky."""
    f = fmt
    agg = {}
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        if not rs:
            continue
        lat = [x for r in rs for x in r["latencies"]]
        span = sum(r["makespan_s"] for r in rs)
        agg[arm] = {"rounds": len(rs), "completed": sum(r["completed"] for r in rs),
                    "requests": sum(r["requests"] for r in rs),
                    "goodput": sum(r["tokens"] for r in rs) / span if span else float("nan"),
                    "p50": pct(lat, 50), "p95": pct(lat, 95), "p99": pct(lat, 99),
                    "ttft_p50": pct([x for r in rs for x in r["ttfts"]], 50),
                    "recomputed": sum(r["recomputed_tokens"] for r in rs)}
    base = agg.get("vllm", {})

    def ratio(g, key):
        b = base.get(key)
        return "–" if not b or b != b or g[key] != g[key] else f"{g[key] / b:.2f}×"

    head = ("| arm | rounds | completed / sent | goodput tok/s | vs vLLM | latency p50 / p95 / p99 s | p99 vs vLLM | "
            "TTFT p50 s | recomputed tokens | vs vLLM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, g in agg.items():
        lines.append(
            f"| {arm} | {g['rounds']} | {g['completed']} / {g['requests']} | {f(g['goodput'])} | "
            f"{ratio(g, 'goodput')} | {f(g['p50'])} / {f(g['p95'])} / {f(g['p99'])} | "
            f"{ratio(g, 'p99')} | {f(g['ttft_p50'], 2)} | {g['recomputed']} | {ratio(g, 'recomputed')} |")
    return "\n".join(lines)


COLOURS = {"none": "#999999", "prompt": "#d62728", "cap": "#ff7f0e", "reserve": "#8c564b", "kvgate": "#1f77b4",
           "elastic": "#2ca02c", "queued": "#17becf", "queued-strict": "#bcbd22", "queued-nobf": "#8c564b", "queued-lean": "#7f7f7f", "oracle": "#000000", "vllm": "#9467bd",
           "vllm-envoy": "#e377c2"}


def plots(rows, arms, out_dir, stem):
    """Three PNGs under out_dir: goodput and failures per arm and round; KV in use and reserved
    over time (round 0 of each arm); latency and TTFT CDFs (completed requests, rounds pooled).
    Returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rounds = sorted({r["round"] for r in rows})
    # 1. goodput and failures
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(rounds))
    for k, rnd in enumerate(rounds):
        by = {r["arm"]: r for r in rows if r["round"] == rnd}
        xs = [i + k * width for i in range(len(arms))]
        ax1.bar(xs, [by[a_]["goodput"] if a_ in by else 0 for a_ in arms], width,
                color=[COLOURS.get(a_, "#333") for a_ in arms], alpha=1 - 0.25 * k, edgecolor="black", linewidth=0.4)
        bottom = [0.0] * len(arms)
        for what, colour in (("kv_oom", "#d62728"), ("gave_up", "#ff7f0e"), ("preempted", "#9467bd"),
                             ("other", "#7f7f7f")):
            vals = [by[a_][what] if a_ in by else 0 for a_ in arms]
            ax2.bar(xs, vals, width, bottom=bottom, color=colour, alpha=1 - 0.25 * k,
                    label=what.replace("_", " ") if k == 0 else None, edgecolor="black", linewidth=0.4)
            bottom = [b_ + v for b_, v in zip(bottom, vals)]
    centre = [i + width * (len(rounds) - 1) / 2 for i in range(len(arms))]
    for ax, title in ((ax1, "goodput, output tok/s (one bar per round)"),
                      (ax2, "failed requests by reason (one bar per round; 413s left out)")):
        ax.set_xticks(centre)
        ax.set_xticklabels(arms)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}-goodput.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    # 2. KV over time, round 0
    first = [r for r in rows if r["round"] == rounds[0]]
    fig, axes = plt.subplots(len(first), 1, figsize=(10, 1.7 * len(first) + 0.6), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], first):
        t = [p[0] for p in r["series"]]
        ax.fill_between(t, [p[1] * 100 for p in r["series"]], step="post", color=COLOURS.get(r["arm"], "#333"),
                        alpha=0.45, label="KV written (backend)")
        if any(p[2] is not None for p in r["series"]):
            ax.step(t, [(p[2] or 0) * 100 for p in r["series"]], where="post", color="black", linewidth=1,
                    label="reserved (ledger)")
            ax.step(t, [((p[2] or 0) + (p[3] or 0)) * 100 for p in r["series"]], where="post", color="black",
                    linewidth=0.8, linestyle=":", label="reserved + set aside for waiting requests")
        ax.set_ylim(0, 110)
        ax.set_ylabel(r["arm"], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0, 0].set_title("KV pool, % of capacity, over time (round 0): written by sequences vs reserved in the ledger", fontsize=10)
    axes[-1, 0].set_xlabel("seconds since the arm's first request")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}-kv.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    # 3. latency and TTFT CDFs
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm in arms:
        for ax, key in ((ax1, "latencies"), (ax2, "ttfts")):
            xs = sorted(v for r in rows if r["arm"] == arm for v in r[key])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        color=COLOURS.get(arm, "#333"), label=arm)
    for ax, title in ((ax1, "latency of completed requests, s (from the first try)"),
                      (ax2, "time to first token, s (from the first try)")):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("fraction of completed requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}-latency.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def machine():
    """This machine in words: its logical CPUs and their model (Linux /proc/cpuinfo)."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{len(names) or '?'} vCPU {names[0] if names else 'unknown CPU'}"


def git_hash():
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="40 jobs, 3 rounds, give up after 300 s")
    p.add_argument("--rounds", type=int)
    p.add_argument("--jobs", type=int)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64, help="KV pool in 16-token blocks (every arm)")
    p.add_argument("--step-delay-ms", type=int, default=10)
    p.add_argument("--max-tries", type=int)
    p.add_argument("--give-up-s", type=float)
    p.add_argument("--patience", choices=["first-token", "retries"], default="first-token",
                   help="first-token: a client gives up on a request with no first token --give-up-s after its "
                        "first try, wherever it waits (in every arm: a Retry-After, the gateway's queue, the "
                        "backend's queue); retries: only a Retry-After that would end past it (the rule before "
                        "2026-12-03, under which a request waiting in a queue waited as long as it took)")
    p.add_argument("--rate", type=float,
                   help="open loop: jobs arrive at this many per second (Poisson, seeded), however many are in "
                        "flight, instead of --clients closed-loop clients (sustained overload when above what "
                        "the backend serves)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--arms", default="none,prompt,cap,reserve,kvgate,elastic,queued,oracle,vllm")
    p.add_argument("--cap", type=int, help="the cap arm's --max-batch (default: sized from the mix)")
    p.add_argument("--elastic-prior", type=int, default=64,
                   help="output tokens an elastic class reserves until it has learned its outputs")
    p.add_argument("--elastic-quantile", type=float, default=0.9,
                   help="the elastic and queued arms: the quantile of learned outputs each class reserves")
    p.add_argument("--lean-quantile", type=float, default=0.5,
                   help="the queued-lean arm: the quantile of learned outputs each class reserves")
    p.add_argument("--lean-prior", type=int, default=16,
                   help="the queued-lean arm: output tokens reserved until a class has learned its outputs")
    p.add_argument("--queue-wait-ms", type=int,
                   help="the queued arms: how long a request may wait in the gateway's queue (default: twice "
                        "the clients' patience, at most the filter's 600 s, as docs/configuration.md advises; with 20 s "
                        "against 60 s of patience, requests sent back to retry gave up: docs/lab/2026-12-benchmarks-history.md, 2026-12-03)")
    p.add_argument("--max-line", type=float, default=0.0,
                   help="arms ending in +line: the filter's fair_retry_max_line (a fraction of the capacity)")
    p.add_argument("--gateway-workers", type=int, default=2,
                   help="the gateway arms: Envoy's --concurrency (each worker keeps its own queue)")
    p.add_argument("--safety-fraction", type=float,
                   help="the gateway arms: the filter's safety_fraction (default: the shipped config's)")
    p.add_argument("--dump", help="append every request's outcome (JSON lines) to this file")
    p.add_argument("--alt-wasm", type=Path,
                   help="a second build of the filter: an arm named ARM+alt runs ARM with it (an A/B)")
    p.add_argument("--alt-backend", type=Path,
                   help="a second build of kvgate-backend: an arm named ARM+altb runs ARM with it (an A/B)")
    p.add_argument("--trace", action="store_true",
                   help="with --dump: also the gateway's /kvgate/status and the backend's lease report, every 0.5 s")
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    p.add_argument("--plots", help="write the PNG plots to this folder (default, when writing BENCHMARKS.md: "
                                   "bench/results/)")
    a = p.parse_args()
    a.rounds = a.rounds or (3 if a.full else 1)
    a.jobs = a.jobs or (40 if a.full else 12)
    a.give_up_s = a.give_up_s or (300.0 if a.full else 60.0)
    a.queue_wait_ms = a.queue_wait_ms or min(600_000, int(a.give_up_s * 2000))
    workload = make_workload(a.seed, a.jobs, a.blocks * 16)
    a.cap = a.cap or concurrency_cap(workload, a.blocks * 16)
    n = sum(len(j) for j in workload)
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = git_hash()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        # Every arm runs the same binaries: copies taken now (others may rebuild target/ meanwhile).
        built = []
        for attr in ("BACKEND", "WASM"):
            src = getattr(harness, attr)
            built.append(f"{src.name} built {datetime.datetime.fromtimestamp(src.stat().st_mtime, datetime.timezone.utc):%H:%M} UTC")
            dst = Path(work) / src.name
            shutil.copy2(src, dst)
            setattr(harness, attr, dst)
        if a.alt_wasm:
            dst = Path(work) / f"alt-{a.alt_wasm.name}"
            built.append(f"--alt-wasm {a.alt_wasm} built {datetime.datetime.fromtimestamp(a.alt_wasm.stat().st_mtime, datetime.timezone.utc):%H:%M} UTC")
            shutil.copy2(a.alt_wasm, dst)
            a.alt_wasm = dst
        if a.alt_backend:
            dst = Path(work) / f"alt-{a.alt_backend.name}"
            built.append(f"--alt-backend {a.alt_backend} built {datetime.datetime.fromtimestamp(a.alt_backend.stat().st_mtime, datetime.timezone.utc):%H:%M} UTC")
            shutil.copy2(a.alt_backend, dst)
            a.alt_backend = dst
        help_text = subprocess.run([str(harness.BACKEND), "--help"], capture_output=True, text=True).stdout
        arms = [x for x in a.arms.split(",") if not x.startswith("vllm") or "--on-kv-exhaustion" in help_text]
        if "vllm" in a.arms and "vllm" not in arms:
            print("the backend has no --on-kv-exhaustion: the vllm arm is left out", flush=True)
        load = (f"open-loop arrivals at {a.rate:g} jobs/s" if a.rate else f"{a.clients} closed-loop clients")
        patience = ("without a first token" if a.patience == "first-token" else "of retries")
        print(f"{n} requests in {len(workload)} jobs (seed {a.seed}), {load}, give up after {a.give_up_s:.0f} s "
              f"{patience}, pool {a.blocks} blocks "
              f"({a.blocks * BLOCK_BYTES / 2**20:.1f} MiB, {a.blocks * 16} tokens), step delay {a.step_delay_ms} ms, "
              f"arms {arms} (cap: --max-batch {a.cap}), {a.rounds} round(s); git {commit}, {', '.join(built)}", flush=True)
        caps = learn_lengths(workload, a, work) if "oracle" in arms else {}
        for rnd in range(a.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]  # interleaved, alternating order
            for arm in order:
                rows.append(run_arm(arm, rnd, workload, a, work, caps))
    wall = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    cmd = "make bench-admission" + (" ARGS=--full" if a.full else "")
    argv = " ".join(["bench/admission_bench.py", *sys.argv[1:]])
    out = table(rows, arms) + "\n\nRounds pooled:\n\n" + pooled(rows, arms)
    print("\n" + out)
    print(f"\nwall {wall:.0f} s")
    stem = f"admission-{started:%Y%m%d-%H%M}"
    pngs = []
    if a.plots or not a.no_write:
        pngs = plots(rows, arms, Path(a.plots) if a.plots else ROOT / "bench" / "results", stem)
        print("plots: " + ", ".join(str(x) for x in pngs))
    if a.no_write:
        return
    text = (ROOT / "BENCHMARKS.md").read_text()
    if HEADING not in text:
        text = text.rstrip("\n") + f"\n\n{HEADING}\n"
    # The run goes at the end of its section, before the next "## " heading.
    nxt = text.find("\n## ", text.index(HEADING) + len(HEADING))
    head, tail = (text, "") if nxt < 0 else (text[:nxt + 1], text[nxt + 1:])
    text = head.rstrip("\n") + "\n"
    text += (f"\n### Run {started:%Y-%m-%d %H:%M} UTC, git {commit} ({', '.join(built)})\n\n"
             f"Command: `.venv/bin/python {argv}` (`{cmd}` runs it after its build steps); machine: {machine()}; {n} requests in {len(workload)} jobs, seed {a.seed}, {load}, "
             f"pool {a.blocks} blocks ({a.blocks * 16} tokens) in every arm, --step-delay-ms {a.step_delay_ms}, "
             f"give up after {f'{a.max_tries} tries or ' if a.max_tries else ''}{a.give_up_s:.0f} s {patience}; "
             f"the cap arm at --max-batch {a.cap}; the queued arms' queue wait {a.queue_wait_ms / 1000:.0f} s; "
             f"wall {wall:.0f} s.\n\n{out}\n"
             + "".join(f"\n![{x.stem}]({x.relative_to(ROOT)})\n" for x in pngs if x.is_relative_to(ROOT)))
    if tail:
        text += "\n" + tail
    (ROOT / "BENCHMARKS.md").write_text(text)


if __name__ == "__main__":
    main()
