"""The run's derived numbers: per-worker throughput and timelines, busy and scaling fractions, MFU, cost.

Definitions (all in report.json, rendered by report/render.py):
- a worker's ``seconds``: the sum of its units' wall times (from taking a unit to writing its part), and
  of its int8/uint8 calibration pieces' (``UnitSpan.calibration``: what a piece computed counts in the
  units that took its rows, cluster/sampled.py); its rows/s and tokens/s are measured over those seconds.
- ``busy_fraction``: busy seconds / worker seconds, busy seconds being the ``encode`` stage's wall
  seconds (exact on CPU, where the encoder computes synchronously; on GPU an upper bound, as the
  encode stage also covers host-side work around the device's).
- ``scaling_efficiency``: run tokens/s / (workers x one worker's tokens/s while processing), which is
  worker-seconds spent on units / (workers x wall seconds): what start-up, scheduling gaps and idle
  tails cost. Contention between workers on shared hardware is not in it; compare against a
  one-worker run for that (``embedpipe report ONE_WORKER_RUN N_WORKER_RUN``).
- ``scaling_efficiency_after_startup``: the same over the wall seconds after start-up (from the first unit,
  or calibration piece, taken to the end): what scheduling gaps and idle tails cost, without the run's fixed start-up.
  Both efficiencies take their wall on the units' clock (``time.time()``: ``ended_at - started_at``), not the
  driver's ``perf_counter`` of ``wall_seconds``: when the two disagree (a VM paused mid-run steps one of them),
  the ratio of the spans to the run stays whole. ``timeline_seconds`` is that wall: every per-worker
  ``timeline`` span ends within it (not always within ``wall_seconds``, when the clocks disagree).
- ``mfu``: flops_per_token x tokens / wall seconds / the summed measured peak of all devices, in the
  model's dtype; ``encode_mfu`` divides by encode seconds instead, i.e. how close the encoder ran to
  the hardware while it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedpipe.config import CostConfig, resolve_dtype
from embedpipe.report.cost import cost_section, price_for, unit_of
from embedpipe.report.counters import Counters
from embedpipe.report.device import DeviceInfo
from embedpipe.report.flops import effective_seq_len, flops_per_token_from_config, is_causal


@dataclass(frozen=True)
class UnitSpan:
    """One finished unit as the report sees it: which worker, when (time.time()), what it counted, where."""

    worker: int
    started: float
    finished: float
    counters: Counters
    node: str = ""  # the Ray node it ran on ("<ip>/<node id prefix>"); "" when not known
    calibration: bool = False  # a piece of the int8/uint8 calibration, not a unit: its wall is the worker's, what
    # it computed counts in the units that took its rows (cluster/sampled.py)


def busy_seconds(stages: dict[str, float]) -> float:
    return stages.get("encode", 0.0)


def run_metrics(report: dict, *, this_run: Counters, spans: list[UnitSpan], devices: list[DeviceInfo],
                started_at: float, wall_seconds: float, dtype: str, model_config: dict | None,
                cost: CostConfig, ended_at: float | None = None) -> dict:
    """The report sections computed from this run's unit spans, its workers' devices and the model config.
    ``started_at`` / ``ended_at``: the run's start and end on the spans' clock (time.time()); ``ended_at``
    None: ``started_at + wall_seconds``.

    Like the rates of the base report, throughput, FLOPs, MFU and cost describe this run (``this_run``:
    the units it encoded), not units a resumed run found already done.
    """
    wall = max(wall_seconds, 1e-9)
    span_wall = max((ended_at - started_at) if ended_at is not None else wall_seconds, 1e-9)  # the spans' clock
    startup = min(s.started for s in spans) - started_at if spans else None  # to the first unit (or piece) taken
    units = [s for s in spans if not s.calibration]  # what the output's rows cost is in their counters
    total = this_run
    fpt, flops = _flops(total, model_config)
    workers = [_worker(i, [s for s in spans if s.worker == i], dev, started_at=started_at, dtype=dtype, fpt=fpt)
               for i, dev in enumerate(devices)]
    worker_seconds = sum(w["seconds"] for w in workers)
    peak_total = sum(_peak(d, dtype) for d in devices) or None
    encode_peak = sum(s.counters.stages.get("encode", 0.0) * _peak(devices[s.worker], dtype)
                      for s in units if s.worker < len(devices))
    prices = [price_for(d, cost) for d in devices for _ in range(d.count)]
    return {
        "padding_efficiency": _ratio(report["tokens"], report["padded_tokens"]),
        "startup_seconds": round(startup, 3) if startup is not None else None,
        "timeline_seconds": round(span_wall, 3),  # the timelines' x axis: job start to end on the spans' clock
        "busy_fraction": _ratio(sum(busy_seconds(s.counters.stages) for s in units), worker_seconds),
        "busy_source": "encode",  # the stage busy seconds come from
        "scaling_efficiency": _ratio(worker_seconds, len(devices) * span_wall),
        "scaling_efficiency_after_startup": _ratio(worker_seconds, len(devices) * (span_wall - startup))
        if startup is not None and span_wall > startup else None,
        "flops_per_token": fpt,
        "flops": flops,
        "mfu": _ratio(fpt * total.tokens / wall, peak_total) if fpt is not None and peak_total else None,
        "encode_mfu": _ratio(fpt * total.tokens, encode_peak) if fpt is not None and encode_peak else None,
        "device": _device_section(devices, dtype),
        "cost": cost_section(prices=prices, wall_seconds=wall_seconds, tokens=total.tokens, rows=total.rows,
                             unit=unit_of(devices)),
        "per_worker": workers,
    }


def devices_by_slot(found: dict[int, DeviceInfo], *, slots: int) -> list[DeviceInfo]:
    """One device per worker slot. A slot that finished no unit never reported its device; it held one
    all the same, so it is counted (and priced) like the first slot that did (workers are uniform)."""
    if not found:
        return []
    return [found.get(slot, found[min(found)]) for slot in range(slots)]


def fill_usd_saved(report: dict, *, this_run: Counters) -> None:
    """Incremental runs: what the reused vectors would have cost at this run's price per encoded row."""
    incremental, total_usd = report.get("incremental"), (report.get("cost") or {}).get("total_usd")
    encoded = this_run.rows - this_run.reused_rows
    if isinstance(incremental, dict) and incremental.get("usd_saved") is None and total_usd is not None and encoded:
        incremental["usd_saved"] = this_run.reused_rows * total_usd / encoded


