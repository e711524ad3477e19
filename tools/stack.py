#!/usr/bin/env python3
"""Run the kvgate stack on this machine: the backend (default model) and Envoy with the filter.

  stack.py up     start both in the background (gateway :10000, admin :9901, backend :8000)
  stack.py up --backends N --gateways M
                  a fleet: backends on :8000, :8001, ... and gateways on :10000, :10001, ...
                  (admin :9901, :9902, ...), each gateway in front of every backend
  stack.py down   stop everything `up` started
  stack.py demo   up, the adversarial traffic mix with a live line per second, summary, down

Logs and pid files live in .run/ (the fleet's generated Envoy configs too). Paths are relative to
the repository root.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from urllib import error as urlerror
from urllib import request as urlrequest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run"
GATEWAY, ADMIN, BACKEND = "http://127.0.0.1:10000", "http://127.0.0.1:9901", "http://127.0.0.1:8000"
KV_BYTES = 268435456  # each backend's KV pool; envoy/kvgate-filter.yaml and envoy/fleet-filter.yaml price against the same
BACKEND_PORT, GATEWAY_PORT, ADMIN_PORT, BASE_ID = 8000, 10000, 9901, 7
MODEL = "smollm2-135m-instruct"


def http(method, url, body=None, headers=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urlrequest.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urlrequest.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urlerror.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def alive(url):
    try:
        return http("GET", url, timeout=2)[0] == 200
    except OSError:
        return False


def start(name, args):
    RUN.mkdir(exist_ok=True)
    log = open(RUN / f"{name}.log", "w")
    # Envoy asks the kernel for SIGTERM when its parent exits (PR_SET_PDEATHSIG): give it a
    # parent that stays, a shell waiting on it in its own session (which `down` signals whole).
    p = subprocess.Popen(["bash", "-c", '"$@" & wait $!', "stack", *args], stdout=log,
                         stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    (RUN / f"{name}.pid").write_text(str(p.pid))
    return p


def wait(url, proc, name, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name} exited; see {RUN / (name + '.log')}:\n" + (RUN / f"{name}.log").read_text()[-3000:])
        if alive(url):
            return
        time.sleep(0.2)
    sys.exit(f"{name} not ready after {timeout}s; see {RUN / (name + '.log')}")


def up(admission="reserve", backends=1, gateways=1):
    """One backend behind envoy/gateway.yaml, or with several backends or gateways a fleet:
    every gateway runs envoy/fleet.yaml + envoy/fleet-filter.yaml, generated into .run/ with
    its own ports, its own `--base-id`, its own `gateway_id`, and every backend as an endpoint."""
    if backends < 1 or gateways < 1:
        sys.exit("BACKENDS and GATEWAYS must be at least 1")
    fleet = backends > 1 or gateways > 1
    bports = [BACKEND_PORT + i for i in range(backends)]
    gports = [(GATEWAY_PORT + j, ADMIN_PORT + j) for j in range(gateways)]
    for url, what in ([(f"http://127.0.0.1:{p}/health", f"a backend :{p}") for p in bports]
                      + [(f"http://127.0.0.1:{a}/ready", f"Envoy admin :{a}") for _, a in gports]):
        if alive(url):
            sys.exit(f"{what} is already answering: run `make down` first")
    procs = []
    for i, port in enumerate(bports):
        name = "backend" if i == 0 else f"backend-{i}"
        procs.append((start(name, [str(ROOT / "target/release/kvgate-backend"), "--port", str(port),
                                   "--kv-cache-bytes", str(KV_BYTES), "--admission", admission]), name, port))
    for p, name, port in procs:  # the backends load the model side by side
        wait(f"http://127.0.0.1:{port}/health", p, name)
    for j, (port, admin) in enumerate(gports):
        name = "envoy" if j == 0 else f"envoy-{j}"
        config = fleet_configs(j, port, admin, bports) if fleet else "envoy/gateway.yaml"
        e = start(name, [str(ROOT / ".venv/bin/envoy"), "-c", config, "--concurrency", "2",
                         "--base-id", str(BASE_ID + j), "-l", "warning"])
        wait(f"http://127.0.0.1:{admin}/ready", e, name)
        wait(f"http://127.0.0.1:{port}/kvgate/status", e, name)
    if not fleet:
        print(f"kvgate up: gateway {GATEWAY}  admin {ADMIN}  backend {BACKEND} (admission {admission}); logs in .run/")
        return
    print(f"kvgate fleet up (admission {admission}); logs and configs in .run/")
    for j, (port, admin) in enumerate(gports):
        print(f"  gateway {j}: http://127.0.0.1:{port}  admin http://127.0.0.1:{admin}  "
              f"(gateway_id {j}; filter config .run/fleet-filter-{j}.yaml, edit it live)")
    for port in bports:
        print(f"  backend: http://127.0.0.1:{port}  (/health, /metrics)")


def fleet_configs(j, port, admin, backend_ports):
    """Gateway j's bootstrap and filter configuration, from envoy/fleet.yaml and
    envoy/fleet-filter.yaml: its ports, the ECDS file it watches, every backend in the cluster
    and in the filter's endpoint list, and its own gateway_id (unique lease ids across gateways).
    Returns the bootstrap's path, relative to the repository root (Envoy runs there)."""
    import yaml  # the project venv has it (tests/requirements.txt); only the fleet needs it

    class Dumper(yaml.SafeDumper):  # the filter's JSON as a readable block, as in the shipped file
        pass
    Dumper.add_representer(str, lambda d, v: d.represent_scalar(
        "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))
    dump = lambda doc: yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=100)  # noqa: E731

    endpoints = [f"127.0.0.1:{p}" for p in backend_ports]
    boot = yaml.safe_load((ROOT / "envoy/fleet.yaml").read_text())
    boot["node"]["id"] = f"kvgate-gateway-{j}"
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = boot["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    kvgate = next(f for f in hcm["http_filters"] if f["name"] == "kvgate")
    ecds_path = f".run/fleet-filter-{j}.yaml"
    kvgate["config_discovery"]["config_source"]["path_config_source"]["path"] = ecds_path
    cluster = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "kvgate_backend")
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in backend_ports]
    doc = yaml.safe_load((ROOT / "envoy/fleet-filter.yaml").read_text())
    wasm = doc["resources"][0]["typed_config"]["config"]
    cfg = json.loads(wasm["configuration"]["value"])
    cfg["gateway_id"] = j
    cfg["backend"]["endpoints"] = endpoints
    wasm["configuration"]["value"] = json.dumps(cfg, indent=2) + "\n"
    RUN.mkdir(exist_ok=True)
    note = "# Generated by `make up` from envoy/{} for gateway {}; `make up` rewrites it.\n"
    (ROOT / ecds_path).write_text(note.format("fleet-filter.yaml", j) + "# Edit live: write a new file, then "
                                  "`mv` it over this one (ECDS).\n" + dump(doc))
    path = RUN / f"gateway-{j}.yaml"
    path.write_text(note.format("fleet.yaml", j) + dump(boot))
    return str(path.relative_to(ROOT))


