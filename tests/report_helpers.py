"""A synthetic finished run (3 workers, 5 units) as report.json would hold it, for render and plot tests."""

from __future__ import annotations

from embedpipe.config import CostConfig
from embedpipe.report.counters import Counters
from embedpipe.report.device import DeviceInfo
from embedpipe.report.metrics import UnitSpan, extend_report, run_metrics
from embedpipe.report.report import build_report

TINY_BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}


def sample_report(*, name: str = "nightly", gpu: str = "NVIDIA H100 80GB HBM3", speed: float = 1.0,
                  workers: int = 3, cost: CostConfig | None = None) -> dict:
    devices = [DeviceInfo(kind="cuda", name=gpu, count=1, threads=2, host=f"node{i}", peak_flops={"bfloat16": 7e14})
               for i in range(workers)]
    spans, total = [], Counters()
    for unit in range(5):
        worker, start = unit % workers, 5.0 + 10.0 * (unit // workers) / speed
        c = Counters(rows=1000, tokens=64_000, padded_tokens=70_000, truncated_rows=unit, tokens_squared=64_000 * 64,
                     stages={"read": 0.5, "tokenize": 1.0, "pack": 0.1, "encode": 7.0 / speed, "write": 0.4})
        spans.append(UnitSpan(worker, 100.0 + start, 100.0 + start + 9.0 / speed, c))
        total.merge(c)
    wall = 5.0 + 20.0 / speed
    units = {"total": 5, "skipped_as_done": 0, "encoded": 5, "retried": 0, "failed": 0, "failed_units": []}
    report = build_report(total, this_run=total, wall_seconds=wall, workers=workers, units=units)
    return extend_report(report, {"job": name, **run_metrics(
        report, this_run=total, spans=spans, devices=devices, started_at=100.0, wall_seconds=wall, dtype="bfloat16",
        model_config=TINY_BERT, cost=cost or CostConfig())})
