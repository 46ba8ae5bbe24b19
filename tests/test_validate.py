"""`embedpipe validate`: the plan it prints, the idle-worker warning, and output.path checked as `run` checks it."""

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from tests.conftest import write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def single_file(tmp_path_factory, quickstart_table):
    """The quickstart's 3,000 rows as one file of one row group."""
    path = tmp_path_factory.mktemp("single") / "corpus.parquet"
    pq.write_table(quickstart_table.select(["id", "text"]), path, row_group_size=3000)
    return path


def _job(tmp_path, corpus, **sections):
    sections = {"input": {"path": str(corpus)}, "model": {"path": MODEL}, "output": {"path": str(tmp_path / "out")},
                **sections}
    return write_job(tmp_path / "job.yaml", **sections)


def _cli(*args):
    return CliRunner().invoke(app, list(args))


def test_validate_prints_the_plan_for_the_workers(tmp_path, single_file):
    result = _cli("validate", str(_job(tmp_path, single_file, cluster={"workers": 2})))
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert "plan: 8 units, 3,000 rows (375 rows each) from 1 file, for 2 workers (cluster.workers)" in lines
    assert not any(line.startswith("warning:") for line in lines)
    assert lines[-1] == "ok: job"


def test_validate_warns_when_a_worker_would_sit_idle(tmp_path, quickstart_table):
    corpus = tmp_path / "small.parquet"
    pq.write_table(quickstart_table.slice(0, 300).select(["id", "text"]), corpus)
    result = _cli("validate", str(_job(tmp_path, corpus, cluster={"workers": 4})))
    assert result.exit_code == 0, result.output
    assert "plan: 2 units, 300 rows (150 rows each) from 1 file, for 4 workers" in result.output
    assert "warning: 2 of 4 workers would sit idle" in result.output


def _error_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.parametrize("case", ["not embedpipe's", "another job's"])
def test_validate_refuses_the_output_run_refuses_with_the_same_line(tmp_path, single_file, case):
    out = tmp_path / "out"
    out.mkdir()
    if case == "not embedpipe's":
        (out / "thesis.tex").write_text("mine")
        code = 5
    else:  # an output whose manifest names another job
        (out / "_manifest").mkdir()
        (out / "_manifest" / "job.json").write_text(json.dumps({"sha256": "another", "inputs": [], "model": "m",
                                                                "settings": {}}))
        code = 2
    job = str(_job(tmp_path, single_file))
    validated, ran = _cli("validate", job), _cli("run", job, "--no-progress")
    assert validated.exit_code == ran.exit_code == code, validated.output + ran.output
    assert _error_line(validated.output) == _error_line(ran.output)
    assert "ok" not in validated.output.replace(_error_line(validated.output), "")


def test_validate_prints_no_ok_before_an_index_error(tmp_path, single_file):
    result = _cli("validate", str(_job(tmp_path, single_file, output={"path": str(tmp_path / "out"),
                                                                      "format": "faiss", "index": "IVF64,PQ7"})))
    assert result.exit_code == 2 and "output.index" in _error_line(result.output)
    assert "ok" not in result.output.split("error:")[0]
