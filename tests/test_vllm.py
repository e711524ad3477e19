"""The filter in a real Envoy in front of a real vLLM (`make test-vllm`; not part of `make test`:
the vLLM install is about 6 GB, `make vllm`).

The filter prices with the model's spec and exact tokenizer (`kvgate-backend --describe`), takes
the pool from vLLM's metrics (`backend.api: vllm`), and holds back what vLLM uses beyond the
ledger. Checked here: its prompt counts are vLLM's own, caps are clamped, a full pool answers
429 with Retry-After, traffic that bypasses the gateway is held back and its preemptions are an
alarm, and the ledger ends at exactly zero.
"""

import json
import threading
import time

import pytest
import requests

from conftest import drained, teardown
from harness import Envoy, Vllm, api_key_entry, vllm_plugin_config

CHAT = "/v1/chat/completions"
DEGRADE_KEY = "vllm-test-degrade"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    v = Vllm(tmp_path_factory.mktemp("vllm"), blocks=45).start()
    yield v
    v.stop()


@pytest.fixture
def gateway(request, tmp_path, wasm, vllm):
    cfg = vllm_plugin_config(vllm, policy={
        "api_keys": {api_key_entry(DEGRADE_KEY): "batch"},
        "classes": {"default": {"action": "reject", "priority": 1},
                    "batch": {"action": "degrade", "min_output_tokens": 16, "priority": 0}}})
    envoy = Envoy(tmp_path, vllm.port, cfg).start()
    yield envoy
    teardown(request, [envoy], settled=drained)
    assert vllm_idle(vllm), "vLLM still runs requests the gateway ended"


def vllm_idle(vllm, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = vllm.metrics()
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            return True
        time.sleep(0.5)
    return False


def chat(content, **kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": content}], **kw}


def error_code(r):
    return r.json()["error"]["code"]


PROMPTS = [
    chat("Hi"),
    chat("Write a haiku about KV caches, then explain it in one sentence."),
    {"model": "smollm2", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "And three more? Ünïcödé, emoji 🚀, tabs\tand\nnewlines."}]},
    {"model": "smollm2", "prompt": "The quick brown fox jumps over the lazy dog. " * 20},
    {"model": "smollm2", "prompt": "x"},
]


PER_TOKEN = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M, bf16 KV
MARGIN_TOKENS = 128  # one vLLM block a request


