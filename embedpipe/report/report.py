"""The run report: report.json (a stable contract later work extends) and a printed summary.

Totals (``rows``, ``tokens``, ``skipped_rows``, ``truncated_rows``, ``stages``...) describe the whole
output, resumed units included (each unit's counters are kept in its manifest record). Rates
(``rows_per_second``, ``tokens_per_second``) describe this run: what it encoded over its wall time. The
output's report.json carries a run's report forward (report/history.py): there they describe the run its
``run`` section names, the last one that held workers.
"""

from __future__ import annotations

import json
from pathlib import Path

from embedpipe.io.layout import OutputLayout, atomic_write_text
from embedpipe.report.counters import Counters


def build_report(total: Counters, *, this_run: Counters, wall_seconds: float, workers: int, units: dict,
                 peak_rss_mb: dict | None = None) -> dict:
    wall = max(wall_seconds, 1e-9)
    return {
        "rows": total.rows,
        "tokens": total.tokens,
        "padded_tokens": total.padded_tokens,
        "truncated_rows": total.truncated_rows,
        "skipped_rows": total.skipped_rows,
        "bad_rows": dict(sorted(total.bad_rows.items())),
        "wall_seconds": round(wall_seconds, 3),
        "rows_per_second": round(this_run.rows / wall, 2),
        "tokens_per_second": round(this_run.tokens / wall, 2),
        "workers": workers,
        "units": units,
        "stages": {stage: round(seconds, 3) for stage, seconds in total.stages.items()},
        "peak_rss_mb": peak_rss_mb or {},
        **({"chunking": chunking_section(total)} if total.documents else {}),
    }


def chunking_section(total: Counters) -> dict:
    """input.chunking: documents, their chunks (the output's rows) and tokens (the chunks', overlap included)."""
    return {"documents": total.documents, "chunks": total.rows,
            "chunks_per_document_mean": round(total.rows / total.documents, 2),
            "chunks_per_document_max": total.chunks_max, "tokens": total.tokens}


def write_report(output: Path, report: dict) -> Path:
    return atomic_write_text(OutputLayout(output).report_json, json.dumps(report, indent=2) + "\n")


def render_summary(report: dict) -> str:
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in report["stages"].items())
    units = report["units"]
    lines = [
        f"{report['rows']:,} rows, {report['tokens']:,} tokens in the output; {measured_by(report)}: "
        f"{report['rows_per_second']:,.0f} rows/s, {report['tokens_per_second']:,.0f} tokens/s over "
        f"{report['wall_seconds']:.1f}s on {report['workers']} worker(s)",
        f"units: {units['total']} total, {units['skipped_as_done']} already done, {units['encoded']} encoded, "
        f"{units['retried']} retried, {units['failed']} failed",
        f"truncated rows: {report['truncated_rows']:,}; skipped rows: {report['skipped_rows']:,}; "
        f"worker-seconds by stage: {stages}",
    ]
    if "chunking" in report:
        c = report["chunking"]
        lines.append(f"chunking: {c['documents']:,} documents, {c['chunks']:,} chunks ({c['chunks_per_document_mean']} "
                     f"per document, at most {c['chunks_per_document_max']}), {c['tokens']:,} tokens")
    if "index" in report:
        lines.append(render_index(report["index"]))
    return "\n".join(lines)


def measured_by(report: dict) -> str:
    """'this run', or the earlier run whose figures an output's report keeps (its last run held no worker)."""
    run, runs = report.get("run") or {}, report.get("runs") or []
    if runs and run.get("id") and run["id"] != runs[-1]["run_id"]:
        return f"run {run['id']} (the last to encode)"
    return "this run"


def render_index(index: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in index["search_params"].items()) or "exhaustive"
    lines = [f"index: {index['factory']}{' (auto)' if index.get('auto') else ''}, {index['ntotal']:,} vectors, "
             f"{index['bytes'] / 1e6:,.1f} MB in {index['build_seconds']:.1f}s; recall@10 {index['recall_at_10']:.3f}, "
             f"recall@1 {index['recall_at_1']:.3f} ({params}); target {index['target_recall']} "
             f"{'reached' if index['target_reached'] else 'NOT reached'} -> {index['path']}"]
    lines += [f"warning: {w}" for w in index.get("warnings", [])]
    return "\n".join(lines)
