"""The run report: report.json (a stable contract later work extends) and a printed summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

from embedpipe.report.counters import Counters


def build_report(total: Counters, *, wall_seconds: float, workers: int, units: int) -> dict:
    wall = max(wall_seconds, 1e-9)
    return {
        "rows": total.rows,
        "tokens": total.tokens,
        "padded_tokens": total.padded_tokens,
        "truncated_rows": total.truncated_rows,
        "wall_seconds": round(wall_seconds, 3),
        "rows_per_second": round(total.rows / wall, 2),
        "tokens_per_second": round(total.tokens / wall, 2),
        "workers": workers,
        "units": units,
        "stages": {stage: round(seconds, 3) for stage, seconds in total.stages.items()},
    }


def write_report(output: Path, report: dict) -> Path:
    path = Path(output) / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def render_summary(report: dict) -> str:
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in report["stages"].items())
    return (f"{report['rows']:,} rows, {report['tokens']:,} tokens in {report['wall_seconds']:.1f}s "
            f"on {report['workers']} worker(s): {report['rows_per_second']:,.0f} rows/s, "
            f"{report['tokens_per_second']:,.0f} tokens/s\n"
            f"truncated rows: {report['truncated_rows']:,}; worker-seconds by stage: {stages}")
