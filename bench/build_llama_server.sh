#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` (and `llama-bench`) for the peer benchmark, outside the repo.
#
# Source: the llama.cpp tree vendored in the llama-cpp-python sdist (pinned version below), fetched from PyPI
# with pip, so the build needs no network beyond PyPI. ISA flags: each GGML_<ISA> is ON iff this CPU reports
# it in /proc/cpuinfo (no -march=native), and AMX is always OFF: llama.cpp's AMX path segfaults on the Xeon
# machines of this kind (ggml-org/llama.cpp issue #20824). The AMD EPYC machines have AVX-512 but no AVX-VNNI
# (VEX), so a fixed flag list would risk SIGILL there.
#
# Usage:  bench/build_llama_server.sh [BUILD_DIR]        (default BUILD_DIR: /work/peers-build)
# Result: BUILD_DIR/llama.cpp-build/bin/llama-server     (~10-15 min on 2 cores; idempotent)
set -euo pipefail

BUILD_DIR="${1:-${KVSCOPE_PEERS_DIR:-/work/peers-build}}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
SERVER_BIN="$BUILD_DIR/llama.cpp-build/bin/llama-server"
if [[ -x "$SERVER_BIN" ]]; then
    echo "already built: $SERVER_BIN"
    exit 0
fi

SDIST="llama_cpp_python-${LCP_VERSION}.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==${LCP_VERSION}" -d .
fi
SRC="$BUILD_DIR/llama_cpp_python-${LCP_VERSION}/vendor/llama.cpp"
[[ -d "$SRC" ]] || tar xzf "$SDIST"

CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
isa() {  # GGML option, cpuinfo flag → -DGGML_X=ON|OFF
    if [[ "$CPU_FLAGS" == *" $2 "* ]]; then echo "-D$1=ON"; else echo "-D$1=OFF"; fi
}
ISA_FLAGS=(
    "$(isa GGML_AVX avx)" "$(isa GGML_AVX2 avx2)" "$(isa GGML_BMI2 bmi2)" "$(isa GGML_FMA fma)"
    "$(isa GGML_F16C f16c)" "$(isa GGML_AVX_VNNI avx_vnni)" "$(isa GGML_AVX512 avx512f)"
    "$(isa GGML_AVX512_VBMI avx512vbmi)" "$(isa GGML_AVX512_VNNI avx512_vnni)" "$(isa GGML_AVX512_BF16 avx512_bf16)"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
echo "ISA flags: ${ISA_FLAGS[*]}"

cmake -S "$SRC" -B "$BUILD_DIR/llama.cpp-build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF "${ISA_FLAGS[@]}"
nice -n 19 cmake --build "$BUILD_DIR/llama.cpp-build" --target llama-server llama-bench -j "$JOBS"
echo "built: $SERVER_BIN"
