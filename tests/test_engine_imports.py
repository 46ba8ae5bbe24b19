"""The engine (runtime, models, text, kernels, the benchmarks' report.bench) imports without Ray, FAISS, typer or tqdm: the GPU check
machine has none of them."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

BLOCKED = ("ray", "faiss", "typer", "tqdm")


def test_engine_modules_import_without_cluster_packages():
    code = "\n".join([
        "import sys",
        *(f"sys.modules[{name!r}] = None  # any import of it raises ImportError" for name in BLOCKED),
        "import embedpipe.runtime, embedpipe.models, embedpipe.text, embedpipe.kernels",
        "import embedpipe.runtime.runners, embedpipe.runtime.graphs, embedpipe.runtime.staging",
        "import embedpipe.runtime.prefetch, embedpipe.runtime.warmup, embedpipe.runtime.buckets",
        "import embedpipe.report.bench  # what scripts/gpu_check.py and bench_cpu.py share",
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r} and sys.modules[m] is not None)",
        "assert not loaded, loaded",
        "print('ok')",
    ])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
