"""kvgate-backend as a running binary with the real model (SmolLM2-135M-Instruct on CPU)."""

import json
import os
import socket
import subprocess
import threading
import time

import requests

from harness import BACKEND, BLOCK_BYTES, free_port
from harness import MODEL as MODEL_FILE

MODEL = "smollm2-135m-instruct"


def chat(b, content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    return requests.post(b.url + "/v1/chat/completions", json=body, timeout=120)


def sse_events(resp):
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            yield line[6:].decode()


def decoding_stream(b, body, lease):
    """Stream `body` under gateway lease id `lease`; its SSE data lines, once it decodes."""
    r = requests.post(b.url + "/v1/completions", json=body, headers=b.gateway_headers(x_kvgate_lease=lease),
                      stream=True, timeout=120)
    assert r.status_code == 200
    events = sse_events(r)
    next(events)  # decoding
    return events


def test_chat_answers_correctly_and_reports_usage(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    r = chat(b, "What is the capital of France?", max_tokens=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    u = body["usage"]
    assert u["prompt_tokens"] > 10 and 0 < u["completion_tokens"] < 30
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    b.wait_pool_empty()


def test_streaming_completion_matches_non_streaming(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    whole = requests.post(b.url + "/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 20
    r = requests.post(b.url + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, stream=True, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 20
    # Chat streaming: the first delta carries the role.
    r = requests.post(b.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5,
        "temperature": 0, "stream": True}, stream=True, timeout=60)
    chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    b.wait_pool_empty()


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    body = {"model": MODEL, "prompt": "My favourite colours are", "max_tokens": 16, "temperature": 1.0,
            "top_p": 0.9, "seed": 1234}
    a = requests.post(b.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    c = requests.post(b.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert a == c
    greedy = requests.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3, 4,",
                           "max_tokens": 20, "temperature": 0}, timeout=60).json()["choices"][0]["text"]
    assert " 6" in greedy
    cut = requests.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3, 4,",
                        "max_tokens": 20, "temperature": 0, "stop": [" 6"]}, timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == greedy[:greedy.index(" 6")]


def test_reserve_answers_429_when_full_and_cancel_preempts(backend):
    # 64 blocks = 1,024 tokens.
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    # Greedy counting never stops by itself: the sequence runs until max_tokens or cancel.
    big = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 900, "temperature": 0, "stream": True}
    events = decoding_stream(b, big, "lease-a")
    # The report is published once per engine step, after the step's first tokens went out: a
    # client can hold its first token a moment before the report says `running`.
    deadline = time.time() + 5
    while True:
        state = b.leases()
        (lease,) = state["leases"]
        if lease["state"] == "running" or time.time() > deadline:
            break
        time.sleep(0.05)
    assert lease["id"] == "lease-a" and lease["state"] == "running"
    assert lease["reserved_tokens"] >= 900 + 5 and lease["reserved_tokens"] % 16 == 0
    assert lease["reserved_bytes"] == lease["reserved_tokens"] * 46_080
    assert 0 < lease["used_tokens"] < lease["reserved_tokens"]
    assert state["pool"]["used_bytes"] == lease["reserved_bytes"]

    full = requests.post(b.url + "/v1/completions", json={**big, "stream": False, "max_tokens": 300}, timeout=30)
    assert full.status_code == 429
    err = full.json()["error"]
    assert err["code"] == "kv_capacity_exceeded" and int(full.headers["retry-after"]) >= 1
    assert err["need_bytes"] > err["free_bytes"]

    c = requests.post(b.url + "/v1/admission/leases/lease-a/cancel", timeout=10, headers=b.gateway_headers())
    assert c.status_code == 200 and c.json()["cancelled"] is True
    tail = list(events)
    assert tail[-1] == "[DONE]" and "error" in json.loads(tail[-2]), tail[-3:]
    rest = [json.loads(e) for e in tail if e != "[DONE]"]
    # The error event ends the stream: no chunk carries a finish_reason OpenAI does not have.
    assert rest[-1]["error"]["code"] == "kv_preempted"
    assert all(c["choices"][0]["finish_reason"] is None for c in rest[:-1]), rest[-3:]
    after = b.wait_pool_empty()
    assert any(f["id"] == "lease-a" and f["reason"] == "preempted" for f in after["finished"])
    assert requests.post(b.url + "/v1/admission/leases/lease-a/cancel", timeout=10, headers=b.gateway_headers()).status_code == 404
    ok = requests.post(b.url + "/v1/completions", json={**big, "stream": False, "max_tokens": 5}, timeout=30)
    assert ok.status_code == 200
    m = b.metrics()
    assert m["kvgate_backend_rejected_kv_total"] == 1
    assert m["kvgate_backend_preempted_total"] == 1
    assert m["kvgate_backend_kv_oom_total"] == 0


def test_client_disconnect_frees_blocks_at_once(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    body = json.dumps({"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 800,
                       "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", b.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert b.leases()["pool"]["used_bytes"] > 0
    s.close()
    t0 = time.time()
    state = b.wait_pool_empty(timeout=5)
    assert time.time() - t0 < 2
    assert state["finished"][-1]["reason"] == "cancelled"
    assert b.metrics()["kvgate_backend_cancelled_total"] == 1


def test_admission_none_fails_mid_decode_when_kv_runs_out(backend):
    # 8 blocks = 128 tokens for two sequences that each want ~110.
    b = backend("--kv-cache-bytes", 8 * BLOCK_BYTES, "--admission", "none")
    results = []

    def one(i):
        r = requests.post(b.url + "/v1/completions", stream=True, timeout=120, json={
            "model": MODEL, "prompt": f"{i}, 1, 2, 3,", "max_tokens": 100, "temperature": 0,
            "stream": True})
        raw = list(sse_events(r))
        assert raw[-1] == "[DONE]", raw[-3:]
        results.append([json.loads(e) for e in raw[:-1]])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A stream cut short ends with its error event, and no chunk names a finish_reason that
    # OpenAI does not have.
    failed = [c for c in results if "error" in c[-1]]
    assert failed, [c[-1] for c in results]
    assert "ran out of KV cache mid-decode" in failed[0][-1]["error"]["message"]
    assert failed[0][-1]["error"]["code"] == "kv_cache_exhausted"
    assert failed[0][-1]["error"]["type"] == "server_error"
    reasons = [c["choices"][0]["finish_reason"] for chunks in results for c in chunks if "choices" in c]
    assert set(reasons) <= {None, "length"}, set(reasons)
    assert b.metrics()["kvgate_backend_kv_oom_total"] >= 1
    b.wait_pool_empty()


def test_recompute_preemption_finishes_both_with_the_output_each_has_alone(backend):
    # The same two sequences as above; with recompute, the younger is preempted and re-prefilled
    # instead of failing, and its stream goes on where it stopped.
    b = backend("--kv-cache-bytes", 8 * BLOCK_BYTES, "--admission", "none", "--on-kv-exhaustion", "recompute")

    def text(i, results):
        r = requests.post(b.url + "/v1/completions", stream=True, timeout=300, json={
            "model": MODEL, "prompt": f"{i}, 1, 2, 3,", "max_tokens": 100, "temperature": 0,
            "stream": True})
        chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
        results[i] = ("".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
                      chunks[-1]["choices"][0]["finish_reason"])
    alone = {}
    for i in range(2):
        text(i, alone)
    together = {}
    threads = [threading.Thread(target=text, args=(i, together)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone, "no token lost, repeated or changed"
    assert all(reason == "length" for _, reason in together.values())
    m = b.metrics()
    assert m["kvgate_backend_recompute_preemptions_total"] >= 1
    assert m["kvgate_backend_recomputed_tokens_total"] > 0
    assert m["kvgate_backend_kv_oom_total"] == 0
    b.wait_pool_empty()


def test_leases_report_finished_with_cursor(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    cursor = b.leases()["cursor"]
    for i in range(3):
        r = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease=f"L{i}"), timeout=60,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
    state = b.leases(since=cursor)
    assert [f["id"] for f in state["finished"]] == ["L0", "L1", "L2"]
    assert all(f["reason"] == "length" and f["completion_tokens"] == 3 for f in state["finished"])
    assert b.leases(since=state["cursor"])["finished"] == []
    model = state["model"]
    # The pool holds 64 blocks x 16 tokens: the backend serves (and advertises) that much context
    # rather than the model's 8,192, which no request could ever fill here.
    assert model["spec"] == {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4,
                             "context_tokens": 1024}
    assert requests.get(b.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 1024
    assert "serving a context of 1024 tokens" in b.logs()
    assert model["kv_bytes_per_token"] == 46_080 and len(model["fingerprint"]) == 16
    # The gateway adds one block to every reservation (whole blocks are allocated); a prefill
    # step's scratch is bounded and said.
    assert model["scratch_margin_bytes"] == BLOCK_BYTES
    assert 10 << 20 < model["prefill_scratch_bytes"] < 100 << 20
    # Prefix caching (the default) runs the paged arena: a decode step gathers the batch's
    # positions, more than a prefill chunk's tiles at this context.
    assert model["prefix_caching"] is True
    assert 0 < model["decode_scratch_bytes"]
    assert f"scratch at most {model['prefill_scratch_bytes']} bytes" in b.logs()
    assert model["tokenizer"]["special_tokens"]["<|im_end|>"] == 2
    full = requests.get(b.url + "/v1/admission/leases?include=tokenizer", timeout=10, headers=b.gateway_headers()).json()
    assert len(full["model"]["tokenizer"]["ranks"].splitlines()) > 49_000


def test_a_long_prompt_fed_in_chunks_answers_as_it_does_fed_whole(backend):
    text = ("The key-value cache of a transformer keeps the keys and values of every past token, "
            "so each new token reads them instead of recomputing them. ") * 12
    body = {"model": MODEL, "prompt": text + "In one sentence, the cache", "max_tokens": 24, "temperature": 0}
    answers = []
    for budget in ("16", "4096"):
        b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--prefill-token-budget", budget)
        assert f"prefill {budget} tokens a step" in b.logs()
        r = requests.post(b.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json())
        b.wait_pool_empty()
        b.stop()
    chunked, whole = answers
    assert chunked["usage"]["prompt_tokens"] > 300, "fed in 20+ chunks of 16"
    assert chunked["choices"][0]["text"] == whole["choices"][0]["text"]
    assert chunked["usage"] == whole["usage"]


def test_the_paged_kv_arena_answers_as_the_host_caches_do(backend):
    """`--kv-layout paged` (the CUDA default: one preallocated arena whose blocks are the pool's,
    attention over it on the device) against the host caches, on CPU: the same greedy text for
    requests decoded together in one batch, across block boundaries."""
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,",
               "Write a haiku about the sea. " * 6]
    answers = {}
    for layout in ("host", "paged"):
        b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--kv-layout", layout, "--prefill-token-budget", "32")
        assert f"{layout} KV" in b.logs()
        out = [None] * len(prompts)

        def run(i):
            out[i] = requests.post(b.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompts[i], "max_tokens": 40, "temperature": 0}).json()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        answers[layout] = [o["choices"][0]["text"] for o in out]
        assert all(o["usage"]["completion_tokens"] > 0 for o in out)
        b.wait_pool_empty()
        b.stop()
    assert answers["paged"] == answers["host"]


def test_bf16_weights_and_kv_answer_and_price_half_the_bytes(backend):
    """`--dtype bf16` (the CUDA default) on CPU: the arena holds bf16 KV, so the descriptor says
    2 bytes per element and the same budget holds twice the tokens; the answer is still right."""
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--dtype", "bf16", "--kv-layout", "paged")
    assert "paged KV in BF16, weights BF16" in b.logs()
    r = chat(b, "What is the capital of France?", max_tokens=30)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    state = b.leases()
    assert state["model"]["spec"]["kv_dtype_bytes"] == 2
    assert state["model"]["kv_bytes_per_token"] == 46_080 // 2
    assert state["pool"]["blocks_total"] == 128, "the same bytes, twice the blocks"
    b.wait_pool_empty()


def test_a_lease_the_engine_refuses_for_room_is_reported_refused_once(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--step-delay-ms", "50")
    r1 = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease="F1"), stream=True,
                       timeout=120, json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 900,
                                          "temperature": 0, "stream": True})
    assert r1.status_code == 200
    cursor = b.leases()["cursor"]
    r2 = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease="F2"), timeout=30,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 300})
    assert r2.status_code == 429 and r2.json()["error"]["code"] == "kv_capacity_exceeded", r2.text
    finished = b.leases(since=cursor)["finished"]
    assert [(f["id"], f["reason"]) for f in finished] == [("F2", "refused")]
    r1.close()
    state = b.wait_pool_empty()
    assert [f["reason"] for f in state["finished"] if f["id"] == "F2"] == ["refused"], "reported once"


def test_leases_are_acknowledged_at_arrival_single_use_and_refusals_are_reported(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--step-delay-ms", "100")
    cursor = b.leases()["cursor"]
    # A refused request (invalid body) is reported finished at once, so the filter can release.
    r = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease="R1"), timeout=30,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": -1})
    assert r.status_code == 400
    finished = b.leases(since=cursor)["finished"]
    assert [(f["id"], f["reason"]) for f in finished] == [("R1", "refused")]
    # A live lease id cannot be used twice.
    r1 = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease="D1"), stream=True, timeout=60,
                       json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 40, "temperature": 0,
                             "stream": True})
    assert r1.status_code == 200
    assert "D1" in [l["id"] for l in b.leases()["leases"]]
    r2 = requests.post(b.url + "/v1/completions", headers=b.gateway_headers(x_kvgate_lease="D1"), timeout=30,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r2.status_code == 409 and r2.json()["error"]["type"] == "invalid_request_error"
    r1.content
    # Its end is in the report by the time the client has its last byte.
    ids = [f["id"] for f in b.leases(since=cursor)["finished"]]
    assert ids[-1] == "D1"
    b.wait_pool_empty()


def test_the_gateways_body_note_sets_the_reservation_and_its_prompt_count_comes_back(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES, "--step-delay-ms", "50")
    cursor = b.leases()["cursor"]
    assert b.leases()["gateway_note"] is True, "the gateway prices elastically only when told so"
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 40, "temperature": 0, "stream": True,
            "kvgate": {"reserve_output": 6, "prompt_tokens": 77}}

    def live(lease_id, headers):
        r = requests.post(b.url + "/v1/completions", json=body, stream=True, timeout=60, headers=headers)
        assert r.status_code == 200, r.text
        (lease,) = [l for l in b.leases()["leases"] if l["id"] == lease_id]
        r.content
        (f,) = [f for f in b.leases(since=cursor)["finished"] if f["id"] == lease_id]
        return lease, f
    # Read only beside x-kvgate-note, which needs the gateway's secret as its other headers.
    for headers in [{"x-kvgate-note": "body"}, {"x-kvgate-note": "body", "x-kvgate-secret": b.secret + "x"}]:
        r = requests.post(b.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    for bad in [{"reserve_output": "6"}, 6, {"prompt_tokens": 1, "lease": "x"}]:
        r = requests.post(b.url + "/v1/completions", json={**body, "kvgate": bad}, timeout=30,
                          headers=b.gateway_headers(x_kvgate_lease="bad", x_kvgate_note="body"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "kvgate", r.text
    # The note wins over the header an older gateway sends (it decides after the body).
    lease, f = live("N1", b.gateway_headers(x_kvgate_lease="N1", x_kvgate_class="batch", x_kvgate_note="body",
                                            x_kvgate_reserve_output="30"))
    assert lease["elastic_output_tokens"] == 6, lease
    assert (f["class"], f["gateway_prompt_tokens"]) == ("batch", 77), f
    assert f["prompt_tokens"] != 77, "the backend's own count beside it"
    # Without x-kvgate-note the field is a client's (through an older gateway, or one in shadow
    # mode): dropped unread, however it looks; the header reserves.
    lease, f = live("N2", b.gateway_headers(x_kvgate_lease="N2", x_kvgate_reserve_output="9"))
    assert lease["elastic_output_tokens"] == 9, lease
    assert "gateway_prompt_tokens" not in f
    body["kvgate"] = "anything"
    lease, f = live("N3", b.gateway_headers(x_kvgate_lease="N3"))
    assert "elastic_output_tokens" not in lease, "the whole cap"
    b.wait_pool_empty()


def test_demote_gives_back_what_a_lease_reserved_and_has_not_written_and_it_goes_on(backend):
    # 64 blocks = 1,024 tokens. A (lease-a) reserves prompt + 900 tokens; B (300) does not fit.
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    big = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 900, "temperature": 0, "stream": True}
    events = decoding_stream(b, big, "lease-a")
    # Reserves prompt + 300 tokens; stops by itself after a few.
    small = {**big, "stream": False, "max_tokens": 300, "stop": [" 9"]}
    refused = requests.post(b.url + "/v1/completions", json=small, timeout=30,
                            headers=b.gateway_headers(x_kvgate_lease="lease-b"))
    assert refused.status_code == 429
    # The gateway preempts A for B: A reserves nothing now and goes on in what it has written.
    d = requests.post(b.url + "/v1/admission/leases/lease-a/demote", timeout=10, headers=b.gateway_headers())
    assert d.status_code == 200 and d.json() == {"id": "lease-a", "demoted": True}, d.text
    (lease,) = b.leases()["leases"]
    assert lease["elastic_output_tokens"] == 0, "all it holds is borrowed"
    assert lease["reserved_tokens"] < 900, lease
    # B is admitted into the blocks A gave back; A is still streaming, not stopped.
    ok = requests.post(b.url + "/v1/completions", json=small, timeout=60,
                       headers=b.gateway_headers(x_kvgate_lease="lease-b"))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] == "stop"
    assert json.loads(next(events))["choices"][0]["finish_reason"] is None
    # A lease on its way when demoted reserves nothing when it arrives.
    early = requests.post(b.url + "/v1/admission/leases/lease-c/demote", timeout=10, headers=b.gateway_headers())
    assert early.status_code == 200 and early.json()["on_arrival"] is True
    c = requests.post(b.url + "/v1/admission/leases/lease-a/cancel", timeout=10, headers=b.gateway_headers())
    assert c.status_code == 200
    b.wait_pool_empty()
    m = b.metrics()
    assert m["kvgate_backend_demoted_total"] == 1 and m["kvgate_backend_kv_oom_total"] == 0


def test_the_admission_api_and_lease_headers_need_the_gateways_secret(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    for method, path in [("GET", "/v1/admission/leases"), ("POST", "/v1/admission/leases/x/cancel"),
                         ("POST", "/v1/admission/leases/x/demote")]:
        for headers in [{}, {"x-kvgate-secret": "wrong"}, {"x-kvgate-secret": b.secret + "x"}]:
            r = requests.request(method, b.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "unauthorized"
    r = requests.post(b.url + "/v1/completions", headers={"x-kvgate-lease": "forged"}, timeout=30,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 401
    assert "forged" not in [l["id"] for l in b.leases()["leases"]]
    assert b.leases()["finished"] == [], "a refused forgery is not even acknowledged"
    assert requests.get(b.url + "/v1/admission/leases", headers=b.gateway_headers(), timeout=10).status_code == 200
    # Operators still read health and metrics on the backend's own port.
    assert requests.get(b.url + "/health", timeout=10).status_code == 200
    assert requests.get(b.url + "/metrics", timeout=10).status_code == 200


def test_a_rotation_accepts_the_current_and_the_next_secret(backend):
    b = backend("--kv-cache-bytes", 16 * BLOCK_BYTES, secret="current-secret,next-secret")
    for secret, status in [("current-secret", 200), ("next-secret", 200), ("current-secret,next-secret", 401),
                           ("old-secret", 401)]:
        r = requests.get(b.url + "/v1/admission/leases", headers={"x-kvgate-secret": secret}, timeout=10)
        assert r.status_code == status, secret
    b.secret = "next-secret"  # what the gateway sends after the rotation (and the teardown's checks)


def test_beyond_loopback_without_a_secret_it_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_ADMISSION_SECRET"}
    out = subprocess.run([str(BACKEND), "--model", str(MODEL_FILE), "--host", "0.0.0.0", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    assert "no admission secret is set" in out.stderr, out.stderr[-500:]


def test_bad_requests_get_openai_errors_and_allocate_nothing(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    url = b.url + "/v1/completions"
    cases = [
        (b"{oops", 400, None),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": [1] * 8192}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": [1] * 100, "max_tokens": 8100}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": [1] * 100, "max_tokens": 2**64 - 1}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": ["y" * 1025]}).encode(), 400, "stop"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "prompt": [99999999]}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "x", "temperature": 9}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    ]
    for body, status, param in cases:
        r = requests.post(url, data=body, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body[:60], err)
        assert err["type"] == "invalid_request_error"
    r = requests.post(url, data=json.dumps({"model": "gpt-9", "prompt": "x"}), timeout=10)
    assert r.json()["error"]["code"] == "model_not_found"
    r = requests.post(url, data=json.dumps({"model": MODEL, "prompt": [1] * 100, "max_tokens": 8100}), timeout=10)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert requests.get(b.url + "/nope", timeout=10).status_code == 404
    m = b.metrics()
    assert m["kvgate_backend_requests_total"] == 0
    assert b.leases()["pool"]["used_bytes"] == 0


def test_a_body_up_to_the_filters_default_limit_is_served_and_a_larger_one_refused_openai_style(backend):
    # The filter admits bodies up to its max_body_bytes (4 MiB by default) and adds its cap and
    # note: the backend must take that much (axum's own default is 2 MiB; the backend's is 4 MiB
    # + 64 KiB), and refuse more with the same JSON shape as the rest.
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    url = b.url + "/v1/completions"
    padded = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "user": "x" * 3_000_000}
    r = requests.post(url, data=json.dumps(padded), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:200]
    assert r.json()["usage"]["completion_tokens"] >= 1
    padded["user"] = "x" * (4 * 1024 * 1024 + 64 * 1024)
    r = requests.post(url, data=json.dumps(padded), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:200]
    err = r.json()["error"]
    assert err["code"] == "request_body_too_large" and err["type"] == "invalid_request_error", err
    assert "--max-body-bytes" in err["message"]
    b.wait_pool_empty()


def test_a_prompt_of_a_million_spaces_is_refused_and_the_backend_lives_on(backend):
    # The exact encoder (tiktoken-rs) panics on a whitespace run of about a million characters
    # (its regex gives up), which would end the process; the capped count comes first.
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    for body in [{"model": MODEL, "prompt": " " * 1_100_000 + "x", "max_tokens": 1},
                 {"model": MODEL, "messages": [{"role": "user", "content": " " * 1_100_000 + "x"}]}]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = requests.post(b.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text[:200]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert requests.get(b.url + "/health", timeout=5).text == "ok"
    r = requests.post(b.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    b.wait_pool_empty()


def test_models_health_metrics(backend):
    b = backend("--kv-cache-bytes", 64 * BLOCK_BYTES)
    assert requests.get(b.url + "/health", timeout=5).text == "ok"
    models = requests.get(b.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == MODEL
    chat(b, "Hi", max_tokens=4)
    m = b.metrics()
    assert m["kvgate_backend_requests_total"] == 1
    assert m["kvgate_backend_generated_tokens_total"] >= 1
    assert m["kvgate_backend_kv_capacity_bytes"] == 64 * BLOCK_BYTES
    assert m["kvgate_backend_prefill_seconds_total"] > 0
    # Latency histograms: one request, one first token, one queue wait; a gap between each pair
    # of its tokens.
    assert m["kvgate_backend_time_to_first_token_seconds_count"] == 1
    assert m["kvgate_backend_queue_wait_seconds_count"] == 1
    assert m['kvgate_backend_queue_wait_seconds_bucket{le="+Inf"}'] == 1
    assert m["kvgate_backend_inter_token_latency_seconds_count"] >= 1
    assert m["kvgate_backend_time_to_first_token_seconds_sum"] >= m["kvgate_backend_queue_wait_seconds_sum"]
