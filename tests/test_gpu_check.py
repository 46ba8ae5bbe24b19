"""scripts/gpu_check.py cannot rot: its CPU smoke mode runs here (tiny models, the CPU graph stand-in), with
ray and faiss unimportable as on the GPU machine; a failed row is recorded, kept and turns the exit status."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT
from tests.test_gpu_imports import imported, shim_env

SCRIPT = str(ROOT / "scripts" / "gpu_check.py")


def test_gpu_check_cpu_smoke(tmp_path):
    env = {**shim_env(tmp_path), "OUT": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
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
    text = rows["minilm-l6 real text (tiny)"]
    assert "error" not in text and not text.get("errors"), text
    assert text["encoder"]["dtype"] == "float32" and text["texts"]["rows"] == 200  # model.dtype auto on CPU
    for engine in ("embedpipe", "sentence_transformers"):
        assert text["speed"][engine]["rows_per_s"] > 0 and text["speed"][engine]["tokens_per_s"] > 0, engine
    assert text["embedpipe_vs_sentence_transformers_min_cosine"] > 0.99  # the same weights, texts and tokenizer
    assert text["embedpipe_vs_sentence_transformers"] > 0 and text["target"]["target"] == 3.0
    assert report["complete"] is True and report["failed"] == [] and imported(env) == []


def test_a_failed_row_is_kept_and_fails_the_run(tmp_path):
    env = shim_env(tmp_path)
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out), "--only", "qwen3 (tiny)",
                           "--fail", "qwen3 (tiny)"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "FAILED rows: ['qwen3 (tiny)']" in done.stderr, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == ["qwen3 (tiny)"] and report["complete"] is True
    assert "fails on purpose" in report["rows"][0]["error"]


def test_rows_are_written_as_they_finish_so_a_crash_keeps_them(tmp_path):
    """A fatal error (the process dies, as on a bad CUDA fault) in row 2 keeps row 1 in the JSON."""
    env = shim_env(tmp_path)
    out = tmp_path / "check.json"
    first, second = "minilm-l6 (tiny)", "minilm-l6 real text (tiny)"
    done = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out), "--only", first, "--only", second,
                           "--fail", first, "--crash", second], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 70, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["rows"]] == [first] and report["complete"] is False
    assert report["failed"] == [first] and "fails on purpose" in report["rows"][0]["error"]