@pytest.mark.parametrize("body", PROMPTS, ids=["hi", "haiku", "multi-turn", "completion", "one-char"])
def test_the_gateways_count_is_vllms_own(gateway, vllm, body):
    """A cap the pool can never hold is refused with the bytes it needs: (prompt + cap + one
    block) x bytes per token, so the filter's count of the prompt is read off it and compared with
    vLLM's `usage.prompt_tokens` for the same request."""
    path = CHAT if "messages" in body else "/v1/completions"
    direct = requests.post(vllm.url + path, json={**body, "max_tokens": 1}, timeout=60)
    assert direct.status_code == 200, direct.text
    n = direct.json()["usage"]["prompt_tokens"]
    cap = vllm.context - n
    r = requests.post(gateway.url + path, json={**body, "max_tokens": cap}, timeout=60)
    assert r.status_code == 413 and error_code(r) == "kv_request_too_large", r.text
    need = r.json()["error"]["need_bytes"]
    assert need % PER_TOKEN == 0
    assert need // PER_TOKEN - cap - MARGIN_TOKENS == n, "the filter counted another prompt length"
    # Admitted with a small cap, vLLM counts the same prompt.
    ok = requests.post(gateway.url + path, json={**body, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == n


def test_the_pool_is_read_from_vllms_metrics(gateway, vllm):
    per_token = 2 * 30 * 3 * 64 * 2
    pool = vllm.blocks * 128 * per_token
    gateway.wait_for(lambda s: s["capacity_bytes"] == int(pool * 0.9),
                     what="capacity from vLLM's metrics")
    gateway.wait_for(lambda _: gateway.stats().get("kvgate.backend_up") == 1, what="vLLM up")
    # Its metrics are internal: never routed to a client.
    r = requests.get(gateway.url + "/metrics", timeout=5)
    assert r.status_code == 404


def test_caps_are_clamped_to_what_fits(gateway, vllm):
    """A degrade class asking for more than the pool holds gets the largest cap that fits (the
    usable 90 % of the pool less the prompt and a block), and vLLM runs to exactly that cap. A
    long prompt keeps that cap short."""
    body = chat("hello " * 4980, max_tokens=100_000, ignore_eos=True)
    n = requests.post(vllm.url + CHAT, json={**body, "max_tokens": 1}, timeout=120).json()["usage"]["prompt_tokens"]
    usable_tokens = int(vllm.blocks * 128 * 0.9)
    # What that direct request used is held back until a poll shows it gone.
    gateway.wait_for(lambda s: s["held_back_bytes"] == 0, what="the direct request's use let go")
    r = requests.post(gateway.url + CHAT, headers={"authorization": f"Bearer {DEGRADE_KEY}"},
                      json=body, timeout=300)
    assert r.status_code == 200, r.text
    cap = int(r.headers["x-kvgate-max-tokens"])
    assert cap == usable_tokens - MARGIN_TOKENS - n
    assert r.headers["x-kvgate-degraded"] == f"max_tokens={vllm.context - n}->{cap}", "clamped to the context, then to what fits"
    assert r.json()["usage"]["completion_tokens"] == cap, "vLLM ran to the cap it was sent"


def stream_in_background(url, body, started):
    """A streamed request held open until `stop` is set; returns (thread, stop, outcome)."""
    stop, outcome = threading.Event(), {}

    def run():
        with requests.post(url, json=body, stream=True, timeout=300) as r:
            outcome["status"] = r.status_code
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop, outcome


def test_a_full_pool_answers_429_with_retry_after_and_nothing_leaks(gateway, vllm):
    """Two long generations fill the pool (each priced at prompt + 2,000 + a block); a third is
    refused with 429 and a Retry-After; when the clients go away, the ledger and vLLM are
    empty."""
    preempted = vllm.metrics().get("vllm:num_preemptions_total", 0)
    long = chat("Tell a long story.", max_tokens=2000, ignore_eos=True, stream=True)
    running = []
    for _ in range(2):
        started = threading.Event()
        running.append(stream_in_background(gateway.url + CHAT, long, started))
        assert started.wait(60), "the stream did not start"
    r = requests.post(gateway.url + CHAT, json=chat("Hi", max_tokens=2000), timeout=30)
    assert r.status_code == 429, r.text
    assert error_code(r) == "kv_capacity_exceeded"
    assert 0 < int(r.headers["retry-after"]) <= 10
    assert gateway.status()["leases"] == 2
    for t, stop, outcome in running:
        stop.set()
        t.join(30)
        assert outcome["status"] == 200
    assert vllm.metrics().get("vllm:num_preemptions_total", 0) == preempted, "nothing preempted"


def test_what_bypasses_the_gateway_is_held_back_and_its_preemptions_are_an_alarm(gateway, vllm):
    """Requests sent to vLLM directly use KV the ledger does not count: the gateway holds it
    back from admission. Enough of them make vLLM preempt, and the gateway counts and logs it."""
    # Four prompts of about 1,050 tokens that share no block (vLLM caches shared prefixes), each
    # growing by 600: 6,600 tokens in a pool of 5,760.
    bodies = [chat(f"Request {i}. " + f"Item {i} grows one token per step. " * 130, max_tokens=600,
                   ignore_eos=True) for i in range(4)]
    threads = [threading.Thread(target=requests.post, args=(vllm.url + CHAT,),
                                kwargs={"json": b, "timeout": 600}, daemon=True) for b in bodies]
    preempted = vllm.metrics().get("vllm:num_preemptions_total", 0)
    for t in threads:
        t.start()
    gateway.wait_for(lambda s: s["held_back_bytes"] > 0, timeout=60,
                     what="vLLM's use beyond the ledger held back")
    gateway.wait_for(lambda _: gateway.stats().get("kvgate.backend_preemptions", 0) > preempted, timeout=240,
                     what="vLLM's preemptions counted")
    assert "preempted" in gateway.logs()
    for t in threads:
        t.join(600)
    gateway.wait_for(lambda s: s["held_back_bytes"] == 0, timeout=30,
                     what="nothing held back once vLLM is idle")


def test_vllm_errors_reach_the_client_and_release_the_lease(gateway, vllm):
    r = requests.post(gateway.url + CHAT, json={**chat("Hi", max_tokens=4), "model": "no-such-model"},
                      timeout=30)
    assert r.status_code == 404, r.text
    assert "error" in r.json()
    gateway.assert_drained()


def test_the_documented_lines_configure_the_filter(tmp_path, wasm):
    """The lines docs/vllm.md (and the README) tell a vLLM user to add configure the filter in a
    real Envoy."""
    from harness import ROOT, free_port
    text = (ROOT / "docs" / "vllm.md").read_text()
    cfg = json.loads(text.split("```json", 1)[1].split("```", 1)[0])
    assert cfg["backend"]["api"] == "vllm"
    cfg["backend"]["cluster"] = "kvgate_backend"
    envoy = Envoy(tmp_path, free_port(), {**cfg, "status_path": "/kvgate/status"}).start()
    try:
        assert envoy.status()["model"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    finally:
        envoy.stop()
