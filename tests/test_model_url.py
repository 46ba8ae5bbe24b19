"""model.path as a URL (s3://bucket/models/minilm/): the driver downloads the model folder once into the local
cache, everything after that is a local folder, and workers get the model through Ray's object store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import REDACTED, parse_job
from embedpipe.io.model_download import ModelCopy, download_model
from embedpipe.io.manifest import job_fingerprint, model_files, model_fingerprint
from embedpipe.models.resolve import resolve_model_path
from conftest import S3_SECRET, write_job


@pytest.fixture
def s3_model(s3_bucket, s3_options, minilm_dir) -> str:
    """The packaged MiniLM folder (README and .gitattributes too) uploaded to ``<bucket>/minilm/``: its URL."""
    import s3fs

    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).put(str(minilm_dir), f"{s3_bucket[5:]}/minilm",
                                                                   recursive=True)
    return f"{s3_bucket}/minilm"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file's (inode, mtime_ns): a file downloaded again is a new file."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_url_model_downloads_once_and_again_when_an_object_changes(s3_model, s3_options, minilm_dir, cache):
    import s3fs

    first = resolve_model_path(s3_model, storage_options=s3_options)
    assert first.parent == cache / "downloads"
    local = [p.relative_to(minilm_dir).as_posix() for p in model_files(minilm_dir)]
    assert sorted(_snapshot(first)) == sorted(local)  # only what a worker reads: no README, no .gitattributes
    assert model_fingerprint(first) == model_fingerprint(minilm_dir)  # the same model, wherever it was read from

    before = _snapshot(first)
    again = resolve_model_path(s3_model + "/", storage_options=s3_options)
    assert again == first and _snapshot(again) == before  # a cache hit: nothing downloaded
    assert download_model(s3_model) == ModelCopy(first, ())  # (the options are this store's since the resolve)
    assert [p.name for p in (cache / "downloads").iterdir()] == [first.name]  # no temp folder left

    (first / "tokenizer.json").write_bytes(b"{}")  # a copy cut by hand is downloaded again
    repaired = download_model(s3_model)
    assert repaired.dir == first and repaired.downloaded == tuple(local)
    assert model_fingerprint(first) == model_fingerprint(minilm_dir)
    before = _snapshot(first)

    changed = json.loads((minilm_dir / "config_sentence_transformers.json").read_text()) | {"note": "re-uploaded"}
    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).pipe_file(
        f"{s3_model[5:]}/config_sentence_transformers.json", json.dumps(changed).encode())
    third = resolve_model_path(s3_model, storage_options=s3_options)
    assert third != first and json.loads((third / "config_sentence_transformers.json").read_text()) == changed
    assert model_fingerprint(third) != model_fingerprint(first)
    assert _snapshot(first) == before  # the old copy is left as it was


def test_model_storage_options_are_redacted_and_not_fingerprinted(minilm_dir):
    def job(options):
        return parse_job({"input": {"path": "s3://data/corpus.parquet"}, "output": {"path": "/tmp/out"},
                          "model": {"path": "s3://models/minilm", "storage_options": options}})

    a, b = job({"endpoint_url": "http://127.0.0.1:9000", "secret": "s3cr3t-a"}), job({"secret": "s3cr3t-b"})
    assert a.model.storage_options["secret"] == "s3cr3t-a"
    assert a.record()["model"]["storage_options"] == {"endpoint_url": "http://127.0.0.1:9000", "secret": REDACTED}
    assert "s3cr3t-a" not in json.dumps(a.record())
    fa, fb = (job_fingerprint(j, files=[], model_dir=minilm_dir) for j in (a, b))
    assert fa["sha256"] == fb["sha256"] and "storage_options" not in fa["settings"]["model"]


@pytest.mark.parametrize("where, says", [("missing prefix", "no model files under it"),
                                         ("missing bucket", "bucket 'no-such-bucket-7f3a' does not exist")])
def test_a_model_url_with_nothing_there_is_one_line_exit_2(where, says, s3_bucket, s3_options, small_corpus, tmp_path,
                                                          cache):
    _, corpus = small_corpus
    url = f"{s3_bucket}/no-such-model/" if where == "missing prefix" else "s3://no-such-bucket-7f3a/minilm/"
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus)}, output={"path": str(tmp_path / "out")},
                    model={"path": url, "storage_options": s3_options})
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line and url.rstrip("/") in line and "model.path" in line
    assert says in line and S3_SECRET not in line
    assert not (cache / "downloads").exists() or not any((cache / "downloads").iterdir())


@pytest.mark.slow
def test_url_model_through_the_cli(s3_model, s3_options, small_corpus, parquet_cli_vectors, minilm_dir, tmp_path,
                                   cache):
    """A job whose model.path is s3://: the same vectors as the local model's, bit for bit, the same model
    fingerprint, and the secret in no file of the output."""
    import pyarrow.dataset as ds

    _, corpus = small_corpus
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus), "unit_rows": 100},
                    model={"path": s3_model, "storage_options": s3_options}, batching={"max_tokens": 4096},
                    output={"path": str(out)}, cluster={"workers": 1, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    vectors = ds.dataset(str(out / "vectors"), format="parquet").to_table()
    got = dict(zip(vectors["id"].to_pylist(), np.asarray(vectors["embedding"].to_pylist(), dtype=np.float32)))
    assert sorted(got) == sorted(parquet_cli_vectors)
    assert all(np.array_equal(got[k], parquet_cli_vectors[k]) for k in got)
    fingerprints = [json.loads(p.read_text()) for p in out.rglob("job.json")]
    assert fingerprints and all(f["model"] == model_fingerprint(minilm_dir) for f in fingerprints)
    for file in out.rglob("*"):
        if file.is_file():
            assert S3_SECRET.encode() not in file.read_bytes(), file


def test_access_denied_on_a_model_url_names_the_model_fields():
    """The fix of a denied read names model.path's permissions (the model section is read-only, like input)."""
    from embedpipe.errors import StorageError
    from embedpipe.io import fs

    with pytest.raises(StorageError) as caught:
        with fs.remote_errors("s3://models-bucket/minilm/model.safetensors", action="read", section="model"):
            raise PermissionError("Access Denied")
    line = caught.value.line()
    assert "grant s3:GetObject on arn:aws:s3:::models-bucket/minilm/model.safetensors*" in line
    assert "model.path needs s3:ListBucket, s3:GetObject" in line
