"""End to end through the real CLI on a real local Ray: 2 workers, several files and row groups."""

import json

import numpy as np
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.runtime import Encoder
from tests.conftest import QUICKSTART, split_corpus, write_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table):
    # 600 real rows, some past 256 tokens, as 3 files of 2 row groups each: 6 work units.
    table = quickstart_table.slice(0, 600)
    folder = tmp_path_factory.mktemp("corpus")
    split_corpus(table, folder, files=3, row_group_size=100)
    return table, folder


def test_run_two_workers_every_id_once_with_its_own_vector(tmp_path, corpus, ray_session, minilm_dir):
    table, folder = corpus
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(folder), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    batching={"max_tokens": 2048},
                    output={"path": str(tmp_path / "out")},
                    cluster={"workers": 2, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output

    out = ds.dataset(tmp_path / "out" / "vectors", format="parquet").to_table()
    parts = sorted(p.name for p in (tmp_path / "out" / "vectors").iterdir())
    assert parts == [f"part-{f:05d}-{rg:05d}.parquet" for f in range(3) for rg in (0, 1)]
    ids = out["id"].to_pylist()
    assert len(ids) == len(set(ids)) == table.num_rows and set(ids) == set(table["id"].to_pylist())

    encoder = Encoder.from_options(str(minilm_dir))
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    want = encoder.embed([texts[i] for i in ids])
    got = np.asarray(out["embedding"].to_pylist(), dtype=np.float32)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    tokens = int(encoder.tokenizer(table["text"].to_pylist()).lengths.sum())
    assert report["rows"] == 600 and report["tokens"] == tokens and report["padded_tokens"] >= tokens
    assert report["workers"] == 2 and report["truncated_rows"] > 0
    assert set(report["stages"]) >= {"read", "tokenize", "pack", "encode", "write"}
    assert all(report["stages"][s] > 0 for s in ("read", "tokenize", "encode", "write"))
    assert report["tokens_per_second"] > 0 and report["wall_seconds"] > 0


def test_bad_input_column_fails_before_workers_start(tmp_path, corpus):
    _, folder = corpus
    job = write_job(tmp_path / "job.yaml", input={"path": str(folder), "text_column": "body"},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "o")})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 3
    assert "no column 'body'" in result.output and "input.text_column" in result.output


def test_validate_reports_units(tmp_path):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART), "unit_rows": 1000},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "o")})
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert "3 units, 3,000 rows" in result.output


def test_validate_bad_job_exit_code_and_message(tmp_path):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "dtype": "fp8"},
                    output={"path": str(tmp_path / "o")})
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 2 and "model.dtype" in result.output
