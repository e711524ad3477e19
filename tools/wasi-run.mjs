// Runs a wasm32-wasip1 program (e.g. a `cargo test` binary) under Node's WASI, so core's tests
// execute inside a wasm VM — the same target the Envoy filter is built for. Used as the cargo
// runner: CARGO_TARGET_WASM32_WASIP1_RUNNER="node tools/wasi-run.mjs".
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import process from 'node:process';

const [file, ...args] = process.argv.slice(2);
const wasi = new WASI({
  version: 'preview1',
  args: [file, ...args],
  // Property tests run 64 cases here (256 natively, the same code): the wasm VM is what this
  // run checks, and its interpreter-free but debug build runs them ~4x slower than native.
  env: {
    RUST_BACKTRACE: '0',
    PROPTEST_DISABLE_FAILURE_PERSISTENCE: '1',
    PROPTEST_CASES: process.env.PROPTEST_CASES ?? '64',
  },
  returnOnExit: true,
});
const module = await WebAssembly.compile(await readFile(file));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
const code = wasi.start(instance);
process.exit(code);
