"""The printed table, report.md and the comparison all show the numbers of report.json."""

import re

from embedpipe.report.render import render_comparison, render_markdown, render_table, stage_names
from tests.report_helpers import sample_report


def _value(text: str, label: str) -> str:
    """The value cell of the first table line whose label is ``label`` (terminal or Markdown)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else \
            re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == label:
            return cells[1]
    raise AssertionError(f"no line {label!r} in\n{text}")


def test_table_and_markdown_show_the_json_numbers():
    r = sample_report()
    table, md = render_table(r), render_markdown(r)
    want = {
        "rows": "5,000", "tokens (real)": "320,000", "padded tokens": "350,000", "padding efficiency": "91.43%",
        "truncated rows": "10", "tokens/s": "12,800.0", "scaling efficiency": "60.00%", "encode": "35.00 s",
        "price": "$6.88 per GPU-hour", "total cost": "$0.1433", "cost per million tokens": "$0.4479",
    }
    for label, value in want.items():
        assert _value(table, label) == _value(md, label) == value, label
    assert r["cost"]["total_usd"] == 6.88 * 3 * 25 / 3600  # 3 H100s for 25 s
    assert "![tokens/s per worker and time by stage](report.png)" in md
    assert md.count("| node") == 3 and "Per worker" in table


def test_projection_rows_appear_when_asked():
    r = sample_report()
    assert "Projection" not in render_table(r)
    table = render_table(r, project_rows=1e9)
    # 3 workers x 111.1 rows/s after 5 s of start-up; 3 H100 at $6.88
    hours = (5 + 1e9 / (3 * 1000 / 9)) / 3600
    assert _value(table, "total cost").startswith("$")
    assert f"${3 * hours * 6.88:,.2f}" in table and "1,000,000,000 rows" in table


def test_index_section_is_shown_when_the_run_built_one():
    r = {**sample_report(), "index": {"factory": "IVF256,PQ32", "recall": {"at_10": 0.9512}, "bytes": 123456789,
                                       "build_seconds": 12.5}}
    table, md = render_table(r), render_markdown(r)
    for text in (table, md):
        assert _value(text, "recall.at_10") == "0.9512" and _value(text, "bytes") == "123,456,789"
        assert _value(text, "factory") == "IVF256,PQ32"


def test_stage_order_keeps_known_stages_first():
    r = {"stages": {"write": 1.0, "index": 2.0, "encode": 4.0, "read": 0.1, "merge": 0.5}}
    assert stage_names(r) == ["read", "encode", "write", "index", "merge"]


def test_comparison_side_by_side_with_ratios_and_scaling():
    a, b = sample_report(name="last night"), sample_report(name="tonight", speed=2.0, workers=2)
    text = render_comparison([a, b], ["A", "B"])
    line = next(l for l in text.splitlines() if l.startswith("tokens/s "))
    assert line.split()[1:] == ["12,800.0", "21,333.3", "1.667x"]
    # B: 1.667x the tokens/s with 2/3 of the workers = 2.5x per worker
    assert next(l for l in text.splitlines() if l.startswith("tokens/s per worker")).endswith("2.500x")
    assert "last night" in text and "tonight" in text


def test_the_per_worker_table_names_the_ray_node_and_the_retried_units():
    """Each slot's Ray node(s) in order (a replacement elsewhere adds one), each lost attempt with its cause
    and node; "none" when nothing was retried."""
    from dataclasses import replace

    from embedpipe.config import CostConfig
    from embedpipe.report.counters import Counters
    from embedpipe.report.device import DeviceInfo
    from embedpipe.report.metrics import UnitSpan, run_metrics

    assert _value(render_table({**sample_report(), "units": {**sample_report()["units"], "retried_units": []}}),
                  "retried units") == "none"
    cpu = DeviceInfo(kind="cpu", name="Test CPU", host="h", peak_flops={"float32": 1e10})
    span = UnitSpan(0, 1.0, 2.0, Counters(rows=10, tokens=100, padded_tokens=100, stages={"encode": 1.0}))
    spans = [replace(span, node="10.0.0.7/3f2a9c1b"), replace(span, started=3.0, finished=4.0, node="10.0.0.8/77aa01cd"),
             replace(span, started=5.0, finished=6.0, node="10.0.0.8/77aa01cd")]
    metrics = run_metrics({"tokens": 300, "padded_tokens": 300}, this_run=Counters(tokens=300), spans=spans,
                          devices=[cpu], started_at=0.0, wall_seconds=6.0, dtype="float32", model_config=None,
                          cost=CostConfig())
    assert metrics["per_worker"][0]["node"] == "10.0.0.7/3f2a9c1b + 10.0.0.8/77aa01cd"
    lost = {"unit": "00000-00004", "file": "a.parquet", "attempt": 1, "cause": "died", "error": "ActorDiedError",
            "worker": 0, "node": "10.0.0.7/3f2a9c1b"}
    r = sample_report()
    r["units"]["retried_units"] = [lost] * 7
    r["per_worker"] = metrics["per_worker"]
    table, md = render_table(r), render_markdown(r)
    for text in (table, md):
        assert _value(text, "retried units") == "00000-00004 (worker died on 10.0.0.7/3f2a9c1b), " * 4 + \
            "00000-00004 (worker died on 10.0.0.7/3f2a9c1b) and 2 more"
    assert "| ray node |" in md and "10.0.0.7/3f2a9c1b + 10.0.0.8/77aa01cd" in table


def test_the_failed_worker_starts_are_listed_with_their_node_and_error():
    """Each worker that did not start, its node and its error (long ones cut); "none"; "unknown" for older reports."""
    r = sample_report()
    r["units"]["failed_starts"] = []
    assert _value(render_table(r), "failed worker starts") == "none"
    missing = {"worker": 1, "node": "10.0.0.8/77aa01cd", "error": "FileNotFoundError: no weights on this node"}
    long = {"worker": 0, "node": "", "error": "model cache /c: " + "x" * 200}
    r["units"]["failed_starts"] = [missing, long, missing, missing]
    for text in (render_table(r), render_markdown(r)):
        value = _value(text, "failed worker starts")
        assert value.startswith("worker 1 on 10.0.0.8/77aa01cd (FileNotFoundError: no weights on this node); "
                                "worker 0 (model cache /c: xxx"), value
        assert "(model cache /c: " + "x" * 83 + "…)" in value, value  # 100 characters of the error in all
        assert value.endswith(" and 1 more"), value
    del r["units"]["failed_starts"]
    assert _value(render_table(r), "failed worker starts") == "unknown"  # a report from before they were kept
