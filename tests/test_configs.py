"""Every configuration that ships is accepted by a real Envoy loading the real filter."""

import json
import subprocess
from pathlib import Path

import yaml

from harness import ENVOY, ROOT, Envoy, fleet_bootstrap, fleet_plugin_config, free_port

SHIPPED_FILTERS = ["envoy/kvgate-filter.yaml", "envoy/compose/kvgate-filter.yaml", "envoy/fleet-filter.yaml"]


def plugin_json(path):
    doc = yaml.safe_load((ROOT / path).read_text())
    cfg = doc["resources"][0]["typed_config"]["config"]["configuration"]["value"]
    return json.loads(cfg)


def test_each_shipped_plugin_configuration_is_accepted(tmp_path, wasm, upstream):
    configs = {p: plugin_json(p) for p in SHIPPED_FILTERS}
    istio = yaml.safe_load((ROOT / "envoy/istio/wasmplugin.yaml").read_text())
    configs["envoy/istio/wasmplugin.yaml"] = istio["spec"]["pluginConfig"]
    for i, (name, cfg) in enumerate(configs.items()):
        d = tmp_path / str(i)
        d.mkdir()
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


def test_compose_gateway_validates_with_its_mounts(tmp_path, wasm):
    text = (ROOT / "envoy/compose/gateway.yaml").read_text()
    text = text.replace("/etc/kvgate/kvgate-filter.yaml", str(ROOT / "envoy/compose/kvgate-filter.yaml"))
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(text)
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(cfg), "-l", "error"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


def test_istio_resources_are_well_formed():
    plugin = yaml.safe_load((ROOT / "envoy/istio/wasmplugin.yaml").read_text())
    assert plugin["kind"] == "WasmPlugin" and plugin["spec"]["failStrategy"] == "FAIL_CLOSE"
    buf = yaml.safe_load((ROOT / "envoy/istio/buffer-envoyfilter.yaml").read_text())
    patch = buf["configPatches"][0] if "configPatches" in buf else buf["spec"]["configPatches"][0]
    assert patch["patch"]["value"]["name"] == "envoy.filters.http.buffer"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"


def test_docker_compose_file_is_valid():
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = doc["services"]["backend"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert doc["services"]["backend"]["build"]["dockerfile"] == "backend/Dockerfile.cuda"
    assert doc["services"]["backend-cpu"]["build"]["dockerfile"] == "backend/Dockerfile"
    assert Path(ROOT / "backend/Dockerfile.cuda").exists() and Path(ROOT / "backend/Dockerfile").exists()
