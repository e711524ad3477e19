"""The kvgate filter inside a real Envoy 1.40, in front of a slow streaming upstream."""

import json
import math
import socket
import threading
import time

import pytest
import requests

from harness import http_connection_manager, shipped_bootstrap, shipped_plugin_config

PER_TOKEN = 46_080  # SmolLM2-135M, f32 KV: 2 x 30 x 3 x 64 x 4


def budget(tokens, **extra):
    """Plugin overrides: a KV budget of exactly `tokens` tokens (safety fraction 1.0, no scratch
    margin: a reservation is its tokens' bytes exactly)."""
    cfg = {"kv_budget_bytes": tokens * PER_TOKEN, "safety_fraction": 1.0, "scratch_margin_bytes": 0}
    cfg.update(extra)
    return cfg


def tokens(n):
    return [1] * n  # a pre-tokenized prompt of n tokens: counted exactly


def stream_in_background(gw, body, chunks=20, delay_ms=100, path="/v1/completions"):
    """Start a slow streaming request; returns (thread, result dict)."""
    result = {}

    def run():
        r = requests.post(gw.url + path, json=body, stream=True, timeout=60,
                          headers={"x-mock-mode": "stream", "x-mock-chunks": str(chunks),
                                   "x-mock-delay-ms": str(delay_ms)})
        result["status"] = r.status_code
        result["headers"] = dict(r.headers)
        result["body"] = r.content
    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_seed_numbers_are_what_the_ledger_reserves(gateway, upstream):
    gw = gateway(budget(20_000))
    cases = [
        ({"prompt": tokens(200), "max_tokens": 4000}, 4200, 4000),
        ({"prompt": tokens(3000), "max_tokens": 200}, 3200, 200),
        ({"prompt": tokens(200)}, 8192, 7992),  # unset cap: the rest of the context
        ({"prompt": tokens(200), "max_tokens": 100_000}, 8192, 7992),  # clamped
    ]
    for body, reserved_tokens, cap in cases:
        upstream.clear()
        t, res = stream_in_background(gw, body)
        s = gw.wait_for(lambda s: s["leases"] == 1, what="the lease to appear")
        assert s["committed_bytes"] == reserved_tokens * PER_TOKEN
        assert s["classes"]["default"] == {"leases": 1, "bytes": reserved_tokens * PER_TOKEN}
        t.join()
        assert res["status"] == 200
        assert res["body"].endswith(b"data: [DONE]\n\n")
        (seen,) = upstream.requests()
        if "max_tokens" in body:
            assert seen["body"]["max_tokens"] == cap, "the effective cap is written into the body"
        else:
            # Reserved the whole context, which bounds the server too: left to the server (the
            # gateway's context - prompt would be over the context for a server counting more).
            assert "max_tokens" not in seen["body"]
        assert int(seen["headers"]["content-length"]) == len(json.dumps(seen["body"], separators=(",", ":")))
        assert res["headers"]["x-kvgate-lease"] == seen["headers"]["x-kvgate-lease"]
        assert res["headers"]["x-kvgate-max-tokens"] == str(cap)
        gw.assert_drained()
    st = gw.stats()
    assert st["kvgate.admitted"] == 4
    assert st["kvgate.released"] == 4


def test_an_approximate_tokenizer_pads_text_prompts_by_its_multiplier(gateway, upstream):
    # The shipped inline configuration counts with cl100k_base, which only approximates
    # SmolLM2's tokenizer: text counts are multiplied (token arrays are the model's own ids).
    mult = shipped_plugin_config()["tokenizer"]["multiplier"]
    assert mult > 1
    gw = gateway(budget(20_000))
    text = " ".join(["hello"] * 100)  # 100 cl100k tokens: "hello", then " hello" 99 times
    # Runs the approximation merges and SmolLM2 does not are padded apart: 300 digits are 100
    # cl100k tokens ("777" is one), padded by 300 - 100; 2,900 newlines are 96 (SmolLM2: 725),
    # padded by what they cost at 4 a token less the one counted. A path "a/b/c/d/" is a token
    # a character to SmolLM2 and 401 cl100k tokens for 800 characters: priced at least at the
    # 800 pieces SmolLM2's pre-tokenizer cuts it into. "\n\t" repeated 500 times is 127: padded
    # by half a token for each change of character past the third.
    for body, prompt in [({"prompt": text, "max_tokens": 10}, math.ceil(100 * mult)),
                         ({"prompt": "7" * 300, "max_tokens": 10}, math.ceil(100 * mult) + 300 - 100),
                         ({"prompt": "\n" * 2900, "max_tokens": 10}, math.ceil(96 * mult) + math.ceil(2900 / 4) - 1),
                         ({"prompt": "a/b/c/d/" * 100, "max_tokens": 10}, 800),
                         ({"prompt": "\n\t" * 500, "max_tokens": 10}, math.ceil(127 * mult) + (999 - 3) // 2),
                         ({"prompt": tokens(100), "max_tokens": 10}, 100)]:
        t, res = stream_in_background(gw, body)
        s = gw.wait_for(lambda s: s["leases"] == 1, what="the lease to appear")
        assert s["committed_bytes"] == (prompt + 10) * PER_TOKEN, (body["prompt"][:20], prompt)
        t.join()
        assert res["status"] == 200
        gw.assert_drained()
    # 9,000 digits: 3,000 cl100k tokens, padded past the 8,192-token context SmolLM2 would fill
    # with them. Refused, not forwarded.
    r = requests.post(gw.url + "/v1/completions", json={"prompt": "7" * 9000, "max_tokens": 10}, timeout=10)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "approximation of the model's tokenizer" in err["message"], err  # and says why
    assert len(upstream.requests()) == 6
    gw.assert_drained()


def test_chat_cap_field_is_rewritten(gateway, upstream):
    gw = gateway(budget(20_000))
    body = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_completion_tokens": 50_000}
    r = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    (seen,) = upstream.requests()
    cap = seen["body"]["max_completion_tokens"]
    assert r.headers["x-kvgate-max-tokens"] == str(cap)
    prompt = 8192 - cap
    # ChatML framing is counted: more than the bare question's 7 cl100k tokens (text counts are
    # padded by the shipped approximate tokenizer's multiplier).
    mult = shipped_plugin_config()["tokenizer"]["multiplier"]
    assert 10 * mult < prompt < 40 * mult
    # And in max_tokens, the field every server reads (one that ignores max_completion_tokens
    # would otherwise run to its context).
    assert seen["body"]["max_tokens"] == cap
    gw.assert_drained()


def test_prompt_over_context_is_413_and_reserves_nothing(gateway, upstream):
    gw = gateway(budget(20_000))
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(8192), "max_tokens": 10}, timeout=10)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "8192" in err["message"] and "10 output tokens" in err["message"]
    assert r.headers["x-kvgate-level"] == "green"
    assert upstream.requests() == []
    assert gw.status()["committed_bytes"] == 0
    assert gw.stats()["kvgate.rejected.context_length_exceeded"] == 1


