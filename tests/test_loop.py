"""The closed loop: real Envoy + the kvgate filter + the real backend with the real model.

Every test ends with the ledger's committed bytes at exactly zero and the backend's pool empty.
"""

import json
import signal
import threading
import time

import requests

from harness import BLOCK_BYTES, unclaimed_bytes

MODEL = "smollm2-135m-instruct"
COUNTING = "1, 2, 3, 4,"  # greedy SmolLM2 keeps counting: a generation that runs to max_tokens


def drained(gw, b):
    gw.assert_drained()
    b.wait_pool_empty()


def sse(resp):
    return [json.loads(l[6:]) for l in resp.iter_lines() if l.startswith(b"data: {")]


def long_stream(gw, max_tokens, headers=None, result=None):
    """Start a streaming completion that runs to max_tokens; returns (thread, result).

    result["admitted_at"]: when its response headers came (it was admitted, or refused)."""
    result = {} if result is None else result

    def run():
        r = requests.post(gw.url + "/v1/completions", stream=True, timeout=180, headers=headers or {},
                          json={"model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True})
        result["admitted_at"] = time.time()
        result["status"] = r.status_code
        result["headers"] = dict(r.headers)
        try:
            result["events"] = sse(r) if r.status_code == 200 else r.json()
        except requests.RequestException as e:  # the stream was cut (a test kills the backend)
            result["cut"] = repr(e)
        result["done_at"] = time.time()
    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_chat_through_the_gateway_prices_exactly_and_frees_everything(stack):
    gw, b = stack(64)
    r = requests.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert r.headers["x-kvgate-max-tokens"] == "40"
    assert r.headers["x-kvgate-level"] == "green"
    # The filter counts with cl100k here, the backend with the model's own tokenizer: the ledger
    # entry was priced from the filter's count; both return to zero.
    drained(gw, b)
    # A cap larger than a 1,024-token budget can ever hold: an immediate 413 (not a 429 to retry),
    # and nothing reaches the backend.
    r = requests.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "kv_request_too_large"
    assert b.metrics()["kvgate_backend_requests_total"] == 1


def test_a_chat_without_a_cap_is_served_when_the_pool_holds_the_whole_context(stack):
    # The shipped inline configuration counts with cl100k and ChatML; SmolLM2's own template adds
    # a default system prompt, so the backend counts the chat higher. An unset cap written as the
    # gateway's context - prompt was over the backend's context: a 400 for a plain chat.
    gw, b = stack(580)  # 9,280 tokens of KV, 0.9 of them usable: the whole 8,192-token context fits
    r = requests.post(gw.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert int(r.headers["x-kvgate-max-tokens"]) > 8100, "priced at the rest of the context"
    drained(gw, b)


def test_status_tracks_the_backend_while_a_stream_runs(stack):
    gw, b = stack(64)
    t, res = long_stream(gw, 300)
    s = gw.wait_for(lambda s: s["leases"] == 1 and s.get("backend", {}).get("used_bytes", 0) > 0,
                    what="the backend's report of the live lease")
    assert s["backend"]["up"] is True
    # The ledger prices exact tokens plus one block of margin; the backend holds whole blocks.
    assert abs(s["backend"]["drift_bytes"]) <= BLOCK_BYTES
    (lease,) = b.leases()["leases"]
    deadline = time.time() + 10
    while "headers" not in res and time.time() < deadline:
        time.sleep(0.05)
    assert lease["id"] == res["headers"]["x-kvgate-lease"], "the backend tracks the filter's lease id"
    t.join()
    assert res["status"] == 200
    assert res["events"][-1]["choices"][0]["finish_reason"] == "length"
    drained(gw, b)
    st = gw.stats()
    assert st["kvgate.backend_up"] == 1
    assert st["kvgate.unseen_leases"] == 0 and st["kvgate.reaped"] == 0


def test_backend_down_turns_the_level_red_and_back(stack):
    gw, b = stack(64)
    gw.wait_for(lambda s: s.get("backend", {}).get("up") is True, what="first poll")
    b.stop()
    s = gw.wait_for(lambda s: s["backend"]["up"] is False, timeout=10, what="the backend to be reported down")
    assert s["level"] == "red"
    r = requests.get(gw.url + "/v1/models", timeout=10)
    assert r.headers["x-kvgate-level"] == "red"
    # Envoy's own reply for the unreachable backend is OpenAI-shaped too.
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    # A backend known to be down gets nothing new: a fast 503 with Retry-After, nothing reserved.
    t0 = time.time()
    r = requests.post(gw.url + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    assert "retry-after" in r.headers and time.time() - t0 < 2
    assert gw.status()["committed_bytes"] == 0
    assert gw.stats()["kvgate.backend_up"] == 0
    b.start()
    s = gw.wait_for(lambda s: s["backend"]["up"] is True, timeout=10, what="the backend to come back")
    assert s["level"] == "green"
    drained(gw, b)


def test_a_hung_backend_gets_no_new_requests_keeps_its_streams_leases_and_comes_back(stack):
    """The backend hangs (SIGSTOP): its lease polls time out (the callout is slow, then silent).
    The stream in flight stalls and keeps its reservation (its request has not ended); new
    requests get a fast 503 with Retry-After instead of hanging with it; the gateway's own status
    answers at once. Resumed (SIGCONT), the stream finishes and everything returns to zero."""
    gw, b = stack(64)
    gw.wait_for(lambda s: s.get("backend", {}).get("up") is True, what="first poll")
    t, res = long_stream(gw, 120)
    gw.wait_for(lambda s: s["leases"] == 1, what="the stream admitted")
    time.sleep(0.5)
    b.proc.send_signal(signal.SIGSTOP)
    try:
        s = gw.wait_for(lambda s: s["backend"]["up"] is False, timeout=15, what="the hung backend marked down")
        assert s["leases"] == 1 and s["committed_bytes"] > 0, "the stalled stream keeps its reservation"
        t0 = time.time()
        r = requests.post(gw.url + "/v1/completions", timeout=10,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
        assert "retry-after" in r.headers
        t0s = time.time()
        # The status answers at once; each worker marks the backend down on its own tick, so the
        # worker answering may be one tick behind the one that answered "down" (a CI run saw it).
        gw.status()
        assert time.time() - t0 < 2 and time.time() - t0s < 1, "answered at once, not with the hung backend"
        gw.wait_for(lambda s: s["level"] == "red", timeout=2, what="every worker's level red")
    finally:
        b.proc.send_signal(signal.SIGCONT)
    gw.wait_for(lambda s: s["backend"]["up"] is True, timeout=15, what="the backend to come back")
    t.join(timeout=120)
    assert res.get("status") == 200 and "cut" not in res, res
    finish = [e["choices"][0].get("finish_reason") for e in res["events"] if e.get("choices")]
    assert finish[-1] == "length", finish[-3:]
    drained(gw, b)


def test_full_budget_429_then_client_retry_succeeds(stack):
    # 32 blocks: 460 tokens usable. The stream holds about 327; the same request beside it does not fit.
    # A step delay keeps the stream going for 9 s at least: on an idle machine it could otherwise
    # end before the second request arrives, which would then be admitted.
    gw, b = stack(32, {"retry_after": {"min_ms": 500, "max_ms": 3000, "jitter": 0.1, "default_lease_ms": 2000}},
                  "--step-delay-ms", "30")
    t, res = long_stream(gw, 300)
    gw.wait_for(lambda s: s["leases"] == 1)
    req = {"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0}
    r = requests.post(gw.url + "/v1/completions", timeout=30, json=req)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "kv_capacity_exceeded"
    assert 500 <= int(r.headers["retry-after-ms"]) <= 3000, dict(r.headers)
    assert b.metrics()["kvgate_backend_requests_total"] == 1, "the rejected request never reached the backend"
    # The client honours Retry-After and tries again: admitted once the stream has ended. Bounded
    # by time, not tries: on a loaded machine the stream outlasts 60 of the shortest waits.
    deadline = time.time() + 240
    while time.time() < deadline:
        time.sleep(int(r.headers["retry-after-ms"]) / 1000)
        r = requests.post(gw.url + "/v1/completions", timeout=120, json=req)
        if r.status_code != 429:
            break
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 300
    t.join()
    assert res["status"] == 200 and res["events"][-1]["choices"][0]["finish_reason"] == "length"
    drained(gw, b)
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0


def streamed_text(events):
    return "".join(e["choices"][0].get("text", "") for e in events if e.get("choices"))


def test_a_cold_gateway_does_not_tell_a_refused_request_the_shortest_wait(stack):
    # A fresh backend and gateway: nothing has finished yet, so no output length is known. A
    # stream counting to its cap of 300 holds most of the 32 blocks; the same request beside it
    # is refused. Its Retry-After comes from the stream's progress, its cap and the measured
    # decode rate: a real fraction of the wait, not a short lease lifetime nobody measured
    # (`default_lease_ms`, quartered for a lease older than it: the shortest wait, 20x short).
    gw, b = stack(32, {"retry_after": {"min_ms": 500, "max_ms": 60000, "jitter": 0.0,
                                       "default_lease_ms": 1000}},
                  "--step-delay-ms", "30")
    t, res = long_stream(gw, 300)
    gw.wait_for(lambda s: s["leases"] == 1)
    # Two polls 200 ms apart that see it move give the decode rate.
    deadline = time.time() + 60
    while time.time() < deadline:
        e = b.leases()["leases"]
        if e and e[0]["used_tokens"] - e[0]["prompt_tokens"] >= 40:
            break
        time.sleep(0.1)
    time.sleep(0.6)
    req = {"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0}
    t0 = time.time()
    r = requests.post(gw.url + "/v1/completions", timeout=30, json=req)
    assert r.status_code == 429, r.text
    told = int(r.headers["retry-after-ms"]) / 1000
    need = r.json()["error"]["need_bytes"]
    gw.wait_for(lambda s: unclaimed_bytes(s) >= need, 120, "room for the refused request")
    real = time.time() - t0
    assert 0.3 * real <= told <= 2 * real, (told, real)
    t.join()
    assert res["status"] == 200
    drained(gw, b)


def test_preempt_demotes_the_youngest_lower_class_stream_which_is_only_delayed(stack):
    policy = {"default_class": "batch", "class_header": "x-tenant-class", "class_header_trusted": True, "classes": {
        "batch": {"action": "reject", "priority": 0},
        "vip": {"action": "reject", "priority": 5, "preempts": ["batch"]}}}
    # 32 blocks: 460 tokens usable. The batch stream holds about 327, the vip needs about 227.
    gw, b = stack(32, {"policy": policy})
    t, res = long_stream(gw, 300, headers={"x-tenant-class": "batch"})
    gw.wait_for(lambda s: s["classes"]["batch"]["leases"] == 1)
    r = requests.post(gw.url + "/v1/completions", timeout=180, headers={"x-tenant-class": "vip"},
                      json={"model": MODEL, "prompt": COUNTING, "max_tokens": 200, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200
    t.join()
    # The preempted stream was only delayed: it ran to its cap, and (greedy, the same prompt)
    # its text goes on from the vip's: nothing lost or repeated across its pause.
    assert res["status"] == 200
    assert not any("error" in e for e in res["events"]), res["events"][-3:]
    assert res["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert streamed_text(res["events"]).startswith(r.json()["choices"][0]["text"])
    drained(gw, b)
    assert gw.stats()["kvgate.preempted"] == 1
    m = b.metrics()
    assert m["kvgate_backend_demoted_total"] == 1 and m["kvgate_backend_preempted_total"] == 0
    assert m["kvgate_backend_kv_oom_total"] == 0


def test_queue_waits_for_budget_then_times_out(stack):
    policy = {"classes": {"default": {"action": "queue", "max_wait_ms": 30000, "max_depth": 4}}}
    gw, b = stack(32, {"policy": policy})
    # 460 tokens usable: 200 (+prompt, +1 block) now, 300 (+...) next does not fit beside it.
    t, res = long_stream(gw, 200)
    gw.wait_for(lambda s: s["leases"] == 1)
    t0 = time.time()
    r2 = {}
    # Not a timing test: it waits for the 200-token stream (about 10 s on this repository's
    # 2-core CPU) and then decodes 300 tokens of its own (about 17 s), unstreamed.
    t2 = threading.Thread(target=lambda: r2.update(r=requests.post(gw.url + "/v1/completions", timeout=180,
                          json={"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0})))
    t2.start()
    gw.wait_for(lambda s: s["queued"] == 1, what="the second request to queue")
    t.join()
    t2.join()
    assert r2["r"].status_code == 200, r2["r"].text
    assert time.time() - t0 > 1.0, "it waited for the first to finish"
    drained(gw, b)
    # A short max_wait answers 429 with the queue's reason when budget never frees.
    gw2, b2 = stack(32, {"policy": {"classes": {"default": {"action": "queue", "max_wait_ms": 300, "max_depth": 4}}}})
    t, res = long_stream(gw2, 200)
    gw2.wait_for(lambda s: s["leases"] == 1)
    r = requests.post(gw2.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "kv_queue_timeout"
    assert "retry-after" in r.headers
    # Told how long the 200-token stream ahead of it will likely take, not the shortest wait
    # (the shipped min_ms, 500), which would bring it straight back to the same queue.
    assert int(r.headers["retry-after-ms"]) > 500, r.headers
    t.join()
    drained(gw2, b2)


def shipped_classes():
    """The policy of the shipped gateway (envoy/kvgate-filter.yaml)."""
    import yaml
    from harness import ROOT
    doc = yaml.safe_load((ROOT / "envoy" / "kvgate-filter.yaml").read_text())
    value = doc["resources"][0]["typed_config"]["config"]["configuration"]["value"]
    return json.loads(value)["policy"]


def test_queue_then_preempt_with_the_shipped_classes(stack):
    policy = shipped_classes()
    assert policy["classes"]["vip"]["action"] == "queue" and "batch" in policy["classes"]["vip"]["preempts"]
    # The shipped classes as they are, but a wait long enough for this machine's speed.
    policy["classes"]["vip"]["max_wait_ms"] = 120_000
    gw, b = stack(64, {"policy": policy})
    cap_tokens = gw.status()["capacity_bytes"] // 46_080
    # The shipped gateway picks classes by API key (a client's own class header is ignored).
    vip, batch = {"authorization": "Bearer kvgate-demo-vip"}, {"authorization": "Bearer kvgate-demo-batch"}
    # A: a short vip stream; B: a long batch stream.
    ta, ra = long_stream(gw, 50, headers=vip)
    gw.wait_for(lambda s: s["classes"]["vip"]["leases"] == 1)
    tb, rb = long_stream(gw, 400, headers=batch)
    gw.wait_for(lambda s: s["classes"]["batch"]["leases"] == 1)
    # C: a vip request priced just under the whole budget. Evicting B alone is not enough while
    # A runs, so C queues; when A ends, evicting B makes room and C is admitted *from the queue*
    # by preemption (the demotion is sent from the tick, and its answer must resume C).
    rc = {}

    def send_c():
        rc["r"] = requests.post(gw.url + "/v1/chat/completions", timeout=180, headers=vip, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": cap_tokens - 80})
    tc = threading.Thread(target=send_c)
    tc.start()
    gw.wait_for(lambda s: s["queued"] == 1, what="C to queue")
    ta.join()
    assert ra["status"] == 200 and ra["events"][-1]["choices"][0]["finish_reason"] == "length"
    tc.join()
    assert rc["r"].status_code == 200, rc["r"].text
    assert "Paris" in rc["r"].json()["choices"][0]["message"]["content"]
    tb.join()
    # B was demoted, not stopped: it waited while C ran and then ran to its cap.
    assert rb["status"] == 200
    assert not any("error" in e for e in rb["events"]), rb["events"][-3:]
    assert rb["events"][-1]["choices"][0]["finish_reason"] == "length"
    drained(gw, b)
    st = gw.stats()
    assert st["kvgate.preempted"] == 1 and st["kvgate.queued"] == 0
    m = b.metrics()
    assert m["kvgate_backend_demoted_total"] == 1 and m["kvgate_backend_preempted_total"] == 0


def one_worker_that_queues(stack, blocks=64):
    """The shipped classes with 2 minutes of queueing for interactive and vip, one Envoy worker
    (one queue, one decode-rate estimate); (gateway, backend, interactive's and vip's headers)."""
    policy = shipped_classes()
    for c in ("interactive", "vip"):
        policy["classes"][c]["max_wait_ms"] = 120_000
    gw, b = stack(blocks, {"policy": policy}, concurrency=1)
    return gw, b, {"authorization": "Bearer kvgate-demo-interactive"}, {"authorization": "Bearer kvgate-demo-vip"}


def test_a_queued_request_pushed_back_by_a_higher_class_is_admitted_when_its_claim_is_full(stack):
    # One worker, one queue. R_low (interactive) waits at the front until its place in the
    # fair-retry line is served; then a vip request R_high, too big to fit before L2 ends, is
    # queued ahead of it. When L1 ends, its bytes go to R_low's claim (the older one), which
    # nobody else may take: R_low must be admitted then, not left waiting behind R_high until
    # L2 ends (the pool idle meanwhile).
    # 64 blocks: 921 tokens usable. L1 and L2 hold about 276 and 476; R_low needs about 276
    # (it waits), R_high about 426 (it does not fit beside R_low's claim until L2 ends).
    gw, b, inter, vip = one_worker_that_queues(stack)
    t1, r1 = long_stream(gw, 250, headers=inter)
    t2, r2 = long_stream(gw, 450, headers=inter)
    gw.wait_for(lambda s: s["leases"] == 2)
    tl, low = long_stream(gw, 250, headers=inter)
    gw.wait_for(lambda s: s["queued"] == 1, what="R_low to queue")
    # Refused again on a tick at the front: its place in line holds the free bytes.
    gw.wait_for(lambda s: s["claimed_bytes"] > 0, what="R_low's claim to be served")
    high = {}

    def send_high():
        high["r"] = requests.post(gw.url + "/v1/completions", timeout=180, headers=vip, json={
            "model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0})
    th = threading.Thread(target=send_high)
    th.start()
    gw.wait_for(lambda s: s["queued"] == 2, what="R_high to queue ahead of R_low")
    for t in (t1, t2, tl, th):
        t.join()
    assert (r1["status"], r2["status"], low["status"]) == (200, 200, 200), low
    assert high["r"].status_code == 200, high["r"].text
    # Admitted when L1's end filled its claim, or before: L1 and L2, decoding, never hold both
    # their caps at once (the time-aware worst case lends that to the line's front). Never left
    # behind R_high until L2 ended.
    assert low["admitted_at"] < r2["done_at"], (
        "R_low admitted before L2 ended", r1["done_at"], low["admitted_at"], r2["done_at"])
    drained(gw, b)
    assert gw.stats()["kvgate.queued"] == 0


def test_a_short_request_goes_ahead_of_a_queue_front_that_cannot_start_yet(stack):
    # A vip front that needs most of the pool waits for a long stream to end; a short request
    # that will be done well before then is admitted at once into the bytes the front holds (a
    # backfill), instead of waiting behind it. One worker: its polls measure the decode rate.
    # 32 blocks: 460 tokens usable. The stream holds about 327, the front needs about 177.
    gw, b, inter, vip = one_worker_that_queues(stack, 32)
    # Outputs for the polls to learn from, then a long stream whose progress gives the rate.
    for _ in range(5):
        r = requests.post(gw.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": COUNTING, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    t_long, r_long = long_stream(gw, 300, headers=inter)
    gw.wait_for(lambda s: s["leases"] == 1)
    time.sleep(1.5)  # several polls of it decoding
    t_front, front = long_stream(gw, 150, headers=vip)
    gw.wait_for(lambda s: s["queued"] == 1, what="the front to queue")
    time.sleep(0.6)  # refused again on ticks: its place in line is active and holds the free bytes
    assert gw.status()["claimed_bytes"] > 0
    short = requests.post(gw.url + "/v1/completions", timeout=60, headers=inter, json={
        "model": MODEL, "prompt": COUNTING, "max_tokens": 16, "temperature": 0})
    short_done = time.time()
    assert short.status_code == 200, short.text
    assert short.json()["usage"]["completion_tokens"] == 16
    assert "admitted_at" not in front or front["admitted_at"] > short_done
    assert gw.stats()["kvgate.backfilled"] >= 1
    t_long.join()
    t_front.join()
    assert r_long["status"] == 200 and front["status"] == 200, front
    assert front["admitted_at"] > short_done, "the short request was done before the front started"
    assert front["events"][-1]["choices"][0]["finish_reason"] == "length"
    drained(gw, b)
    assert gw.stats()["kvgate.queued"] == 0


def test_degrade_lowers_the_cap_and_says_so(stack):
    policy = {"classes": {"default": {"action": "degrade", "min_output_tokens": 50}}}
    # 32 blocks: 460 tokens usable. The stream holds about 327; the rest fits 50 or more.
    gw, b = stack(32, {"policy": policy})
    t, res = long_stream(gw, 300)
    gw.wait_for(lambda s: s["leases"] == 1)
    r = requests.post(gw.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0})
    assert r.status_code == 200, r.text
    asked, granted = r.headers["x-kvgate-degraded"].removeprefix("max_tokens=").split("->")
    assert asked == "300" and 50 <= int(granted) < 300
    assert r.json()["usage"]["completion_tokens"] == int(granted)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    t.join()
    drained(gw, b)
    assert gw.stats()["kvgate.degraded"] == 1


def test_live_policy_reload_changes_behaviour_and_keeps_leases(stack):
    gw, b = stack(64, None, ecds=True)
    t, res = long_stream(gw, 500)
    gw.wait_for(lambda s: s["leases"] == 1)
    big = {"model": MODEL, "prompt": COUNTING, "max_tokens": 600, "temperature": 0}
    assert requests.post(gw.url + "/v1/completions", json=big, timeout=30).status_code == 429
    # The operator edits the policy: the default class now degrades instead of rejecting.
    cfg = dict(gw.plugin_config)
    cfg["policy"] = {"classes": {"default": {"action": "degrade", "min_output_tokens": 20}}}
    gw.write_filter_config(cfg)
    deadline = time.time() + 20
    while True:
        r = requests.post(gw.url + "/v1/completions", json={**big, "stop": [" 9,"]}, timeout=60)
        if r.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-degraded"].startswith("max_tokens=600->")
    assert "0 ledger(s) created, 1 live leases kept" in gw.logs(), "the reload kept the ledger and its lease"
    t.join()
    assert res["events"][-1]["choices"][0]["finish_reason"] == "length", "the old stream was not disturbed"
    drained(gw, b)


def test_model_descriptor_from_the_backend_makes_counts_exact(stack):
    spec = {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4, "context_tokens": 8192}
    # 600 blocks = 9,600 tokens: room for a whole-context reservation. The backend allocates in
    # blocks of 32 tokens, and the gateway is configured with no margin: the descriptor's margin
    # (one such block) applies.
    gw, b = stack(600, {"model": "from_backend", "fallback_model": spec, "kv_budget_bytes": 10 * BLOCK_BYTES,
                        "fallback_token_multiplier": 1.5, "tokenizer": {"encoding": "cl100k_base"},
                        "scratch_margin_bytes": 0}, "--block-size", "32",
                  ecds=True)
    s = gw.wait_for(lambda s: s["model"]["tokenizer"] == "custom", timeout=30, what="the backend's descriptor")
    pool = int(600 * BLOCK_BYTES * 0.9)
    assert s["capacity_bytes"] == pool, "the budget came from the backend's pool"
    # Each worker configures on its own, some after another has read the pool: a configuration
    # (here a reload, with the backend frozen so that no poll reads the pool again) keeps the
    # capacity read from the pool, not the fallback's.
    b.proc.send_signal(signal.SIGSTOP)
    try:
        configured = gw.logs().count(" configured: capacity ")
        gw.write_filter_config({**gw.plugin_config, "fallback_token_multiplier": 1.4})
        deadline = time.time() + 20
        while gw.logs().count(" configured: capacity ") < 2 * configured and time.time() < deadline:
            time.sleep(0.2)
        assert gw.logs().count(" configured: capacity ") >= 2 * configured, "every worker reconfigured"
        assert gw.status()["capacity_bytes"] == pool, "a reload put the fallback's capacity back"
    finally:
        b.proc.send_signal(signal.SIGCONT)
    s = gw.wait_for(lambda s: s.get("backend", {}).get("up") is True and s["model"]["tokenizer"] == "custom",
                    timeout=30, what="the backend back, its descriptor read again")
    assert s["capacity_bytes"] == pool
    assert s["model"]["fingerprint"] == b.leases()["model"]["fingerprint"]
    assert b.leases()["model"]["scratch_margin_bytes"] == 2 * BLOCK_BYTES
    assert f"scratch margin {2 * BLOCK_BYTES} B per reservation" in gw.logs()
    # No cap: the filter grants context − prompt, counting with the model's own tokenizer, so the
    # grant plus the backend's prompt count is exactly the context.
    r = requests.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
        "temperature": 0, "stop": ["."]})
    assert r.status_code == 200, r.text
    assert int(r.headers["x-kvgate-max-tokens"]) + r.json()["usage"]["prompt_tokens"] == 8192
    drained(gw, b)


def test_bad_input_matrix_is_refused_at_the_gateway_and_reserves_nothing(stack):
    """Every request the backend would refuse is refused by the gateway first (the same validator,
    with what the backend serves from its descriptor): the documented status, an OpenAI-style
    error naming the field, nothing reserved, nothing sent to the backend."""
    spec = {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4, "context_tokens": 8192}
    gw, b = stack(600, {"model": "from_backend", "fallback_model": spec, "kv_budget_bytes": 10 * BLOCK_BYTES})
    gw.wait_for(lambda s: s["model"]["tokenizer"] == "custom", timeout=30, what="the backend's descriptor")
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (cmpl, b'{"prompt": "hi", "max_tokens": 5', 400, None),  # truncated JSON
        (cmpl, b'[1, 2]', 400, None),
        (cmpl, b'\xff\xfe{"prompt": 1}', 400, None),  # not UTF-8
        (cmpl, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        (cmpl, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (cmpl, {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
        (cmpl, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
        (cmpl, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
        (cmpl, {"prompt": "hi", "n": 10**6}, 400, "n"),
        (cmpl, {"prompt": "hi", "n": 2}, 400, "n"),
        (cmpl, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (cmpl, {"prompt": "hi", "top_p": 7}, 400, "top_p"),
        (cmpl, {"prompt": "hi", "stop": 5}, 400, "stop"),
        (cmpl, {"prompt": "hi", "seed": 1.5}, 400, "seed"),
        (cmpl, {"prompt": ""}, 400, "prompt"),
        (cmpl, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
        (cmpl, {"prompt": ["a", "b"]}, 400, "prompt"),
        (cmpl, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        (cmpl, {"prompt": "hi", "logprobs": "x"}, 400, "logprobs"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {}, 400, "messages"),
        (chat, {"messages": [{"role": "alien", "content": "x"}]}, 400, "messages[0].role"),
        (chat, {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (chat, {"messages": msgs, "tool_choice": "auto"}, 400, "tool_choice"),
        (chat, {"messages": msgs, "functions": [{"name": "f"}]}, 400, "functions"),
        (chat, {"messages": msgs, "response_format": 5}, 400, "response_format"),
    ]
    before = b.metrics()["kvgate_backend_requests_total"]
    for path, body, status, param in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(gw.url + path, data=data, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == ("invalid_request_error") and err["message"], (body, err)
        if param:
            assert err["param"] == param, (body, err)
        assert "x-kvgate-lease" not in r.headers
    s = gw.status()
    assert s["committed_bytes"] == 0 and s["counters"]["admitted"] == 0
    assert b.metrics()["kvgate_backend_requests_total"] == before, "nothing reached the backend"
    st = gw.stats()
    assert st["kvgate.rejected.model_not_found"] == 1
    rejected = {k: v for k, v in st.items() if k.startswith("kvgate.rejected.") and v}
    assert sum(rejected.values()) == len(cases), ("every refusal is counted under its code", rejected)
    # A chunked body and HTTP/2 are priced like any other (valid ones are admitted and freed).
    r = requests.post(gw.url + cmpl, data=iter([b'{"prompt": "Hello", ', b'"max_tokens": 3, "temperature": 0}']),
                      headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    drained(gw, b)


def test_backend_killed_mid_stream_frees_every_reservation_and_comes_back(stack):
    """The backend dies (SIGKILL) with streams and a non-streaming request in flight: every client
    gets an answer or a cut stream (never a hang), the ledger returns to exactly 0 as their
    streams end, new requests get a fast OpenAI-style 503, and after a restart it serves again."""
    gw, b = stack(64)
    gw.wait_for(lambda s: s.get("backend", {}).get("up") is True, what="first poll")
    t1, r1 = long_stream(gw, 300)
    t2, r2 = long_stream(gw, 200)
    r3 = {}

    def plain():
        try:
            r = requests.post(gw.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": COUNTING, "max_tokens": 150, "temperature": 0})
            r3["status"], r3["body"] = r.status_code, r.text
        except requests.RequestException as e:
            r3["error"] = repr(e)
    t3 = threading.Thread(target=plain)
    t3.start()
    gw.wait_for(lambda s: s["leases"] == 3, what="three requests in flight")
    time.sleep(1.0)
    b.proc.kill()
    b.proc.wait()
    for t in (t1, t2, t3):
        t.join(timeout=60)
        assert not t.is_alive(), "a client hung after the backend died"
    # Cut streams, or errors: never a success that did not happen.
    assert "cut" in r1 and "cut" in r2, (r1.get("events", [])[-2:], r2.get("events", [])[-2:])
    assert r3.get("status") != 200, r3
    if "status" in r3:
        assert r3["status"] >= 500 and json.loads(r3["body"])["error"]["code"].startswith("backend_"), r3
    gw.assert_drained(timeout=30)
    gw.wait_for(lambda s: s["backend"]["up"] is False, timeout=15, what="the backend to be reported down")
    r = requests.post(gw.url + "/v1/completions", timeout=10, json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    b.start()
    gw.wait_for(lambda s: s["backend"]["up"] is True, timeout=20, what="the backend to come back")
    # Each Envoy worker reads the backend's state on its own tick (100 ms): the worker that
    # answered the status may be a tick ahead of the one that takes the next request. Within a
    # few ticks every worker sends to it; until then a refusal is the documented 503.
    for attempt in range(5):
        r = requests.post(gw.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
        time.sleep(0.3)
    assert r.status_code == 200 and attempt <= 2, (attempt, r.text)
    drained(gw, b)
