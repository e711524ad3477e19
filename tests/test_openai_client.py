"""The official `openai` Python client against the gateway (Envoy + filter + real backend)."""

import openai

from test_loop import COUNTING, MODEL, drained, long_stream


def client(gw, **kw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", **kw)


def test_chat_completions_and_streaming_with_the_official_client(stack):
    gw, b = stack(64)
    c = client(gw)
    chat = c.chat.completions.create(model=MODEL, max_tokens=30, temperature=0,
                                     messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 30
    comp = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length"
    assert "5" in comp.choices[0].text
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}]) if ch.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    drained(gw, b)


def test_the_clients_own_retry_honours_kvgate_429(stack):
    # 32 blocks = 512 tokens, 460 usable: an 80-token stream leaves too little for a 350 cap.
    gw, b = stack(32, {"retry_after": {"min_ms": 500, "max_ms": 2000, "jitter": 0.1, "default_lease_ms": 2000}})
    t, res = long_stream(gw, 80)
    gw.wait_for(lambda s: s["leases"] == 1)
    # Enough retries for a loaded machine (each waits the advertised Retry-After, at most 2 s).
    c = client(gw, max_retries=30)
    # Reserved at 350, stopped early by the stop string.
    comp = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=350, temperature=0, stop=[" 9,"])
    assert comp.choices[0].finish_reason == "stop"
    st = gw.stats()
    assert st["kvgate.rejected.kv_capacity_exceeded"] >= 1, "the first attempt was a 429"
    assert st["kvgate.admitted"] == 2
    t.join()
    assert res["status"] == 200
    drained(gw, b)


def test_the_default_client_completes_when_the_pool_is_busy(stack):
    # The shipped Retry-After settings and the client's defaults (2 retries, honouring
    # retry-after-ms): a request refused while a stream holds the pool comes back when told and
    # is admitted within its retries (its place is held for it meanwhile: fair retries).
    # 32 blocks = 512 tokens, 460 usable: an 80-token stream leaves too little for a 350 cap.
    gw, b = stack(32)
    t, res = long_stream(gw, 80)
    gw.wait_for(lambda s: s["leases"] == 1)
    c = client(gw)
    assert c.max_retries == 2, "the client's default"
    comp = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=350, temperature=0, stop=[" 9,"])
    assert comp.choices[0].finish_reason == "stop"
    st = gw.stats()
    assert st["kvgate.rejected.kv_capacity_exceeded"] >= 1, "the first attempt was a 429"
    t.join()
    assert res["status"] == 200
    drained(gw, b)
