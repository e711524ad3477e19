"""Real processes for end-to-end tests: Envoy with the freshly built kvgate .wasm.

Envoy runs on free ports with the shipped envoy/envoy.yaml, rewritten only where a test must
(ports, the upstream, the plugin configuration, concurrency). A readiness loop also checks the
child is alive; logs are dumped when a test fails; teardown always kills the process.
"""

import copy
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
WASM = ROOT / "target" / "wasm32-wasip1" / "wasm" / "kvgate_plugin.wasm"
ENVOY = ROOT / ".venv" / "bin" / "envoy"
BACKEND = ROOT / "target" / "release" / "kvgate-backend"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_BYTES = 16 * 46_080  # SmolLM2-135M, f32 KV, 16-token blocks
SHIPPED = ROOT / "envoy" / "envoy.yaml"
FLEET = ROOT / "envoy" / "fleet.yaml"
FLEET_FILTER = ROOT / "envoy" / "fleet-filter.yaml"
VLLM_SERVE = ROOT / "tools" / "vllm-serve.sh"
VLLM_BLOCK = 128  # tokens a block of the vLLM tools/vllm-serve.sh starts


def _ephemeral_low():
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port():
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) can be taken as the source port of any outgoing connection before the child binds it
    (CI saw Envoy fail with "Address already in use" so), while ports below that range are only
    taken by an explicit bind. Random, so parallel test workers rarely pick the same one."""
    lo = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_key_entry(key):
    """How `policy.api_keys` names an API key: its SHA-256, never the key itself."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def unclaimed_bytes(status):
    """From a /kvgate/status document, the room neither committed nor held back. Unlike its
    `free_bytes`, what places in the fair-retry line hold counts as room: a refused request's own
    place holds part of what it waits for. The slack (the time-aware worst case) is room too."""
    return (status["capacity_bytes"] + status["slack_bytes"] - status["committed_bytes"]
            - status["held_back_bytes"])


def shipped_bootstrap():
    return yaml.safe_load(SHIPPED.read_text())


def http_connection_manager(bootstrap):
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def wasm_filter(bootstrap):
    return next(f for f in http_connection_manager(bootstrap)["http_filters"] if f["name"] == "kvgate")


def shipped_plugin_config():
    f = wasm_filter(shipped_bootstrap())
    return json.loads(f["typed_config"]["config"]["configuration"]["value"])


def fleet_filter():
    """The wasm filter's typed_config that envoy/fleet-filter.yaml delivers by ECDS."""
    return yaml.safe_load(FLEET_FILTER.read_text())["resources"][0]["typed_config"]


def fleet_bootstrap():
    """envoy/fleet.yaml (one gateway, several backends, override_host on the backend cluster) with
    the filter of envoy/fleet-filter.yaml inline, the shape `Envoy` rewrites."""
    boot = yaml.safe_load(FLEET.read_text())
    f = wasm_filter(boot)
    f.clear()
    f.update({"name": "kvgate", "typed_config": fleet_filter()})
    return boot


def fleet_plugin_config():
    return json.loads(fleet_filter()["config"]["configuration"]["value"])


def endpoint_address(port):
    """How the fleet's cluster and the filter's `backend.endpoints` name a local backend."""
    return f"127.0.0.1:{port}"


