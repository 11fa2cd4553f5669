#!/bin/sh
# Build llama.cpp's tools (llama-quantize, llama-bench, llama-batched-bench, llama-server) from the llama.cpp
# source vendored in llama-cpp-python's sdist on PyPI: the baseline of `pagedgen bench throughput --baselines
# llama.cpp --llama-cpp-dir DEST/build/bin`, and the quantizer of scripts/make_quantized_ggufs.py
# (convert_hf_to_gguf.py is in DEST/llama_cpp_python-VERSION/vendor/llama.cpp).
#
#   scripts/build_llama_cpp.sh [DEST]       # default DEST: ./llamacpp; needs cmake, ninja, a C++17 compiler
#
# GGML_NATIVE=ON compiles for this CPU (AVX2 / AVX-512 / VNNI as it has them), as a user building it would.
# BUILD names the build folder (default build) and LLAMA_CPP_CMAKE_ARGS adds CMake options after the defaults:
# an AVX2-only build beside the native one, to compare with pagedgen's kernels built for AVX2
# (PAGEDGEN_KERNEL_MARCH), is
#   BUILD=build-avx2 LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
#       -DGGML_F16C=ON -DGGML_BMI2=ON" scripts/build_llama_cpp.sh DEST
set -eu
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
DEST=${1:-$PWD/llamacpp}
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-build}
mkdir -p "$DEST"
cd "$DEST"
[ -f "llama_cpp_python-$VERSION.tar.gz" ] ||
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
# shellcheck disable=SC2086  # LLAMA_CPP_CMAKE_ARGS is a list of options
cmake -S "llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF ${LLAMA_CPP_CMAKE_ARGS:-} > "cmake-$BUILD.log"
cmake --build "$BUILD" -j "$JOBS" --target llama-quantize llama-bench llama-batched-bench llama-server
echo "llama.cpp tools in $DEST/$BUILD/bin"
