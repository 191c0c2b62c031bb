#!/usr/bin/env bash
# Build llama.cpp once for the llama.cpp runner and the llama-server peer, in about 6 minutes on two cores
# (`pip install llama-cpp-python` compiles every target of the tree: ~25 minutes).
#
#   bash scripts/llama_cpp/build.sh            # into the active Python environment
#
# 1. Downloads llama-cpp-python's source release from the package registry (it carries the llama.cpp tree its
#    bindings were written against) and builds only the shared libraries and llama-server, llama-quantize and
#    llama-bench, under $MINEDRAFT_LLAMA_HOME (default ~/.cache/minedraft/llama.cpp; scripts/bench/llama_peer.py
#    finds the tools in its bin/).
# 2. Installs the Python bindings without compiling again (CMAKE_ARGS=-DLLAMA_BUILD=OFF) and copies the libraries
#    into the package's lib/ folder, where the bindings load them from.
# CPU features come from this machine's /proc/cpuinfo (no -march=native): AMX stays off, because VMs list it and
# then kill the process on its first tile instruction (SIGILL in ggml's Q4 kernels, seen on a 2-core Xeon VM).
# A second run reuses the build (ninja rebuilds nothing) and reinstalls the bindings.
set -euo pipefail
VERSION=${MINEDRAFT_LLAMA_VERSION:-0.3.36}
HOME_DIR=${MINEDRAFT_LLAMA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/minedraft/llama.cpp}
SRC=$HOME_DIR/src/llama_cpp_python-$VERSION
mkdir -p "$HOME_DIR/src"
command -v cmake >/dev/null || pip install -q cmake
command -v ninja >/dev/null || pip install -q ninja
if [ ! -d "$SRC" ]; then
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$HOME_DIR/src"
    tar xzf "$HOME_DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$HOME_DIR/src"
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
cmake -S "$SRC/vendor/llama.cpp" -B "$HOME_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
    -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
    -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >/dev/null
ninja -C "$HOME_DIR/build" llama llama-server llama-quantize llama-bench
ln -sfn "$HOME_DIR/build/bin" "$HOME_DIR/bin"
CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install -q --force-reinstall --no-deps "$SRC"
pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3" "numpy>=1.20.0" "typing-extensions>=4.5.0"
LIB=$(python -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('llama_cpp').submodule_search_locations[0], 'lib'))")
mkdir -p "$LIB"
cp -a "$HOME_DIR/build/bin/"lib*.so* "$LIB/"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready; tools in $HOME_DIR/bin')"
