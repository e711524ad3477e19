"""Sustained load through the real stack with a deliberately slow backend.

The backend runs the real model with `--admission none` (a sequence that finds no free KV block
fails mid-decode: a real OOM if the gateway over-admits) and a per-step delay, so prefills of long
prompts take seconds. The gateway's lost-grace period (400 ms) is far shorter than the requests:
any lease taken back while its request is alive would let the gateway admit more than the pool
holds. The gateway admits past its capacity by the slack of its decoding leases (the time-aware
worst case): priced wrongly, that too would run the backend out. Eight closed-loop clients that honour Retry-After send many more
requests than fit for SUSTAINED_SECONDS (default 60).
"""

import json
import os
import random
import threading
import time

import requests

from harness import BLOCK_BYTES

MODEL = "smollm2-135m-instruct"
SPEC = {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4, "context_tokens": 8192}
WORDS = ("the quick brown fox jumps over lazy dog river stone cloud paper light green house "
         "music table window garden winter summer yellow silver market bridge forest").split()


def request_for(rng):
    """One request of the mix: (path, body, stream, abort_after_events)."""
    kind = rng.random()
    if kind < 0.35:  # a long prompt with a small cap
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(250, 600)))
        return "/v1/completions", {"prompt": prompt, "max_tokens": rng.randint(4, 24)}, False, None
    if kind < 0.65:  # a short prompt with a big cap that runs to it
        return "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": rng.randint(60, 200),
                                   "stream": True}, True, None
    if kind < 0.85:  # a big cap that stops early
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                        "max_tokens": rng.randint(300, 700)}, False, None
    # a stream its client abandons
    return "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 300, "stream": True}, True, rng.randint(1, 8)


def request_with_runs(rng):
    """The mix, most of it prompts that cl100k_base counts far below SmolLM2: runs of newlines
    (SmolLM2 counts one token per 4, cl100k_base one per ~30), of digits (one per digit against
    one per 3) and of dots."""
    kind = rng.random()
    if kind < 0.4:
        prompt = "\n" * rng.randint(1000, 2900)
    elif kind < 0.55:
        prompt = "7" * rng.randint(400, 1200)
    elif kind < 0.65:
        prompt = "." * rng.randint(1000, 2900)
    else:
        return request_for(rng)
    return "/v1/completions", {"prompt": prompt, "max_tokens": rng.randint(4, 24)}, False, None


SYSTEMS = [f"You are agent team {t}. Tools:\n" + "\n".join(
    f"- tool_{t}_{i}(path: str) -> list: reads shelf {i} of archive {t} and returns its records."
    for i in range(14)) for t in range(3)]


def request_of_a_swarm(rng):
    """The mix, most of it agents of three swarms: one of three system prompts (~300 tokens each,
    which the gateway charges once per swarm while a lease pays it) and a short task of their own."""
    if rng.random() < 0.3:
        return request_for(rng)
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                {"role": "user", "content": f"Which tool reads shelf {rng.randint(0, 13)}? Then count to 50."}]
    return "/v1/chat/completions", {"messages": messages, "max_tokens": rng.randint(20, 160)}, False, None


def test_sustained_load_with_a_slow_backend_never_ooms_and_never_reclaims_a_live_lease(stack):
    gw, _, seen = sustained(stack, float(os.environ.get("SUSTAINED_SECONDS", "60")), {},
                            "--admission", "none")
    # The decoding leases' slack (the time-aware worst case) was admitted into, and nothing ran
    # out (asserted in `sustained`).
    assert seen["beyond"] > 0, "committed never passed the capacity"
    assert "kvgate.slack_bytes" in gw.stats()


