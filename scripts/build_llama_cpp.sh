#!/bin/sh
# Build llama.cpp's tools (llama-quantize, llama-bench, llama-batched-bench, llama-server) from the llama.cpp
# source vendored in llama-cpp-python's sdist on PyPI: the baseline of `pagedgen bench throughput --baselines
# llama.cpp --llama-cpp-dir DEST/build/bin`, and the quantizer of scripts/make_quantized_ggufs.py
# (convert_hf_to_gguf.py is in DEST/llama_cpp_python-VERSION/vendor/llama.cpp).
#
#   scripts/build_llama_cpp.sh [DEST]       # default DEST: ./llamacpp; needs cmake, ninja, a C++17 compiler
#
# GGML_NATIVE=ON compiles for this CPU (AVX2 / AVX-512 / VNNI as it has them), as a user building it would.
set -eu
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
DEST=${1:-$PWD/llamacpp}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DEST"
cd "$DEST"
[ -f "llama_cpp_python-$VERSION.tar.gz" ] ||
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
cmake -S "llama_cpp_python-$VERSION/vendor/llama.cpp" -B build -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF > cmake.log
cmake --build build -j "$JOBS" --target llama-quantize llama-bench llama-batched-bench llama-server
echo "llama.cpp tools in $DEST/build/bin"