def test_context_error_status_can_be_400(gateway):
    gw = gateway(budget(20_000, context_error_status=400))
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(9000)}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = requests.post(gw.url + "/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "word " * 9000}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages", "a chat's prompt is its messages"


def test_full_budget_answers_429_with_retry_after_then_admits_after_release(gateway, upstream):
    gw = gateway(budget(5000, retry_after={"min_ms": 1000, "max_ms": 30000, "jitter": 0.25,
                                           "default_lease_ms": 5000}))
    t, res = stream_in_background(gw, {"prompt": tokens(200), "max_tokens": 4000}, chunks=15)
    gw.wait_for(lambda s: s["leases"] == 1)
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(200), "max_tokens": 4000}, timeout=10)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "kv_capacity_exceeded"
    assert err["type"] == "rate_limit_error"
    assert err["need_bytes"] == 4200 * PER_TOKEN
    assert err["free_bytes"] == 800 * PER_TOKEN
    retry_s, retry_ms = int(r.headers["retry-after"]), int(r.headers["retry-after-ms"])
    assert 1000 <= retry_ms <= 30000
    assert retry_s == -(-retry_ms // 1000)
    assert err["retry_after_seconds"] == retry_s
    assert r.headers["x-kvgate-level"] == "amber"  # 4200 / 5000 = 0.84
    # A request that fits still goes through while the big one runs.
    ok = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(100), "max_tokens": 100}, timeout=10)
    assert ok.status_code == 200
    t.join()
    assert res["status"] == 200
    gw.assert_drained()
    again = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(200), "max_tokens": 4000}, timeout=10)
    assert again.status_code == 200
    gw.assert_drained()
    st = gw.stats()
    assert st["kvgate.rejected.kv_capacity_exceeded"] == 1
    assert st["kvgate.admitted"] == 3


def test_request_larger_than_budget_is_413_not_429(gateway):
    gw = gateway(budget(1000))
    r = requests.post(gw.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5000}, timeout=10)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "kv_request_too_large"
    assert "retry-after" not in r.headers
    gw.assert_drained()


def test_an_unset_cap_gets_what_the_budget_can_serve_not_413(gateway, upstream):
    # A 1,000-token budget cannot hold the model's 8,192-token context: a request without a cap is
    # granted what one sequence can use here (1,000 − prompt), and a second one waits (429).
    gw = gateway(budget(1000))
    t, res = stream_in_background(gw, {"prompt": tokens(10)}, chunks=10)
    s = gw.wait_for(lambda s: s["leases"] == 1)
    assert s["committed_bytes"] == 1000 * PER_TOKEN
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(10)}, timeout=10)
    assert r.status_code == 429 and r.json()["error"]["code"] == "kv_capacity_exceeded"
    t.join()
    assert res["status"] == 200
    assert res["headers"]["x-kvgate-max-tokens"] == "990"
    gw.assert_drained()


