"""open_index / `embedpipe search` on an output in an object store (moto's real S3 API): the index files are
read from a local copy cached by index.json's sha256; a second open downloads nothing."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.index.search import open_index
from embedpipe.io.fs import filesystem, join
from tests.conftest import write_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_corpus, ray_session):
    """A Flat index over 300 real rows, built by the CLI on the session Ray: (output folder, table)."""
    table, path = small_corpus
    folder = tmp_path_factory.mktemp("objstore-search")
    out = folder / "out"
    job = write_job(folder / "job.yaml", input={"path": str(path), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "max_seq_len": 64},
                    batching={"max_tokens": 2048}, output={"path": str(out), "format": "faiss", "index": "Flat"},
                    cluster={"workers": 1, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return out, table


def _upload(local, url: str) -> None:
    fs, inner = filesystem(url)
    fs.put(str(local), inner, recursive=True)
    fs.invalidate_cache()


def test_an_index_on_s3_is_searched_from_a_cached_local_copy(built, s3_bucket, tmp_path, monkeypatch):
    out, table = built
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    url = join(s3_bucket, "out")
    _upload(out, url)
    queries = [table["text"][7].as_py(), table["text"][123].as_py()]

    first = open_index(url)
    assert set(first.downloaded) >= {"index.faiss", "ids.parquet"}
    assert first.local_dir.parent == tmp_path / "cache" / "indexes"
    hits = first.search(queries, k=5)
    assert hits == open_index(out).search(queries, k=5)  # what the local output answers
    assert hits[0][0][0] == table["id"][7].as_py() and hits[1][0][0] == table["id"][123].as_py()

    fs, inner = filesystem(url)
    fs.rm_file(f"{inner}/index/index.faiss")  # a second open must not need it: the cached copy is used
    fs.invalidate_cache()
    again = open_index(url)
    assert again.downloaded == () and again.local_dir == first.local_dir
    assert again.search(queries, k=5) == hits


def test_a_rebuilt_index_gets_a_new_copy(built, s3_bucket, tmp_path, monkeypatch):
    out, _ = built
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    url = join(s3_bucket, "out")
    _upload(out, url)
    first = open_index(url)
    fs, inner = filesystem(url)
    meta = fs.cat_file(f"{inner}/index/index.json")
    fs.pipe_file(f"{inner}/index/index.json", meta.replace(b'"format_version"', b'"rebuilt": 1, "format_version"'))
    second = open_index(url)
    assert "index.faiss" in second.downloaded and second.local_dir != first.local_dir


def test_search_command_takes_the_output_url(built, s3_bucket, tmp_path, monkeypatch):
    out, table = built
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    url = join(s3_bucket, "out")
    _upload(out, url)
    result = CliRunner().invoke(app, ["search", url, table["text"][42].as_py(), "-k", "3"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0].split()
    assert first[0] == "1" and first[2] == str(table["id"][42].as_py())
    missing = CliRunner().invoke(app, ["search", join(s3_bucket, "nowhere"), "x"])
    assert missing.exit_code == 2 and "no index at" in missing.output
    assert pq.read_table(tmp_path / "cache" / "indexes" / next(p.name for p in (tmp_path / "cache" / "indexes").iterdir())
                         / "ids.parquet").num_rows == table.num_rows
