"""Every configuration that ships is accepted by a real Envoy loading the real filter."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import ENVOY, ROOT, WASM, Envoy, api_key_entry, fleet_bootstrap, fleet_plugin_config, free_port

SHIPPED_FILTERS = ["envoy/kvgate-filter.yaml", "envoy/compose/kvgate-filter.yaml", "envoy/fleet-filter.yaml"]


def plugin_json(path):
    doc = yaml.safe_load((ROOT / path).read_text())
    cfg = doc["resources"][0]["typed_config"]["config"]["configuration"]["value"]
    return json.loads(cfg)


DEPLOYABLE = ["envoy/compose/kvgate-filter.yaml", "envoy/compose/fleet-filter.yaml",
              "envoy/istio/wasmplugin.yaml", "envoy/istio/fleet-wasmplugin.yaml"]


def shipped_config(path):
    if path.startswith("envoy/istio/"):
        return yaml.safe_load((ROOT / path).read_text())["spec"]["pluginConfig"]
    return plugin_json(path)


def filled_in(cfg):
    """A deployable sample as its operator fills it in: each placeholder API key replaced by the
    digest of a key of their own, the placeholder secret by theirs."""
    keys = cfg["policy"].get("api_keys", {})
    cfg["policy"]["api_keys"] = {
        (api_key_entry(f"own-key-{i}") if k.startswith("sha256:REPLACE") else k): c
        for i, (k, c) in enumerate(keys.items())}
    if cfg["backend"].get("secret", "").startswith("REPLACE"):
        cfg["backend"]["secret"] = "an-operators-own-secret"
    return cfg


def test_deployable_samples_carry_no_credential_and_refuse_to_load_until_filled_in(tmp_path, wasm, upstream):
    """The demo keys (vip preempts everyone) and a usable secret live only in the local configs
    (`make up`): the compose and Istio samples carry placeholders the filter refuses, naming them."""
    demo_digests = {api_key_entry(f"kvgate-demo-{c}") for c in ("batch", "interactive", "vip")}
    for i, name in enumerate(DEPLOYABLE):
        text = (ROOT / name).read_text()
        assert not any(d.removeprefix("sha256:") in text for d in demo_digests), name
        assert "kvgate-compose-demo-secret" not in text, name
        cfg = shipped_config(name)
        assert cfg["backend"]["secret"].startswith("REPLACE"), name
        assert cfg.get("status_path", "") == "", f"{name}: the status page is off where clients reach the listener"
        d = tmp_path / str(i)
        d.mkdir()
        gw = Envoy(d, upstream.port, cfg)
        try:
            with pytest.raises(RuntimeError) as e:
                gw.start(timeout=20)
        finally:
            gw.stop()
        assert "REPLACE" in str(e.value), name
    assert "kvgate-compose-demo-secret" not in (ROOT / "docker-compose.yml").read_text()


def test_each_shipped_plugin_configuration_is_accepted(tmp_path, wasm, upstream):
    configs = {p: filled_in(shipped_config(p)) for p in SHIPPED_FILTERS + DEPLOYABLE[2:]}
    status_off = []
    for i, (name, cfg) in enumerate(configs.items()):
        d = tmp_path / str(i)
        d.mkdir()
        if cfg.get("status_path", "") == "":
            # Off, as the status page is by default (clients can reach the listener): turned on
            # here only to read what the filter made of the rest.
            status_off.append(name)
            cfg = {**cfg, "status_path": "/kvgate/status"}
        e = Envoy(d, upstream.port, cfg)
        try:
            e.start()
            s = e.status()
            usable = int(cfg["kv_budget_bytes"] * cfg["safety_fraction"])
            endpoints = cfg["backend"].get("endpoints", [])
            if endpoints:
                # A fleet: one ledger per endpoint, each priced against the (fallback) budget.
                assert [x["address"] for x in s["endpoints"]] == endpoints, name
                assert all(x["capacity_bytes"] == usable for x in s["endpoints"]), name
            else:
                assert s["capacity_bytes"] == usable, name
            assert set(s["classes"]) == set(cfg["policy"]["classes"]), name
        finally:
            e.stop()
    assert status_off == DEPLOYABLE[:1] + DEPLOYABLE[2:]


def test_fleet_gateway_starts_with_its_endpoints(tmp_path, wasm):
    """envoy/fleet.yaml with envoy/fleet-filter.yaml (by ECDS, as shipped) on free ports, its two
    backends nowhere: Envoy loads the override_host cluster and the header_mutation chain, the
    filter lists both endpoints, and both are reported down."""
    ports = [free_port(), free_port()]
    cfg = fleet_plugin_config()
    cfg["backend"] = {**cfg["backend"], "endpoints": [f"127.0.0.1:{p}" for p in ports],
                      "poll_ms": 200, "timeout_ms": 300, "down_after_failures": 1}
    e = Envoy(tmp_path, ports, cfg, ecds=True, bootstrap=fleet_bootstrap())
    try:
        e.start()
        s = e.wait_for(lambda s: [x["up"] for x in s["endpoints"]] == [False, False], what="both endpoints down")
        assert [x["address"] for x in s["endpoints"]] == cfg["backend"]["endpoints"]
        assert s["committed_bytes"] == 0 and s["level"] == "red"
    finally:
        e.stop()


def validate(path):
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path), "-l", "error"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


def test_compose_gateways_validate_with_their_mounts(tmp_path, wasm):
    for gateway, filter_config in (("gateway.yaml", "kvgate-filter.yaml"), ("fleet.yaml", "fleet-filter.yaml")):
        text = (ROOT / "envoy/compose" / gateway).read_text()
        text = text.replace(f"/etc/kvgate/conf/{filter_config}", str(ROOT / "envoy/compose" / filter_config))
        cfg = tmp_path / gateway
        cfg.write_text(text)
        validate(cfg)


def cluster_hosts(bootstrap):
    cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvgate_backend")
    return [f"{a['address']}:{a['port_value']}" for a in
            (e["endpoint"]["address"]["socket_address"] for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"])]


def test_fleet_endpoints_name_the_cluster_hosts():
    """override_host matches a host by its address: every shipped fleet's endpoint list is exactly
    its cluster's hosts (and, in compose, the backends' fixed addresses)."""
    for boot, filt in (("envoy/fleet.yaml", "envoy/fleet-filter.yaml"),
                       ("envoy/compose/fleet.yaml", "envoy/compose/fleet-filter.yaml")):
        hosts = cluster_hosts(yaml.safe_load((ROOT / boot).read_text()))
        assert plugin_json(filt)["backend"]["endpoints"] == hosts, boot
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for a, b in (("backend", "backend-b"), ("backend-cpu", "backend-cpu-b")):
        addrs = [compose[x]["networks"]["default"]["ipv4_address"] + ":8000" for x in (a, b)]
        assert addrs == plugin_json("envoy/compose/fleet-filter.yaml")["backend"]["endpoints"], (a, b)


def test_istio_resources_are_well_formed():
    for f in ("envoy/istio/wasmplugin.yaml", "envoy/istio/fleet-wasmplugin.yaml"):
        plugin = yaml.safe_load((ROOT / f).read_text())
        assert plugin["kind"] == "WasmPlugin" and plugin["spec"]["failStrategy"] == "FAIL_CLOSE", f
        cfg = plugin["spec"]["pluginConfig"]
        assert cfg["model"] == "from_backend", "priced with the backend's own tokenizer and template"
        # A sample applied as it is must not let a client pick its class with a header.
        assert not cfg["policy"].get("class_header_trusted", False), f
        assert cfg["max_body_bytes"] <= 1 << 20, "within Envoy's default per-connection buffer"
    sidecar = yaml.safe_load((ROOT / "envoy/istio/wasmplugin.yaml").read_text())["spec"]
    assert sidecar["match"] == [{"mode": "SERVER"}], "inbound only: outbound calls have no buffer filter"
    buf = yaml.safe_load((ROOT / "envoy/istio/buffer-envoyfilter.yaml").read_text())
    patch = buf["configPatches"][0] if "configPatches" in buf else buf["spec"]["configPatches"][0]
    assert patch["patch"]["value"]["name"] == "envoy.filters.http.buffer"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"


def test_istio_fleet_patches_are_the_verified_chain(tmp_path):
    """The fleet EnvoyFilter inserts buffer then header_mutation before the router, and its
    CLUSTER patch, merged into a cluster as Istio builds it (lb_policy LEAST_REQUEST), gives a
    bootstrap Envoy accepts: envoy/fleet.yaml with the Istio patches in place of its own."""
    doc = yaml.safe_load((ROOT / "envoy/istio/fleet-envoyfilter.yaml").read_text())
    patches = doc["spec"]["configPatches"]
    filters = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    assert [f["name"] for f in filters] == ["envoy.filters.http.buffer", "envoy.filters.http.header_mutation"]
    assert all(p["patch"]["operation"] == "INSERT_BEFORE" and p["match"]["listener"]["filterChain"]["filter"]
               ["subFilter"]["name"] == "envoy.filters.http.router" for p in patches if p["applyTo"] == "HTTP_FILTER")
    (cluster_patch,) = [p for p in patches if p["applyTo"] == "CLUSTER"]
    assert cluster_patch["patch"]["operation"] == "MERGE"
    boot = fleet_bootstrap()
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    shipped = [f for f in hcm["http_filters"] if f["name"] != "kvgate"]
    assert [f["name"] for f in shipped] == [f["name"] for f in filters] + ["envoy.filters.http.router"]
    assert filters[1] == shipped[1], "the Istio header_mutation is envoy/fleet.yaml's"
    hcm["http_filters"] = [hcm["http_filters"][0], *filters, shipped[-1]]
    hcm["http_filters"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(WASM)
    cluster = boot["static_resources"]["clusters"][0]
    cluster.pop("load_balancing_policy")
    cluster["lb_policy"] = "LEAST_REQUEST"
    cluster.update(cluster_patch["patch"]["value"])
    cfg = tmp_path / "istio-fleet.json"
    cfg.write_text(json.dumps(boot))
    validate(cfg)


def test_docker_compose_file_is_valid():
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "KVGATE_ADMISSION_SECRET": "an-operators-own-secret"})
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = doc["services"]["backend"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    second = doc["services"]["backend-b"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert second["device_ids"] == ["1"], "the fleet's second GPU backend gets the second GPU"
    assert doc["services"]["gateway-fleet"]["profiles"] == ["gpu-fleet", "cpu-fleet"]
    assert doc["services"]["backend"]["build"]["dockerfile"] == "backend/Dockerfile.cuda"
    assert doc["services"]["backend-cpu"]["build"]["dockerfile"] == "backend/Dockerfile"
    assert Path(ROOT / "backend/Dockerfile.cuda").exists() and Path(ROOT / "backend/Dockerfile").exists()
    services = doc["services"]
    # Every backend takes the secret the gateways' callouts carry (its admission API answers no
    # one else), from the operator's environment: compose refuses to start without it.
    for b in ("backend", "backend-b", "backend-cpu", "backend-cpu-b"):
        assert services[b]["environment"]["KVGATE_ADMISSION_SECRET"].startswith("${KVGATE_ADMISSION_SECRET:?"), b
    unset = {k: v for k, v in os.environ.items() if k != "KVGATE_ADMISSION_SECRET"}
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True, cwd=ROOT, env=unset)
    assert out.returncode != 0 and "KVGATE_ADMISSION_SECRET" in out.stderr, out.stderr
    for f in ("envoy/compose/kvgate-filter.yaml", "envoy/compose/fleet-filter.yaml"):
        assert plugin_json(f)["model"] == "from_backend", "priced with the backend's own tokenizer and template"
    # The filter configs are edited live by renaming a new file over the old one: the gateway
    # must mount their directory (a file mounted on its own keeps its old inode in the container).
    for gw, conf in (("gateway", "gateway.yaml"), ("gateway-fleet", "fleet.yaml")):
        mounts = dict(v.rsplit(":", 2)[:2] for v in services[gw]["volumes"])
        assert mounts["./envoy/compose"] == "/etc/kvgate/conf", mounts
        assert f"/etc/kvgate/conf/{conf}" in services[gw]["command"]