def test_release_after_client_abort_mid_stream(gateway):
    gw = gateway(budget(20_000))
    body = json.dumps({"prompt": tokens(100), "max_tokens": 1000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"x-mock-mode: stream\r\nx-mock-chunks: 200\r\nx-mock-delay-ms: 100\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200")
    assert gw.status()["leases"] == 1
    s.close()  # the client walks away mid-stream
    gw.assert_drained(timeout=10)
    assert gw.stats()["kvgate.released"] == 1


def test_release_after_upstream_reset(gateway):
    gw = gateway(budget(20_000))
    try:
        r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(100), "max_tokens": 1000},
                          headers={"x-mock-mode": "reset", "x-mock-chunks": "6", "x-mock-delay-ms": "50"},
                          timeout=10)
        r.content
    except requests.RequestException:
        pass  # the client sees a truncated stream; that is the point
    gw.assert_drained(timeout=10)
    assert gw.stats()["kvgate.released"] == 1


def test_bad_requests_are_400_and_reserve_nothing(gateway, upstream):
    gw = gateway(budget(20_000))
    cases = [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
        ("/v1/completions", b'{"max_tokens": 5}', "prompt"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    ]
    for path, body, param in cases:
        r = requests.post(gw.url + path, data=body, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
    r = requests.post(gw.url + "/v1/completions", timeout=10)  # no body at all
    assert r.status_code == 400
    assert upstream.requests() == []
    assert gw.status()["committed_bytes"] == 0
    assert gw.stats()["kvgate.rejected.invalid_request"] == len(cases) + 1


def test_body_over_limit_is_413(gateway, upstream):
    gw = gateway(budget(20_000, max_body_bytes=1000))
    r = requests.post(gw.url + "/v1/completions", json={"prompt": "x" * 5000}, timeout=10)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_body_too_large"
    assert upstream.requests() == []
    assert gw.status()["committed_bytes"] == 0


def test_spoofed_kvgate_headers_are_stripped(gateway, upstream):
    gw = gateway(budget(20_000))
    spoof = {"x-kvgate-lease": "999", "x-kvgate-class": "vip", "x-kvgate-anything": "1"}
    r = requests.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers=spoof, timeout=10)
    assert r.status_code == 200
    assert requests.get(gw.url + "/v1/models", headers=spoof, timeout=10).status_code == 200
    seen = upstream.requests()
    assert [s["path"] for s in seen] == ["/v1/completions", "/v1/models"]
    h = seen[0]["headers"]
    assert h["x-kvgate-lease"] != "999" and h["x-kvgate-lease"] == r.headers["x-kvgate-lease"]
    assert h["x-kvgate-class"] == "default"
    assert "x-kvgate-anything" not in h
    # A path the filter does not price is forwarded without any of them.
    assert not [k for k in seen[1]["headers"] if k.startswith("x-kvgate-")], seen[1]["headers"]
    gw.assert_drained()


def test_a_stream_that_outlives_its_owners_timeout_keeps_its_reservation_until_it_ends(gateway, upstream):
    # A request that takes 4 s, the reaper running every 100 ms: the lease's owner is alive (its
    # heartbeat beats), so the reaper never takes the reservation back while the request is in
    # flight; leases have no deadline.
    gw = gateway(budget(20_000, tick_ms=100))
    result = {}

    def hang():
        r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 10},
                          headers={"x-mock-mode": "hang", "x-mock-hang-s": "4"}, timeout=30)
        result["status"] = r.status_code
    t = threading.Thread(target=hang)
    t.start()
    s = gw.wait_for(lambda s: s["leases"] == 1)
    held = s["committed_bytes"]
    assert held == 20 * PER_TOKEN
    time.sleep(2.5)  # 25 reaper passes
    assert t.is_alive()
    s = gw.status()
    assert s["committed_bytes"] == held and s["counters"]["reaped"] == 0, s
    t.join()
    assert result["status"] == 200
    s = gw.assert_drained()
    assert s["counters"]["released"] == 1 and s["counters"]["reaped"] == 0
    st = gw.stats()
    assert st["kvgate.reaped"] == 0
    assert st["kvgate.release_unknown"] == 0, "the end of the stream released it, nothing else"
    assert "reaped lease" not in gw.logs()


def test_a_backend_silent_past_the_routes_idle_timeout_gets_an_openai_504(gateway, upstream):
    # Envoy answers the route's idle timeout itself (504 "stream timeout", flag SI, not UT): the
    # shipped bootstrap maps it to JSON as it does the route's overall timeout.
    def idle_1s():
        boot = shipped_bootstrap()
        for r in http_connection_manager(boot)["route_config"]["virtual_hosts"][0]["routes"]:
            if "idle_timeout" in r.get("route", {}):
                r["route"]["idle_timeout"] = "1s"
        return boot
    gw = gateway(budget(20_000), bootstrap=idle_1s())
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 10},
                      headers={"x-mock-mode": "hang", "x-mock-hang-s": "4"}, timeout=30)
    assert r.status_code == 504, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "backend_timeout" and err["type"] == "server_error", err
    assert "param" in err, "the full OpenAI error shape"
    gw.assert_drained()
    # It bounds a wait in a queue class too (docs/configuration.md: keep it above max_wait_ms): nothing moves on
    # a queued stream, and its place ends with it.
    gw = gateway(budget(1_000, policy={"default_class": "q",
                                       "classes": {"q": {"action": "queue", "max_wait_ms": 5000}}}),
                 bootstrap=idle_1s())
    result = {}

    def holder():
        result["status"] = requests.post(gw.url + "/v1/completions", timeout=30,
                                         json={"prompt": tokens(10), "max_tokens": 900},
                                         headers={"x-mock-mode": "stream", "x-mock-chunks": "12",
                                                  "x-mock-delay-ms": "500"}).status_code
    t = threading.Thread(target=holder)
    t.start()
    gw.wait_for(lambda s: s["leases"] == 1, what="the holder's lease")
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 500}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "backend_timeout", r.text
    t.join()
    assert result["status"] == 200
    gw.assert_drained()