class Process:
    """A child process on free ports: a readiness loop that also checks the child is alive,
    logs kept for failure reports, teardown that always ends it."""

    name = "process"

    def launch(self, args, ready, timeout):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if ready():
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in {timeout}s:\n{self.logs()}")

    def cpu_seconds(self):
        """User + system CPU time the process has used so far (Linux /proc), or None."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def logs(self):
        try:
            return self.log_path.read_text()[-20000:]
        except OSError:
            return ""


class Envoy(Process):
    name = "envoy"

    def __init__(self, workdir, upstream_port, plugin_config, concurrency=2, ecds=False, bootstrap=None,
                 plain=False, wasm=None):
        """`upstream_port`: one port, or a list of them (every host of the backend cluster, as in
        envoy/fleet.yaml). `bootstrap`: the shipped envoy/envoy.yaml unless given (e.g.
        `fleet_bootstrap()`). `plain`: the same Envoy without the kvgate filter (what a mesh
        in front of another server runs). `wasm`: the filter module (the built one, WASM, unless
        given)."""
        self.plain = plain
        self.workdir = Path(workdir)
        self.port = free_port()
        self.admin_port = free_port()
        self.upstream_port = upstream_port
        self.concurrency = concurrency
        self.ecds_path = self.workdir / "kvgate-filter.yaml" if ecds else None
        self.log_path = self.workdir / "envoy.log"
        self.proc = None
        self.plugin_config = plugin_config
        boot = bootstrap or shipped_bootstrap()
        boot["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        listener = boot["static_resources"]["listeners"][0]
        listener["address"]["socket_address"]["port_value"] = self.port
        cluster = boot["static_resources"]["clusters"][0]
        ports = upstream_port if isinstance(upstream_port, (list, tuple)) else [upstream_port]
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in ports]
        f = wasm_filter(boot)
        f["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm or WASM)
        self.filter_template = copy.deepcopy(f)
        if ecds:
            self.write_filter_config(plugin_config)
            f.clear()
            f.update({
                "name": "kvgate",
                "config_discovery": {
                    "config_source": {
                        "resource_api_version": "V3",
                        "path_config_source": {"path": str(self.ecds_path)},
                    },
                    "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"],
                },
            })
        else:
            f["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin_config)
        if plain:
            hcm = http_connection_manager(boot)
            hcm["http_filters"] = [x for x in hcm["http_filters"] if x["name"] != "kvgate"]
        self.config_path = self.workdir / "envoy.json"
        self.config_path.write_text(json.dumps(boot))

    def write_filter_config(self, plugin_config):
        """ECDS: write the filter's config to a new file and rename it over the watched one."""
        self.plugin_config = plugin_config
        f = copy.deepcopy(self.filter_template)
        f["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin_config)
        doc = {"resources": [{
            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
            "name": "kvgate",
            "typed_config": f["typed_config"],
        }]}
        tmp = self.ecds_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.ecds_path)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self):
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout=60):
        args = [str(ENVOY), "-c", str(self.config_path), "--concurrency", str(self.concurrency),
                "--base-id", str(self.admin_port), "-l", os.environ.get("ENVOY_LOG_LEVEL", "info"),
                "--disable-hot-restart"]

        def ready():
            # Admin ready, and the filter answering on the listener.
            return (requests.get(self.admin + "/ready", timeout=1).status_code == 200
                    and (self.plain or requests.get(self.url + "/kvgate/status", timeout=2).status_code == 200))
        return self.launch(args, ready, timeout)

    def status(self):
        r = requests.get(self.url + "/kvgate/status", timeout=5)
        r.raise_for_status()
        return r.json()

    def endpoint(self, address, status=None):
        """One endpoint's entry of the status page (a fleet gateway), or None when not listed."""
        s = status or self.status()
        return next((e for e in s.get("endpoints", []) if e["address"] == address), None)

    def stats(self):
        """kvgate's Envoy stats (admin /stats; Envoy files wasm metrics under `wasmcustom.`)."""
        text = requests.get(self.admin + "/stats?filter=^wasmcustom\\.kvgate", timeout=5).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name.removeprefix("wasmcustom.")] = int(value)
        return out

    def wait_for(self, predicate, timeout=15, what="condition"):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            last = self.status()
            if predicate(last):
                return last
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(last)}")

    def assert_drained(self, timeout=15):
        """The ledger's committed bytes return to exactly zero, and nothing waits in the queue."""
        s = self.wait_for(lambda s: s["committed_bytes"] == 0 and s["leases"] == 0 and s["queued"] == 0,
                          timeout, "committed bytes to return to zero and the queue to empty")
        assert s["committed_bytes"] == 0 and s["queued"] == 0
        return s


