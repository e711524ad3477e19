#!/usr/bin/env python3
"""How far an approximate tokenizer is from the model's own: the prompt tokens kvgate-backend
counts with SmolLM2's tokenizer (its `usage.prompt_tokens`) against kvgate-core's cl100k_base
count, per kind of text, and the count the filter prices after padding it (`tokenizer.multiplier`,
and the runs the approximation merges that the model may not: `kvgate_core::tokenize::
padded_count`). This is the figure behind `tokenizer.multiplier` in envoy/envoy.yaml.

    .venv/bin/python bench/tokenizer_ratio.py [--encoding cl100k_base] [--multiplier 1.6] [--only NAME]

Needs `make backend-build model` and `cargo build --release -p kvgate-core --example count`.
The texts: files of this repository (prose, code, YAML), seeded JSON records and numbers, and
one paragraph each of German, Russian and Chinese, repeated, and what a hostile client would send
(runs of one character, short units repeated). Each is cut into chunks that fit the model's
context and the counts are summed.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import Backend  # noqa: E402

COUNT = ROOT / "target" / "release" / "examples" / "count"
CHUNK_CHARS = 3000
HOSTILE_CHUNK_CHARS = 2000
MAX_CHARS = 12000

LANGUAGES = {
    "German prose": "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist "
                    "Verpflichtung aller staatlichen Gewalt. Das Deutsche Volk bekennt sich darum "
                    "zu unverletzlichen und unveräußerlichen Menschenrechten als Grundlage jeder "
                    "menschlichen Gemeinschaft, des Friedens und der Gerechtigkeit in der Welt. ",
    "Russian prose": "Все люди рождаются свободными и равными в своем достоинстве и правах. Они "
                     "наделены разумом и совестью и должны поступать в отношении друг друга в "
                     "духе братства. ",
    "Chinese prose": "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。",
}

HOSTILE = {
    "hostile: newlines": "\n",
    "hostile: dots": ".",
    "hostile: one letter": "a",
    "hostile: spaces": " ",
    "hostile: zero-width spaces": "\u200b",
    "hostile: emoji": "\U0001F600",
    "hostile: indented code": "\n" + " " * 16 + "x = 1",
    "hostile: newline, space": "\n ",
    "hostile: path": "a/b/c/d/",
    "hostile: newline, tab": "\n\t",
    "hostile: space, tab": " \t",
    "hostile: dash, underscore": "-_",
    "hostile: apostrophe, letter": "'a",
    "hostile: comment opener": "/**\n",
}


def texts():
    rng = random.Random(1)
    yield "English prose (README.md)", (ROOT / "README.md").read_text()
    yield "Rust (core/src/ledger.rs)", (ROOT / "core" / "src" / "ledger.rs").read_text()
    yield "Python (bench/admission_bench.py)", (ROOT / "bench" / "admission_bench.py").read_text()
    yield "YAML (envoy/fleet-filter.yaml)", (ROOT / "envoy" / "fleet-filter.yaml").read_text()
    records = [{"id": i, "name": f"user{i}", "score": rng.random(), "tags": ["a", "bb", "ccc"][: i % 3 + 1]}
               for i in range(600)]
    yield "JSON records", json.dumps(records)
    for name, paragraph in LANGUAGES.items():
        yield name, paragraph * (MAX_CHARS // len(paragraph) + 1)
    yield "numbers (9-digit, spaced)", " ".join(str(rng.randint(0, 10**9)) for _ in range(3000))
    # What a hostile client would send: runs the approximation merges and the model does not.
    for name, unit in HOSTILE.items():
        yield name, unit * (MAX_CHARS // len(unit) + 1)


def approximate(encoding, multiplier, text, scratch):
    """(the encoding's count, the filter's padded count) of one chunk."""
    scratch.write_text(text)
    out = subprocess.check_output([str(COUNT), encoding, str(scratch), "1", str(multiplier)], text=True)
    counted, _, padded, _ = out.split()
    return int(counted), int(padded)


def exact(backend, text):
    r = requests.post(backend.url + "/v1/completions", timeout=300,
                      json={"model": "smollm2-135m-instruct", "prompt": text, "max_tokens": 1})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoding", default="cl100k_base")
    ap.add_argument("--multiplier", type=float, default=1.6, help="tokenizer.multiplier (envoy/envoy.yaml's)")
    ap.add_argument("--only", action="append", default=[],
                    help="measure only the texts whose name contains this (repeatable)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        backend = Backend(tmp)
        backend.start()
        scratch = Path(tmp) / "chunk.txt"
        try:
            enc, m = args.encoding, args.multiplier
            print(f"| text | model's tokens | {enc} tokens | model / {enc} | priced (x{m} + runs) | priced / model |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, text in texts():
                if args.only and not any(o in name for o in args.only):
                    continue
                text = text[:MAX_CHARS]
                # The hostile texts in smaller chunks: the model counts up to 3 tokens a character.
                size = CHUNK_CHARS if not name.startswith("hostile") else HOSTILE_CHUNK_CHARS
                chunks = [text[i:i + size] for i in range(0, len(text), size)]
                model = sum(exact(backend, c) for c in chunks)
                counts = [approximate(enc, m, c, scratch) for c in chunks]
                approx, priced = (sum(c[i] for c in counts) for i in (0, 1))
                print(f"| {name} | {model:,} | {approx:,} | {model / approx:.2f} | {priced:,} | {priced / model:.2f} |",
                      flush=True)
        finally:
            backend.stop()


if __name__ == "__main__":
    main()
