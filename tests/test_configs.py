"""Every configuration that ships is accepted by a real Envoy loading the real filter."""

import json
import subprocess
from pathlib import Path

import yaml

from harness import ENVOY, ROOT, Envoy

SHIPPED_FILTERS = ["envoy/kvgate-filter.yaml", "envoy/compose/kvgate-filter.yaml"]


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
            assert s["capacity_bytes"] == int(cfg["kv_budget_bytes"] * cfg["safety_fraction"]), name
            assert set(s["classes"]) == set(cfg["policy"]["classes"]), name
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
