"""JSONL, CSV and Hugging Face inputs through the real CLI on the shared local Ray: the same
vectors as the Parquet input of the same rows; the CSV run reads a file:// URL (through fsspec)."""

import json
import os

import pyarrow.csv as pacsv
import pytest

from tests.conftest import assert_same_vectors, run_cli_job

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _write_jsonl(table, path):
    with open(path, "w", encoding="utf-8") as f:
        for row in table.select(["id", "text", "source_doc"]).to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def _write_csv(table, path):
    pacsv.write_csv(table.select(["id", "text", "source_doc"]), path)
    return f"file://{path}"


def _save_dataset(table, path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset(table).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt, write", [("jsonl", _write_jsonl), ("csv", _write_csv), ("huggingface", _save_dataset)])
def test_input_format_gives_the_parquet_vectors(tmp_path, small_corpus, parquet_cli_vectors, fmt, write):
    table, _ = small_corpus
    path = write(table, tmp_path / f"corpus.{ {'jsonl': 'jsonl', 'csv': 'csv', 'huggingface': 'hf'}[fmt] }")
    got = run_cli_job(tmp_path, input={"path": path})  # input.format: auto

    ids = table["id"].to_pylist()
    assert sorted(got) == sorted(ids)
    assert_same_vectors([got[i] for i in ids], [parquet_cli_vectors[i] for i in ids])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rows"] == 300 and report["units"]["total"] == 3
    parts = sorted(p.name for p in (tmp_path / "out" / "vectors").iterdir())
    assert parts == [f"part-00000-{row:010d}.parquet" for row in (0, 100, 200)]