class Backend(Process):
    """The real kvgate-backend binary with the real model, on a free port."""

    name = "backend"

    def __init__(self, workdir, *args, port=None, secret=None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        # The gateway's credential for the admission API and lease headers (what the filter
        # sends as x-kvgate-secret; the stack fixture gives it to the filter too). Backends
        # behind one gateway share one (the filter sends one secret to every endpoint).
        # False: no secret (the admission API is then open, on loopback).
        self.secret = "" if secret is False else (secret or f"test-secret-{self.port}")
        secret_args = []
        if self.secret:
            secret_file = self.workdir / f"admission-secret-{self.port}"
            secret_file.write_text(self.secret + "\n")
            secret_args = ["--admission-secret-file", str(secret_file)]
        self.args = [str(BACKEND), "--model", str(MODEL), "--port", str(self.port),
                     *secret_args, *map(str, args)]
        self.log_path = self.workdir / f"backend-{self.port}.log"
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self):
        return endpoint_address(self.port)

    def kill(self):
        """SIGKILL: the backend dies with whatever it was doing (no graceful end of streams)."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def start(self, timeout=60):
        return self.launch(self.args, lambda: requests.get(self.url + "/health", timeout=1).status_code == 200, timeout)

    def leases(self, since=0):
        r = requests.get(self.url + f"/v1/admission/leases?since={since}", timeout=5, headers=self.gateway_headers())
        r.raise_for_status()
        return r.json()

    def gateway_headers(self, **extra):
        """Headers only the gateway can send: the admission secret (plus `extra`)."""
        return {"x-kvgate-secret": self.secret, **{k.replace("_", "-"): v for k, v in extra.items()}}

    def metrics(self):
        """`name value` and `name{labels} value` samples (OpenMetrics text), keyed by everything
        before the value: `kvgate_backend_requests_total`, `..._seconds_bucket{le="0.004"}`."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_pool_empty(self, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.leases()
            if state["pool"]["used_bytes"] == 0 and not state["leases"]:
                return state
            time.sleep(0.05)
        raise AssertionError(f"backend KV pool not empty: {json.dumps(self.leases())}")


class Vllm(Process):
    """A real vLLM (`make vllm`) serving the shipped model converted for it, with a pool of
    `blocks` blocks of 128 tokens (tools/vllm-serve.sh)."""

    name = "vllm"

    def __init__(self, workdir, blocks=45, port=None):
        self.port = port or free_port()
        self.blocks = blocks
        self.log_path = Path(workdir) / "vllm.log"
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def context(self):
        """The context it serves (tools/vllm-serve.sh: the pool less one block)."""
        return (self.blocks - 1) * VLLM_BLOCK

    def start(self, timeout=400):
        assert (ROOT / ".vllm" / ".ok").exists(), "no vLLM: run `make vllm`"
        # Its own process group: the API server starts an engine and workers.
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(VLLM_SERVE), str(self.port), str(self.blocks)],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm not ready in {timeout}s:\n{self.logs()}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc:
            self.log.close()

    def metrics(self):
        """The vLLM gauges and counters kvgate reads, by name (summed over label sets)."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:") and not line.startswith("vllm:cache_config_info"):
                name = line.split("{")[0].split(" ")[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def vllm_plugin_config(vllm, **extra):
    """The filter in front of `vllm`: the model's spec and exact tokenizer as
    `kvgate-backend --describe` writes them (bf16 KV, vLLM's context), the pool from its
    metrics (`backend.api: vllm`), and the shipped config's other settings."""
    desc = json.loads(subprocess.run(
        [str(BACKEND), "--model", str(MODEL), "--dtype", "bf16", "--max-context", str(vllm.context),
         "--describe"], check=True, capture_output=True, text=True).stdout)
    per_token = 2 * desc["model"]["layers"] * desc["model"]["kv_heads"] * desc["model"]["head_dim"] * 2
    cfg = {
        "model": desc["model"],
        "tokenizer": desc["tokenizer"],
        "kv_budget_bytes": vllm.blocks * VLLM_BLOCK * per_token,
        "scratch_margin_bytes": VLLM_BLOCK * per_token,
        "status_path": "/kvgate/status",
        "retry_after": {"min_ms": 500, "max_ms": 10000, "jitter": 0.25, "default_lease_ms": 3000},
        "backend": {"api": "vllm", "cluster": "kvgate_backend", "poll_ms": 500},
    }
    cfg.update(extra)
    return cfg