def test_a_chunked_body_past_envoys_buffer_in_one_read_gets_an_openai_413(gateway, upstream):
    # The filter refuses a body past max_body_bytes as it grows; but a body paused on its first
    # chunk and then sent past Envoy's own buffer limit in one burst is refused by Envoy
    # (`request_payload_too_large`) before the filter sees it: still an OpenAI-shaped 413.
    gw = gateway(budget(20_000))
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"transfer-encoding: chunked\r\n\r\n1\r\n{\r\n")
    time.sleep(0.5)
    payload = b'"prompt": "' + b"a" * (9 << 20) + b'"}'

    def send():
        try:
            s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
        except OSError:
            pass  # Envoy answers and closes before it has read everything
    t = threading.Thread(target=send)
    t.start()
    answer = b""
    try:
        while chunk := s.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass  # closed with the rest of the body unread, after its answer
    t.join()
    s.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["error"]["code"] == "request_body_too_large", body[:300]
    assert "param" in json.loads(body)["error"], "the full OpenAI error shape"
    assert upstream.requests() == []
    gw.assert_drained()


def test_a_stream_cut_short_is_cancelled_at_the_backend(gateway, upstream):
    # The filter tells the backend to stop a stream whose client left: a server may not see
    # the connection close until it writes. The call is sent as the stream ends; Envoy sends
    # it as the VM's root context's, so it outlives the stream. (The mock answers the lease
    # poll with an empty report and closes that connection: the call needs a new one.)
    gw = gateway(budget(20_000, backend={"cluster": "kvgate_backend", "poll_ms": 60_000,
                                         "lost_grace_ms": 120_000}))
    gw.wait_for(lambda s: s["backend"]["up"], what="the first poll")
    body = json.dumps({"prompt": tokens(10), "max_tokens": 100}).encode()
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"x-mock-mode: stream\r\nx-mock-chunks: 50\r\nx-mock-delay-ms: 200\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
    lease = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                 if line.lower().startswith(b"x-kvgate-lease:"))
    s.close()
    cancel = f"/v1/admission/leases/{lease}/cancel"
    deadline = time.time() + 10
    while cancel not in (paths := [r["path"] for r in upstream.requests()]) and time.time() < deadline:
        time.sleep(0.05)
    assert cancel in paths, paths
    gw.assert_drained()


