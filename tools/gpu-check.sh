#!/usr/bin/env bash
# GPU readiness check, run ON a CUDA machine from the repository root, with the prebuilt bundle
# that `make gpu-bundle` puts in .gpu/ (that machine has no Rust toolchain and no network):
#
#   tools/gpu-check.sh            # results also land in $OUT (or .gpu/out when OUT is unset)
#
# GPU_CHECK_DEVICE=cpu SKIP_LLAMA8B=1 tools/gpu-check.sh is a dry run of the script itself on a
# machine without a GPU (the binaries still need the CUDA 13 libraries, or stubs, to load).
#
# 1. finds the CUDA 13 user-space libraries the binaries link (cuBLAS, cuBLASLt, cuRAND, NVRTC,
#    cudart) — in a PyTorch venv's nvidia/*/lib, a CUDA toolkit or the system — and sets
#    LD_LIBRARY_PATH; the driver's libcuda.so.1 comes from the system;
# 2. correctness: CPU vs cuda:0 on the same synthetic weights (gpu_check --check-only);
# 3. decode throughput on cuda:0 for the smollm2 and llama8b synthetic shapes: time to first
#    token, single-stream and 8/16-stream aggregate tok/s (gpu_check --bench-only);
# 4. the server itself: kvgate-backend --synthetic smollm2 --device cuda:0, one chat completion.
# Prints the tables; exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${GPU_BUNDLE:-.gpu}
OUT=${OUT:-$BUNDLE/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
fail=0
DEV=${GPU_CHECK_DEVICE:-cuda:0}
say() { printf '\n== %s\n' "$*"; }

say "bundle"
cat "$BUNDLE/MANIFEST" 2>/dev/null || { echo "no $BUNDLE/MANIFEST: run 'make gpu-bundle' on the build machine and carry $BUNDLE"; exit 2; }
# The binaries travel xz-compressed (60 MB -> 8 MB each); unpack them outside the carried tree.
BIN=$(mktemp -d /tmp/kvgate-gpu.XXXXXX)
for b in gpu_check kvgate-backend; do
  [[ -f $BUNDLE/$b.xz ]] || { echo "missing $BUNDLE/$b.xz"; exit 2; }
  if command -v xz >/dev/null; then xz -dc "$BUNDLE/$b.xz" >"$BIN/$b"
  else python3 -c 'import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$BUNDLE/$b.xz" >"$BIN/$b"; fi || exit 2
  chmod +x "$BIN/$b"
done

say "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_cap --format=csv 2>&1 || echo "nvidia-smi failed"
nproc; free -g | head -2

say "CUDA libraries"
# NEEDED by the binaries: libcuda.so.1 (driver), libcublas.so.13 (+ its libcublasLt), libcurand.so.10,
# libcudart.so.13; NVRTC only if a kernel is compiled at run time.
need=(libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnvrtc.so.13)
roots=(/opt/torch/.venv /usr/local/cuda /usr/local /opt /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib)
for py in /opt/torch/.venv/bin/python python3; do
  command -v "$py" >/dev/null 2>&1 && roots+=($("$py" -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null))
done
libdirs=()
for lib in "${need[@]}"; do
  found=""
  for r in "${roots[@]}"; do
    [[ -d $r ]] || continue
    found=$(find -L "$r" -maxdepth 7 -name "$lib*" \( -type f -o -type l \) 2>/dev/null | head -1)
    [[ -n $found ]] && break
  done
  if [[ -n $found ]]; then
    echo "$lib -> $found"
    libdirs+=("$(dirname "$found")")
  else
    echo "$lib: not found (searched ${roots[*]})"
  fi
done
# cudart also ships in the bundle, as a fallback.
libdirs+=("$(cd "$BUNDLE/lib" && pwd)")
LD_LIBRARY_PATH=$(printf '%s\n' "${libdirs[@]}" | awk '!seen[$0]++' | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
if ldd "$BIN/gpu_check" | grep -q 'not found'; then
  ldd "$BIN/gpu_check"
  echo "FAIL: the binaries link CUDA 13 libraries (sonames above) that this machine lacks."
  ls -d /opt/torch/.venv/lib/python*/site-packages/nvidia/*/lib 2>/dev/null
  exit 3
fi
ldd "$BIN/gpu_check" | grep -E 'cu|nvrtc' || true

say "correctness: CPU vs $DEV"
timeout 300 "$BIN/gpu_check" --device $DEV --check-only --json "$OUT/correctness.json" | tee "$OUT/correctness.md"
rc=${PIPESTATUS[0]}; [[ $rc == 0 ]] || { echo "correctness check exited $rc"; fail=1; }

say "throughput: smollm2 shape"
timeout 180 "$BIN/gpu_check" --device $DEV --bench-only --shapes smollm2 --steps 64 --prompt 128 \
  --json "$OUT/bench-smollm2.json" | tee "$OUT/bench-smollm2.md"
rc=${PIPESTATUS[0]}; [[ $rc == 0 ]] || { echo "smollm2 bench exited $rc"; fail=1; }

say "throughput: llama8b shape"
[[ -n ${SKIP_LLAMA8B:-} ]] && echo skipped || timeout 300 "$BIN/gpu_check" --device $DEV --bench-only --shapes llama8b --steps ${LLAMA8B_STEPS:-24} --prompt 128 \
  --json "$OUT/bench-llama8b.json" | tee "$OUT/bench-llama8b.md"
rc=${PIPESTATUS[0]}; [[ $rc == 0 ]] || { echo "llama8b bench exited $rc"; fail=1; }
nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null

say "server: kvgate-backend --synthetic smollm2 --device $DEV"
PORT=18123
"$BIN/kvgate-backend" --synthetic smollm2 --device $DEV --port $PORT --kv-cache-bytes 1073741824 \
  >"$OUT/server.log" 2>&1 &
spid=$!
http() { # METHOD PATH [BODY] — curl when present, else Python's urllib
  if command -v curl >/dev/null; then
    curl -sS -m 60 -X "$1" -H 'content-type: application/json' ${3:+-d "$3"} "http://127.0.0.1:$PORT$2"
  else
    python3 - "$1" "$2" "${3:-}" "$PORT" <<'EOF'
import sys, urllib.request
m, p, b, port = sys.argv[1:5]
r = urllib.request.Request(f"http://127.0.0.1:{port}{p}", data=b.encode() or None, method=m,
                           headers={"content-type": "application/json"})
print(urllib.request.urlopen(r, timeout=60).read().decode())
EOF
  fi
}
up=0
for _ in $(seq 120); do
  if http GET /v1/models >/dev/null 2>&1; then up=1; break; fi
  kill -0 $spid 2>/dev/null || break
  sleep 0.5
done
if [[ $up == 1 ]]; then
  resp=$(http POST /v1/chat/completions '{"model":"synthetic-smollm2","messages":[{"role":"user","content":"Hello GPU"}],"max_tokens":16,"temperature":0}')
  echo "$resp" | head -c 1500; echo
  if echo "$resp" | grep -q '"completion_tokens"'; then echo "server: PASS"; else echo "server: FAIL"; fail=1; fi
  http GET /health | head -c 800; echo
else
  echo "server: FAIL (did not come up)"; fail=1
fi
kill $spid 2>/dev/null; wait $spid 2>/dev/null
tail -5 "$OUT/server.log"

say "summary"
cat "$OUT/correctness.md" "$OUT/bench-smollm2.md" "$OUT/bench-llama8b.md" 2>/dev/null | grep -E '^\||^##'
[[ $fail == 0 ]] && echo "GPU CHECK: PASS" || echo "GPU CHECK: FAIL"
exit $fail
