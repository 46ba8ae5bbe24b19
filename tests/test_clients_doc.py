"""Every recipe in docs/clients.md, extracted from the doc and run against a real output (MiniLM, Parquet parts and
a Flat FAISS index, built once): its top 5 must be the brute-force top 5 of the output's own vectors."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from tests.conftest import ROOT, write_job

DOC = ROOT / "docs" / "clients.md"
RECIPE = re.compile(r"<!-- recipe: (?P<name>\w+) -->\s*```python\n(?P<code>.*?)```", re.S)
OUT_LINE = re.compile(r'^OUT = "[^"]*"', re.M)
CLIENTS = {"duckdb": "duckdb", "polars": "polars", "pandas": "pandas", "hf_add_faiss_index": "datasets",
           "hf_load_faiss_index": "datasets", "lancedb": "lancedb", "qdrant": "qdrant_client", "faiss": "faiss"}
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def recipes() -> dict[str, str]:
    return {m["name"]: m["code"] for m in RECIPE.finditer(DOC.read_text())}


def test_the_doc_has_a_recipe_for_every_client():
    assert set(recipes()) == {"setup", *CLIENTS}


@pytest.fixture(scope="module")
def output(tmp_path_factory, quickstart_table, ray_session) -> Path:
    folder = tmp_path_factory.mktemp("clients")
    corpus = folder / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, 200).select(["id", "text"]), corpus, row_group_size=100)
    out = folder / "out"
    job = write_job(folder / "job.yaml", input={"path": str(corpus), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, batching={"max_tokens": 4096},
                    cluster={"workers": 1, "cpus_per_worker": 1},
                    output={"path": str(out), "format": "both", "index": "Flat"})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def setup(output) -> dict:
    """The doc's setup block, with OUT pointing at the real output: meta and the query vector q."""
    code, n = OUT_LINE.subn(f"OUT = {str(output)!r}", recipes()["setup"])
    assert n == 1, "the setup recipe must set OUT on a line of its own"
    namespace: dict = {}
    exec(compile(code, f"{DOC}:setup", "exec"), namespace)
    return namespace


def _brute_force_top5(output: Path, q: np.ndarray) -> list:
    vectors = pq.read_table(output / "vectors")
    X = np.asarray(vectors["embedding"].to_pylist(), dtype=np.float32)
    scores = X @ q / np.linalg.norm(X, axis=1) / np.linalg.norm(q)  # cosine, whatever the lengths
    return [vectors["id"][int(i)].as_py() for i in np.argsort(-scores)[:5]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLIENTS))
def test_the_recipe_finds_the_exact_top5(name, setup, output, tmp_path, monkeypatch):
    if importlib.util.find_spec(CLIENTS[name]) is None:
        pytest.skip(f"{CLIENTS[name]} is not installed (pip install -e '.[dev]')")
    monkeypatch.chdir(tmp_path)  # a recipe's own files (lancedb/) land here
    namespace = dict(setup)
    exec(compile(recipes()[name], f"{DOC}:{name}", "exec"), namespace)
    assert namespace["meta"]["metric"] == "cosine" and namespace["q"].shape == (namespace["meta"]["dim"],)
    assert list(namespace["top5"]) == _brute_force_top5(output, namespace["q"])
