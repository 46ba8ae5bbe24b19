"""Reports are history: each run's report under ``runs/<run id>/``, and the output's report beside the vectors.

    <output>/runs/<run id>/report.json, .md, .png   one run, as it measured itself; never rewritten
    <output>/report.json, .md, .png                  the output: what it holds, what measured it, its runs

The output's report is the last run's report when that run held workers. A run that held none (a
resume with nothing left, an index-only rerun) measured nothing: the output's report keeps the
measured figures of the run before (throughput, wall time, cost, devices, per worker; its ``run``
section names that run) and takes from the new run only what describes the output (``OUTPUT_KEYS``).
Both carry ``runs`` (one entry per folder under runs/, oldest first) and ``output`` (their sums).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

from embedpipe.io.layout import RUNS, OutputLayout, stamp_name
from embedpipe.io.store import Store, TreePath, store_for
from embedpipe.report.counters import Counters
from embedpipe.report.outputs import write_renderings
from embedpipe.report.report import write_report

log = logging.getLogger(__name__)

# What a run that held no worker still knows about the output, and so rewrites in the output's report.
OUTPUT_KEYS = ("job", "rows", "tokens", "padded_tokens", "truncated_rows", "skipped_rows", "bad_rows",
               "padding_efficiency", "units", "stages", "index", "incremental", "version")


def new_run_id(runs: TreePath, *, started_at: float) -> str:
    """The run's UTC start second, with ``-1``, ``-2``... when a run of that second exists."""
    return stamp_name(started_at, taken=set(store_for(runs).names(runs)))


def record_run(output: TreePath, report: dict, *, started_at: float, this_run: Counters) -> dict:
    """Write the run's report under runs/<run id>/, then the output's report from it; returns the output's."""
    layout = OutputLayout(output)
    run_id = new_run_id(layout.runs, started_at=started_at)
    run = {**report, "run": {"id": run_id,
                             "started": datetime.fromtimestamp(started_at, timezone.utc).isoformat(timespec="seconds"),
                             "rows_encoded": this_run.rows - this_run.reused_rows, "tokens_encoded": this_run.tokens}}
    folder = layout.run(run_id).root
    layout.store.mkdir(folder)
    write_report(folder, run)
    write_renderings(folder, run)
    previous = None if run["workers"] else _read(layout.store, layout.report_json)
    whole = output_report(run, previous=previous, runs=list_runs(output))
    write_report(output, whole)
    write_renderings(output, whole)
    return whole


def output_report(run: dict, *, previous: dict | None, runs: list[dict]) -> dict:
    """The output's report after ``run``: ``previous``'s measured figures when ``run`` held no worker."""
    base = run if run["workers"] or previous is None else {**previous, **{k: run[k] for k in OUTPUT_KEYS if k in run}}
    base = {k: v for k, v in base.items() if k not in ("runs", "output")}
    return {**base, "runs": runs, "output": _sums(runs)}


def list_runs(output: TreePath) -> list[dict]:
    """One line per run under runs/, oldest first: what it encoded, in what time, at what cost."""
    layout = OutputLayout(output)
    reports = [layout.run(name).report_json for name in layout.store.names(layout.runs)]
    read = layout.store.read_many(reports)  # a name that is no run folder has no report.json: left out
    found = [_parse(read[path], path) for path in reports if path in read]
    entries = [_entry(r) for r in found if r is not None and isinstance(r.get("run"), dict)]
    return sorted(entries, key=lambda e: (e["started"], e["run_id"]))


def _entry(run: dict) -> dict:
    cost = run.get("cost") or {}
    return {
        "run_id": run["run"]["id"],
        "started": run["run"]["started"],
        "wall_seconds": run["wall_seconds"],
        "workers": run["workers"],
        "rows_encoded": run["run"]["rows_encoded"],
        "tokens_encoded": run["run"]["tokens_encoded"],
        "tokens_per_second": run["tokens_per_second"],
        "device_hours": cost.get("device_hours"),
        "cost_usd": cost.get("total_usd"),
        "index": (run.get("index") or {}).get("factory"),
    }


def _sums(runs: list[dict]) -> dict:
    costs = [r.get("cost_usd") for r in runs]
    return {
        "runs": len(runs),
        "wall_seconds": round(sum(r["wall_seconds"] for r in runs), 3),
        "device_hours": sum(r.get("device_hours") or 0.0 for r in runs),
        "cost_usd": None if any(c is None for c in costs) else sum(costs),
        "rows_encoded": sum(r["rows_encoded"] for r in runs),
        "tokens_encoded": sum(r["tokens_encoded"] for r in runs),
    }


def _read(store: Store, path: TreePath) -> dict | None:
    """A report.json, or None when there is none or it cannot be read (then it is not carried)."""
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s is unreadable and is not carried into the new report: %s", path, exc)
        return None
    return _parse(data, path)


def _parse(data: bytes, path: TreePath) -> dict | None:
    try:
        report = json.loads(data)
    except ValueError as exc:
        log.warning("%s is unreadable and is not carried into the new report: %s", path, exc)
        return None
    return report if isinstance(report, dict) else None
