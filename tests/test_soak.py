"""Soak: many requests through the real Envoy and filter, about a fifth of them abandoned by their
clients at random points (mid-request body, before the answer, mid-stream), at concurrency 16.

The ledger must never exceed its capacity and must end at exactly zero, with every admission
released exactly once. `make soak` runs 10,000 requests; `make test` a quick 1,500
(SOAK_REQUESTS sets the number).
"""

import json
import os
import random
import socket
import threading
import time

import requests

PER_TOKEN = 46_080
CAPACITY_TOKENS = 20_000


def raw_request(port, body, headers, abort_at, rng):
    """Send a request on a raw socket and walk away at `abort_at`:
    'body' (half the body sent), 'wait' (whole request sent, no answer read), 'stream'
    (the first bytes of the answer read)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + f"content-length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        if abort_at == "body":
            s.sendall(head + body[: max(1, len(body) // 2)])
            time.sleep(rng.uniform(0, 0.02))
            return "aborted"
        s.sendall(head + body)
        if abort_at == "wait":
            time.sleep(rng.uniform(0, 0.05))
            return "aborted"
        first = s.recv(4096)
        return "aborted" if first else "closed"
    finally:
        s.close()


def run_soak(gw, total, concurrency=16, abort_fraction=0.2, seed=7):
    rng_master = random.Random(seed)
    seeds = [rng_master.randrange(1 << 30) for _ in range(concurrency)]
    counts = {"200": 0, "429": 0, "aborted": 0, "closed": 0, "other": 0}
    lock = threading.Lock()
    next_i = iter(range(total))
    peak = {"committed": 0, "violations": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = gw.status()
            peak["committed"] = max(peak["committed"], s["committed_bytes"])
            if s["committed_bytes"] > s["capacity_bytes"]:
                peak["violations"] += 1
            time.sleep(0.01)

    def client(k):
        rng = random.Random(seeds[k])
        sess = requests.Session()
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            stream = rng.random() < 0.5
            body = json.dumps({"prompt": [1] * rng.randint(10, 400), "max_tokens": rng.randint(100, 6000),
                               "stream": stream}).encode()
            headers = {"x-mock-mode": "stream" if stream else "normal", "x-mock-chunks": str(rng.randint(1, 6)),
                       "x-mock-delay-ms": str(rng.randint(0, 15))}
            if rng.random() < abort_fraction:
                # "closed": the gateway shut the connection without a byte of an answer.
                outcome = raw_request(gw.port, body, headers, rng.choice(["body", "wait", "stream"]), rng)
            else:
                r = sess.post(gw.url + "/v1/completions", data=body, timeout=60,
                              headers={"content-type": "application/json", **headers})
                r.content
                outcome = str(r.status_code) if r.status_code in (200, 429) else "other"
            with lock:
                counts[outcome] += 1

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.time()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    return counts, peak, time.time() - t0


def test_soak_with_client_aborts_never_exceeds_capacity_and_ends_at_zero(gateway):
    total = int(os.environ.get("SOAK_REQUESTS", "1500"))
    gw = gateway({"kv_budget_bytes": CAPACITY_TOKENS * PER_TOKEN, "safety_fraction": 1.0,
                  "scratch_margin_bytes": 0}, concurrency=4)
    counts, peak, secs = run_soak(gw, total)
    print(f"soak: {total} requests in {secs:.1f} s ({total / secs:.0f}/s): {counts}, "
          f"peak committed {peak['committed']} of {CAPACITY_TOKENS * PER_TOKEN} B")
    assert sum(counts.values()) == total
    assert counts["other"] == 0 and counts["closed"] == 0, counts
    assert counts["200"] > 0 and counts["429"] > 0 and counts["aborted"] > total // 10, counts
    assert peak["violations"] == 0
    assert 0 < peak["committed"] <= CAPACITY_TOKENS * PER_TOKEN
    s = gw.assert_drained(timeout=30)
    c = s["counters"]
    assert c["admitted"] == c["released"], c
    assert c["reaped"] == 0
    st = gw.stats()
    assert st["kvgate.release_unknown"] == 0, "every lease was released exactly once, by its own stream"
    assert st["kvgate.ledger_errors"] == 0
