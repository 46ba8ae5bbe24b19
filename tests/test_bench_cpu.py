"""scripts/bench_cpu.py runs end to end on a tiny sample (so it cannot rot); its numbers are not checked."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SHARED_DATA, needs_shared_data

CORPUS = SHARED_DATA / "linux_kernel_docs_paragraphs.parquet"


@pytest.mark.slow
@needs_shared_data
def test_bench_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_cpu.py"), "--rows", "60", "--repeats", "1", "--chunks", "2",
           "--batch-sizes", "16", "--cli", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| embedpipe bf16 |" in done.stdout and "× sentence-transformers" in done.stdout
    results = json.loads(out.read_text())
    rows = results["results"]
    names = [r["contender"] for r in rows]
    assert any(n.startswith("sentence-transformers") for n in names) and "embedpipe fp32" in names
    assert all(r["tokens_per_s"] > 0 for r in rows)
    fp32 = next(r for r in rows if r["contender"] == "embedpipe fp32")
    assert fp32["cos_min"] >= 0.99999
    # the CLI row's vectors come back by id, the others chunk by chunk (2 interleaved): held to the same rows
    cli = next(r for r in rows if "through `embedpipe run`" in r["contender"])
    assert cli["cos_min"] >= 0.99999
    assert all(r["cos_min"] >= 0.999 for r in rows), [(r["contender"], r["cos_min"]) for r in rows]
