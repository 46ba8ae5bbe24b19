"""What runs on the GPU machine imports neither Ray nor FAISS (it has neither): scripts/gpu_check.py, its
model libraries and the CUDA tests of scripts/gpu_device_run.sh, with ray and faiss made unimportable by a
sys.path shim whose import is recorded and raises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SHIM = ("import os\n"
        "open(os.environ['SHIM_LOG'], 'a').write(__name__ + '\\n')\n"
        "raise ImportError(__name__ + ' is not installed on the GPU machine (test shim)')\n")


def shim_env(tmp_path: Path) -> dict:
    """Environment whose PYTHONPATH puts fake ray / faiss packages first; their imports land in SHIM_LOG."""
    shim = tmp_path / "shim"
    for name in ("ray", "faiss"):
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text(SHIM)
    log = tmp_path / "shim.log"
    log.write_text("")
    return {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}", "SHIM_LOG": str(log),
            "TOKENIZERS_PARALLELISM": "false"}


def imported(env: dict) -> list[str]:
    return Path(env["SHIM_LOG"]).read_text().split()


def cuda_tests() -> list[str]:
    """The test files scripts/gpu_device_run.sh runs (its CUDA_TESTS variable)."""
    text = (ROOT / "scripts" / "gpu_device_run.sh").read_text()
    return re.search(r'CUDA_TESTS="([^"]+)"', text).group(1).split()


def test_gpu_check_and_its_libraries_import_no_ray_or_faiss(tmp_path):
    env = shim_env(tmp_path)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('gpu_check', {str(ROOT / 'scripts' / 'gpu_check.py')!r})\n"
            "module = sys.modules['gpu_check'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "import transformers, sentence_transformers, safetensors, tokenizers, pyarrow.parquet\n"
            "from sentence_transformers import SentenceTransformer\n"
            "from embedpipe.runtime import Encoder\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'faiss'))\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert imported(env) == []  # not even tried


def test_the_cuda_tests_import_no_ray_or_faiss(tmp_path):
    files = cuda_tests()
    assert files and all((ROOT / f).is_file() for f in files), files
    # as the script runs them: the image has no pytest-xdist, and pyproject's addopts asks for it (-n 2)
    assert '-o addopts=""' in (ROOT / "scripts" / "gpu_device_run.sh").read_text()
    env = shim_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-o", "addopts=", *files],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert imported(env) == []
