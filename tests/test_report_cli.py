"""A real CLI run writes report.json, report.md and report.png, prints the table, and they all agree
with each other and with counts recomputed from the output; `embedpipe report` re-renders and compares."""

import json
import shutil

import numpy as np
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.report.flops import flops_per_token_from_config, read_model_config
from embedpipe.report.plot import build_figure
from embedpipe.report.render import f_hours, f_int, f_num, f_pct, f_usd, headline
from embedpipe.runtime import Encoder
from tests.conftest import split_corpus, write_job
from tests.test_report_render import _value

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, quickstart_table, ray_session):
    """300 real rows as 3 units over 2 CPU workers, priced at $0.05 per vCPU-hour through --set."""
    tmp = tmp_path_factory.mktemp("report_run")
    table = quickstart_table.slice(0, 300)
    split_corpus(table, tmp / "corpus", files=1, row_group_size=100)
    job = write_job(tmp / "job.yaml", name="nightly",
                    input={"path": str(tmp / "corpus"), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    batching={"max_tokens": 2048},
                    output={"path": str(tmp / "out")},
                    cluster={"workers": 2, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress", "--set", "cost.cpu_hour_usd=0.05"])
    assert result.exit_code == 0, result.output
    return table, tmp / "out", result.output, job


def test_report_json_matches_counts_recomputed_from_the_output(run, minilm_dir):
    table, out, _, _ = run
    report = json.loads((out / "report.json").read_text())
    vectors = ds.dataset(out / "vectors", format="parquet").to_table()
    encoder = Encoder.from_options(str(minilm_dir))
    lengths = encoder.tokenizer(table["text"].to_pylist()).lengths.astype(np.int64)

    assert report["rows"] == vectors.num_rows == 300 and report["tokens"] == int(lengths.sum())
    assert report["job"] == "nightly" and report["workers"] == 2 and report["units"]["encoded"] == 3
    assert sum(w["rows"] for w in report["per_worker"]) == 300
    assert sum(w["tokens"] for w in report["per_worker"]) == report["tokens"]
    spans = [s for w in report["per_worker"] for s in w["timeline"]]
    assert len(spans) == 3 and sum(s[2] for s in spans) == 300
    # on the units' clock (time.time()), which a stepped or paused VM clock can move off wall_seconds' perf_counter
    assert all(0 <= s[0] < s[1] <= report["timeline_seconds"] + 1e-3 for s in spans)

    seq = float((lengths**2).sum() / lengths.sum())  # the run's FLOPs-weighted sequence length
    fpt = flops_per_token_from_config(read_model_config(str(minilm_dir)), seq)
    assert report["flops_per_token"] == pytest.approx(fpt, rel=1e-9)
    device = report["device"]
    assert device["kind"] == "cpu" and device["count"] == 2 and device["threads"] == 1 and device["peak_flops"] > 0
    # runtime.cpu_linears auto: the library the machine measured faster, the same for every worker of one machine
    assert device["linears"] in ("onednn", "torch")
    assert [w["linears"] for w in report["per_worker"]] == [device["linears"]] * 2
    mfu = fpt * report["tokens"] / report["wall_seconds"] / device["peak_flops_total"]
    assert report["mfu"] == pytest.approx(mfu, rel=1e-3) and 0 < report["mfu"] < 1
    assert 0 < report["busy_fraction"] <= 1 and 0 < report["scaling_efficiency"] <= 1

    cost = report["cost"]
    assert cost["usd_per_hour"] == pytest.approx(0.05)  # --set cost.cpu_hour_usd=0.05, 1 thread per worker
    assert cost["device_hours"] == pytest.approx(2 * report["wall_seconds"] / 3600, rel=1e-3)
    assert cost["total_usd"] == pytest.approx(cost["device_hours"] * 0.05, rel=1e-3)
    assert cost["usd_per_million_tokens"] == pytest.approx(cost["total_usd"] / report["tokens"] * 1e6)
    assert cost["usd_per_million_rows"] == pytest.approx(cost["total_usd"] / 300 * 1e6)


def test_printed_table_markdown_and_json_agree(run):
    _, out, printed, _ = run
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    want = {
        "rows": f_int(report["rows"]), "tokens (real)": f_int(report["tokens"]),
        "truncated rows": f_int(report["truncated_rows"]), "tokens/s": f_num(report["tokens_per_second"]),
        "MFU (run)": f_pct(report["mfu"]), "device-hours": f_hours(report["cost"]["device_hours"]),
        "total cost": f_usd(report["cost"]["total_usd"]), "skipped rows": "0",
    }
    for label, value in want.items():
        assert _value(printed, label) == _value(md, label) == value, label
    assert f"{report['rows']:,}" == _value(md, "rows") and "report.png" in printed
    library = {"onednn": "oneDNN linears", "torch": "torch's linears"}[report["device"]["linears"]]
    assert _value(printed, "device") == _value(md, "device") == f"2 x {report['device']['name']} (float32, 1 thread each, {library})"
    line = headline(report)
    assert line in md.splitlines() and "300 rows" in line
    assert build_figure(report)._suptitle.get_text() == line
    assert printed.startswith("300 rows, ")  # the run's short summary (report.render_summary) leads the table


def test_plot_is_a_png_with_one_line_per_worker(run):
    _, out, _, _ = run
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    assert len(build_figure(report).axes[0].get_lines()) == report["workers"] == 2


def test_report_command_rerenders_and_projects(run):
    _, out, _, _ = run
    before = (out / "report.json").read_bytes()
    (out / "report.md").unlink()
    result = CliRunner().invoke(app, ["report", str(out), "--project-rows", "1e9"])
    assert result.exit_code == 0, result.output
    assert "Projection: 1,000,000,000 rows" in result.output
    assert "Projection: 1,000,000,000 rows" in (out / "report.md").read_text()
    assert (out / "report.json").read_bytes() == before  # re-rendering never rewrites the run's numbers


def test_report_command_compares_two_runs(run):
    _, out, _, _ = run
    result = CliRunner().invoke(app, ["report", str(out), str(out)])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("tokens/s "))
    assert line.rstrip().endswith("1.000x")


def test_report_command_names_a_missing_run(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "report.json does not exist" in result.output


def test_a_resumed_run_with_nothing_left_costs_nothing(run, tmp_path):
    _, out, _, job = run
    shutil.copytree(out, tmp_path / "copy")  # the same job's finished output elsewhere: every unit is done
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress", "--set", f"output.path={tmp_path / 'copy'}"])
    assert result.exit_code == 0, result.output
    assert "3 already done, 0 encoded" in result.output
    whole = json.loads((tmp_path / "copy" / "report.json").read_text())  # the output's: keeps the first run's figures
    report = json.loads((tmp_path / "copy" / "runs" / whole["runs"][-1]["run_id"] / "report.json").read_text())
    assert report["rows"] == 300 and report["per_worker"] == [] and report["mfu"] is None
    assert report["cost"]["total_usd"] == 0 and report["cost"]["device_hours"] == 0
    assert "report.png" in (tmp_path / "copy" / "report.md").read_text()
