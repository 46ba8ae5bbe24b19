"""embedpipe.json at an output's root and the same record in every part's Parquet schema metadata: the resolved
facts of the vectors (model, dim, dtype, normalisation, metric, pooling, max_seq_len, prompt, calibration)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import embedpipe
from embedpipe.cli import app
from embedpipe.config import load_job
from embedpipe.io.describe import METADATA_KEY, read_description
from embedpipe.io.layout import OutputLayout
from embedpipe.preflight import preflight
from tests.conftest import write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table) -> Path:
    path = tmp_path_factory.mktemp("describe_corpus") / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, 120).select(["id", "text"]), path, row_group_size=60)
    return path


def _run(folder: Path, corpus: Path, *, out: str | None = None, chunking: dict | None = None, **output) -> Path:
    out = out or folder / "out"
    chunked = {"chunking": chunking} if chunking else {}
    job = write_job(folder / "job.yaml", input={"path": str(corpus), "unit_rows": 60, **chunked}, model={"path": MODEL},
                    batching={"max_tokens": 4096}, cluster={"workers": 1, "cpus_per_worker": 1},
                    output={"path": str(out), **output})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


def _record_and_parts(out: Path) -> tuple[dict, list[dict]]:
    layout = OutputLayout(out)
    record = json.loads(Path(layout.description).read_text())
    parts = [json.loads(pq.read_schema(p).metadata[METADATA_KEY]) for p in layout.parts()]
    assert len(parts) == 2
    return record, parts


def _assert_model(record: dict, minilm_dir: Path) -> None:
    model = record["model"]
    assert model["name"] == MODEL and Path(model["path"]) == minilm_dir
    assert re.fullmatch(r"[0-9a-f]{64}", model["sha256"])
    assert set(model["weights"]) == {"model.safetensors"}
    import hashlib

    assert model["weights"]["model.safetensors"] == hashlib.sha256(
        (minilm_dir / "model.safetensors").read_bytes()).hexdigest()
    assert record["embedpipe_version"] == embedpipe.__version__ and record["format_version"] == 1
    assert record["pooling"] == "mean" and record["max_seq_len"] == 256  # the model's, resolved
    assert record["prompt"] == "" and record["query_prompt"] == "" and record["chunking"] is None


@pytest.mark.slow
def test_a_float_output_describes_itself(tmp_path, corpus, minilm_dir, ray_session):
    out = _run(tmp_path, corpus, format="both", index="Flat")
    record, parts = _record_and_parts(out)
    _assert_model(record, minilm_dir)
    assert (record["dim"], record["model_dim"], record["dtype"], record["width"]) == (384, 384, "float32", 384)
    assert record["normalized"] is True and record["metric"] == "cosine" and record["calibration"] is None
    assert all(part == record for part in parts)
    vectors = np.asarray(pq.read_table(OutputLayout(out).parts()[0])["embedding"].to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # what "normalized" says
    assert read_description(out).metric == "cosine"
    meta = json.loads(Path(OutputLayout(out).index.meta).read_text())
    assert meta["normalize"] is True and meta["job"]["model"]["normalize"] == "auto"  # resolved beside the job's
    shown = CliRunner().invoke(app, ["report", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "vectors: 384 x float32, normalized, metric cosine; model " + MODEL in shown.output


@pytest.mark.slow
def test_an_object_store_output_describes_itself(tmp_path, corpus, minilm_dir, s3_bucket, s3_options, ray_session):
    import s3fs

    out = _run(tmp_path, corpus, out=f"{s3_bucket}/out", storage_options=s3_options)
    s3 = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    record = json.loads(s3.cat_file(f"{s3_bucket[5:]}/out/embedpipe.json"))
    _assert_model(record, minilm_dir)
    assert (record["dim"], record["dtype"], record["normalized"]) == (384, "float32", True)
    parts = [p for p in s3.ls(f"{s3_bucket[5:]}/out/vectors") if p.endswith(".parquet")]
    assert len(parts) == 2
    for part in parts:
        with s3.open(part, "rb") as f:
            assert json.loads(pq.read_schema(f).metadata[METADATA_KEY]) == record
    assert read_description(out).to_dict() == record


@pytest.mark.slow
def test_a_matryoshka_output_records_the_truncated_dimension(tmp_path, corpus, minilm_dir, ray_session):
    out = _run(tmp_path, corpus, dim=128, dtype="float16")
    record, parts = _record_and_parts(out)
    _assert_model(record, minilm_dir)
    assert (record["dim"], record["model_dim"], record["dtype"], record["width"]) == (128, 384, "float16", 128)
    assert record["normalized"] is True and record["metric"] == "cosine"  # renormalised after the cut
    assert all(part == record for part in parts)


@pytest.mark.slow
def test_an_int8_output_records_its_calibration(tmp_path, corpus, minilm_dir, ray_session):
    out = _run(tmp_path, corpus, dtype="int8", calibration_rows=100)
    record, parts = _record_and_parts(out)
    _assert_model(record, minilm_dir)
    assert (record["dim"], record["dtype"], record["width"], record["metric"]) == (384, "int8", 384, "cosine")
    calibration = record["calibration"]
    assert calibration["precision"] == "int8" and calibration["rows"] == 100 and calibration["input_rows"] == 120
    assert np.asarray(calibration["ranges"]).shape == (2, 384)
    quantization = json.loads(Path(OutputLayout(out).quantization).read_text())
    assert calibration == quantization["calibration"]  # the ranges the parts were quantized with
    assert all(part == record for part in parts)


@pytest.mark.slow
def test_a_chunked_output_records_its_chunking(tmp_path, corpus, minilm_dir, ray_session):
    out = _run(tmp_path, corpus, chunking={"mode": "split", "overlap": 16})
    record, parts = _record_and_parts(out)
    assert record["chunking"] == {"mode": "split", "max_tokens": 256, "overlap": 16, "boundary_window": 32}
    assert (record["dim"], record["dtype"], record["metric"]) == (384, "float32", "cosine")
    assert all(part == record for part in parts)
    assert "chunk" in pq.read_schema(OutputLayout(out).parts()[0]).names


def test_the_record_resolves_what_the_job_leaves_to_the_model(tmp_path, corpus, minilm_dir):
    """normalize/pooling/max_seq_len/prompt as the job sets them, never "auto"; unnormalised vectors imply l2."""
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus)},
                    model={"path": MODEL, "normalize": False, "pooling": "cls", "max_seq_len": 64,
                           "prompt": "passage: "}, output={"path": str(tmp_path / "out"), "dtype": "binary"})
    record = preflight(load_job(job)).describe(load_job(job)).to_dict()
    assert (record["normalized"], record["pooling"], record["max_seq_len"], record["prompt"]) == \
        (False, "cls", 64, "passage: ")
    assert (record["dtype"], record["width"], record["metric"]) == ("binary", 48, "hamming")
    auto = load_job(job, overrides=["model.normalize=auto", "model.pooling=auto", "model.max_seq_len=null",
                                    "model.prompt=null", "output.dtype=float32"])
    default = preflight(auto).describe(auto).to_dict()
    assert (default["normalized"], default["pooling"], default["max_seq_len"], default["prompt"]) == \
        (True, "mean", 256, "")


@pytest.mark.slow
def test_an_incremental_run_names_the_facts_that_changed(tmp_path, corpus, ray_session):
    """Night 2 cuts the vectors to 128 dimensions: nothing is reusable, and the report says which fact changed
    (the current version's embedpipe.json against this run's); the versioned root describes the new CURRENT."""
    root = tmp_path / "nightly"
    versioned = {"versioned": True, "incremental": True}
    for night, extra in (("a", {}), ("b", {"dim": 128})):
        (tmp_path / night).mkdir()
        _run(tmp_path / night, corpus, out=str(root), **versioned, **extra)
    layout = OutputLayout(root)
    night2 = layout.version(Path(layout.current).read_text().strip())
    report = json.loads(Path(night2.report_json).read_text())
    assert report["incremental"]["reused"] == 0
    assert "dim 384 -> 128" in report["incremental"]["reencoded_all"]
    assert read_description(root) == read_description(night2.root) and read_description(root).dim == 128
