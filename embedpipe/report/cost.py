"""The cost model: a price per device-hour (preset table or the job's override) -> what a run cost.

Device-hours are what you pay for: every device the run held, for the whole wall time (start-up,
model load and idle tails included). A device is one GPU, or one CPU worker (priced per vCPU-hour
times its threads). A GPU that is neither in the table nor priced by the job has no price: the
cost fields are then ``null``, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from embedpipe.config import CostConfig
from embedpipe.report.device import DeviceInfo


@dataclass(frozen=True)
class Preset:
    pattern: str  # regex matched against the detected device name
    usd_per_hour: float  # on-demand list price per GPU-hour
    source: str


# Approximate on-demand list prices, USD per GPU-hour: AWS us-east-1, mid-2025, instance price / GPUs.
# Planning defaults only: contracts, reservations and other clouds differ by 2-3x; set
# cost.gpu_hour_usd (or cost.instance_hour_usd + cost.gpus_per_instance) for your own price.
GPU_PRESETS: dict[str, Preset] = {
    "H100": Preset(r"\bH100\b", 6.88, "p5.48xlarge $55.04/h / 8"),
    "H200": Preset(r"\bH200\b", 7.91, "p5en.48xlarge $63.30/h / 8"),
    "B200": Preset(r"\bB200\b", 14.24, "p6-b200.48xlarge $113.93/h / 8"),
    "A100": Preset(r"\bA100\b", 2.74, "p4d.24xlarge $21.96/h / 8"),
    "L4": Preset(r"\bL4\b", 0.80, "g6.xlarge $0.80/h, 1 GPU"),
}
# USD per vCPU-hour for CPU workers: AWS c7i.xlarge $0.1785/h / 4 vCPU (us-east-1, on-demand).
CPU_VCPU_HOUR_USD = 0.0446


@dataclass(frozen=True)
class Price:
    usd_per_hour: float  # per device-hour, spot discount applied
    unit: str  # "GPU-hour" or "worker-hour"
    source: str  # where the number came from, for the report


def preset_for(device: DeviceInfo) -> str | None:
    """The preset row for a detected device (cpu for CPU workers), or None for an unknown GPU."""
    if device.kind == "cpu":
        return "cpu"
    for name, preset in GPU_PRESETS.items():
        if re.search(preset.pattern, device.name):
            return name
    return None


def price_for(device: DeviceInfo, cfg: CostConfig) -> Price | None:
    """The price of one device-hour of ``device`` under the job's cost section; None when unknown."""
    if device.kind == "cpu" and cfg.preset in ("auto", "cpu"):
        per_vcpu = CPU_VCPU_HOUR_USD if cfg.cpu_hour_usd is None else cfg.cpu_hour_usd
        origin = "cpu preset" if cfg.cpu_hour_usd is None else "cost.cpu_hour_usd"
        price = Price(per_vcpu * device.threads, "worker-hour",
                      f"{origin}: ${per_vcpu:g} per vCPU-hour x {device.threads} threads")
    elif cfg.gpu_hour_usd is not None:
        price = Price(cfg.gpu_hour_usd, "GPU-hour", "cost.gpu_hour_usd")
    elif cfg.instance_hour_usd is not None and cfg.gpus_per_instance:
        price = Price(cfg.instance_hour_usd / cfg.gpus_per_instance, "GPU-hour",
                      f"cost.instance_hour_usd ${cfg.instance_hour_usd:g} / {cfg.gpus_per_instance} GPUs")
    else:
        name = preset_for(device) if cfg.preset == "auto" else cfg.preset
        if name is None or name == "cpu":  # an unknown GPU, or the cpu preset forced on a GPU
            return None
        preset = GPU_PRESETS[name]
        price = Price(preset.usd_per_hour, "GPU-hour", f"{name} on-demand list price ({preset.source})")
    if cfg.spot:
        return Price(price.usd_per_hour * (1.0 - cfg.spot_discount), price.unit,
                     f"{price.source}, spot: -{cfg.spot_discount:.0%}")
    return price


def unit_of(devices: list[DeviceInfo]) -> str:
    """What a device-hour is called in the report: GPU-hours, or worker-hours for CPU workers."""
    return "GPU-hour" if devices and all(d.kind == "cuda" for d in devices) else "worker-hour"


def cost_section(*, prices: list[Price | None], wall_seconds: float, tokens: int, rows: int,
                 unit: str = "device-hour") -> dict:
    """report.json's ``cost``: every device held for the wall time; all null when any price is unknown."""
    device_hours = len(prices) * wall_seconds / 3600.0
    if not prices:  # no worker ran (a resumed run with nothing left): no device was held
        return {"usd_per_hour": None, "device_hours": 0.0, "unit": unit, "total_usd": 0.0,
                "usd_per_million_tokens": None, "usd_per_million_rows": None, "source": "no workers ran"}
    if not all(p is not None for p in prices):
        return {"usd_per_hour": None, "device_hours": device_hours, "unit": unit,
                "total_usd": None, "usd_per_million_tokens": None, "usd_per_million_rows": None,
                "source": "unknown: no price for this device; set cost.gpu_hour_usd"}
    total = sum(p.usd_per_hour for p in prices) * wall_seconds / 3600.0  # type: ignore[union-attr]
    return {
        "usd_per_hour": total / device_hours if device_hours else prices[0].usd_per_hour,  # type: ignore[union-attr]
        "device_hours": device_hours,
        "unit": unit,
        "total_usd": total,
        "usd_per_million_tokens": total / tokens * 1e6 if tokens else None,
        "usd_per_million_rows": total / rows * 1e6 if rows else None,
        "source": "; ".join(sorted({p.source for p in prices})),  # type: ignore[union-attr]
    }


def project(report: dict, *, rows: float) -> dict:
    """What a corpus of ``rows`` rows would take and cost on the same devices: the run's start-up once,
    then every worker busy at its measured rows/s (the sum over workers; the run's own rows/s if it
    has no per-worker numbers), with the run's tokens per row and price per device-hour."""
    per_worker = report.get("per_worker") or []
    rate = sum(w["rows"] / w["seconds"] for w in per_worker if w.get("seconds")) or report.get("rows_per_second") or 0.0
    seconds = (report.get("startup_seconds") or 0.0) + rows / rate if rate else None
    devices = (report.get("device") or {}).get("count") or report.get("workers") or 0
    device_hours = devices * seconds / 3600.0 if seconds is not None else None
    price = (report.get("cost") or {}).get("usd_per_hour")
    return {
        "rows": rows,
        "tokens": rows * report["tokens"] / report["rows"] if report.get("rows") else None,
        "wall_hours": seconds / 3600.0 if seconds is not None else None,
        "device_hours": device_hours,
        "total_usd": device_hours * price if device_hours is not None and price is not None else None,
    }
