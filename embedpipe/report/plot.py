"""report.png: tokens/s over time, one line per worker, and worker-seconds by stage.

A worker's line steps up to the unit's tokens / unit wall time while it processes a unit and
drops to zero in the gaps between units (waiting for the driver, start-up, the idle tail).
Matplotlib is imported here only, through its object API (no pyplot state, no display needed).

A run writes the same image two or three times (its own report's, then its output's, which differ only in what the
figure does not draw): the last image drawn is kept, by what it was drawn from, and written again as it is.
"""

from __future__ import annotations

import io
import json
from functools import lru_cache
from pathlib import Path

from embedpipe.io.layout import atomic_write_bytes
from embedpipe.io.store import tree_path
from embedpipe.report.render import headline, stage_names

# What the figure reads of a report (build_figure and its headline); write_plot draws it from these alone.
FIGURE_KEYS = ("job", "rows", "tokens", "wall_seconds", "timeline_seconds", "workers", "rows_per_second",
               "tokens_per_second", "mfu", "cost", "per_worker", "stages")


def worker_line(timeline: list[list[float]]) -> tuple[list[float], list[float]]:
    """(x seconds, y tokens/s) of one worker's step line from its [start, end, rows, tokens] spans."""
    xs: list[float] = [0.0]
    ys: list[float] = [0.0]
    for start, end, _rows, tokens in timeline:
        rate = tokens / (end - start) if end > start else 0.0
        xs += [start, start, end, end]
        ys += [0.0, rate, rate, 0.0]
    return xs, ys


def build_figure(report: dict):
    """The figure: axes[0] the per-worker tokens/s lines, axes[1] the stage breakdown."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    timeline, stages = fig.subplots(1, 2, width_ratios=[2, 1])
    for w in report.get("per_worker", []):
        xs, ys = worker_line(w.get("timeline", []))
        timeline.plot(xs, ys, label=f"worker {w['worker']}", linewidth=1.2)
    timeline.set(xlabel="seconds since start", ylabel="tokens/s", title="tokens/s per worker")
    timeline.set_xlim(0, max(report.get("timeline_seconds") or report.get("wall_seconds", 0.0), 1e-3))
    timeline.grid(alpha=0.3)
    if report.get("per_worker"):
        timeline.legend(loc="best", fontsize="small")

    names = stage_names(report)
    seconds = [report["stages"][s] for s in names]
    stages.barh(names, seconds, color="tab:blue")
    stages.invert_yaxis()
    stages.set(xlabel="worker-seconds", title="time by stage")
    total = sum(seconds) or 1.0
    stages.set_xlim(0, max(seconds, default=0.0) * 1.4 or 1.0)  # room for the labels
    for y, s in enumerate(seconds):
        stages.annotate(f"{s:,.1f} s, {100 * s / total:.0f}%", (s, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize="small")
    fig.suptitle(headline(report), fontsize="medium")
    return fig


def figure_inputs(report: dict) -> dict:
    """The part of ``report`` the figure draws (FIGURE_KEYS): two reports that agree on it draw the same image."""
    return {key: report[key] for key in FIGURE_KEYS if key in report}


def write_plot(report: dict, path: str | Path) -> Path:
    return atomic_write_bytes(tree_path(path), _png(json.dumps(figure_inputs(report), sort_keys=True)))


@lru_cache(maxsize=1)
def _png(inputs: str) -> bytes:
    """The PNG of the figure drawn from ``inputs`` (figure_inputs as JSON, the report's own form) and nothing else."""
    png = io.BytesIO()
    build_figure(json.loads(inputs)).savefig(png, format="png", dpi=100)
    return png.getvalue()
