"""Reports are history: every run keeps its own report under runs/<run id>/, and the output's report.json
keeps what the run that did the work measured when a later run had nothing to do (or only built an index).
On a real local Ray with a tiny random BERT (MiniLM's tokenizer), so a run takes seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.report.render import f_num, f_sec, f_usd, render_markdown, render_table
from tests.conftest import write_job
from tests.model_helpers import save_tiny_text_model
from tests.report_helpers import sample_report
from tests.test_report_render import _value

ROWS, UNIT_ROWS = 100, 50  # two units
RUNS, RENDERED = "runs", ("report.json", "report.md", "report.png")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_text_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, ROWS).select(["id", "text"]), path, row_group_size=UNIT_ROWS)
    return path


def _job(folder: Path, *, corpus: Path, model: Path, **output) -> Path:
    return write_job(folder / "job.yaml", input={"path": str(corpus), "unit_rows": UNIT_ROWS},
                     model={"path": str(model)}, batching={"max_tokens": 2048},
                     output={"path": str(folder / "out"), **output}, cluster={"workers": 1, "cpus_per_worker": 1})


def _run(job: Path, *extra: str) -> None:
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress", *extra])
    assert result.exit_code == 0, result.output


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.usefixtures("one_faiss_thread")
def test_reruns_keep_the_first_runs_measurements_and_every_run(tmp_path, corpus, model, ray_session):
    job = _job(tmp_path, corpus=corpus, model=model)
    out = tmp_path / "out"
    _run(job)
    first = _report(out)
    assert first["tokens_per_second"] > 0 and first["cost"]["total_usd"] > 0
    _run(job)  # nothing to do: no worker starts
    _run(job, "--set", "output.format=both", "--set", "output.index=Flat")  # the index alone

    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert _value(result.output, "tokens/s") == f_num(first["tokens_per_second"])
    assert _value(result.output, "wall time") == f_sec(first["wall_seconds"])
    assert _value(result.output, "total cost") == f_usd(first["cost"]["total_usd"])

    whole = _report(out)
    assert whole["units"]["encoded"] == 0 and whole["units"]["skipped_as_done"] == 2  # what the last run found
    assert whole["index"]["ntotal"] == ROWS and whole["rows"] == ROWS  # the index the last run built
    assert whole["per_worker"] == first["per_worker"] and whole["run"] == first["run"]
    runs = sorted((out / RUNS).iterdir())
    assert len(runs) == 3 and all((run / name).is_file() for run in runs for name in RENDERED)
    reports = [_report(run) for run in runs]
    assert [r["run"]["id"] for r in reports] == [r["run_id"] for r in whole["runs"]] == [p.name for p in runs]
    assert reports[0] == {k: v for k, v in first.items() if k not in ("runs", "output")}
    assert [r["workers"] for r in reports] == [1, 0, 0] and "index" in reports[2]
    assert whole["output"]["runs"] == 3 and whole["output"]["rows_encoded"] == ROWS
    assert whole["output"]["cost_usd"] == pytest.approx(sum(r["cost"]["total_usd"] for r in reports))
    assert whole["output"]["wall_seconds"] == pytest.approx(sum(r["wall_seconds"] for r in reports), abs=1e-2)
    for run in runs:  # the output lists its runs; each run renders alone
        assert run.name in result.output
    one = CliRunner().invoke(app, ["report", str(runs[1])])
    assert one.exit_code == 0 and _value(one.output, "tokens/s") == f_num(0)


@pytest.mark.slow
def test_a_versioned_output_keeps_its_runs_in_its_version_folder(tmp_path, corpus, model, ray_session):
    _run(_job(tmp_path, corpus=corpus, model=model, versioned=True))
    version = (tmp_path / "out" / "CURRENT").read_text().strip()
    folder = tmp_path / "out" / "versions" / version
    [run] = (folder / RUNS).iterdir()
    assert all((run / name).is_file() for name in RENDERED)
    whole = _report(folder)
    assert [r["run_id"] for r in whole["runs"]] == [run.name] and whole["version"]["run_id"] == version
    assert not (tmp_path / "out" / RUNS).exists()  # the versioned root is no output of its own


def test_a_run_that_encoded_nothing_keeps_the_measured_figures(tmp_path):
    from embedpipe.report.history import output_report

    worked = {**sample_report(), "run": {"id": "20260101T000000Z", "started": "2026-01-01T00:00:00+00:00",
                                         "rows_encoded": 5000, "tokens_encoded": 320_000}}
    idle = {**sample_report(name="rerun"), "workers": 0, "tokens_per_second": 0.0, "per_worker": [],
            "cost": {**worked["cost"], "total_usd": 0.0, "device_hours": 0.0},
            "units": {**worked["units"], "skipped_as_done": 5, "encoded": 0}, "index": {"ntotal": 5000},
            "run": {"id": "20260101T000100Z", "started": "2026-01-01T00:01:00+00:00", "rows_encoded": 0,
                    "tokens_encoded": 0}}
    entries = [{"run_id": r["run"]["id"], "started": r["run"]["started"], "wall_seconds": r["wall_seconds"],
                "cost_usd": r["cost"]["total_usd"], "device_hours": r["cost"]["device_hours"], "rows_encoded": r["run"]["rows_encoded"],
                "tokens_encoded": r["run"]["tokens_encoded"], "tokens_per_second": r["tokens_per_second"]}
               for r in (worked, idle)]
    first = output_report(worked, previous=None, runs=entries[:1])
    whole = output_report(idle, previous=first, runs=entries)
    assert whole["tokens_per_second"] == worked["tokens_per_second"] and whole["run"] == worked["run"]
    assert whole["per_worker"] == worked["per_worker"] and whole["cost"] == worked["cost"]
    assert whole["units"] == idle["units"] and whole["index"] == {"ntotal": 5000} and whole["job"] == "rerun"
    assert whole["output"]["runs"] == 2 and whole["output"]["rows_encoded"] == 5000
    assert output_report(idle, previous=None, runs=entries)["tokens_per_second"] == 0.0  # nothing to keep
    shown = {k: v for k, v in whole.items() if k != "index"}  # this index is no real index section
    table, md = render_table(shown), render_markdown(shown)
    assert table.splitlines()[0].endswith("run 20260101T000000Z (the last to encode): 200 rows/s, 12,800 tokens/s "
                                          "over 25.0s on 3 worker(s)")
    for text in (table, md):
        assert _value(text, "measured by run") == "20260101T000000Z" and _value(text, "runs") == "2"
        assert _value(text, "20260101T000000Z") == "2026-01-01T00:00:00+00:00"  # the runs table, a row per run
        assert _value(text, "20260101T000100Z") == "2026-01-01T00:01:00+00:00"


def test_run_ids_are_utc_seconds_with_a_suffix_when_taken(tmp_path):
    from embedpipe.report.history import new_run_id

    assert new_run_id(tmp_path, started_at=0.0) == "19700101T000000Z"
    (tmp_path / "19700101T000000Z").mkdir()
    (tmp_path / "19700101T000000Z-1").mkdir()
    assert new_run_id(tmp_path, started_at=0.4) == "19700101T000000Z-2"


def test_a_new_version_is_named_by_its_runs_start_second(tmp_path):
    from embedpipe.versions import choose_version

    assert choose_version(tmp_path, {"sha256": "abc"}, started_at=0.9) == "19700101T000000Z"
    (tmp_path / "versions" / "19700101T000000Z").mkdir(parents=True)  # a version of that second exists (finished)
    (tmp_path / "CURRENT").write_text("19700101T000000Z")
    assert choose_version(tmp_path, {"sha256": "abc"}, started_at=0.9) == "19700101T000000Z-1"
