import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (BACKEND, BLOCK_BYTES, MODEL, WASM, Backend, Envoy, fleet_bootstrap,  # noqa: E402
                     fleet_plugin_config, shipped_plugin_config)
from mock_upstream import MockUpstream  # noqa: E402


def teardown(request, processes, settled=None):
    """Stop every process; print its log when the test failed.

    A test that passed must leave what it started at rest: `settled(p)` asserts it for each
    process still running (a gateway's ledger and queue empty, a backend's pool empty), unless
    the test is marked `leaves_state` with the reason."""
    rep = getattr(request.node, "rep_call", None)
    failed = rep is not None and rep.failed
    try:
        if settled and rep is not None and rep.passed and not request.node.get_closest_marker("leaves_state"):
            for p in processes:
                if p.proc is not None and p.proc.poll() is None:
                    settled(p)
    except BaseException:
        failed = True
        raise
    finally:
        for p in processes:
            p.stop()
            if failed:
                print(f"----- {p.name} log ({p.log_path}) -----\n{p.logs()}")


def drained(envoy):
    """A gateway with the filter: committed bytes exactly zero, no lease, nothing queued."""
    if not envoy.plain:
        envoy.assert_drained()


@pytest.fixture(scope="session")
def wasm():
    assert WASM.exists(), f"{WASM} missing: run `make wasm` (make test does)"
    return WASM


@pytest.fixture(scope="session")
def upstream():
    up = MockUpstream().start()
    yield up
    up.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def gateway(request, tmp_path, wasm, upstream):
    """A factory: gateway(config_overrides, concurrency=2, ecds=False, bootstrap=None) -> started
    Envoy (`bootstrap`: the shipped one unless given)."""
    started = []

    def make(overrides=None, concurrency=2, ecds=False, bootstrap=None):
        cfg = shipped_plugin_config()
        cfg.update(overrides or {})
        d = tmp_path / f"envoy{len(started)}"
        d.mkdir()
        e = Envoy(d, upstream.port, cfg, concurrency=concurrency, ecds=ecds, bootstrap=bootstrap)
        started.append(e)
        return e.start()

    upstream.clear()
    yield make
    teardown(request, started, drained)


@pytest.fixture
def backend(request, tmp_path):
    """A factory: backend(*flags, secret=None) -> a started kvgate-backend with the real model
    (`secret`: its admission secret, one made up unless given; False: none, open on loopback)."""
    assert BACKEND.exists(), f"{BACKEND} missing: run `make backend-build` (make test does)"
    assert MODEL.exists(), f"{MODEL} missing: run `make setup` (make test does)"
    started = []

    def make(*args, secret=None):
        b = Backend(tmp_path, *args, secret=secret)
        started.append(b)
        return b.start()

    yield make
    teardown(request, started, lambda b: b.wait_pool_empty())


@pytest.fixture
def stack(request, tmp_path, wasm, backend):
    """The product: the real backend with the real model behind Envoy with the filter.

    stack(blocks, plugin_overrides, *backend_flags) -> (envoy, backend). The gateway's budget is
    the backend's KV pool, with one KV block of scratch margin per request (the backend rounds
    every reservation up to whole blocks), and the backend callout polling every 200 ms.
    """
    started = []

    def make(blocks=64, overrides=None, *backend_flags, concurrency=2, ecds=False, secret=None):
        b = backend("--kv-cache-bytes", blocks * BLOCK_BYTES, *backend_flags, secret=secret)
        cfg = shipped_plugin_config()
        cfg.update({
            "kv_budget_bytes": blocks * BLOCK_BYTES,
            "scratch_margin_bytes": BLOCK_BYTES,
            "backend": {"poll_ms": 200, "timeout_ms": 1000, "lost_grace_ms": 5000, "down_after_failures": 2},
        })
        cfg.update(overrides or {})
        cfg["backend"] = {**cfg["backend"], "secret": b.secret}
        d = tmp_path / f"stack{len(started)}"
        d.mkdir()
        e = Envoy(d, b.port, cfg, concurrency=concurrency, ecds=ecds)
        started.append(e)
        return e.start(), b

    yield make
    teardown(request, started, drained)


@pytest.fixture
def fleet(request, tmp_path, wasm, backend):
    """Several backends behind several gateways, each gateway built from envoy/fleet.yaml +
    envoy/fleet-filter.yaml: every backend is a host of its cluster and an endpoint of its filter.

    fleet(backends=2, gateways=1, blocks=64, overrides=None, *backend_flags, ecds=False)
    -> (gateways, backends). Every backend has a pool of `blocks` KV blocks (or blocks[i], a list
    per backend) and the same admission secret; gateway j has `gateway_id` j + 1, the first pool as
    its per-endpoint budget until each backend's descriptor arrives, one block of scratch margin,
    and polls every 200 ms (down after two failed polls).
    """
    started = []

    def make(backends=2, gateways=1, blocks=64, overrides=None, *backend_flags, ecds=False):
        secret = f"fleet-secret-{len(started)}"
        pools = blocks if isinstance(blocks, list) else [blocks] * backends
        bs = [backend("--kv-cache-bytes", n * BLOCK_BYTES, *backend_flags, secret=secret) for n in pools]
        gws = []
        for j in range(gateways):
            cfg = fleet_plugin_config()
            cfg.update({"kv_budget_bytes": pools[0] * BLOCK_BYTES, "scratch_margin_bytes": BLOCK_BYTES,
                        "gateway_id": j + 1})
            cfg["backend"] = {**cfg["backend"], "poll_ms": 200, "timeout_ms": 1000, "lost_grace_ms": 5000,
                              "down_after_failures": 2, "endpoints": [b.address for b in bs], "secret": secret}
            cfg.update(overrides or {})
            d = tmp_path / f"fleet{len(started)}"
            d.mkdir()
            e = Envoy(d, [b.port for b in bs], cfg, ecds=ecds, bootstrap=fleet_bootstrap())
            started.append(e)
            gws.append(e.start())
        return gws, bs

    yield make
    teardown(request, started, drained)