def down():
    """Stop every gateway, then every backend, that `up` started (by their pid files)."""
    names = sorted(RUN.glob("envoy*.pid")) + sorted(RUN.glob("backend*.pid")) if RUN.exists() else []
    for pid_file in names:
        name = pid_file.stem
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file.unlink()
        print(f"stopped {name}")


# ----- the demo ---------------------------------------------------------------------------------

FILLER = ("The gateway prices every request at the worst case it is allowed to reach, counting the "
          "prompt with the model's tokenizer and adding the whole output cap. ")
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Say hello in Spanish.", "What colour is the sky?", "Name a fruit."]


def kinds():
    """The seed's adversarial mix: (name, weight, class, request body, endpoint)."""
    q = lambda: [{"role": "user", "content": random.choice(QUESTIONS)}]  # noqa: E731
    return [
        # Big caps that the answers never use: what admission on prompt length alone lets through.
        ("short prompt, big cap", 4, lambda: ("batch", {"messages": q(), "max_tokens": random.randint(2500, 4000), "stop": ["\n", "."]})),
        ("short prompt, big cap (strict)", 2, lambda: ("standard", {"messages": q(), "max_tokens": random.randint(2500, 4000), "stop": ["\n", "."]})),
        ("unset cap", 1, lambda: ("standard", {"messages": q()})),
        ("long prompt, small cap", 3, lambda: ("interactive", {"messages": [{"role": "user", "content":
            FILLER * random.randint(12, 20) + " Summarize in one sentence."}], "max_tokens": 40})),
        ("prompt over the context", 1, lambda: ("standard", {"prompt": [1] * 9000, "max_tokens": 16})),
    ]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_kind = defaultdict(Counter)

    def add(self, kind, outcome):
        with self.lock:
            self.by_kind[kind][outcome] += 1


def send(kind, cls, body, stats):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    body = {"model": MODEL, "temperature": 0, **body}
    try:
        status, headers, raw = http("POST", GATEWAY + path, body, {"authorization": f"Bearer kvgate-demo-{cls}"})
    except OSError as e:  # includes timeouts: the client gives up (kvgate cancels it at the backend)
        stats.add(kind, f"client gave up ({type(e).__name__})")
        return 1
    headers = {k.lower(): v for k, v in headers.items()}
    if status == 200:
        stats.add(kind, "degraded" if "x-kvgate-degraded" in headers else "ok")
        return 0
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "unknown"
    stats.add(kind, f"{status} {code}")
    return int(headers.get("retry-after-ms", "0")) / 1000


def client(stop, stats, seed):
    random.seed(seed)
    table = kinds()
    while not stop.is_set():
        name, _, make = random.choices(table, weights=[k[1] for k in table])[0]
        cls, body = make()
        backoff = send(name, cls, body, stats)
        # A well-behaved client backs off for the time kvgate asked.
        stop.wait(backoff)


