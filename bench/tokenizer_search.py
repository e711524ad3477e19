#!/usr/bin/env python3
"""Where the approximate tokenizer's padded count falls short of the model's: a seeded search
over short units repeated (1,506 of them, 1-7 characters from an alphabet of letters, digits,
spaces and symbols), each priced by the filter (`core/examples/count.rs`: cl100k_base times the
multiplier, padded by `kvgate_core::tokenize::padded_count`) and counted by SmolLM2's own
tokenizer, rebuilt offline from the GGUF (its vocabulary and merges, and the pre-tokenizer
FACTS.md names: digits one by one, then GPT-2's byte-level pattern). Prints the units priced
lowest against the model's count and how many are priced under it.

    .venv/bin/python bench/tokenizer_search.py [--multiplier 1.6] [--count PATH] [--top 25]

Needs `make model` and `cargo build --release -p kvgate-core --example count`; `--count` takes
another build of the example (an older commit's, to compare).
"""

import argparse
import itertools
import random
import subprocess
import tempfile
from pathlib import Path

import gguf
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ALPHABET = ["a", "A", "1", " ", "\n", "\t", ".", "-", "_", "/", "(", ")", "'", '"', "é", "中",
            "\U0001F600", "=", ",", "\r", "#", "*"]
CHARS = 1200


def smollm2():
    reader = gguf.GGUFReader(str(MODEL))

    def strings(name):
        field = reader.fields[name]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = {t: i for i, t in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tokenizer


def units():
    rng = random.Random(1)
    yield from ALPHABET
    yield from ("".join(p) for p in itertools.product(ALPHABET, repeat=2))
    yield from ("".join(rng.choice(ALPHABET) for _ in range(3)) for _ in range(600))
    yield from ("".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 7))) for _ in range(400))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--multiplier", type=float, default=1.6, help="tokenizer.multiplier (envoy/envoy.yaml's)")
    ap.add_argument("--count", default=str(ROOT / "target" / "release" / "examples" / "count"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    tokenizer = smollm2()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "unit.txt"
        for unit in units():
            text = unit * (CHARS // len(unit))
            model = len(tokenizer.encode(text).ids)
            scratch.write_text(text)
            out = subprocess.check_output([args.count, "cl100k_base", str(scratch), "1", str(args.multiplier)],
                                          text=True).split()
            approx, priced = int(out[0]), int(out[2])
            rows.append((priced / model, unit, model, approx, priced))
    rows.sort()
    print("| priced / model | unit | model's tokens | cl100k_base | priced |")
    print("|---:|---|---:|---:|---:|")
    for ratio, unit, model, approx, priced in rows[:args.top]:
        print(f"| {ratio:.2f} | {unit!r} | {model:,} | {approx:,} | {priced:,} |")
    under = [r for r in rows if r[0] < 1.0]
    print(f"\npriced under the model's count: {len(under)} of {len(rows)}; lowest {rows[0][0]:.2f}")


if __name__ == "__main__":
    main()
