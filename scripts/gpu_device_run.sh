#!/usr/bin/env bash
# The one command for the GPU machine (docs/performance.md, "GPU check: how to run it"):
#
#     bash scripts/gpu_device_run.sh          # from the repository root; OUT defaults to ./gpu_out
#
# 1. the environment (nvidia-smi, python, torch, CUDA, the libraries the check uses)
# 2. the CUDA tests (the CUDA cases of the runtime, kernel and model tests), under a timeout
# 3. scripts/gpu_check.py with a time budget, under a timeout; it rewrites $OUT/gpu_check.json
#    after every row, so a timeout or a CUDA error keeps the rows already measured
#
# Everything is teed under $OUT: device_run.log (all of it), cuda_tests.log, gpu_check.log,
# gpu_check.json. Sized for <= 7 minutes (tests <= 120 s, check <= 270 s) so that a rerun fits
# in a 15-minute device budget. Nothing here needs the network, Ray or FAISS. Exit status: 0 when
# the tests and every check row passed, else the first non-zero of (tests, check).
#
# Knobs (environment): PYTHON, OUT, TESTS_TIMEOUT, CHECK_TIMEOUT, CHECK_BUDGET (seconds after which
# gpu_check starts no new speed sweep), CHECK_ARGS (extra gpu_check.py arguments, e.g. --only "minilm-l6").
set -u -o pipefail

PY=${PYTHON:-python}
OUT=${OUT:-$PWD/gpu_out}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-120}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-270}
CHECK_BUDGET=${CHECK_BUDGET:-150}
# the CUDA tests: files with CUDA cases, and of them the cases whose id names cuda (plus the flash fallback)
CUDA_TESTS="tests/test_graphs.py tests/test_runners.py tests/test_staging.py tests/test_kernels.py
tests/test_kernels_varlen.py tests/test_kernels_fallback.py tests/test_models_bert.py tests/test_models_qwen3.py
tests/test_models_modernbert.py tests/test_models_xlm_roberta.py"
CUDA_TESTS_K="cuda or fallback"

mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/device_run.log") 2>&1
started=$(date +%s)

echo "== environment ($(date -u +%FT%TZ))"
nvidia-smi || echo "nvidia-smi failed"
"$PY" - <<'EOF' || echo "the environment probe failed"
import importlib, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for name in ("transformers", "sentence_transformers", "tokenizers", "safetensors", "pyarrow", "numpy", "pytest",
             "flash_attn", "ray", "faiss"):
    try:
        print(f"  {name}: {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # absent or broken
        print(f"  {name}: - ({type(e).__name__})")
EOF

echo "== CUDA tests (timeout ${TESTS_TIMEOUT}s)"
tests_rc=0
if "$PY" -c "import pytest" 2>/dev/null; then
  # shellcheck disable=SC2086  # -o addopts="": the image has no pytest-xdist (pyproject's addopts asks for it)
  timeout -k 10 "$TESTS_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts="" $CUDA_TESTS -k "$CUDA_TESTS_K" \
    2>&1 | tee "$OUT/cuda_tests.log"
  tests_rc=${PIPESTATUS[0]}
  [ "$tests_rc" = 124 ] && echo "CUDA tests: timed out after ${TESTS_TIMEOUT}s"
else
  echo "pytest is not installed on this machine: CUDA tests skipped (gpu_check still runs)" | tee "$OUT/cuda_tests.log"
  tests_rc=3
fi

echo "== gpu_check (budget ${CHECK_BUDGET}s, timeout ${CHECK_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout -k 10 "$CHECK_TIMEOUT" "$PY" scripts/gpu_check.py --budget "$CHECK_BUDGET" --out "$OUT/gpu_check.json" \
  ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
[ "$check_rc" = 124 ] && echo "gpu_check: timed out after ${CHECK_TIMEOUT}s; $OUT/gpu_check.json holds the rows done"

echo "== done in $(( $(date +%s) - started ))s: CUDA tests rc=$tests_rc, gpu_check rc=$check_rc; files in $OUT"
[ "$tests_rc" != 0 ] && exit "$tests_rc"
exit "$check_rc"