def test_sustained_load_with_elastic_reservations_never_fails_a_request_mid_decode(stack):
    """The same mix with every request elastic (a 32-token prior, then the learned 0.9 quantile):
    the backend (`--admission reserve`, `--on-kv-exhaustion error`) lends past reservations and
    takes blocks back by recompute. Nothing may fail mid-decode or be reaped, and the gateway
    must really have admitted elastically."""
    policy = {"policy": {"default_class": "default", "classes": {"default": {
        "action": "reject", "reservation": "elastic", "elastic_min_samples": 5,
        "elastic_prior_tokens": 32}}}}
    gw, b, _ = sustained(stack, float(os.environ.get("ELASTIC_SUSTAINED_SECONDS", "40")), policy,
                         "--admission", "reserve", wait_elastic=True)
    assert gw.stats()["kvgate.elastic_admitted"] > 0


def test_sustained_load_through_aged_queues_starves_no_class(stack):
    """The same mix with every request waiting in the gateway's queue, half of the clients in a
    low class (batch, priority 0) and half in a high one (vip, 9), aged one level a second, and
    requests that time out of the queue retried: nothing fails mid-decode or is reaped, requests
    really wait in the queue, both classes are served, and everything is released at the end.
    (Which order aging gives is the glue tests' to show: at this load strict priority would
    serve both classes too.)"""
    queued = lambda p: {"action": "queue", "max_wait_ms": 3000, "max_depth": 64, "priority": p}
    policy = {"policy": {"default_class": "batch", "class_header": "x-class",
                         "class_header_trusted": True, "queue_aging_ms": 1000,
                         "classes": {"batch": queued(0), "vip": queued(9)}}}
    gw, b, seen = sustained(stack, float(os.environ.get("QUEUE_SUSTAINED_SECONDS", "40")), policy,
                            "--admission", "none",
                            headers=lambda seed: {"x-class": "vip" if seed % 2 else "batch"})
    assert seen["peak_queued"] > 0, "nothing waited in the queue"
    assert seen["served"].get("batch", 0) > 0 and seen["served"].get("vip", 0) > 0, seen


def test_sustained_load_of_runs_an_approximate_tokenizer_merges_never_ooms(stack):
    """The shipped inline configuration (cl100k_base for SmolLM2, its counts padded) under the
    mix with prompts made of runs, in front of a backend that admits everything (`--admission
    none`): priced below the model's count, such prompts would take more KV than reserved and
    run the backend out mid-decode. The pad for the runs keeps every reservation above it."""
    sustained(stack, float(os.environ.get("RUNS_SUSTAINED_SECONDS", "40")), {}, "--admission", "none",
              mix=request_with_runs, inline=True)


def test_sustained_swarms_sharing_prefixes_never_run_a_backend_that_admits_everything_out(stack):
    """Agents of three swarms, closed loop, into `--admission none`: the gateway charges each
    swarm's system prompt once (it must really be held once, or the backend runs out mid-decode),
    and the backend serves the cached prefix."""
    gw, b, seen = sustained(stack, float(os.environ.get("SWARM_SUSTAINED_SECONDS", "40")), {},
                            "--admission", "none", mix=request_of_a_swarm)
    assert seen["credit"] > 0, "no lease was admitted without its shared prefix"
    assert b.metrics()["kvgate_backend_prefix_cached_tokens_total"] > 0


