"""Peers for scripts/bench_cpu.py: the packaged model exported offline to ONNX, run by ONNX Runtime and OpenVINO.

sentence-transformers' own ONNX / OpenVINO backends go through optimum-onnx and optimum-intel, which pin
transformers below 4.58 / 5.6 (this venv has 5.x), so they cannot be installed beside it. These peers do what
those backends do, with the runtimes themselves (the ``bench`` extra: onnxruntime, openvino, onnx, onnxscript):
the Hugging Face model with sentence-transformers' mean pooling and normalization, exported once with
torch.onnx (dynamo, dynamic batch and length), then run on length-sorted padded batches as
sentence-transformers batches them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def export_onnx(model_dir: str, path: Path) -> float:
    """Export ``model_dir`` (mean pooled, normalized, float32) to ``path``; the seconds it took."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):  # [B, S] each -> [B, D]
            h = self.model(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state  # [B, S, D]
            w = attention_mask.unsqueeze(-1).to(h.dtype)  # [B, S, 1]
            return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1).clamp(min=1e-9), dim=-1)

    tok = AutoTokenizer.from_pretrained(model_dir)
    example = tok(["an example", "a somewhat longer example sentence"], padding=True, return_tensors="pt")
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=512)
    began = time.perf_counter()
    torch.onnx.export(Pooled(), tuple(example[k] for k in INPUTS), str(path), input_names=list(INPUTS),
                      output_names=["sentence_embedding"], dynamic_shapes={k: {0: batch, 1: seq} for k in INPUTS},
                      dynamo=True, external_data=False)
    return time.perf_counter() - began


def _batched(model_dir: str, infer: Callable[[dict], np.ndarray], *, batch_size: int,
             max_length: int = 256) -> Callable[[list[str]], np.ndarray]:
    """texts -> vectors: sorted by length, longest first, padded per batch (sentence-transformers' batching)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def run(texts: list[str]) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = [None] * len(texts)
        for i in range(0, len(order), batch_size):
            rows = order[i:i + batch_size]
            feed = tok([texts[r] for r in rows], padding=True, truncation=True, max_length=max_length,
                       return_tensors="np")
            vectors = infer({k: feed[k].astype(np.int64) for k in INPUTS})
            for r, v in zip(rows, vectors):
                out[r] = v
        return np.stack(out)

    return run


def onnxruntime_runner(model_dir: str, onnx_path: Path, *, threads: int, batch_size: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    return _batched(model_dir, lambda feed: session.run(None, feed)[0], batch_size=batch_size)


def openvino_runner(model_dir: str, onnx_path: Path, *, threads: int, batch_size: int, precision: str):
    """``precision``: "f32" or "bf16" (OpenVINO's INFERENCE_PRECISION_HINT); None when the CPU cannot run it
    (OpenVINO runs bf16 only with AVX-512 BF16 or AMX: elsewhere it falls back to f32 silently)."""
    import openvino as ov

    core = ov.Core()
    if precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return None
    compiled = core.compile_model(ov.convert_model(str(onnx_path)), "CPU", {
        "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"})
    return _batched(model_dir, lambda feed: compiled(feed)[0], batch_size=batch_size)
