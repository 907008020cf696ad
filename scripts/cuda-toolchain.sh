#!/usr/bin/env bash
# scripts/cuda-toolchain.sh [PREFIX]
#
# Installs a GPU-less CUDA 13.0 *build* toolchain for candle-paged-attention's
# `cuda` feature from NVIDIA's PyPI wheels into PREFIX (default
# /opt/cuda-pip) and assembles a CUDA_HOME-like tree at PREFIX/cuda:
#
#   PREFIX/cuda/bin      nvcc, ptxas, ... (from the nvcc wheel)
#   PREFIX/cuda/include  cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, cuda.h, cccl/ ...
#   PREFIX/cuda/nvvm     cicc, libdevice
#   PREFIX/cuda/lib64/   links to the wheel libraries plus unversioned dev links
#   PREFIX/cuda/lib64/stubs/libcuda.so   link-time stub of the driver API
#                        (SONAME libcuda.so.1), generated from cuda.h
#
# Enough to compile kernels/*.cu to PTX (build.rs) and to link binaries built
# with `--features cuda`; running them needs a machine with the NVIDIA driver
# and the CUDA 13 libraries.
#
# Idempotent. Prints the environment to use on stdout, so:
#   eval "$(scripts/cuda-toolchain.sh)"
#   cargo build --release --features cuda --all-targets
#
# CUDA_COMPUTE_CAP: kept when already set, else 90 (H100/H200); use 80 for
# PTX that loads on every sm_80+ GPU.
set -euo pipefail

PREFIX="${1:-/opt/cuda-pip}"
PY="${PYTHON:-python3}"
PKGS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.1.0.3
  nvidia-curand==10.4.0.35
)

log() { echo "[cuda-toolchain] $*" >&2; }

mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"

# ---- 1. pip wheels -----------------------------------------------------------
need_pip=0
for spec in "${PKGS[@]}"; do
  name="${spec%%==*}"; ver="${spec##*==}"
  dist="$PREFIX/$(echo "$name" | tr '-' '_')-$ver.dist-info"
  [[ -d "$dist" ]] || { need_pip=1; log "missing $spec"; }
done
if (( need_pip )); then
  log "pip install --target $PREFIX ${PKGS[*]}"
  # --no-deps: every dependency is pinned above (nvcc requires nvvm, runtime, crt)
  "$PY" -m pip install --disable-pip-version-check --no-cache-dir --no-deps \
      --upgrade --target "$PREFIX" "${PKGS[@]}" >&2
else
  log "all pinned wheels already in $PREFIX"
fi

CU="$PREFIX/nvidia/cu13"
[[ -x "$CU/bin/nvcc" ]] || { log "ERROR: $CU/bin/nvcc missing"; exit 1; }

# ---- 2. CUDA_HOME-like tree --------------------------------------------------
CH="$PREFIX/cuda"
mkdir -p "$CH/lib64/stubs"
for d in bin include nvvm; do ln -sfn "../nvidia/cu13/$d" "$CH/$d"; done
ln -sfn lib64 "$CH/lib"

# versioned libs + static archives from the wheels; unversioned dev links next to them
for f in "$CU"/lib/*.so.* "$CU"/lib/*.a; do
  [[ -e "$f" ]] || continue
  b="$(basename "$f")"
  ln -sfn "../../nvidia/cu13/lib/$b" "$CH/lib64/$b"
  case "$b" in
    *.so.*) ln -sfn "$b" "$CH/lib64/${b%%.so.*}.so" ;;   # libcublas.so -> libcublas.so.13
  esac
done
# nvcc's own profile looks for TOP/lib64 and TOP/lib64/stubs (TOP = nvidia/cu13)
[[ -e "$CU/lib64" ]] || ln -sfn ../../cuda/lib64 "$CU/lib64"

# ---- 3. libcuda.so link stub (driver API), generated from cuda.h ------------------
stub="$CH/lib64/stubs/libcuda.so"
if [[ ! -f "$stub" || "$CH/include/cuda.h" -nt "$stub" ]]; then
  tmp="$(mktemp -d)"
  # every `CUresult cuXxx(` declared by cuda.h after macro expansion (gets the _v2/_v3 names)
  echo '#include <cuda.h>' | gcc -E -P -I"$CH/include" -x c - \
    | tr '\n' ' ' | grep -oE '\bCUresult[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' \
    | sed -E 's/CUresult[[:space:]]+//; s/[[:space:]]*\(//' | sort -u > "$tmp/syms"
  # plus the un-suffixed legacy names that libcuda also exports (cuda.h #defines them away)
  grep -oE '^#define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+cu[A-Za-z0-9_]+_v[0-9]+' "$CH/include/cuda.h" \
    | awk '{print $2}' >> "$tmp/syms"
  # profiler entry points (cudaProfiler.h is not in these wheels; cudarc declares them unconditionally)
  printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop >> "$tmp/syms"
  sort -u "$tmp/syms" -o "$tmp/syms"
  { echo '/* generated link-time stub of libcuda.so.1; never load it at run time */'
    while read -r s; do echo "int $s(void) { return 999; /* CUDA_ERROR_UNKNOWN */ }"; done < "$tmp/syms"
  } > "$tmp/stub.c"
  gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$stub" "$tmp/stub.c"
  log "generated $stub with $(wc -l < "$tmp/syms") driver API symbols"
  rm -rf "$tmp"
fi

# ---- 4. smoke test ----------------------------------------------------------
tmp="$(mktemp -d)"
cat > "$tmp/t.cu" <<'EOF'
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
template <typename T>
__device__ void axpy(const T* x, T* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = T(a * float(x[i]) + float(y[i]));
}
extern "C" __global__ void axpy_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, float a, int n) { axpy(x, y, a, n); }
extern "C" __global__ void axpy_f16(const __half* x, __half* y, float a, int n) { axpy(x, y, a, n); }
extern "C" __global__ void to_fp8(const float* x, __nv_fp8_e4m3* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __nv_fp8_e4m3(x[i]);
}
EOF
"$CH/bin/nvcc" -ptx -arch=sm_90 -std=c++17 "$tmp/t.cu" -o "$tmp/t.ptx"
grep -q '^\.version 9\.0' "$tmp/t.ptx" || { log "unexpected PTX version: $(grep '^\.version' "$tmp/t.ptx")"; exit 1; }
"$CH/bin/nvcc" -c -arch=sm_90 "$tmp/t.cu" -o "$tmp/t.o"       # full SASS path (ptxas) works too
rm -rf "$tmp"
log "$("$CH/bin/nvcc" --version | tail -2 | head -1) ; PTX .version 9.0 for sm_90 OK"

# ---- 5. env to use ---------------------------------------------------------
cat <<EOF
export CUDA_HOME=$CH
export CUDA_PATH=$CH
export PATH=$CH/bin:\$PATH
export LIBRARY_PATH=$CH/lib64:$CH/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
EOF