def sustained(stack, seconds, overrides, *backend_flags, wait_elastic=False, headers=None,
              mix=request_for, inline=False):
    blocks = 160  # 2,560 tokens: a few long prompts at once
    # The model from the backend's descriptor (exact counts once it is in), or, inline, the
    # shipped configuration's: cl100k_base, padded, throughout.
    pricing = {} if inline else {
        "model": "from_backend", "fallback_model": SPEC, "fallback_token_multiplier": 1.5,
        "tokenizer": {"encoding": "cl100k_base"},  # the fallback's pad, not the shipped one's
    }
    gw, b = stack(blocks, {
        **pricing,
        "tick_ms": 100,
        "backend": {"poll_ms": 200, "timeout_ms": 1000, "lost_grace_ms": 400, "down_after_failures": 5},
        **overrides,
    }, *backend_flags, "--step-delay-ms", "150", concurrency=2)
    if not inline:
        gw.wait_for(lambda s: s["model"]["tokenizer"] == "custom", timeout=30, what="the backend's descriptor")
    if wait_elastic:
        gw.wait_for(lambda s: s["elastic"]["default"]["active"], 10, "the backend known to lend")
        time.sleep(1.0)  # every worker has polled
    capacity = gw.status()["capacity_bytes"]
    pool_capacity = b.leases()["pool"]["capacity_bytes"]
    counts = {}
    lock = threading.Lock()
    peak = {"committed": 0, "pool": 0, "over": 0, "beyond": 0, "queued": 0, "credit": 0}
    served = {}  # 200s per x-class header
    stop = threading.Event()
    deadline = time.time() + seconds

    def count(k):
        with lock:
            counts[k] = counts.get(k, 0) + 1

    def watch():
        while not stop.is_set():
            s, pool = gw.status(), b.leases()["pool"]
            peak["committed"] = max(peak["committed"], s["committed_bytes"])
            # Blocks taken: with lazy blocks (the backend's default) the report's used_bytes also
            # counts blocks promised and not taken yet, which borrowers may hold meanwhile.
            peak["pool"] = max(peak["pool"], pool["used_bytes"] - pool.get("promised_bytes", 0))
            # Committed may pass the capacity by the slack: what the decoding leases will never
            # all hold at once (the time-aware worst case); never further.
            peak["over"] += s["committed_bytes"] > capacity + s["slack_bytes"]
            peak["beyond"] += s["committed_bytes"] > capacity
            peak["queued"] = max(peak["queued"], s.get("queued", 0))
            peak["credit"] = max(peak["credit"], s.get("prefix_credit_bytes", 0))
            time.sleep(0.25)

    def client(seed):
        rng = random.Random(seed)
        h = headers(seed) if headers else {}
        while time.time() < deadline:
            path, body, stream, abort_after = mix(rng)
            body = {"model": MODEL, "temperature": 0, **body}
            r = requests.post(gw.url + path, json=body, stream=stream, timeout=300, headers=h)
            if r.status_code == 429:
                count("429")
                time.sleep(min(float(r.headers["retry-after-ms"]) / 1000, 5.0))
                continue
            if r.status_code != 200:
                count(f"{r.status_code} {r.text[:200]}")
                continue
            if abort_after is not None:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= abort_after:
                        break
                r.close()
                count("aborted")
                continue
            if stream:
                events = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith(b"data: {")]
                errors = [e for e in events if "error" in e]
                count("stream error" if errors else "200")
            else:
                r.json()
                count("200")
            if r.status_code == 200 and "x-class" in h:
                with lock:
                    served[h["x-class"]] = served.get(h["x-class"], 0) + 1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    stop.set()
    watcher.join()
    print(f"sustained: {counts}, peak committed {peak['committed']} of {capacity} B, "
          f"peak pool {peak['pool']} of {pool_capacity} B, peak queued {peak['queued']}, served {served}, "
          f"samples past the capacity {peak['beyond']}")
    gw.assert_drained(timeout=120)
    b.wait_pool_empty(timeout=60)
    m = b.metrics()
    assert m["kvgate_backend_kv_oom_total"] == 0, "an admitted request ran the backend out of KV"
    assert counts.get("200", 0) >= 8 and counts.get("429", 0) > 0, counts
    assert set(counts) <= {"200", "429", "aborted"}, counts
    st = gw.stats()
    assert st["kvgate.reaped"] == 0, "a lease was taken back while its request was alive"
    assert "reaped lease" not in gw.logs()
    assert peak["pool"] <= pool_capacity and peak["over"] == 0
    return gw, b, {"peak_queued": peak["queued"], "served": served, "beyond": peak["beyond"],
                   "credit": peak["credit"]}
