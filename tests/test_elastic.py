"""Elastic reservations through the real stack: Envoy with the filter in front of the real backend
(`--admission reserve`) decoding SmolLM2.

An elastic class reserves prompt + a learned quantile of its outputs (a prior until learned)
instead of prompt + cap; the backend lends free blocks to a sequence that outgrows that and takes
them back first (recompute) when a reservation needs them. The tests check what a user relies on:
more requests share the pool than worst-case pricing lets in, the class learns its outputs from
the backend's reports, a sequence that outgrows its reservation is delayed and never fails, a
request refused for what it borrowed is told when that frees, and everything returns to exactly
zero.
"""

import json
import math
import threading
import time

import requests

from harness import BLOCK_BYTES, api_key_entry, unclaimed_bytes

MODEL = "smollm2-135m-instruct"
COUNTING = "1, 2, 3, 4,"  # greedy SmolLM2 keeps counting: a generation that runs to max_tokens


def elastic_policy(prior=16, min_samples=3):
    return {"policy": {"default_class": "default", "classes": {"default": {
        "action": "reject", "reservation": "elastic", "elastic_quantile": 0.9,
        "elastic_min_samples": min_samples, "elastic_prior_tokens": prior}}}}


def active(gw):
    """Elastic pricing starts once the backend has reported `--admission reserve` to every worker
    (each polls for itself; a few polls of 200 ms)."""
    gw.wait_for(lambda s: s["elastic"]["default"]["active"], 10, "the backend known to lend")
    time.sleep(1.0)


def drained(gw, b):
    gw.assert_drained()
    b.wait_pool_empty()


def watch(gw, stop, peak):
    """The most leases the gateway held at once, sampled until `stop`."""
    while not stop.is_set():
        try:
            s = gw.status()
            peak["leases"] = max(peak.get("leases", 0), s["leases"])
            peak["committed"] = max(peak.get("committed", 0), s["committed_bytes"])
        except (requests.RequestException, KeyError, ValueError):
            pass
        time.sleep(0.05)


def test_elastic_requests_share_a_pool_worst_case_pricing_would_refuse_and_the_class_learns(stack):
    # 64 blocks = 1,024 tokens. Each question asks for 400 tokens and stops at its first full
    # stop: priced at its worst case (~430 tokens) two fit at once; elastic with a prior of 16
    # output tokens, all eight do.
    gw, b = stack(64, elastic_policy(), "--admission", "reserve", "--step-delay-ms", "40")
    active(gw)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 400, "stop": ["."],
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    out, stop, peak = [None] * 8, threading.Event(), {}
    watcher = threading.Thread(target=watch, args=(gw, stop, peak))
    watcher.start()

    def ask(i):
        out[i] = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=120)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    stop.set()
    watcher.join()
    assert [r.status_code for r in out] == [200] * 8, [r.text for r in out if r.status_code != 200]
    worst_case_fit = 1024 // (int(out[0].json()["usage"]["prompt_tokens"]) + 400)
    assert worst_case_fit == 2
    assert peak["leases"] > worst_case_fit, peak
    assert peak["committed"] <= gw.status()["capacity_bytes"]
    assert gw.stats()["kvgate.elastic_admitted"] == 8
    m = b.metrics()
    assert m["kvgate_backend_kv_oom_total"] == 0
    # The class learned the outputs from the backend's reports: the 0.9 quantile of what the
    # eight produced (each worker polls and learns for itself; the status comes from one).
    lengths = sorted(r.json()["usage"]["completion_tokens"] for r in out)
    q90 = lengths[math.ceil(0.9 * len(lengths)) - 1]
    s = gw.wait_for(lambda s: s["elastic"]["default"]["samples"] >= 8, 10, "eight outputs learned")
    e = s["elastic"]["default"]
    assert e["learned_tokens"] == q90, (e, lengths)
    assert e["reserved_output_tokens"] == q90
    drained(gw, b)


