"""`embedpipe search` in a second: the query model in process (no Ray, no transformers), texts through each input
format's reader, an unreadable text source degrading to ids with one warning line, and `--json` for scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.io.layout import OutputLayout
from tests.conftest import ROOT, free_port, write_job

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROWS = 60


def _parquet(table, folder: Path) -> str:
    pq.write_table(table, folder / "corpus.parquet")
    return str(folder / "corpus.parquet")


def _jsonl(table, folder: Path) -> str:
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in table.to_pylist()), encoding="utf-8")
    return str(path)


def _csv(table, folder: Path) -> str:
    pacsv.write_csv(table, folder / "corpus.csv")
    return str(folder / "corpus.csv")


def _hf(table, folder: Path) -> str:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset(table).save_to_disk(str(folder / "corpus.hf"))
    return str(folder / "corpus.hf")


WRITERS = {"parquet": _parquet, "jsonl": _jsonl, "csv": _csv, "huggingface": _hf}


@pytest.fixture(scope="module")
def table(quickstart_table):
    return quickstart_table.slice(0, ROWS).select(["id", "text"])


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, table, ray_session) -> dict[str, Path]:
    """An output per input format, each of the same rows: one real run on the Parquet file, then for each
    other format a copy of that output whose recorded job reads the same rows from a file of that format
    (what a run on it records: the run itself per format is tests/test_e2e_inputs.py's)."""
    folder = tmp_path_factory.mktemp("search_parquet")
    out = folder / "out"
    job = write_job(folder / "job.yaml", input={"path": _parquet(table, folder), "unit_rows": 30},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, batching={"max_tokens": 4096},
                    cluster={"workers": 1, "cpus_per_worker": 1},
                    output={"path": str(out), "format": "faiss", "index": "Flat"})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    found = {"parquet": out}
    for fmt, write in WRITERS.items():
        if fmt != "parquet":
            folder = tmp_path_factory.mktemp(f"search_{fmt}")
            found[fmt] = _with_input(out, folder / "out", path=write(table, folder), format=fmt)
    return found


def _with_input(out: Path, copy: Path, **input_fields) -> Path:
    """A copy of the output ``out`` whose index records a job reading its input as ``input_fields`` say."""
    shutil.copytree(out, copy)
    meta_path = Path(OutputLayout(copy).index.meta)
    meta = json.loads(meta_path.read_text())
    meta["job"]["input"].update(input_fields)
    meta_path.write_text(json.dumps(meta))
    return copy


def _search(out: Path, query: str, *args: str):
    return CliRunner().invoke(app, ["search", str(out), query, "-k", "3", *args])


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_texts_come_back_for_every_input_format(outputs, table, fmt):
    row = 17
    text, own = table["text"][row].as_py(), table["id"][row].as_py()
    result = _search(outputs[fmt], text, "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["query"] == text and answer["warnings"] == [] and len(answer["results"]) == 3
    first = answer["results"][0]
    assert first["rank"] == 1 and first["id"] == own and first["score"] == pytest.approx(1.0, abs=1e-3)
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    assert all(hit["text"] == texts[hit["id"]] for hit in answer["results"])


def test_an_unreachable_text_source_gives_ids_and_one_warning(outputs, table, tmp_path):
    """The index is local, its input an S3 endpoint nobody answers: ids and scores, one warning line."""
    out = _with_input(outputs["parquet"], tmp_path / "out", path="s3://gone-bucket/corpus.parquet",
                      storage_options={"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k",
                                       "secret": "s", "config_kwargs": {"retries": {"max_attempts": 1}}})
    text, own = table["text"][5].as_py(), table["id"][5].as_py()
    result = CliRunner().invoke(app, ["search", str(out), text, "-k", "3"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    hits = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert len(hits) == 3 and hits[0].split()[2] == own and len(hits[0].split()) == 3  # ids and scores, no text
    warnings = [line for line in lines if "texts not shown" in line]
    assert len(warnings) == 1 and "s3://gone-bucket/corpus.parquet" in warnings[0]
    answer = json.loads(CliRunner().invoke(app, ["search", str(out), text, "--json"]).output.splitlines()[-1])
    assert answer["results"][0]["id"] == own and answer["results"][0]["text"] is None
    assert len(answer["warnings"]) == 1 and "texts not shown" in answer["warnings"][0]


def test_search_loads_neither_ray_nor_torch_and_its_cold_time_is_measured(outputs, capsys):
    """A fresh interpreter opens the index and answers one query with texts: no ray, transformers or
    sentence_transformers import on that path, nor torch at all (~2 s: MiniLM's queries run in numpy,
    embedpipe/index/query.py), torch._dynamo, pyarrow.dataset (pq.read_table of the id map) or pandas (pa.array
    and take import it):
    the cold wall time is printed, not asserted (shared CPUs)."""
    code = ("import sys, time, json; t = time.perf_counter(); from embedpipe.index.search import open_index; "
            "HEAVY = ('ray', 'transformers', 'sentence_transformers', 'torch', 'torch._dynamo', 'pyarrow.dataset', "
            "'pandas'); "
            f"ix = open_index({str(outputs['parquet'])!r}); [hits] = ix.search(['kernel scheduler'], k=3); "
            "texts = ix.source_texts([i for i, _ in hits]); "
            "print(json.dumps({'seconds': time.perf_counter() - t, 'texts': len(texts), "
            "'loaded': sorted(m for m in HEAVY if m in sys.modules)}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["loaded"] == [] and answer["texts"] == 3
    with capsys.disabled():
        print(f"\ncold search (fresh interpreter, open + encode + search + texts): {wall:.2f} s wall, "
              f"{answer['seconds']:.2f} s after start-up")
