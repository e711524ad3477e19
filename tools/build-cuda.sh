#!/usr/bin/env bash
# Build the backend with `--features cuda` on a machine with no GPU and no system CUDA toolkit.
#
#   tools/build-cuda.sh [extra cargo args]     (what `make build-cuda` runs)
#
# 1. The CUDA 13.0 compiler pieces come from PyPI wheels, unpacked into .cuda/ (git-ignored):
#    nvcc + nvvm (cicc) + crt + the runtime (headers, libcudart.so.13) + cccl (cub/thrust headers).
#    13.0 and not the newest 13.x on purpose: the GPU machines run driver 580 (CUDA 13.0), which
#    cannot JIT PTX written by a newer nvcc, and cudarc 0.19.10 (candle 0.11.1's) knows 13.0–13.4
#    only — `nvcc --version` 13.5 makes its build script panic ("Unsupported cuda toolkit version").
# 2. candle 0.11.1 enables cudarc's `dynamic-linking`, so the link needs libcuda, libcublas,
#    libcublasLt, libcurand and libnvrtc. No driver here and the cuBLAS wheel is ~0.5 GB, so we link
#    against generated stubs that carry the real SONAMEs and every function name cudarc's bindings
#    declare; on the GPU machine the dynamic loader binds the real driver and the real CUDA 13
#    libraries (tools/gpu-check.sh finds them in the PyTorch venv).
# 3. cargo builds into target/cuda (the CPU build in target/ is left alone), for sm_90 (H100/H200)
#    unless CUDA_COMPUTE_CAP says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CUDA_DIR=${KVGATE_CUDA_DIR:-$ROOT/.cuda}
CU=$CUDA_DIR/nvidia/cu13
PY=${PYTHON:-python3}

NVCC_VER=13.0.88
PKGS=(nvidia-cuda-nvcc==$NVCC_VER nvidia-nvvm==$NVCC_VER nvidia-cuda-crt==$NVCC_VER
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)

if [[ ! -f $CUDA_DIR/.ok-$NVCC_VER ]]; then
  echo "== installing the CUDA $NVCC_VER toolkit wheels into .cuda/"
  rm -rf "$CUDA_DIR"
  "$PY" -m pip install --quiet --disable-pip-version-check --target "$CUDA_DIR" "${PKGS[@]}"
  touch "$CUDA_DIR/.ok-$NVCC_VER"
fi
[[ -x $CU/bin/nvcc ]] || { echo "no nvcc at $CU/bin/nvcc" >&2; exit 1; }

# Link-time stubs (lib/stubs is on cudarc's search path under CUDA_ROOT).
STUBS=$CU/lib/stubs
CUDARC_SRC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src 2>/dev/null | head -1 || true)
if [[ -z $CUDARC_SRC ]]; then
  cargo fetch --quiet
  CUDARC_SRC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src | head -1)
fi
if [[ ! -f $STUBS/.ok ]]; then
  echo "== generating link stubs from $CUDARC_SRC"
  mkdir -p "$STUBS"
  # module:library:SONAME (the CUDA 13.0 sonames)
  for spec in driver:cuda:libcuda.so.1 cublas:cublas:libcublas.so.13 cublaslt:cublasLt:libcublasLt.so.13 \
              curand:curand:libcurand.so.10 nvrtc:nvrtc:libnvrtc.so.13; do
    IFS=: read -r mod lib soname <<<"$spec"
    grep -A1 'extern "C" {' "$CUDARC_SRC/$mod/sys/mod.rs" | grep -oP '^\s*(pub )?fn \K\w+' | sort -u |
      sed 's/.*/void &(void) {}/' >"$STUBS/$lib.c"
    gcc -shared -fPIC -o "$STUBS/lib$lib.so" -Wl,-soname,"$soname" "$STUBS/$lib.c"
  done
  touch "$STUBS/.ok"
fi
# candle-kernels links -lcudart: the wheel ships only the versioned name.
ln -sf libcudart.so.13 "$CU/lib/libcudart.so"

export PATH=$CU/bin:$PATH
export CUDA_ROOT=$CU CUDA_HOME=$CU CUDA_PATH=$CU
export CUDARC_CUDA_VERSION=13000
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export NVCC_CCBIN=${NVCC_CCBIN:-$(command -v g++)}
export CPATH=$CU/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$CU/lib:$STUBS${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target/cuda}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$CARGO_BUILD_JOBS}
# The workspace's release profile (fat LTO, one codegen unit, opt-level s) is tuned for the wasm
# filter; on 2 cores it makes this build far slower and buys the GPU path nothing.
export CARGO_PROFILE_RELEASE_LTO=${CARGO_PROFILE_RELEASE_LTO:-off}
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=${CARGO_PROFILE_RELEASE_CODEGEN_UNITS:-16}
export CARGO_PROFILE_RELEASE_OPT_LEVEL=${CARGO_PROFILE_RELEASE_OPT_LEVEL:-3}

echo "== nvcc: $(nvcc --version | tail -1); compute cap $CUDA_COMPUTE_CAP; target dir target/cuda"
start=$(date +%s)
nice -n 10 cargo build --release -p kvgate-backend --features cuda --bins --example gpu_check "$@"
echo "== build-cuda took $(( $(date +%s) - start )) s"
