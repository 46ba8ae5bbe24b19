"""scripts/gpu_check.py cannot rot: its CPU smoke mode runs here (tiny models, the CPU graph stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_gpu_check_cpu_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "| graphed tok/s |" in done.stdout and report["matmul_bf16_flops"] > 0
    rows = {r["model"]: r for r in report["rows"]}
    bert = rows["minilm-l6 (tiny)"]
    assert "error" not in bert, bert.get("traceback")
    assert bert["parity_min_cosine"] > 0.999 and bert["fp32_vs_transformers_min_cosine"] > 0.99999
    assert bert["replay_bitwise_equal"] is True
    for engine in ("embedpipe_eager", "embedpipe_graphed", "transformers", "sentence_transformers"):
        assert bert["speed"][engine]["tokens_per_s"] > 0 and bert["speed"][engine]["mfu"] > 0, engine
    assert bert["speed"]["embedpipe_graphed"]["padded_tokens"] >= bert["mixed"]["tokens"]
    qwen = rows["qwen3 (tiny)"]
    assert "error" not in qwen, qwen.get("traceback")
    assert qwen["parity_min_cosine"] > 0.999 and qwen["fp32_vs_transformers_min_cosine"] > 0.99999
    assert qwen["replay_bitwise_equal"] is True and qwen["long"]["mfu"] > 0
    assert set(report["targets"]) == {"minilm_graphed_vs_sentence_transformers", "qwen3_0.6b_mfu_at_512"}
