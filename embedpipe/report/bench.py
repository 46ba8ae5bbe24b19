"""Pieces the benchmarks share (scripts/gpu_check.py, scripts/bench_cpu.py), each the engine's own.

- ``matmul_peak``: the MFU denominator, measured by the report's probe (report/device.py: square
  matmuls through every implementation the encoder may use on that device).
- ``model_flops``: the MFU numerator, each sequence at its own length by the family's FLOPs rule
  (report/flops.py).
- ``packed_model``: our packed model and head filled from an in-memory state dict (a random-weight
  ``transformers`` model) through the family's mapping table, as ``load_model`` fills it from files.
- ``bench_runner``: the GPU engine (``build_runner``'s DeviceRunner), also on CPU with the eager
  graph stand-in, and bucketed without graphs for a replay-vs-eager comparison.

Imports torch, numpy and the engine only: gpu_check runs where Ray and FAISS are absent.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from embedpipe.models import build_head, load_state_dict_into, model_class
from embedpipe.models.head import EmbeddingHead
from embedpipe.models.st import STSpec
from embedpipe.report.device import PROBE_SIZES, measure_peak_flops
from embedpipe.report.flops import flops_per_token_from_config
from embedpipe.runtime.buckets import Bucketer
from embedpipe.runtime.graphs import CudaGraphs, EagerGraphs, GraphCache
from embedpipe.config import BatchingConfig, RuntimeConfig
from embedpipe.runtime.runners import DeviceRunner, build_runner

BENCH_RUNTIME = RuntimeConfig(max_graphs=64, graph_memory_mb=16 << 10)  # room for every bucket of a sweep


def matmul_peak(device: str, dtype: str, *, sizes: tuple[int, ...] | None = None,
                seconds: float | None = None) -> float:
    """Measured matmul FLOP/s of this device in `dtype` ("float32", "bfloat16"): the best over
    `sizes` and ``seconds`` of repeats (default: the report's probe sizes and seconds for the device kind)."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    return max(measure_peak_flops(kind, dtype, size=n, seconds=seconds) for n in sizes or PROBE_SIZES[kind])


def model_flops(config_json: dict, lengths: np.ndarray) -> float:
    """Model FLOPs of sequences of these lengths, each at its own length by the family's rule."""
    values, counts = np.unique(np.asarray(lengths), return_counts=True)
    return float(sum(int(n) * int(c) * flops_per_token_from_config(config_json, int(n))
                     for n, c in zip(values, counts)))


def packed_model(config_json: dict, state_dict: dict, *, pooling: str, dtype: torch.dtype, device: str,
                 backend: str) -> tuple[nn.Module, EmbeddingHead]:
    """Our model for config.json's model_type, weights from `state_dict` through the family's
    mapping table, and a normalized head with `pooling` (mean | cls | last)."""
    cls = model_class(config_json["model_type"])
    config = cls.config_class.from_hf_config(config_json)
    with torch.device("meta"):
        model = cls(config, attention_backend=backend)
    load_state_dict_into(model, state_dict, dtype=dtype, device=device)
    head = build_head(STSpec(pooling=pooling, normalize=True), default_pooling=config.default_pooling)
    return model, head.to(device)


def bench_runner(model: nn.Module, head: nn.Module, *, device: str, max_tokens: int, max_seq_len: int,
                 graphed: bool, bucketed: bool | None = None) -> DeviceRunner:
    """The staged GPU runner: on CUDA with graphs on or off, exactly what ``build_runner`` builds;
    on CPU the same runner over the eager graph stand-in; ``bucketed`` without ``graphed``: padded
    bucket shapes run eagerly (the reference a graph replay must match bit for bit)."""
    runtime = dataclasses.replace(BENCH_RUNTIME, cuda_graphs=graphed)
    bucketed = graphed if bucketed is None else bucketed
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and bucketed == graphed:
        return build_runner(model, head, device=device, max_seq_len=max_seq_len,
                            batching=BatchingConfig(max_tokens=max_tokens), runtime=runtime)
    graphs = None
    if graphed:
        graphs = GraphCache(CudaGraphs(device) if on_cuda else EagerGraphs(), max_graphs=runtime.max_graphs,
                            max_bytes=runtime.graph_memory_mb * 2**20)
    return DeviceRunner(model, head, device=device, bucketer=Bucketer(max_tokens=max_tokens, max_seq_len=max_seq_len),
                        bucketed=bucketed, graphs=graphs)
