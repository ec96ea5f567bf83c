#!/usr/bin/env bash
# The peers of `python -m lab bench model`, built outside git in .peers/ (`make peers`):
# llama.cpp CPU-only from the source vendored in the llama-cpp-python sdist on PyPI (the only
# registry that carries it), and the SmolLM2 GGUF requantized to F16 and F32 beside the shipped
# Q4_1 (llama-server too: a peer of `bench http`; vLLM, the other, is scripts/build_vllm_peer.sh). Each step is skipped when its output exists, so a rerun costs nothing; delete .peers/ to
# rebuild. The build is niced and uses -j2: the machine has 2 cores and is shared.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS_DIR:-$ROOT/.peers}
VENV=${PEERS_VENV:-$ROOT/.venv-peers}
PROJECT_PY=${PROJECT_PY:-$ROOT/.venv/bin/python}
JOBS=${PEERS_JOBS:-2}
TOOLS=(llama-bench llama-batched-bench llama-quantize llama-simple llama-server)

mkdir -p "$PEERS/src"
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install --quiet cmake ninja

# --no-binary for llama-cpp-python alone: its build tools (cmake, scikit-build-core) may come as
# wheels, only the package itself must be the source archive.
if ! ls "$PEERS"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$PEERS/src"
fi
SDIST=$(ls "$PEERS"/src/llama_cpp_python-*.tar.gz | tail -n 1)
SRC="$PEERS/src/$(basename "$SDIST" .tar.gz)"
[ -d "$SRC" ] || tar xzf "$SDIST" -C "$PEERS/src"
LLAMA="$SRC/vendor/llama.cpp"

BUILD="$PEERS/build"
if [ ! -f "$BUILD/build.ninja" ]; then
  "$VENV/bin/cmake" -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_METAL=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON
fi
nice -n 10 "$VENV/bin/cmake" --build "$BUILD" -j "$JOBS" --target "${TOOLS[@]}"
mkdir -p "$PEERS/bin"
for tool in "${TOOLS[@]}"; do cp -f "$BUILD/bin/$tool" "$PEERS/bin/"; done

# The same model at three precisions: the shipped Q4_1 and requantized F16 / F32 (from Q4_1, so
# the three hold the same values up to rounding; --allow-requantize because Q4_1 is quantized).
GGUF=$("$PROJECT_PY" -c 'from pagedkv.loaders.registry import locate_registered; print(locate_registered("smollm2-135m"))')
mkdir -p "$PEERS/models"
ln -sf "$GGUF" "$PEERS/models/smollm2-Q4_1.gguf"
for type in F16 F32; do
  out="$PEERS/models/smollm2-$type.gguf"
  [ -f "$out" ] || nice -n 10 "$PEERS/bin/llama-quantize" --allow-requantize "$GGUF" "$out" "$type" "$JOBS" >"$PEERS/quantize-$type.log" 2>&1
done
"$PEERS/bin/llama-bench" --version >"$PEERS/version.txt" 2>&1 || true
echo "peers ready in $PEERS: $(ls "$PEERS/bin" | tr '\n' ' ')"
