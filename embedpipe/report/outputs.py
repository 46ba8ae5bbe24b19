"""The human forms of a report, written next to report.json: report.md and report.png."""

from __future__ import annotations

import os
from pathlib import Path

from embedpipe.report.plot import write_plot
from embedpipe.report.render import render_markdown

MARKDOWN, PLOT = "report.md", "report.png"


def write_renderings(output: str | Path, report: dict, *, project_rows: float | None = None) -> dict[str, Path]:
    """Write report.md and report.png from a report dict (a run's, or one loaded from report.json)."""
    output = Path(output)
    md = output / MARKDOWN
    tmp = md.with_name(md.name + ".tmp")
    tmp.write_text(render_markdown(report, project_rows=project_rows, plot=PLOT))
    os.replace(tmp, md)
    return {"markdown": md, "plot": write_plot(report, output / PLOT)}