def fanout(stop, stats):
    """Bursts of agent fan-out: 6 parallel calls in several classes, every 8 seconds."""
    while not stop.wait(4):
        burst = [threading.Thread(target=send, args=("agent fan-out burst", cls, {
            "messages": [{"role": "user", "content": random.choice(QUESTIONS)}], "max_tokens": 1200, "stop": ["\n", "."]}, stats))
            for cls in ("vip", "interactive", "interactive", "batch", "batch", "standard")]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        stop.wait(4)


def stats_of(url, prefix):
    status, _, raw = http("GET", url)
    out = {}
    for line in raw.decode().splitlines():
        name, _, value = line.partition(": ") if ": " in line else line.partition(" ")
        if name.startswith(prefix):
            try:
                out[name.removeprefix(prefix)] = float(value)
            except ValueError:
                pass
    return out


def progress_line(t0):
    s = json.loads(http("GET", GATEWAY + "/kvgate/status")[2])
    e = stats_of(ADMIN + "/stats?filter=^wasmcustom", "wasmcustom.kvgate.")
    b = stats_of(BACKEND + "/metrics", "kvgate_backend_")
    rejected = lambda code: int(e.get(f"rejected.{code}", 0))  # noqa: E731
    return (f"[{time.time() - t0:5.1f}s] level {s['level']:<5} committed {s['committed_bytes'] / 2**20:6.1f}/"
            f"{s['capacity_bytes'] / 2**20:.1f} MiB  admitted {int(e.get('admitted', 0)):4d}  queued {s.get('queued', 0):2d}  "
            f"degraded {int(e.get('degraded', 0)):3d}  429 {rejected('kv_capacity_exceeded') + rejected('kv_queue_timeout') + rejected('kv_queue_full'):3d}  "
            f"413 {rejected('context_length_exceeded') + rejected('kv_request_too_large'):3d}  preempted {int(e.get('preempted', 0)):2d}  "
            f"backend KV {b.get('kv_used_bytes', 0) / 2**20:6.1f} MiB  drift {s.get('backend', {}).get('drift_bytes', 0) / 2**20:+5.1f} MiB  "
            f"KV OOM {int(b.get('kv_oom_total', 0))}")


def demo(seconds=40, clients=5):
    # --admission none: the backend does no check of its own, so only kvgate stands between
    # this traffic and a mid-decode KV OOM.
    up(admission="none")
    try:
        print(f"sending the adversarial mix for {seconds}s with {clients} clients + fan-out bursts "
              f"(backend KV pool {KV_BYTES / 2**20:.0f} MiB, admission none: only kvgate protects it)\n", flush=True)
        stats, stop, t0 = Stats(), threading.Event(), time.time()
        threads = [threading.Thread(target=client, args=(stop, stats, i)) for i in range(clients)]
        threads.append(threading.Thread(target=fanout, args=(stop, stats)))
        for t in threads:
            t.start()
        while time.time() - t0 < seconds:
            print(progress_line(t0), flush=True)
            time.sleep(1)
        stop.set()
        print("\nwaiting for in-flight requests to finish...", flush=True)
        for t in threads:
            t.join()
        deadline = time.time() + 60
        while time.time() < deadline:
            s = json.loads(http("GET", GATEWAY + "/kvgate/status")[2])
            used = stats_of(BACKEND + "/metrics", "kvgate_backend_").get("kv_used_bytes", 0)
            if s["committed_bytes"] == 0 and used == 0:
                break
            time.sleep(0.5)
        print(progress_line(t0))
        outcomes = sorted({o for c in stats.by_kind.values() for o in c})
        print("\n| request kind | sent | " + " | ".join(outcomes) + " |")
        print("|---|---|" + "---|" * len(outcomes))
        for kind, c in stats.by_kind.items():
            print(f"| {kind} | {sum(c.values())} | " + " | ".join(str(c.get(o, 0)) for o in outcomes) + " |")
        b = stats_of(BACKEND + "/metrics", "kvgate_backend_")
        s = json.loads(http("GET", GATEWAY + "/kvgate/status")[2])
        print(f"\nmid-decode KV OOMs at the backend: {int(b.get('kv_oom_total', 0))}")
        print(f"tokens generated: {int(b.get('generated_tokens_total', 0))}, requests decoded: {int(b.get('requests_total', 0))}")
        print(f"ledger committed at the end: {s['committed_bytes']} B; backend KV in use: {int(b.get('kv_used_bytes', 0))} B")
        if b.get("kv_oom_total", 0) or s["committed_bytes"]:
            sys.exit("FAILED: an OOM happened or the ledger did not drain")
    finally:
        down()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Run the kvgate stack in the background.", usage=__doc__)
    ap.add_argument("cmd", nargs="?", default="demo", choices=["up", "down", "demo"])
    ap.add_argument("--backends", type=int, default=1, help="backends on :8000, :8001, ... (up)")
    ap.add_argument("--gateways", type=int, default=1, help="gateways on :10000, :10001, ... (up)")
    a = ap.parse_args()
    if a.cmd == "up":
        up(backends=a.backends, gateways=a.gateways)
    elif a.cmd == "down":
        down()
    else:
        demo()
