"""Agent swarms through the real stack: twelve agents send the same ~3,000-token system prompt
(60 tool descriptions) and differ only in their last message.

The backend caches the prompt's KV blocks (prefix caching, on by default) and holds the shared
ones once; the gateway charges the shared prefix once among the live leases that start with it.
On the shipped 256 MiB pool one agent priced whole takes most of what the gateway promises, so
without sharing they ran one at a time.
"""

import threading
import time

import requests

from harness import BLOCK_BYTES

MODEL = "smollm2-135m-instruct"
SPEC = {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4, "context_tokens": 8192}
POOL_BLOCKS = 268_435_456 // BLOCK_BYTES  # the shipped pool (tools/stack.py)
AGENTS = 12

TOOLS = "\n".join(
    f"- tool_{i}(path: str, limit: int) -> list: reads the records of shelf {i} in the archive "
    f"of district {i * 7 % 13}, sorted by date, and returns at most `limit` of them as JSON."
    for i in range(60))
SYSTEM = f"You are one agent of a team. Answer in one short sentence. Tools:\n{TOOLS}\n"


def agent_body(k):
    return {"model": MODEL, "temperature": 0, "max_tokens": 64, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Agent {k}: which tool reads shelf {k * 3}?"}]}


def chat_until_admitted(gw, body):
    """A chat completion, sent again after each 429's Retry-After: (status, JSON body)."""
    for _ in range(200):
        r = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 429:
            return r.status_code, r.json()
        time.sleep(float(r.headers["retry-after-ms"]) / 1000)
    return None


def swarm(gw, b):
    """All agents at once, each retrying on 429 after Retry-After; returns (results, peaks)."""
    results = [None] * AGENTS
    peak = {"running": 0, "over": 0}
    stop = threading.Event()
    capacity = gw.status()["capacity_bytes"]

    def watch():
        while not stop.is_set():
            running = sum(l["state"] == "running" for l in b.leases()["leases"])
            s = gw.status()
            peak["running"] = max(peak["running"], running)
            peak["over"] += s["committed_bytes"] > capacity + s["slack_bytes"]
            time.sleep(0.1)

    def agent(k):
        results[k] = chat_until_admitted(gw, agent_body(k))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=agent, args=(k,)) for k in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    return results, peak


def stack_for_swarm(stack, *backend_flags):
    gw, b = stack(POOL_BLOCKS, {"model": "from_backend", "fallback_model": SPEC,
                                "tokenizer": {"encoding": "cl100k_base"}}, *backend_flags)
    gw.wait_for(lambda s: s["model"]["tokenizer"] == "custom", timeout=30, what="the backend's descriptor")
    return gw, b


