"""scripts/bench_tokenize.py runs end to end on a small sample (so it cannot rot); its numbers are not checked,
its check of embedpipe's ids against the full encode is (it exits 1 when they differ)."""

import subprocess
import sys

from tests.conftest import ROOT, needs_shared_data


@needs_shared_data
def test_bench_tokenize_smoke():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_tokenize.py"), "--rows", "300", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT / "scripts")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| embedpipe (TextTokenizer)",
                                                      "| tokenizers encode_batch (offsets tracked)",
                                                      "| sentence-transformers (batches of 32)"], rows
