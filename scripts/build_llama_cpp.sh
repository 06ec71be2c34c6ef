#!/usr/bin/env bash
# Builds llama.cpp (CPU only) from the source that the pinned llama-cpp-python sdist vendors, for the GGUF parity
# tests and for running `astrai export-gguf` files locally. Nothing lands in the checkout: the archive, the sources
# and the build live in ~/.cache/astrai/llama.cpp-$VERSION (override with ASTRAI_LLAMA_CPP_DIR); the tools end up
# in its bin/. A second run with the same pin does nothing; a new pin builds a new directory.
#
#   scripts/build_llama_cpp.sh            # prints the bin directory last
#   JOBS=2 NICE=10 scripts/build_llama_cpp.sh
#   LLAMA_CPP_TOOLS="llama-simple llama-tokenize llama-perplexity" scripts/build_llama_cpp.sh   # the tests' tools only
#
# There is no wheel of llama-cpp-python for this version and no Debian package of llama.cpp, so the sdist from PyPI
# (a 76 MB archive with llama.cpp under vendor/llama.cpp) is the one source that the package registries give us.
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python; the llama.cpp it vendors is what the tests run
ROOT=${ASTRAI_LLAMA_CPP_DIR:-$HOME/.cache/astrai/llama.cpp-$VERSION}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
# llama-simple: greedy, printing straight to stdout (the tests' generation); llama-completion logs its text through
# an asynchronous logger that may lose the last lines when its output is a pipe.
# LLAMA_CPP_TOOLS="llama-simple llama-tokenize llama-perplexity" builds only what tests/test_gguf.py runs (about
# half the build: CI's choice); a later run without it adds the rest.
read -r -a TOOLS <<<"${LLAMA_CPP_TOOLS:-llama-simple llama-tokenize llama-perplexity llama-completion llama-server}"
PYTHON=$(command -v "${PYTHON:-python3}")  # absolute: the script changes directory

built() { for tool in "${TOOLS[@]}"; do [ -x "$ROOT/bin/$tool" ] || return 1; done; }
if built; then
  echo "$ROOT/bin"
  exit 0
fi

mkdir -p "$ROOT"
cd "$ROOT"
if [ ! -d src/vendor/llama.cpp ]; then
  rm -rf download src src.tmp
  # --no-binary for this package only: its build requirements may come as wheels (pip prepares its metadata).
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest download "llama-cpp-python==$VERSION"
  mkdir src.tmp
  tar -xzf download/llama_cpp_python-"$VERSION".tar.gz -C src.tmp --strip-components=1
  mv src.tmp src  # only a whole extraction counts as the sources
fi

start=$(date +%s)
# Everything cmake says goes to build.log (its configure step prints notes such as "CMAKE_BUILD_TYPE=Release" on
# stderr); a step that fails shows the log's end.
trap 'status=$?; [ $status -eq 0 ] || { tail -n 40 "$ROOT/build.log" >&2; echo "llama.cpp build failed: $ROOT/build.log" >&2; }' EXIT
# GGML_NATIVE: the machine's own vector units (AVX-512 on one machine kind, AVX2 on the other); a cache built on one
# kind is not moved to another (the cache is per machine). Tests and examples are not needed.
nice -n "$NICE" cmake -S src/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DBUILD_SHARED_LIBS=OFF >build.log 2>&1
for tool in "${TOOLS[@]}"; do  # one at a time, in this order: the tests' tools are ready first (server: half the build)
  nice -n "$NICE" cmake --build build -j "$JOBS" --target "$tool" >>build.log 2>&1
done
mkdir -p bin
for tool in "${TOOLS[@]}"; do cp build/bin/"$tool" bin/"$tool.tmp" && mv bin/"$tool.tmp" bin/"$tool"; done
echo "built llama.cpp (llama-cpp-python $VERSION) in $(( $(date +%s) - start )) s" | tee -a build.log >&2
echo "$ROOT/bin"