def extend_report(report: dict, sections: dict) -> dict:
    """Add sections without overwriting keys the base report (or other stages) already set."""
    return {**report, **{k: v for k, v in sections.items() if k not in report}}


def _flops(total: Counters, model_config: dict | None) -> tuple[float | None, dict | None]:
    if model_config is None or not total.tokens:
        return None, None
    seq = effective_seq_len(tokens=total.tokens, tokens_squared=total.tokens_squared)
    try:
        fpt = flops_per_token_from_config(model_config, seq)
    except (ValueError, KeyError):
        return None, {"model_type": model_config.get("model_type"), "error": "no FLOPs count for this model"}
    return fpt, {"model_type": model_config.get("model_type"), "causal": is_causal(model_config),
                 "seq_len": round(seq, 3), "total": fpt * total.tokens}


def _worker(index: int, spans: list[UnitSpan], device: DeviceInfo, *, started_at: float, dtype: str,
            fpt: float | None) -> dict:
    c = Counters()
    for s in spans:
        if not s.calibration:  # a calibration piece's: counted in the units that took its rows
            c.merge(s.counters)
    seconds = sum(s.finished - s.started for s in spans)  # the calibration's pieces too: the worker's time
    peak = _peak(device, dtype) or None
    return {
        "worker": index,
        "host": device.host,
        "node": " + ".join(dict.fromkeys(s.node for s in sorted(spans, key=lambda s: s.started) if s.node)) or None,
        "device": device.name,
        "linears": device.linears or None,
        "units": sum(not s.calibration for s in spans),
        "rows": c.rows,
        "tokens": c.tokens,
        "seconds": round(seconds, 3),
        "rows_per_second": round(c.rows / seconds, 2) if seconds > 0 else 0.0,
        "tokens_per_second": round(c.tokens / seconds, 2) if seconds > 0 else 0.0,
        "busy_fraction": _ratio(busy_seconds(c.stages), seconds),
        "mfu": _ratio(fpt * c.tokens / seconds, peak) if fpt is not None and peak and seconds > 0 else None,
        "stages": {k: round(v, 3) for k, v in c.stages.items()},
        # the tokens each span computed: a unit's less those its calibration sample rows took (the pieces')
        "timeline": [[round(s.started - started_at, 3), round(s.finished - started_at, 3),
                      s.counters.rows, s.counters.tokens - s.counters.sampled_tokens]
                     for s in sorted(spans, key=lambda s: s.started)],
    }


def _device_section(devices: list[DeviceInfo], dtype: str) -> dict:
    if not devices:
        return {"kind": None, "name": None, "count": 0, "threads": None, "dtype": dtype, "peak_flops": None,
                "peak_flops_total": None, "linears": None}
    count = sum(d.count for d in devices)
    total = sum(_peak(d, dtype) for d in devices)
    resolved = {resolve_dtype(dtype, device=d.kind) for d in devices}
    return {
        "kind": devices[0].kind if len({d.kind for d in devices}) == 1 else "mixed",
        "name": " + ".join(dict.fromkeys(d.name for d in devices)),
        "count": count,  # GPUs, or CPU workers
        "threads": max(d.threads for d in devices),  # per worker
        "hosts": len({d.host for d in devices}),
        "dtype": resolved.pop() if len(resolved) == 1 else dtype,  # model.dtype auto: what the workers ran
        "peak_flops": total / count if total else None,  # per device, measured
        "peak_flops_total": total or None,
        "linears": " + ".join(dict.fromkeys(d.linears for d in devices if d.linears)) or None,  # CPU GEMM library
    }


def _peak(device: DeviceInfo, dtype: str) -> float:
    """The device's measured peak in model.dtype as its worker ran it (auto: bfloat16 on CUDA, float32 on CPU)."""
    return device.peak_flops.get(resolve_dtype(dtype, device=device.kind), 0.0)


def _ratio(num: float, den: float | None) -> float | None:
    return round(num / den, 6) if den else None