def stream(gw, max_tokens, result):
    r = requests.post(gw.url + "/v1/completions", stream=True, timeout=180, json={
        "model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    result["status"] = r.status_code
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    result["text"] = "".join(e["choices"][0].get("text", "") for e in events if e.get("choices"))
    result["finish"] = next((e["choices"][0]["finish_reason"] for e in reversed(events)
                             if e.get("choices") and e["choices"][0].get("finish_reason")), None)


def test_sequences_that_outgrow_their_reservations_are_delayed_and_never_fail(stack):
    # 32 blocks = 512 tokens. Two streams that count to 300 tokens each reserve ~20 tokens apiece
    # (the prior), so both are admitted; together they outgrow the pool. The backend takes the
    # borrowed blocks back from the younger and recomputes it: both end at their cap with exactly
    # the text each produces alone.
    gw, b = stack(32, elastic_policy(min_samples=512), "--admission", "reserve")
    active(gw)
    alone = {}
    stream(gw, 300, alone)
    assert alone["status"] == 200 and alone["finish"] == "length", alone
    drained(gw, b)
    results = [{}, {}]
    threads = [threading.Thread(target=stream, args=(gw, 300, r)) for r in results]
    for t in threads:
        t.start()
        time.sleep(0.2)
    s = gw.wait_for(lambda s: s["leases"] == 2, 20, "both admitted at once")
    assert s["committed_bytes"] < s["capacity_bytes"] // 4, s
    for t in threads:
        t.join(timeout=240)
    for r in results:
        assert r["status"] == 200 and r["finish"] == "length", r
        assert r["text"] == alone["text"], "recomputed without a token lost or repeated"
    m = b.metrics()
    assert m["kvgate_backend_recompute_preemptions_total"] >= 1
    assert m["kvgate_backend_kv_oom_total"] == 0
    assert gw.stats()["kvgate.rejected.kv_capacity_exceeded"] == 0
    drained(gw, b)


def test_a_refused_request_is_told_when_an_outgrown_sequence_frees_what_it_borrowed(stack):
    # 32 blocks = 512 tokens. An elastic stream counting to 250 reserves its prompt + 16 tokens
    # and borrows the rest as it grows: the gateway holds that back. A worst-case request (its own
    # class, by API key) that lacks more than the stream's reservation must wait for the borrowed
    # blocks too, which free when the stream ends. Its Retry-After says when: within 0.5-2x of
    # the real wait, not the longest wait (which it was told while only reservations counted).
    key = "kvgate-test-probe"
    policy = elastic_policy(min_samples=512)
    policy["policy"]["api_keys"] = {api_key_entry(key): "probe"}
    policy["policy"]["classes"]["probe"] = {"action": "reject"}
    policy["retry_after"] = {"min_ms": 500, "max_ms": 30000, "jitter": 0.0, "default_lease_ms": 3000}
    gw, b = stack(32, policy, "--admission", "reserve", "--step-delay-ms", "30")
    active(gw)
    # One output like it first: where a lease will end is estimated from outputs seen before.
    first = {}
    stream(gw, 250, first)
    assert first["status"] == 200 and first["finish"] == "length", first
    # What it borrowed is given back with its lease.
    gw.wait_for(lambda s: s["leases"] == 0 and s["held_back_bytes"] == 0, 10, "its growth released")
    filler = {}
    t = threading.Thread(target=stream, args=(gw, 250, filler))
    t.start()
    s = gw.wait_for(lambda s: s["leases"] == 1 and s["held_back_bytes"] >= 6 * BLOCK_BYTES, 60,
                    "the stream grown six blocks past its reservation")
    per_token = s["model"]["kv_bytes_per_token"]
    free = unclaimed_bytes(s)
    # Lacking the reservation and about half of what is borrowed (the chat template's ~40 prompt
    # tokens and the one-block margin priced in).
    lack = s["committed_bytes"] + s["held_back_bytes"] // 2
    max_tokens = (free + lack - BLOCK_BYTES) // per_token - 40
    t0 = time.monotonic()
    r = requests.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      timeout=30, json={"model": MODEL, "max_tokens": max_tokens, "messages": [
                          {"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    ra = int(r.headers["retry-after-ms"])
    reserved = gw.status()["committed_bytes"]
    assert err["need_bytes"] - err["free_bytes"] > reserved, (err, reserved, "lacks more than reserved")
    real = None
    while real is None and time.monotonic() - t0 < 60:
        if unclaimed_bytes(gw.status()) >= err["need_bytes"]:
            real = time.monotonic() - t0
        time.sleep(0.05)
    t.join(timeout=60)
    assert not t.is_alive(), "the stream ended"
    assert filler["status"] == 200 and filler["finish"] == "length", filler
    assert real is not None, "the stream's end freed what the request needed"
    assert 0.5 <= ra / max(real * 1000, 500) <= 2.0, (ra, real)
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0
    drained(gw, b)


def test_what_an_outgrown_sequence_borrowed_is_admitted_again_when_it_ends_not_at_the_next_poll(stack):
    # 32 blocks = 512 tokens, one worker polling every 4 s. An elastic stream counting to 300
    # reserves its prompt + 16 tokens and grows far past that: the polls hold its growth back.
    # When it ends, the backend has given all its blocks back with the stream, so the gateway
    # gives back the growth with the reservation, at once: a worst-case request that needs
    # most of the pool is admitted right after, where it was refused until the next poll.
    policy = elastic_policy(min_samples=512)
    policy["backend"] = {"poll_ms": 4000, "timeout_ms": 1000, "lost_grace_ms": 10000,
                         "down_after_failures": 2}
    key = "kvgate-test-worst-case"
    policy["policy"]["api_keys"] = {api_key_entry(key): "worst"}
    policy["policy"]["classes"]["worst"] = {"action": "reject"}
    gw, b = stack(32, policy, "--admission", "reserve", "--step-delay-ms", "30", concurrency=1)
    gw.wait_for(lambda s: s["elastic"]["default"]["active"], 15, "the backend known to lend")
    for _ in range(3):
        # A poll between the last look at the growth and the first look after the end would
        # clear it either way: such a try proves nothing and is run again.
        filler = {}
        t = threading.Thread(target=stream, args=(gw, 300, filler))
        t.start()
        grown = None
        while t.is_alive():
            s = gw.status()
            if s["leases"] == 1 and s["held_back_bytes"] >= 6 * BLOCK_BYTES:
                grown = s
            time.sleep(0.02)
        after = gw.wait_for(lambda s: s["leases"] == 0, 5, "the stream's lease released")
        assert filler["status"] == 200 and filler["finish"] == "length", filler
        assert grown is not None, "a poll saw the stream grown six blocks past its reservation"
        if after["backend"]["last_ok_ms"] == grown["backend"]["last_ok_ms"]:
            break
        gw.wait_for(lambda s: s["held_back_bytes"] == 0, 10, "the growth cleared")
    else:
        raise AssertionError("a poll fell between the stream's end and the look after it 3 times")
    assert after["held_back_bytes"] == 0, (grown, after)
    freed = grown["committed_bytes"] + grown["held_back_bytes"]
    assert after["free_bytes"] >= grown["free_bytes"] + freed, (grown, after)
    # Priced at all that is free now (the chat template's ~40 prompt tokens, padded by the
    # approximate tokenizer's multiplier, and the one-block margin priced in): more than the
    # stream's reservation alone gave back.
    per_token = after["model"]["kv_bytes_per_token"]
    prompt = math.ceil(40 * gw.plugin_config["tokenizer"].get("multiplier", 1.0))
    max_tokens = (after["free_bytes"] - BLOCK_BYTES) // per_token - prompt
    assert max_tokens * per_token > grown["free_bytes"] + grown["committed_bytes"], grown
    r = requests.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      timeout=120, json={"model": MODEL, "max_tokens": max_tokens, "messages": [
                          {"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0
    drained(gw, b)


def test_a_request_reserves_what_answers_to_prompts_of_its_length_were_not_its_classs_long_mode(stack):
    # One elastic class, two tasks: a counting prompt that runs to its cap of 100, and a
    # question (its chat template makes it several times as long, as the gateway counts) that
    # stops at its first full stop. Three of each make the class's 0.9 quantile the long mode;
    # the next question reserves what the questions answered in, and the counting prompt what
    # it ran to.
    policy = elastic_policy(prior=16, min_samples=3)
    policy["policy"]["classes"]["default"]["elastic_by_prompt"] = True
    gw, b = stack(64, policy, "--admission", "reserve", "--step-delay-ms", "20", concurrency=1)
    active(gw)
    question = {"model": MODEL, "temperature": 0, "max_tokens": 400, "stop": ["."],
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    for _ in range(3):
        long = {}
        stream(gw, 100, long)
        assert long["status"] == 200 and long["finish"] == "length", long
        r = requests.post(gw.url + "/v1/chat/completions", json=question, timeout=60)
        assert r.status_code == 200, r.text
        short = r.json()["usage"]["completion_tokens"]
        assert short < 50, r.json()
    s = gw.wait_for(lambda s: s["elastic"]["default"]["samples"] >= 6, 10, "six outputs learned")
    assert s["elastic"]["default"]["by_prompt"] is True
    assert s["elastic"]["default"]["reserved_output_tokens"] == 100, "the class's long mode"

    def reserved(body, path):
        r = requests.post(gw.url + path, json={**body, "stream": True}, stream=True, timeout=60)
        assert r.status_code == 200, r.text
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: {"))
        (lease,) = b.leases()["leases"]
        for _ in lines:
            pass
        return lease.get("elastic_output_tokens")
    assert reserved(question, "/v1/chat/completions") == short
    assert reserved({"model": MODEL, "prompt": COUNTING, "max_tokens": 100, "temperature": 0},
                    "/v1/completions") is None, "its own long mode is its cap: the worst case"
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0
    drained(gw, b)


def test_elastic_classes_stay_at_the_worst_case_in_front_of_a_backend_that_does_not_reserve(stack):
    # A backend that does not reserve (--admission none) cannot lend and reclaim: an elastic
    # class there would let it run out of KV mid-decode, so the filter prices the worst case.
    gw, b = stack(64, elastic_policy(), "--admission", "none")
    gw.wait_for(lambda s: s.get("backend", {}).get("polled"), 10, "the backend polled")
    time.sleep(1.0)
    e = gw.status()["elastic"]["default"]
    assert e["active"] is False and e["reserved_output_tokens"] is None, e
    r = requests.post(gw.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 400, "temperature": 0})
    assert r.status_code == 200, r.text
    assert gw.stats()["kvgate.elastic_admitted"] == 0
    drained(gw, b)


def test_a_request_in_line_waits_for_a_borrower_and_a_class_that_preempts_takes_its_blocks_back(stack):
    # 16 blocks = 256 tokens. A counting stream reserves its prompt + 16 output tokens (the
    # prior) and grows far past that on borrowed blocks. A request too big for what is free
    # beside that growth waits in the gateway's queue until the long one ends: what a borrower
    # holds is not lent to the line (taking it back preempts the borrower, and under load the
    # line kept borrowers recomputing). The same request from a class with `preempts` is
    # admitted into the borrowed blocks (the backend takes them back) while the long one is
    # still running. The long one pauses and still ends at its cap with exactly the text it
    # produces alone.
    vip = "kvgate-test-vip"
    policy = elastic_policy(min_samples=512)
    policy["policy"]["classes"]["default"].update(
        {"action": "queue", "max_wait_ms": 60_000, "max_depth": 8})
    policy["policy"]["api_keys"] = {api_key_entry(vip): "vip"}
    policy["policy"]["classes"]["vip"] = {"action": "queue", "max_wait_ms": 60_000,
                                          "max_depth": 8, "priority": 9, "preempts": ["default"]}
    gw, b = stack(16, policy, "--admission", "reserve")
    active(gw)
    alone = {}
    stream(gw, 200, alone)
    assert alone["status"] == 200 and alone["finish"] == "length", alone
    drained(gw, b)

    def run_long(long, ended):
        r = requests.post(gw.url + "/v1/completions", stream=True, timeout=180, json={
            "model": MODEL, "prompt": COUNTING, "max_tokens": 200, "temperature": 0,
            "stream": True})
        long["status"], text = r.status_code, []
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                c = json.loads(line[6:]).get("choices") or [{}]
                text.append(c[0].get("text", ""))
                long["finish"] = c[0].get("finish_reason") or long.get("finish")
                long["chunks"] += 1
        long["text"] = "".join(text)
        ended["long"] = time.monotonic()

    for headers in [{}, {"authorization": f"Bearer {vip}"}]:
        # What the last run held back is given back with its lease (rounding at the next poll).
        gw.wait_for(lambda s: s["held_back_bytes"] == 0, 10, "the growth cleared")
        preempted = b.metrics()["kvgate_backend_recompute_preemptions_total"]
        long, ended = {"chunks": 0}, {}
        t = threading.Thread(target=run_long, args=(long, ended))
        t.start()
        s = gw.wait_for(lambda s: s["leases"] == 1 and s["lendable_bytes"] >= 8 * BLOCK_BYTES,
                        60, "the long one borrowing")
        # Priced (prompt + 4 output tokens + one block of margin) at what is free beside the
        # growth plus all but one block of what the long one borrowed: it fits neither the
        # gateway's free bytes nor the backend's free blocks (the gateway keeps 10 % and a block
        # per request aside) without taking borrowed ones back.
        bpt = s["model"]["kv_bytes_per_token"]
        n = (s["free_bytes"] + s["lendable_bytes"] - 2 * BLOCK_BYTES) // bpt - 4
        assert n > 0, s
        refused = s["counters"]["rejected"]
        r = requests.post(gw.url + "/v1/completions", headers=headers, timeout=120, json={
            "model": MODEL, "prompt": [1] * n, "max_tokens": 4, "temperature": 0})
        streamed, done = long["chunks"], time.monotonic()
        assert r.status_code == 200, r.text
        t.join(timeout=180)
        assert long["status"] == 200 and long["finish"] == "length", long
        assert long["text"] == alone["text"], "paused without a token lost or repeated"
        took_back = b.metrics()["kvgate_backend_recompute_preemptions_total"] - preempted
        if headers:
            # Admitted into the borrowed blocks at once, and done while the long one had tens
            # of tokens to go (it paused for it).
            assert streamed <= 180, streamed
            assert took_back >= 1
        else:
            # It waited in line, and was done only once the long one had ended (its client
            # reads the last chunks a moment later), which nobody preempted.
            assert gw.status()["counters"]["rejected"] > refused, "it waited in line first"
            assert ended["long"] <= done + 0.5, (ended["long"] - done, streamed)
            assert took_back == 0
    assert b.metrics()["kvgate_backend_kv_oom_total"] == 0
    drained(gw, b)