def test_a_swarm_sharing_a_long_prefix_runs_together_and_its_output_is_unchanged(stack):
    gw, b = stack_for_swarm(stack)
    # One agent alone first: it writes the prefix, and its greedy answer is the reference.
    r = requests.post(gw.url + "/v1/chat/completions", json=agent_body(0), timeout=300)
    assert r.status_code == 200, r.text
    alone = r.json()
    prompt_tokens = alone["usage"]["prompt_tokens"]
    assert 3000 < prompt_tokens < 3400, prompt_tokens
    # Cached blocks nobody holds are free room, not use.
    assert b.leases()["pool"]["used_bytes"] == 0
    before = b.metrics().get("kvgate_backend_prefix_cached_tokens_total", 0)
    results, peak = swarm(gw, b)
    assert all(r and r[0] == 200 for r in results), results
    assert results[0][1]["choices"][0]["message"] == alone["choices"][0]["message"], \
        "the same greedy answer with the prefix cached"
    assert peak["running"] >= 8, peak
    assert peak["over"] == 0, "committed never passed the capacity (and the decoding leases' slack)"
    m = b.metrics()
    skipped = m["kvgate_backend_prefix_cached_tokens_total"] - before
    assert skipped >= AGENTS * 2900, skipped
    assert m["kvgate_backend_kv_oom_total"] == 0
    gw.assert_drained()
    b.wait_pool_empty()
    # Cached blocks are free room: a prompt longer than the free list takes cached blocks, least
    # recently used first, and of a prefix its tail first (given back last to first), so the
    # agents' prompts still start with cached blocks.
    cached = lambda: b.metrics()["kvgate_backend_prefix_cached_tokens_total"]
    other = {"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Say yes. " + "archive shelf " * 1700}]}
    r = requests.post(gw.url + "/v1/chat/completions", json=other, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 3300
    hit = cached()
    r = requests.post(gw.url + "/v1/chat/completions", json=agent_body(0), timeout=300)
    assert r.json()["choices"][0]["message"] == alone["choices"][0]["message"]
    assert 0 < cached() - hit < prompt_tokens - 64, "the prefix's tail was taken, its head kept"
    gw.assert_drained()
    b.wait_pool_empty()

def test_a_swarm_into_a_backend_that_admits_everything_never_runs_it_out(stack):
    """The gateway is the only guard (`--admission none`): its shared-prefix charge must hold
    what the backend really holds, or sequences fail mid-decode."""
    gw, b = stack_for_swarm(stack, "--admission", "none")
    results, peak = swarm(gw, b)
    assert all(r and r[0] == 200 for r in results), results
    assert peak["over"] == 0
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0
    print(f"swarm into --admission none: peak running {peak['running']}")
    gw.assert_drained()
    b.wait_pool_empty()


def test_a_fleet_sends_an_agent_to_the_endpoint_that_holds_its_prefix(fleet):
    """Two backends; agent A runs on one of them. Agent B, with the same system prompt, goes to
    A's endpoint (its prefix is paid there, and cached), not to the emptier one."""
    (gw,), bs = fleet(2, 1, 160, None, "--step-delay-ms", "100")
    gw.wait_for(lambda s: all(e["up"] and e["polled"] for e in s["endpoints"])
                and s["model"]["tokenizer"] == "custom", 30, "both endpoints and the descriptor")
    system = "You are one agent of a team. Tools:\n" + "\n".join(TOOLS.splitlines()[:10])
    chat = lambda task, n: {"model": MODEL, "temperature": 0, "max_tokens": n, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": task}]}
    a = requests.post(gw.url + "/v1/chat/completions", stream=True, timeout=120,
                      json={**chat("Count from 1 to 100, one number a line.", 120), "stream": True})
    assert a.status_code == 200, a.text
    lines = a.iter_lines()
    next(l for l in lines if l.startswith(b"data: {"))  # A is decoding
    home = next(b for b in bs if b.leases()["leases"])
    other = next(b for b in bs if b is not home)
    cached = lambda b: b.metrics().get("kvgate_backend_prefix_cached_tokens_total", 0)
    before = (cached(home), cached(other))
    r = requests.post(gw.url + "/v1/chat/completions", json=chat("Which tool reads shelf 3?", 8), timeout=60)
    assert r.status_code == 200, r.text
    assert cached(home) - before[0] >= 256, "B ran where A's prefix is cached"
    assert cached(other) == before[1]
    for _ in lines:
        pass
    gw.assert_drained()


def test_agents_sharing_a_prefix_preempted_by_elastic_growth_all_complete_unchanged(stack):
    """Elastic agents (reservations of a few output tokens) sharing a ~500-token system prompt
    outgrow a small pool together: the backend takes borrowed blocks back by preempting the
    youngest, which keeps its reservation's blocks (the shared prefix among them) or gives its
    references back and adopts the cached prefix when it runs again. Every stream completes,
    none fails, and the youngest agent's greedy answer is the one it gives alone."""
    policy = {"policy": {"default_class": "default", "classes": {"default": {
        "action": "reject", "reservation": "elastic", "elastic_min_samples": 512,
        "elastic_prior_tokens": 8}}}}
    gw, b = stack(64, {"model": "from_backend", "fallback_model": SPEC,
                       "tokenizer": {"encoding": "cl100k_base"}, **policy})
    gw.wait_for(lambda s: s["model"]["tokenizer"] == "custom" and s["elastic"]["default"]["active"],
                timeout=30, what="the descriptor, and the backend known to lend")
    system = "You are one agent of a team. Tools:\n" + "\n".join(TOOLS.splitlines()[:10])
    body = lambda k: {"model": MODEL, "temperature": 0, "max_tokens": 100, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"List the numbers from {k} to {k + 60}, separated by commas."}]}
    agents = 6
    alone = requests.post(gw.url + "/v1/chat/completions", json=body(agents - 1), timeout=120).json()
    m0 = b.metrics()
    results = [None] * agents

    def agent(k):
        results[k] = chat_until_admitted(gw, body(k))

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(agents)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # arrival order: the last is the youngest
    for t in threads:
        t.join()
    assert all(r and r[0] == 200 for r in results), results
    m = b.metrics()
    delta = lambda name: m[name] - m0.get(name, 0)
    preempted = delta("kvgate_backend_recompute_preemptions_total")
    assert preempted > 0, "the agents outgrew the pool together"
    assert m["kvgate_backend_kv_oom_total"] == 0
    assert results[-1][1]["choices"][0]["message"] == alone["choices"][0]["message"]
    # Every agent adopted the prefix (at least 400 of its ~500 tokens) the lone run cached.
    assert delta("kvgate_backend_prefix_cached_tokens_total") >= agents * 400, \
        (delta("kvgate_backend_prefix_cached_tokens_total"), preempted)
    gw.assert_drained()
    b.wait_pool_empty()
