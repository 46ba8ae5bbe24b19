"""report.json -> the printed summary table, report.md, and the side-by-side comparison of runs.

One table of metrics (section, label, how to read it from report.json, how to format it) feeds
every form, so the terminal, the Markdown and the JSON cannot disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from embedpipe.io.layout import REPORT_PNG, OutputLayout
from embedpipe.io.store import store_for, tree_path
from embedpipe.report.cost import project

UNKNOWN = "unknown"
STAGE_ORDER = ("read", "tokenize", "pack", "encode", "write", "index")


# --------------------------------------------------------------------------- formatting

def f_int(v: Any) -> str:
    return f"{int(v):,}"


def f_num(v: Any) -> str:
    return f"{v:,.1f}"


def f_sec(v: Any) -> str:
    return f"{v:,.2f} s"


def f_pct(v: Any) -> str:
    return f"{100 * v:.2f}%" if v == 0 or abs(v) >= 1e-4 else f"{100 * v:.2g}%"


def f_usd(v: Any) -> str:
    return f"${v:,.2f}" if abs(v) >= 1 else f"${v:.4g}"


def f_hours(v: Any) -> str:
    return f"{v:,.1f} h" if abs(v) >= 100 else f"{v:.4g} h"


def f_si(unit: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= scale:
                return f"{v / scale:.3f} {prefix}{unit}"
        return f"{v:.3f} {unit}"
    return fmt


def f_mb(v: Any) -> str:
    return f"{v:,.0f} MB"


def f_text(v: Any) -> str:
    return str(v)


def fmt(value: Any, formatter: Callable[[Any], str]) -> str:
    return UNKNOWN if value is None else formatter(value)


# --------------------------------------------------------------------------- the metrics table

@dataclass(frozen=True)
class Metric:
    section: str
    label: str
    get: Callable[[dict], Any]  # report -> value (None: unknown)
    format: Callable[[Any], str]
    numeric: bool = True  # compared as a ratio in `embedpipe report A B`


def _dig(*keys: str) -> Callable[[dict], Any]:
    def get(r: dict) -> Any:
        for k in keys:
            r = r.get(k) if isinstance(r, dict) else None
        return r
    return get


# runtime.cpu_linears' outcomes (device.linears) as the report names them
LINEARS_TEXT = {"onednn": "oneDNN linears", "torch": "torch's linears"}


def _device_text(r: dict) -> str | None:
    d = r.get("device") or {}
    if not d.get("name"):
        return None
    n = d.get("threads") or 0
    threads = f", {n} thread{'s' if n != 1 else ''} each" if d.get("kind") == "cpu" else ""
    linears = " + ".join(LINEARS_TEXT.get(x, x) for x in (d.get("linears") or "").split(" + ") if x)
    return f"{d['count']} x {d['name']} ({d.get('dtype', '?')}{threads}{', ' + linears if linears else ''})"


def _price_text(r: dict) -> str | None:
    c = r.get("cost") or {}
    return None if c.get("usd_per_hour") is None else f"{f_usd(c['usd_per_hour'])} per {c.get('unit', 'device-hour')}"


def _units_text(r: dict) -> str | None:
    u = r.get("units")
    if not isinstance(u, dict):
        return None if u is None else f"{u:,}"
    return (f"{u['encoded']} encoded of {u['total']} ({u['skipped_as_done']} already done, "
            f"{u['retried']} retried, {u['failed']} failed)")


def _listed(r: dict, key: str, one, *, listed: int, sep: str) -> str | None:
    """``units[key]``'s first ``listed`` entries, each by ``one``, then "and N more"; "none" when empty; None for
    older reports, which lack the key."""
    u = r.get("units")
    items = u.get(key) if isinstance(u, dict) else None
    if items is None:
        return None
    more = f" and {len(items) - listed} more" if len(items) > listed else ""
    return sep.join(one(x) for x in items[:listed]) + more if items else "none"


def _on_node(x: dict) -> str:
    return f" on {x['node']}" if x.get("node") else ""


def _retried_text(r: dict) -> str | None:
    """The units whose attempts were lost, with the cause and the node."""
    causes = {"died": "worker died", "timeout": "worker stalled", "error": "error"}
    return _listed(r, "retried_units", lambda x: f"{x['unit']} ({causes.get(x['cause'], x['cause'])}{_on_node(x)})",
                   listed=5, sep=", ")


def _failed_starts_text(r: dict, *, error_chars: int = 100) -> str | None:
    """The workers that did not start, with their node and error (cut at ``error_chars``)."""

    def one(x: dict) -> str:
        error = x["error"] if len(x["error"]) <= error_chars else x["error"][:error_chars - 1] + "…"
        return f"worker {x['worker']}{_on_node(x)} ({error})"

    return _listed(r, "failed_starts", one, listed=3, sep="; ")


def _bad_rows_text(r: dict) -> str | None:
    bad = r.get("bad_rows")
    if bad is None:
        return None
    return ", ".join(f"{reason}: {n:,}" for reason, n in bad.items()) or "none"


def _max_worker_rss(r: dict) -> float | None:
    workers = [w for w in (r.get("peak_rss_mb") or {}).get("workers", []) if w is not None]
    return max(workers) if workers else None


# before the per-stage seconds
OVERVIEW: list[Metric] = [
    Metric("Run", "job", _dig("job"), f_text, numeric=False),
    Metric("Run", "device", _device_text, f_text, numeric=False),
    Metric("Run", "workers", _dig("workers"), f_int),
    Metric("Run", "units", _units_text, f_text, numeric=False),
    Metric("Run", "retried units", _retried_text, f_text, numeric=False),
    Metric("Run", "failed worker starts", _failed_starts_text, f_text, numeric=False),
    Metric("Run", "wall time", _dig("wall_seconds"), f_sec),
    Metric("Run", "start-up (to first unit or calibration piece)", _dig("startup_seconds"), f_sec),
    Metric("Run", "peak memory, driver", _dig("peak_rss_mb", "driver"), f_mb),
    Metric("Run", "peak memory, worker (max)", _max_worker_rss, f_mb),
    Metric("Data", "rows", _dig("rows"), f_int),
    Metric("Data", "tokens (real)", _dig("tokens"), f_int),
    Metric("Data", "padded tokens", _dig("padded_tokens"), f_int),
    Metric("Data", "padding efficiency", _dig("padding_efficiency"), f_pct),
    Metric("Data", "truncated rows", _dig("truncated_rows"), f_int),
    Metric("Data", "skipped rows", _dig("skipped_rows"), f_int),
    Metric("Data", "bad rows", _bad_rows_text, f_text, numeric=False),
    Metric("Throughput", "rows/s", _dig("rows_per_second"), f_num),
    Metric("Throughput", "tokens/s", _dig("tokens_per_second"), f_num),
    Metric("Throughput", "scaling efficiency", _dig("scaling_efficiency"), f_pct),
    Metric("Throughput", "scaling efficiency after start-up", _dig("scaling_efficiency_after_startup"), f_pct),
    Metric("Throughput", "device busy (of worker time)", _dig("busy_fraction"), f_pct),
]
# after them
HARDWARE_AND_COST: list[Metric] = [
    Metric("Hardware", "FLOPs per token", _dig("flops_per_token"), f_si("FLOP")),
    Metric("Hardware", "peak per device (measured)", _dig("device", "peak_flops"), f_si("FLOP/s")),
    Metric("Hardware", "MFU (run)", _dig("mfu"), f_pct),
    Metric("Hardware", "MFU (while encoding)", _dig("encode_mfu"), f_pct),
    Metric("Cost", "price", _price_text, f_text, numeric=False),
    Metric("Cost", "device-hours", _dig("cost", "device_hours"), f_hours),
    Metric("Cost", "total cost", _dig("cost", "total_usd"), f_usd),
    Metric("Cost", "cost per million tokens", _dig("cost", "usd_per_million_tokens"), f_usd),
    Metric("Cost", "cost per million rows", _dig("cost", "usd_per_million_rows"), f_usd),
]


def stage_names(*reports: dict) -> list[str]:
    names = dict.fromkeys(s for r in reports for s in r.get("stages", {}))
    return sorted(names, key=lambda s: (STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER), s))


def stage_metrics(*reports: dict) -> list[Metric]:
    """Worker-seconds per stage, read to index first, then any other stage by name."""
    def get(stage: str) -> Callable[[dict], Any]:
        return lambda r: r.get("stages", {}).get(stage)

    return [Metric("Worker-seconds by stage", s, get(s), f_sec) for s in stage_names(*reports)]


def projection_metrics(rows: float) -> list[Metric]:
    def get(key: str) -> Callable[[dict], Any]:
        return lambda r: project(r, rows=rows)[key]

    section = f"Projection: {rows:,.0f} rows"
    return [Metric(section, "tokens", get("tokens"), f_int), Metric(section, "wall time", get("wall_hours"), f_hours),
            Metric(section, "device-hours", get("device_hours"), f_hours),
            Metric(section, "total cost", get("total_usd"), f_usd)]


# sections other stages write into report.json, shown as they are (flattened)
FREE_SECTIONS: dict[str, str] = {"index": "Index", "incremental": "Incremental", "version": "Version",
                                  "calibration": "int8/uint8 calibration"}


def free_metrics(report: dict) -> list[Metric]:
    """Sections written by other stages, flattened: the FAISS index (recall, size, build time...),
    the incremental re-embedding, the output version, the int8/uint8 calibration this run fitted."""
    def flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict):
            return [kv for k, v in value.items() for kv in flat(f"{prefix}.{k}" if prefix else str(k), v)]
        return [(prefix, value)]

    def show(v: Any) -> str:
        return f"{v:,.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

    out = []
    for key, title in FREE_SECTIONS.items():
        items = flat("", report[key]) if isinstance(report.get(key), dict) else []
        out += [Metric(title, k, lambda r, v=v: v, show, numeric=False) for k, v in items]
    return out


# an output's report (report/history.py): its runs summed; labels unlike the run's own, so each reads alone
OUTPUT_METRICS: list[Metric] = [
    Metric("Output", "runs", _dig("output", "runs"), f_int),
    Metric("Output", "measured by run", _dig("run", "id"), f_text, numeric=False),
    Metric("Output", "rows encoded, all runs", _dig("output", "rows_encoded"), f_int),
    Metric("Output", "tokens encoded, all runs", _dig("output", "tokens_encoded"), f_int),
    Metric("Output", "wall time, all runs", _dig("output", "wall_seconds"), f_sec),
    Metric("Output", "device-hours, all runs", _dig("output", "device_hours"), f_hours),
    Metric("Output", "cost, all runs", _dig("output", "cost_usd"), f_usd),
]


def metrics_for(report: dict, *, project_rows: float | None = None) -> list[Metric]:
    out = [*OVERVIEW, *stage_metrics(report), *HARDWARE_AND_COST]
    if project_rows:
        out += projection_metrics(project_rows)
    if isinstance(report.get("output"), dict):
        out += OUTPUT_METRICS
    return out + free_metrics(report)


# --------------------------------------------------------------------------- per-worker table

WORKER_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("worker", "worker", f_int), ("host", "host", f_text), ("ray node", "node", f_text), ("units", "units", f_int),
    ("rows", "rows", f_int),
    ("tokens", "tokens", f_int), ("seconds", "seconds", f_sec), ("rows/s", "rows_per_second", f_num),
    ("tokens/s", "tokens_per_second", f_num), ("busy", "busy_fraction", f_pct), ("MFU", "mfu", f_pct),
]


def worker_rows(report: dict) -> list[list[str]]:
    return [[fmt(w.get(key), f) for _, key, f in WORKER_COLUMNS] for w in report.get("per_worker", [])]


# --------------------------------------------------------------------------- an output's runs

RUN_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("run", "run_id", f_text), ("started", "started", f_text), ("rows encoded", "rows_encoded", f_int),
    ("wall", "wall_seconds", f_sec), ("tokens/s", "tokens_per_second", f_num), ("cost", "cost_usd", f_usd),
]


def run_rows(report: dict) -> list[list[str]]:
    """One row per run that wrote into the output (report.json's ``runs``), oldest first, and the index
    it built ('-': none)."""
    return [[*(fmt(r.get(key), f) for _, key, f in RUN_COLUMNS), r.get("index") or "-"]
            for r in report.get("runs") or []]


def run_header() -> list[str]:
    return [*(c for c, _, _ in RUN_COLUMNS), "index"]


# --------------------------------------------------------------------------- renderers

def _sections(metrics: list[Metric], report: dict) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for m in metrics:
        out.setdefault(m.section, []).append((m.label, fmt(m.get(report), m.format)))
    return out


def headline(report: dict) -> str:
    """One line: what the run did, how fast, and what it cost."""
    cost = (report.get("cost") or {}).get("total_usd")
    return (f"{report.get('job') or 'run'}: {report['rows']:,} rows, {report['tokens']:,} tokens in "
            f"{report['wall_seconds']:,.1f}s on {report['workers']} worker(s): {report['rows_per_second']:,.1f} rows/s, "
            f"{report['tokens_per_second']:,.1f} tokens/s, MFU {fmt(report.get('mfu'), f_pct)}, cost {fmt(cost, f_usd)}")


def summary_lines(report: dict) -> list[str]:
    """The run's short summary (report.render_summary); the headline for reports it cannot read."""
    from embedpipe.report.report import render_summary

    try:
        return render_summary(report).splitlines()
    except (KeyError, TypeError):
        return [headline(report)]


def render_table(report: dict, *, project_rows: float | None = None) -> str:
    """The summary printed at the end of a run (and by `embedpipe report OUTPUT_DIR`)."""
    sections = _sections(metrics_for(report, project_rows=project_rows), report)
    width = max(len(label) for rows in sections.values() for label, _ in rows)
    lines = summary_lines(report)
    for title, rows in sections.items():
        lines.append(title)
        lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    workers = worker_rows(report)
    if workers:
        lines.append("Per worker")
        lines += ["  " + line for line in _aligned([[c for c, _, _ in WORKER_COLUMNS], *workers])]
    runs = run_rows(report)
    if runs:
        lines.append("Runs")
        lines += ["  " + line for line in _aligned([run_header(), *runs])]
    return "\n".join(lines)


def render_markdown(report: dict, *, project_rows: float | None = None, plot: str | None = REPORT_PNG) -> str:
    name = report.get("job") or "run"
    lines = [f"# embedpipe report: {name}", "", headline(report), ""]
    for title, rows in _sections(metrics_for(report, project_rows=project_rows), report).items():
        lines += [f"## {title}", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {label} | {value} |" for label, value in rows] + [""]
    workers = worker_rows(report)
    if workers:
        lines += ["## Per worker", "", _md_row([c for c, _, _ in WORKER_COLUMNS]),
                  _md_row(["---"] * len(WORKER_COLUMNS)), *(_md_row(w) for w in workers), ""]
    runs = run_rows(report)
    if runs:
        lines += ["## Runs", "", _md_row(run_header()), _md_row(["---"] * len(run_header())),
                  *(_md_row(r) for r in runs), ""]
    cost = report.get("cost") or {}
    lines += ["## Notes", "",
              f"- price source: {cost.get('source', UNKNOWN)}",
              f"- device busy is measured from the `{report.get('busy_source', 'encode')}` stage "
              "(on CPU the encoder computes synchronously, so its wall time is device time).",
              "- scaling efficiency: worker-seconds on units (and int8/uint8 calibration pieces) / (workers x wall "
              "seconds), after start-up: over the wall seconds from the first unit or piece taken; MFU: model FLOPs "
              "(counted from config.json, see embedpipe/report/flops.py) over the measured matmul peak.", ""]
    if plot:
        lines += [f"![tokens/s per worker and time by stage]({plot})", ""]
    return "\n".join(lines)


def render_comparison(reports: list[dict], names: list[str], *, project_rows: float | None = None) -> str:
    """Runs side by side (e.g. last night against tonight), with B/A ratios for two runs."""
    metrics = [*OVERVIEW, *stage_metrics(*reports), *HARDWARE_AND_COST]
    if project_rows:
        metrics += projection_metrics(project_rows)
    two = len(reports) == 2
    header = ["metric", *names, *(["B/A"] if two else [])]
    rows: list[list[str]] = []
    section = None
    for m in metrics:
        if m.section != section:
            section = m.section
            rows.append([f"[{section}]", *[""] * (len(header) - 1)])
        values = [m.get(r) for r in reports]
        row = [m.label, *(fmt(v, m.format) for v in values)]
        if two:
            a, b = values
            ok = m.numeric and isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
            row.append(f"{b / a:.3f}x" if ok else "")
        rows.append(row)
    if two:
        rows.append(["[Scaling]", "", "", ""])
        rows.append(["tokens/s per worker, B vs A", "", "", _scaling(*reports)])
    return "\n".join(_aligned([header, *rows]))


def _scaling(a: dict, b: dict) -> str:
    """(tokens/s B / tokens/s A) / (workers B / workers A): 1.0 is linear scaling."""
    ta, tb, wa, wb = a.get("tokens_per_second"), b.get("tokens_per_second"), a.get("workers"), b.get("workers")
    if not (ta and tb and wa and wb):
        return UNKNOWN
    return f"{(tb / ta) / (wb / wa):.3f}x"


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def vectors_line(output_dir: str | Path) -> str | None:
    """What the output's vectors are, from its embedpipe.json (None for an output written before there was one)."""
    from embedpipe.io.describe import read_description

    d = read_description(output_dir)
    if d is None:
        return None
    cut = f" of the model's {d.model_dim}" if d.dim != d.model_dim else ""
    chunked = ", chunked" if d.chunking else ""
    return (f"vectors: {d.dim}{cut} x {d.dtype}, {'normalized' if d.normalized else 'not normalized'}, "
            f"metric {d.metric}{chunked}; model {d.model.name} (sha256 {d.model.sha256[:12]}), {d.pooling} pooling, "
            f"max_seq_len {d.max_seq_len}; embedpipe {d.embedpipe_version}")


def load_report(output_dir: str | Path) -> dict:
    """report.json of a finished output or of one of its runs (``OUTPUT/runs/<run id>``), or the file itself."""
    path = tree_path(output_dir)
    path = path if path.suffix == ".json" else OutputLayout(path).report_json
    store = store_for(path)
    if not store.exists(path):
        raise FileNotFoundError(f"{path} does not exist: pass the output.path of a finished run")
    return json.loads(store.read_bytes(path))
