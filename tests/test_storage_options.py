"""input.storage_options / output.storage_options: fsspec options that reach every worker and are never written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedpipe.config import REDACTED, JobError, parse_job
from embedpipe.io import fs
from conftest import S3_SECRET, run_cli_job


def _job(**input_extra):
    return parse_job({"input": {"path": "s3://bucket/corpus.parquet", **input_extra},
                      "model": {"path": "sentence-transformers/all-MiniLM-L6-v2"}, "output": {"path": "/tmp/out"}})


def test_record_redacts_secrets_and_keeps_the_endpoint():
    job = _job(storage_options={"endpoint_url": "http://127.0.0.1:9000", "key": "AKIA", "secret": "s3cr3t",
                                "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": "tok-9f3e"}})
    assert job.input.storage_options["secret"] == "s3cr3t"  # what the workers get
    written = job.record()["input"]["storage_options"]
    assert written == {"endpoint_url": "http://127.0.0.1:9000", "key": REDACTED, "secret": REDACTED,
                       "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": REDACTED}}
    assert "s3cr3t" not in json.dumps(job.record()) and "tok-9f3e" not in json.dumps(job.record())


def test_record_redacts_a_password_in_the_endpoint_url():
    job = _job(storage_options={"endpoint_url": "http://minio:pw-77c1@127.0.0.1:9000"})
    assert job.record()["input"]["storage_options"] == {"endpoint_url": f"http://{REDACTED}@127.0.0.1:9000"}


def test_storage_options_must_be_a_mapping():
    with pytest.raises(JobError, match=r"input\.storage_options: .* is not a mapping of names to values"):
        _job(storage_options=["endpoint_url=http://x"])


def test_options_apply_per_store_in_this_process():
    fs.use_storage_options("s3://store-a/corpus/*.parquet", {"endpoint_url": "http://127.0.0.1:1"})
    assert fs.storage_options("s3://store-a/other/file.parquet") == {"endpoint_url": "http://127.0.0.1:1"}
    assert fs.storage_options("s3://store-b/file.parquet") == {}
    assert fs.storage_options("/local/path") == {}


def test_an_unknown_storage_option_is_one_line_naming_the_options(tmp_path):
    from embedpipe.errors import StorageError

    fs.use_storage_options("s3://store-c", {"retries": 3, "secret": "x-77f", "endpoint_url": "http://127.0.0.1:1"})
    with pytest.raises(StorageError, match=r"^s3://store-c/a.parquet: a storage option is not one s3:// takes .*"
                                           r"\(endpoint_url, retries, secret\)") as caught:
        fs.expand("s3://store-c/a.parquet")
    assert "x-77f" not in str(caught.value)


@pytest.mark.slow
def test_s3_input_through_the_cli_with_job_storage_options(s3_bucket, s3_options, small_corpus, parquet_cli_vectors,
                                                           tmp_path):
    """Workers (other processes, started before this test set any option) read s3:// with the job's options;
    the vectors are the local run's, and the secret is in no file of the output."""
    import s3fs

    _, path = small_corpus
    s3fs.S3FileSystem(**s3_options).put(str(path), f"{s3_bucket[5:]}/corpus.parquet")
    got = run_cli_job(tmp_path, input={"path": f"{s3_bucket}/corpus.parquet", "storage_options": s3_options})
    assert sorted(got) == sorted(parquet_cli_vectors)
    assert all(np.array_equal(got[k], parquet_cli_vectors[k]) for k in got)
    for file in (tmp_path / "out").rglob("*"):
        if file.is_file():
            assert S3_SECRET.encode() not in file.read_bytes(), file
