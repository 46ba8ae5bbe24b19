"""The human forms of a report, written next to report.json: report.md and report.png."""

from __future__ import annotations

from pathlib import Path

from embedpipe.io.layout import REPORT_MD, REPORT_PNG, OutputLayout, atomic_write_text
from embedpipe.report.plot import write_plot
from embedpipe.report.render import render_markdown

MARKDOWN, PLOT = REPORT_MD, REPORT_PNG  # the layout's names


def write_renderings(output: str | Path, report: dict, *, project_rows: float | None = None) -> dict[str, Path]:
    """Write report.md and report.png from a report dict (a run's, or one loaded from report.json)."""
    layout = OutputLayout(output)
    md = atomic_write_text(layout.report_md, render_markdown(report, project_rows=project_rows,
                                                             plot=layout.report_png.name))
    return {"markdown": md, "plot": write_plot(report, layout.report_png)}