def test_only_the_openai_paths_are_routed_and_errors_are_openai_shaped(gateway, upstream):
    gw = gateway(budget(20_000))
    upstream.clear()
    # The backend's admission API, health and metrics are not reachable through the gateway.
    for method, path in [("GET", "/v1/admission/leases"), ("POST", "/v1/admission/leases/1/cancel"),
                         ("POST", "/v1/admission/leases/1/demote"),
                         ("GET", "/metrics"), ("GET", "/health"), ("GET", "/anything")]:
        r = requests.request(method, gw.url + path, timeout=10)
        assert r.status_code == 404, (path, r.status_code)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "not_found"
    assert upstream.requests() == [], "nothing reached the backend"
    # Other methods on the guarded paths: 405, OpenAI-shaped.
    for method in ["GET", "PUT", "DELETE"]:
        r = requests.request(method, gw.url + "/v1/chat/completions", timeout=10)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    # A declared body over the limit is refused at the headers, before any of it is read.
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 50000000\r\n\r\n{")
    answer = s.recv(65536)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    assert b"request_body_too_large" in answer
    gw.assert_drained()


def raw_exchange(port, request):
    """Send raw bytes and read the answer until the gateway closes or 2 s of silence."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(request)
        s.settimeout(2)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def test_requests_envoy_refuses_as_bad_http_get_openai_style_errors(gateway, upstream):
    gw = gateway(budget(20_000))
    upstream.clear()
    cases = [
        # Both framings at once (request smuggling's shape).
        (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
         b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        # One header past Envoy's 60 KiB default.
        (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 100_000 +
         b"\r\ncontent-length: 2\r\n\r\n{}", 431),
    ]
    for request, status in cases:
        answer = raw_exchange(gw.port, request)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status), answer[:300]
        assert b"content-type: application/json" in head.lower(), head
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error", err
        assert "param" in err, "the full OpenAI error shape"
    assert upstream.requests() == [], "nothing reached the backend"
    gw.assert_drained()


def test_a_body_shorter_than_its_content_length_gets_408_or_a_prompt_close(gateway, upstream):
    # The shipped request_timeout (30 s), shortened to 3 s: the same 408 path, 27 s sooner.
    boot = shipped_bootstrap()
    assert http_connection_manager(boot)["request_timeout"] == "30s"
    http_connection_manager(boot)["request_timeout"] = "3s"
    gw = gateway(budget(20_000), bootstrap=boot)
    body = b'{"prompt": [1, 2, 3], "max_tokens": 5}'
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body) + 100, body))

    def answer_of(half_close):
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=60)
        s.sendall(head)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        t0 = time.time()
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        return answer, time.time() - t0
    # The client stalls: Envoy's request timeout answers 408, OpenAI-shaped, after 3 s.
    answer, waited = answer_of(half_close=False)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
    assert 2.5 < waited < 15
    # The client half-closes: Envoy (HTTP/1) closes the connection at once, not at the timeout's
    # 408; nothing is held.
    answer, waited = answer_of(half_close=True)
    assert not answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert waited < 2.5, (waited, answer[:200])
    gw.assert_drained()
    assert upstream.requests() == []


def test_a_queue_wait_longer_than_envoys_request_timeout_still_ends_in_admission(gateway, upstream):
    """Envoy's request_timeout bounds how long a client takes to send its request, and stops once
    the body is in: a queue class may hold a request past it (here 3 s against a 6 s wait) and
    still admit it, and nothing is left in the queue or the ledger after."""
    boot = shipped_bootstrap()
    http_connection_manager(boot)["request_timeout"] = "3s"
    queue = {"classes": {"default": {"action": "queue", "max_wait_ms": 20_000, "max_depth": 4}}}
    gw = gateway(budget(5000, policy=queue), bootstrap=boot)
    t, res = stream_in_background(gw, {"prompt": tokens(200), "max_tokens": 4000}, chunks=60, delay_ms=100)
    gw.wait_for(lambda s: s["leases"] == 1)
    t0 = time.time()
    r = requests.post(gw.url + "/v1/completions", json={"prompt": tokens(200), "max_tokens": 4000}, timeout=30)
    waited = time.time() - t0
    assert r.status_code == 200, (waited, r.text)
    assert waited > 4, waited
    t.join()
    assert res["status"] == 200
    gw.assert_drained()
    st = gw.stats()
    assert st["kvgate.admitted"] == 2 and st["kvgate.queued"] == 0
    assert st["kvgate.rejected.kv_queue_timeout"] == 0


def test_a_client_cannot_pick_its_class(gateway, upstream):
    classes = {"default_class": "std", "classes": {"std": {"action": "reject"},
                                                   "vip": {"action": "reject", "priority": 9}}}
    gw = gateway(budget(20_000, policy=classes))
    t, _ = stream_in_background(gw, {"prompt": tokens(10), "max_tokens": 10}, chunks=10)
    s = gw.wait_for(lambda s: s["leases"] == 1)
    assert s["classes"]["std"]["leases"] == 1
    t.join()
    keyed = dict(classes, api_keys={
        "sha256:99b8ea75629d57dae3f1de7663befecff0a039612d12f2cd1e6a1c3c96ba65b9": "vip"})
    gw2 = gateway(budget(20_000, policy=keyed))
    t, _ = stream_in_background(gw2, {"prompt": tokens(10), "max_tokens": 10}, chunks=10)
    gw2.wait_for(lambda s: s["leases"] == 1)
    t.join()
    # The API key picks the class; a spoofed class header does nothing.
    t = threading.Thread(target=lambda: requests.post(
        gw2.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 10}, timeout=30,
        headers={"authorization": "Bearer kvgate-demo-vip", "x-mock-mode": "stream", "x-mock-chunks": "10",
                 "x-mock-delay-ms": "100"}))
    t.start()
    s = gw2.wait_for(lambda s: s["leases"] == 1)
    assert s["classes"]["vip"]["leases"] == 1
    t.join()
    t = threading.Thread(target=lambda: requests.post(
        gw2.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 10}, timeout=30,
        headers={"x-tenant-class": "vip", "authorization": "Bearer guess", "x-mock-mode": "stream",
                 "x-mock-chunks": "10", "x-mock-delay-ms": "100"}))
    t.start()
    s = gw2.wait_for(lambda s: s["leases"] == 1)
    assert s["classes"]["std"]["leases"] == 1 and s["classes"]["vip"]["leases"] == 0
    t.join()
    gw.assert_drained()
    gw2.assert_drained()


def admission_wait_of_a_big_request_among_small_ones(gw, seconds=12):
    """Six clients keep sending small requests (1 s streams) and honour Retry-After; one client
    sends a request needing 90 % of the budget, retrying as told. Returns how long the big one
    waited to be admitted (None: never within `seconds`)."""
    stop = time.time() + seconds
    headers = {"x-mock-mode": "stream", "x-mock-chunks": "5", "x-mock-delay-ms": "200"}

    def small(i):
        with requests.Session() as sess:
            while time.time() < stop:
                r = sess.post(gw.url + "/v1/completions", json={"prompt": tokens(10 + i), "max_tokens": 190},
                              headers=headers, timeout=30)
                r.content
                if r.status_code == 429:
                    time.sleep(float(r.headers["retry-after-ms"]) / 1000)
    clients = [threading.Thread(target=small, args=(i,)) for i in range(6)]
    for t in clients:
        t.start()
    time.sleep(1.5)
    t0 = time.time()
    waited = None
    with requests.Session() as sess:
        while time.time() < stop:
            r = sess.post(gw.url + "/v1/completions", json={"prompt": tokens(10), "max_tokens": 890},
                          headers=headers, timeout=30)
            r.content
            if r.status_code == 200:
                waited = time.time() - t0
                break
            assert r.status_code == 429, r.text
            time.sleep(float(r.headers["retry-after-ms"]) / 1000)
    for t in clients:
        t.join()
    return waited


def test_a_big_request_is_not_starved_by_small_ones(gateway):
    retry = {"min_ms": 100, "max_ms": 1000, "jitter": 0.1, "default_lease_ms": 1000}
    gw = gateway(budget(1000, retry_after=retry))
    fair = admission_wait_of_a_big_request_among_small_ones(gw, seconds=20)
    print(f"big request's admission wait with fair retries: {fair} s")
    # With fair retries the freed bytes are set aside for the big request: it is admitted once the
    # small leases ahead of it end (1 s streams, a few rounds on a loaded machine), not when five
    # happen to end at once and no small client is quicker. (Without them it may wait for ever;
    # that comparison is a benchmark's, docs/lab/2026-12-benchmarks-history.md "Queue aging and retries that keep their
    # age", not a test's.)
    assert fair is not None and fair < 10.0, fair
    gw.assert_drained()
    # Places in line of clients that stopped retrying expire (twice the advertised wait + 5 s).
    s = gw.wait_for(lambda s: s["claims"] == 0 and s["claimed_bytes"] == 0, timeout=20, what="claims to expire")
    assert s["free_bytes"] == s["capacity_bytes"]


def test_burst_of_200_never_exceeds_capacity(gateway):
    gw = gateway(budget(10_000), concurrency=4)
    capacity = 10_000 * PER_TOKEN
    peak = {"committed": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = gw.status()
            peak["committed"] = max(peak["committed"], s["committed_bytes"])
            assert s["committed_bytes"] <= s["capacity_bytes"] == capacity
            time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    statuses = []
    lock = threading.Lock()

    def one(i):
        body = {"prompt": tokens(100 + i % 7), "max_tokens": 800}
        with requests.Session() as sess:
            r = sess.post(gw.url + "/v1/completions", json=body, timeout=60,
                          headers={"x-mock-mode": "stream", "x-mock-chunks": "5", "x-mock-delay-ms": "60"})
            r.content
        with lock:
            statuses.append(r.status_code)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert len(statuses) == 200
    assert set(statuses) <= {200, 429}
    admitted = statuses.count(200)
    assert admitted >= 10 and statuses.count(429) > 0
    assert peak["committed"] <= capacity
    s = gw.assert_drained()
    assert s["counters"]["admitted"] == admitted
    assert s["counters"]["released"] == admitted
    st = gw.stats()
    assert st["kvgate.admitted"] == admitted
    assert st["kvgate.rejected.kv_capacity_exceeded"] == 200 - admitted


def test_level_and_stats_are_exported(gateway):
    gw = gateway(budget(10_000))
    r = requests.get(gw.url + "/v1/models", timeout=10)
    assert r.headers["x-kvgate-level"] == "green"
    t, _ = stream_in_background(gw, {"prompt": tokens(100), "max_tokens": 7900}, chunks=10)
    gw.wait_for(lambda s: s["leases"] == 1)
    # An unpriced response's level reads the room as its worker's last tick (100 ms) saw it.
    deadline = time.time() + 2
    while (level := requests.get(gw.url + "/v1/models", timeout=10).headers["x-kvgate-level"]) != "amber":
        assert time.time() < deadline, level
        time.sleep(0.05)
    prom = requests.get(gw.admin + "/stats/prometheus", timeout=10).text
    for name in ["kvgate_admitted", "kvgate_released", "kvgate_reaped", "kvgate_committed_bytes",
                 "kvgate_capacity_bytes", "kvgate_level", "kvgate_live_leases",
                 "kvgate_rejected_kv_capacity_exceeded"]:
        assert name in prom, name
    st = gw.stats()
    assert st["kvgate.committed_bytes"] == 8000 * PER_TOKEN
    assert st["kvgate.capacity_bytes"] == 10_000 * PER_TOKEN
    assert st["kvgate.level"] == 1
    assert st["kvgate.live_leases"] == 1
    t.join()
    gw.assert_drained()


@pytest.mark.parametrize("bad, says", [
    ({"safety_fraction": 1.5}, "field `safety_fraction` = 1.5: must be in (0, 1]"),
    # The shipped config pads its tokenizer already (tokenizer.multiplier): a second pad of the
    # same counts is refused, not silently ignored.
    ({"fallback_token_multiplier": 1.3}, "field `fallback_token_multiplier` = 1.3: set it or tokenizer.multiplier, not both"),
    # A run pad for a tokenizer the configuration calls exact would never apply.
    ({"tokenizer": {"encoding": "cl100k_base", "pad_runs": False}},
     "field `tokenizer.pad_runs` = false: applies only to an approximate tokenizer"),
])
def test_invalid_config_is_refused_naming_the_field(gateway, bad, says):
    with pytest.raises(RuntimeError) as e:
        gateway(bad)
    assert says in str(e.value)


def test_reconfiguration_keeps_the_ledger_and_its_leases(gateway):
    gw = gateway(budget(10_000), ecds=True)
    t, res = stream_in_background(gw, {"prompt": tokens(100), "max_tokens": 900}, chunks=60, delay_ms=100)
    s = gw.wait_for(lambda s: s["leases"] == 1)
    lease_bytes = s["committed_bytes"]
    gw.write_filter_config({**gw_plugin_config(), **budget(20_000)})
    s = gw.wait_for(lambda s: s["capacity_bytes"] == 20_000 * PER_TOKEN, timeout=20, what="the new config")
    assert s["leases"] == 1 and s["committed_bytes"] == lease_bytes, "the live lease survived the reload"
    t.join()
    assert res["status"] == 200
    gw.assert_drained()
    assert "0 ledger(s) created, 1 live leases kept" in gw.logs()


def gw_plugin_config():
    from harness import shipped_plugin_config
    return shipped_plugin_config()


def h2_post_with_trailers(port, path, body):
    """An HTTP/2 request whose body is ended by trailers (the body callback never sees
    end_of_stream; the trailers callback must end it). Returns (status, headers)."""
    import h2.config
    import h2.connection
    import h2.events

    s = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                            (":authority", "kvgate"), ("content-type", "application/json")])
    conn.send_data(sid, body)
    conn.send_headers(sid, [("x-checksum", "1")], end_stream=True)
    s.sendall(conn.data_to_send())
    status, headers = None, {}
    deadline = time.time() + 10
    while status is None and time.time() < deadline:
        for ev in conn.receive_data(s.recv(65536)):
            if isinstance(ev, h2.events.ResponseReceived):
                headers = {k.decode(): v.decode() for k, v in ev.headers}
                status = int(headers[":status"])
        s.sendall(conn.data_to_send())
    s.close()
    return status, headers


def test_http2_trailers_end_the_body(gateway, upstream):
    gw = gateway(budget(20_000))
    status, headers = h2_post_with_trailers(gw.port, "/v1/completions",
                                            json.dumps({"prompt": tokens(100), "max_tokens": 50}).encode())
    assert status == 200
    assert headers["x-kvgate-max-tokens"] == "50"
    (seen,) = upstream.requests()
    assert seen["body"]["max_tokens"] == 50 and seen["headers"]["x-kvgate-lease"] == headers["x-kvgate-lease"]
    # Bad JSON ended by trailers is still answered (400), not left hanging.
    status, _ = h2_post_with_trailers(gw.port, "/v1/completions", b"{nope")
    assert status == 400
    gw.assert_drained()


def test_filter_reloaded_under_load_loses_nothing(gateway):
    """ECDS reconfigurations (budget and policy changes) while eight clients keep streaming: every
    answer is 200 or 429, nothing is reaped or released twice, and the ledger ends at exactly 0."""
    gw = gateway(budget(5_000), ecds=True)
    stop = time.time() + 12
    statuses, lock = [], threading.Lock()

    def client(i):
        with requests.Session() as sess:
            while time.time() < stop:
                r = sess.post(gw.url + "/v1/completions", timeout=30,
                              json={"prompt": tokens(50 + i), "max_tokens": 400 + 50 * i, "stream": True},
                              headers={"x-mock-mode": "stream", "x-mock-chunks": "5", "x-mock-delay-ms": "60"})
                r.content
                with lock:
                    statuses.append(r.status_code)
                if r.status_code == 429:
                    time.sleep(float(r.headers["retry-after-ms"]) / 1000)
    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in clients:
        t.start()
    for n, tokens_budget in enumerate([8_000, 3_000, 6_000]):
        time.sleep(3)
        policy = {"classes": {"default": {"action": "degrade", "min_output_tokens": 64}}} if n % 2 else \
            {"classes": {"default": {"action": "reject"}}}
        gw.write_filter_config({**gw_plugin_config(), **budget(tokens_budget), "policy": policy})
        gw.wait_for(lambda s: s["capacity_bytes"] == tokens_budget * PER_TOKEN, timeout=20, what="the new config")
    for t in clients:
        t.join()
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) > 20
    s = gw.assert_drained(timeout=20)
    c = s["counters"]
    assert c["admitted"] == c["released"] and c["reaped"] == 0, c
    st = gw.stats()
    assert st["kvgate.release_unknown"] == 0 and st["kvgate.ledger_errors"] == 0


def test_a_client_that_stops_reading_does_not_hold_the_budget_past_its_generation(gateway):
    """A streaming client that stops reading: Envoy buffers the (small) answer, so the generation
    runs to its end and its reservation is released then, not when the client finally reads or
    goes; the client still gets its whole answer afterwards."""
    gw = gateway(budget(20_000))
    body = json.dumps({"prompt": tokens(100), "max_tokens": 1000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"x-mock-mode: stream\r\nx-mock-chunks: 200\r\nx-mock-delay-ms: 5\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    gw.wait_for(lambda st: st["leases"] == 1)
    st = gw.assert_drained(timeout=15)  # while the client reads nothing at all
    assert st["counters"]["released"] == 1
    s.settimeout(10)
    answer = b""
    while b"0\r\n\r\n" not in answer:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    s.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0\r\n\r\n"), answer[-200:]


def test_shadow_mode_lets_everything_through_and_counts_what_it_would_do(gateway, upstream):
    gw = gateway(budget(5_000, mode="shadow"))
    t, res = stream_in_background(gw, {"prompt": tokens(100), "max_tokens": 3900}, chunks=30)
    gw.wait_for(lambda s: s["leases"] == 1)
    # The lease is recorded before the request is forwarded: let it reach the upstream before
    # forgetting it (a CI run once cleared first and then saw it beside the next one).
    deadline = time.time() + 10
    while not upstream.requests() and time.time() < deadline:
        time.sleep(0.02)
    assert upstream.requests(), "the first request reached the upstream"
    upstream.clear()
    # Enforce would refuse this one (429); shadow forwards it unchanged and says so.
    body = {"prompt": tokens(100), "max_tokens": 3900}
    r = requests.post(gw.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200
    assert r.headers["x-kvgate-shadow"] == "would_reject=kv_capacity_exceeded"
    (seen,) = upstream.requests()
    assert seen["body"] == body, "forwarded as it came"
    # Bad input too: the upstream answers it, kvgate only counts.
    r = requests.post(gw.url + "/v1/completions", data=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert r.headers["x-kvgate-shadow"] == "would_reject=invalid_request"
    t.join()
    assert res["status"] == 200 and res["headers"]["x-kvgate-shadow"] == "would_admit"
    st = gw.stats()
    assert st["kvgate.shadow.would_reject.kv_capacity_exceeded"] == 1
    assert st["kvgate.shadow.would_reject.invalid_request"] == 1
    assert st["kvgate.rejected.kv_capacity_exceeded"] == 0
    gw.assert_drained()


def jwt_hs256(secret, claims):
    """A signed JWT (HS256), built with the standard library."""
    import base64
    import hashlib
    import hmac

    def b64(b):
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = b64(json.dumps(claims).encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def test_the_class_comes_from_a_verified_jwt_claim_or_the_route(gateway, upstream):
    import base64

    secret = b"kvgate-test-hs256-secret-of-32-bytes"
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1",
                      "k": base64.urlsafe_b64encode(secret).rstrip(b"=").decode()}]}
    boot = shipped_bootstrap()
    hcm = http_connection_manager(boot)
    # Envoy's own JWT filter verifies the token before kvgate and puts its payload in dynamic
    # metadata; a request without a token passes (allow_missing), a bad one gets 401 there.
    hcm["http_filters"].insert(0, {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"test": {"issuer": "kvgate-test", "local_jwks": {"inline_string": json.dumps(jwks)},
                                   "payload_in_metadata": "jwt_payload"}},
            "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
                {"provider_name": "test"}, {"allow_missing": {}}]}}}]}})
    # The completions route says "batch" in its metadata; chat completions say nothing.
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    (completions,) = [r for r in routes if r["match"].get("path") == "/v1/completions"]
    completions["metadata"] = {"filter_metadata": {"kvgate": {"class": "batch"}}}
    policy = {"default_class": "std", "class_from_route": True,
              "class_claim": {"payload_in_metadata": "jwt_payload", "claim": "tier"},
              "classes": {"std": {}, "batch": {}, "vip": {"priority": 9}}}
    gw = gateway(budget(20_000, policy=policy), bootstrap=boot)

    def class_of(path, token=None, body=None):
        upstream.clear()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        body = body or ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
                        if "chat" in path else {"prompt": tokens(10), "max_tokens": 5})
        r = requests.post(gw.url + path, json=body, headers=headers, timeout=10)
        if r.status_code != 200:
            return r.status_code
        (seen,) = upstream.requests()
        return seen["headers"]["x-kvgate-class"]

    exp = int(time.time()) + 3600
    vip = jwt_hs256(secret, {"iss": "kvgate-test", "tier": "vip", "exp": exp})
    gold = jwt_hs256(secret, {"iss": "kvgate-test", "tier": "gold", "exp": exp})
    forged = jwt_hs256(b"not-the-secret-not-the-secret-xx", {"iss": "kvgate-test", "tier": "vip", "exp": exp})
    assert class_of("/v1/completions") == "batch", "the route's class"
    assert class_of("/v1/chat/completions") == "std", "no route class: the default"
    assert class_of("/v1/completions", vip) == "vip", "a verified claim comes before the route"
    assert class_of("/v1/chat/completions", vip) == "vip"
    assert class_of("/v1/completions", gold) == "batch", "a claim naming no class: the route's"
    assert class_of("/v1/chat/completions", forged) == 401, "a forged token never reaches kvgate"
    # A client-sent claim header or class header is nothing: only the verified payload counts.
    upstream.clear()
    r = requests.post(gw.url + "/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
                      headers={"x-kvgate-class": "vip", "tier": "vip", "x-jwt-payload": "eyJ0aWVyIjoidmlwIn0"})
    assert r.status_code == 200 and upstream.requests()[0]["headers"]["x-kvgate-class"] == "std"
    gw.assert_drained()
