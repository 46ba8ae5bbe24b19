"""Outputs in object stores (output.path an fsspec URL): the store on memory://, then runs on moto's real S3
server through the real CLI and a real local Ray: exact vectors, the index uploaded, a killed worker, a killed
driver, and an orphan part of a killed attempt."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import load_job
from embedpipe.errors import OutputRefused
from embedpipe.io.layout import PART_NAME, OutputLayout
from embedpipe.io.manifest import Manifest
from embedpipe.io.ownership import OutputNotOwned, check_output, claim_output
from embedpipe.io.store import OBJECT, Url, Written
from embedpipe.io.writer import ParquetPartWriter
from tests.conftest import S3_SECRET, write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def mem_root():
    """A fresh prefix in this process's memory:// store."""
    import fsspec

    root = f"memory://objout-{uuid.uuid4().hex[:8]}/out"
    yield root
    memory, bucket = fsspec.filesystem("memory"), root.split("://")[1].split("/")[0]
    if memory.exists(bucket):
        memory.rm(bucket, recursive=True)


# --------------------------------------------------------------------------- the store, on memory://

def test_url_paths_keep_their_slashes_and_the_store_writes_lists_hashes_removes(mem_root):
    layout = OutputLayout(mem_root)
    assert isinstance(layout.root, Url) and layout.store is OBJECT and layout.store.unique_parts
    assert str(layout.unit_record("u")) == f"{mem_root}/_manifest/units/u.json"
    assert OutputLayout("s3://b/x").part("u") == "s3://b/x/vectors/part-u.parquet"  # never s3:/b/x/...
    assert not OutputLayout("/tmp/x").store.unique_parts  # local parts keep part-<unit>.parquet

    store = layout.store
    data = b"x" * 1000
    written = store.write_bytes(layout.vectors / "a.bin", data)
    assert written == Written(layout.vectors / "a.bin", 1000, hashlib.sha256(data).hexdigest())
    table = store.write_table(pa.table({"id": [1, 2, 3]}), layout.vectors / "t.parquet")
    assert store.list(layout.vectors) == {"a.bin": 1000, "t.parquet": table.bytes}
    assert store.sha256(table.path) == table.sha256 == hashlib.sha256(store.read_bytes(table.path)).hexdigest()
    assert store.exists(table.path) and not store.exists(layout.vectors / "none")
    assert set(store.read_many([written.path, layout.vectors / "none"])) == {written.path}
    store.remove_many([written.path, layout.vectors / "none"])  # a missing object is no error
    assert list(store.list(layout.vectors)) == ["t.parquet"]
    store.remove_tree(layout.vectors)
    assert store.list(layout.vectors) == {} and store.names(layout.root) == []


def test_each_attempt_writes_its_own_part_on_object_stores_and_the_record_names_it(mem_root, tmp_path):
    writer = ParquetPartWriter(output_path=mem_root)
    ids, vectors = pa.array(["a", "b"]), np.eye(2, 4, dtype=np.float32)
    first, second = writer.write("00000-00000", ids, vectors), writer.write("00000-00000", ids, vectors)
    assert first.path != second.path
    for part in (first, second):
        match = PART_NAME.match(part.path.name)
        assert match and match["unit"] == "00000-00000" and len(match["attempt"]) == 12
    record = Manifest(mem_root).record("00000-00000", parts=[second], counters={})
    assert record["parts"] == [{"path": f"vectors/{second.path.name}", "bytes": second.bytes, "sha256": second.sha256}]
    local = ParquetPartWriter(output_path=str(tmp_path)).write("00000-00000", ids, vectors)
    assert local.path == tmp_path / "vectors" / "part-00000-00000.parquet"  # local names as before


def test_done_checks_recorded_parts_by_one_listing_and_orphans_are_cleaned(mem_root, monkeypatch):
    manifest, writer = Manifest(mem_root), ParquetPartWriter(output_path=mem_root)
    ids, vectors = pa.array(["a"]), np.ones((1, 4), np.float32)
    parts = {}
    for unit in ("00000-00000", "00000-00001", "00000-00002"):
        parts[unit] = writer.write(unit, ids, vectors)
        manifest.record(unit, parts=[parts[unit]], counters={})
    orphan = writer.write("00000-00000", pa.array(["other"]), vectors)  # a killed attempt's part
    unrecorded = writer.write("00000-00003", ids, vectors)  # a unit whose record was never written
    store = manifest.store
    store.remove(parts["00000-00001"].path)  # lost
    store.write_bytes(parts["00000-00002"].path, b"short")  # replaced: another size

    listed, looked = [], []
    monkeypatch.setattr(store, "list", lambda folder, real=store.list: listed.append(folder) or real(folder))
    monkeypatch.setattr(store, "exists", lambda path, real=store.exists: looked.append(path) or real(path))
    done = manifest.done(verify=True)
    assert set(done) == {"00000-00000"}
    assert listed == [manifest.layout.units, manifest.layout.vectors] and looked == []  # no look per part

    manifest.clean_partials(done)
    assert sorted(store.list(manifest.layout.vectors)) == [parts["00000-00000"].path.name]
    assert not store.exists(orphan.path) and not store.exists(unrecorded.path)
    assert sorted(store.list(manifest.layout.units)) == ["00000-00000.json"]


def test_the_index_is_built_from_the_recorded_parts_never_an_orphan_and_uploaded(mem_root, tmp_path, one_faiss_thread):
    from types import SimpleNamespace

    from embedpipe.index.build import plan_index_build
    from embedpipe.index.plan import ModelFacts, plan_index
    from tests.conftest import QUICKSTART

    job = load_job(write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model={"path": MODEL},
                             output={"path": mem_root, "format": "both", "index": "Flat"}))
    rng = np.random.default_rng(0)
    writer, manifest, units = ParquetPartWriter(output_path=mem_root), Manifest(mem_root), []
    for u in range(3):
        unit = SimpleNamespace(id=f"00000-{u:05d}", num_rows=40)
        vectors = rng.standard_normal((40, 8)).astype(np.float32)
        part = writer.write(unit.id, pa.array([f"doc-{u}-{i}" for i in range(40)]), vectors / np.linalg.norm(
            vectors, axis=1, keepdims=True))
        manifest.record(unit.id, parts=[part], counters={})
        units.append(unit)
    writer.write("00000-00001", pa.array([f"orphan-{i}" for i in range(40)]), np.ones((40, 8), np.float32))
    plan = plan_index(job, rows=120, model=ModelFacts(dim=8, normalize=True, query_prompt=""))
    report = plan_index_build(job, units, plan)()
    index = OutputLayout(mem_root).index
    ids = pq.read_table(pa.BufferReader(OBJECT.read_bytes(index.ids)))["id"].to_pylist()
    assert report["ntotal"] == 120 and len(ids) == 120 and not [i for i in ids if i.startswith("orphan")]
    assert sorted(OBJECT.list(index.dir)) == ["holdout.parquet", "ids.parquet", "index.faiss", "index.json"]
    assert report["path"] == f"{mem_root}/index" and json.loads(OBJECT.read_bytes(index.meta))["ntotal"] == 120


def test_a_prefix_with_foreign_objects_is_refused_and_an_own_one_is_claimed(mem_root):
    check_output(mem_root)  # new: nothing there
    claim_output(mem_root, kind="run")
    layout = OutputLayout(mem_root)
    assert layout.store.exists(layout.marker)
    check_output(mem_root)  # its own

    foreign = mem_root + "-other"
    OBJECT.write_bytes(Url(foreign) / "data.csv", b"a,b\n")
    with pytest.raises(OutputNotOwned, match=r"-other is not empty and was not created by embedpipe \(found: data.csv"):
        check_output(foreign)
    assert issubclass(OutputNotOwned, OutputRefused) and OutputNotOwned("x").exit_code == 5
    assert OBJECT.names(Url(foreign)) == ["data.csv"]  # untouched
    OBJECT.remove_tree(Url(foreign))


def test_url_outputs_load_versioned_ones_too(tmp_path):
    from embedpipe.preflight import check_output_settings

    job = load_job(write_job(tmp_path / "a.yaml", input={"path": "s3://b/in.parquet"}, model={"path": MODEL},
                             output={"path": "s3://b/out"}))
    assert job.output.path == "s3://b/out"
    check_output_settings(job.output)
    check_output_settings(job.replace(output={"versioned": True}).output)  # tests/test_objstore_versions.py


# --------------------------------------------------------------------------- runs on the loopback S3 server

def _s3(options: dict):
    import s3fs

    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


def _s3_job(tmp_path: Path, *, input: dict, output: dict, options: dict, unit_rows: int, max_tokens: int) -> Path:
    return write_job(tmp_path / "job.yaml", input={"unit_rows": unit_rows, "storage_options": options, **input},
                     model={"path": MODEL}, batching={"max_tokens": max_tokens},
                     output={"storage_options": options, **output}, cluster={"workers": 2, "cpus_per_worker": 1})


def _s3_vectors(s3, out: str) -> dict:
    """{id: vector} of the parts the output's folder holds (as DuckDB or Polars would read vectors/)."""
    table = pa.concat_tables([pq.read_table(s3.open(p)) for p in s3.glob(f"{out[5:]}/vectors/*.parquet")])
    return dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)))


def _s3_records(s3, out: str) -> int:
    s3.invalidate_cache()
    return len(s3.glob(f"{out[5:]}/_manifest/units/*.json"))


@pytest.mark.slow
def test_s3_input_and_output_through_the_cli_on_two_workers(s3_bucket, s3_options, small_corpus, parquet_cli_vectors,
                                                            tmp_path, one_faiss_thread):
    """Every id once with its own vector, bit for bit the local 1-worker run's; the index uploaded; the secret
    in no object of the output."""
    import faiss

    s3 = _s3(s3_options)
    _, path = small_corpus
    s3.put(str(path), f"{s3_bucket[5:]}/in/corpus.parquet")
    out = f"{s3_bucket}/out"
    job = _s3_job(tmp_path, input={"path": f"{s3_bucket}/in/corpus.parquet"}, options=s3_options,
                  output={"path": out, "format": "both", "index": "Flat"}, unit_rows=100, max_tokens=4096)
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output

    got = _s3_vectors(s3, out)
    assert sorted(got) == sorted(parquet_cli_vectors)
    assert all(np.array_equal(got[k], parquet_cli_vectors[k]) for k in got)
    report = json.loads(s3.cat_file(f"{out[5:]}/report.json"))
    assert report["rows"] == 300 and report["workers"] == 2 and report["index"]["ntotal"] == 300
    assert all(PART_NAME.match(p.rsplit("/", 1)[1])["attempt"] for p in s3.ls(f"{out[5:]}/vectors"))

    local = tmp_path / "index"
    s3.get(f"{out[5:]}/index/", str(local), recursive=True)  # open_index(URL) is objlock's: a download here
    index = faiss.read_index(str(local / "index.faiss"))
    meta = json.loads((local / "index.json").read_text())
    assert index.ntotal == meta["ntotal"] == 300 and meta["report"]["path"] == f"{out}/index"
    ids = pq.read_table(local / "ids.parquet")["id"].to_pylist()
    _, hits = index.search(parquet_cli_vectors[ids[7]][None, :], 1)
    assert ids[int(hits[0][0])] == ids[7]
    for key in s3.find(f"{out[5:]}"):
        assert S3_SECRET.encode() not in s3.cat_file(key), key
    shown = CliRunner().invoke(app, ["report", out])
    assert shown.exit_code == 0 and "300" in shown.output, shown.output


def test_a_foreign_s3_prefix_is_refused_by_the_cli_before_anything_is_written(s3_bucket, s3_options, tmp_path):
    s3 = _s3(s3_options)
    s3.pipe_file(f"{s3_bucket[5:]}/theirs/data.csv", b"a,b\n")
    job = _s3_job(tmp_path, input={"path": f"{s3_bucket}/in.parquet"}, output={"path": f"{s3_bucket}/theirs"},
                  options=s3_options, unit_rows=20, max_tokens=2048)
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 5 and "was not created by embedpipe (found: data.csv;" in result.output, result.output
    assert s3.find(f"{s3_bucket[5:]}/theirs") == [f"{s3_bucket[5:]}/theirs/data.csv"]


@pytest.fixture(scope="module")
def s3_corpus(tmp_path_factory, quickstart_table):
    """240 real rows as 2 local files of 20-row row groups: 12 units of 20."""
    from tests.conftest import split_corpus

    table = quickstart_table.slice(0, 240).select(["id", "text"])
    folder = tmp_path_factory.mktemp("s3_corpus")
    split_corpus(table, folder, files=2, row_group_size=20)
    return table, folder


def _upload_corpus(s3, bucket: str, folder: Path) -> str:
    for file in sorted(folder.iterdir()):
        s3.put(str(file), f"{bucket[5:]}/in/{file.name}")
    return f"{bucket}/in/"


def _assert_exact(got: dict, table: pa.Table, encoder) -> None:
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    ids = sorted(got)
    assert ids == sorted(texts)  # every id once: a dict would hide a duplicate, so count the rows too
    np.testing.assert_allclose(np.stack([got[i] for i in ids]), encoder.embed([texts[i] for i in ids]), atol=2e-6)


@pytest.fixture(scope="module")
def encoder():
    from embedpipe.runtime import Encoder

    return Encoder.from_options(MODEL)


def _rows_in_folder(s3, out: str) -> int:
    return sum(pq.ParquetFile(s3.open(p)).metadata.num_rows for p in s3.glob(f"{out[5:]}/vectors/*.parquet"))


@pytest.mark.slow
def test_s3_output_sigkill_a_worker_mid_run(s3_bucket, s3_options, s3_corpus, tmp_path, ray_session, encoder):
    from tests.test_reliability import _run_and_signal_a_worker

    s3 = _s3(s3_options)
    table, folder = s3_corpus
    out = f"{s3_bucket}/out"
    job = _s3_job(tmp_path, input={"path": _upload_corpus(s3, s3_bucket, folder)}, output={"path": out},
                  options=s3_options, unit_rows=20, max_tokens=2048)
    runner, outcome, _ = _run_and_signal_a_worker(load_job(job), Path(tmp_path), signal.SIGKILL,
                                                  records=lambda: _s3_records(s3, out))
    runner.join(timeout=600)
    report = outcome["result"].report
    assert report["units"]["retried"] >= 1 and report["units"]["failed"] == 0
    assert report["units"]["encoded"] == report["units"]["total"] == 12
    assert _rows_in_folder(s3, out) == table.num_rows  # 0 lost, 0 duplicated, for a reader of the folder itself
    _assert_exact(_s3_vectors(s3, out), table, encoder)


@pytest.mark.slow
def test_s3_output_kill_the_driver_then_rerun_resumes_and_orphans_are_never_read(
        s3_bucket, s3_options, s3_corpus, tmp_path, ray_session, encoder, one_faiss_thread):
    s3 = _s3(s3_options)
    table, folder = s3_corpus
    out = f"{s3_bucket}/out"
    job = _s3_job(tmp_path, input={"path": _upload_corpus(s3, s3_bucket, folder)}, output={"path": out},
                  options=s3_options, unit_rows=20, max_tokens=2048)
    cmd = [str(Path(sys.executable).parent / "embedpipe"), "run", str(job), "--no-progress"]
    log = tmp_path / "driver.log"
    with open(log, "wb") as stderr:
        driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    deadline = time.time() + 300
    while _s3_records(s3, out) < 2 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.1)
    assert driver.poll() is None, f"the driver finished before it could be killed: {log.read_text()[-2000:]}"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    time.sleep(2)  # its local Ray shares its fate
    done_before = _s3_records(s3, out)
    assert 2 <= done_before < 12

    # a killed attempt's part of a finished unit, holding rows of its own: committed by no record
    recorded = json.loads(s3.cat_file(sorted(s3.glob(f"{out[5:]}/_manifest/units/*.json"))[0]))
    orphan = f"{out[5:]}/vectors/part-{recorded['unit_id']}.0123456789ab.parquet"
    fake = pa.table({"id": pa.array([f"orphan-{i}" for i in range(5)], table["id"].type),
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(5 * 384, np.float32)), 384)})
    with s3.open(orphan, "wb") as f:
        pq.write_table(fake, f)

    result = CliRunner().invoke(app, ["run", str(job), "--no-progress", "--set", "output.format=both",
                                      "--set", "output.index=Flat"])  # the index settings keep every unit
    assert result.exit_code == 0, result.output
    report = json.loads(s3.cat_file(f"{out[5:]}/report.json"))
    assert report["units"]["skipped_as_done"] >= done_before and report["units"]["encoded"] < 12
    assert report["units"]["skipped_as_done"] + report["units"]["encoded"] == 12
    assert report["rows"] == table.num_rows and report["index"]["ntotal"] == table.num_rows
    s3.invalidate_cache()
    assert not s3.exists(orphan)  # gone after the run
    ids = pq.read_table(s3.open(f"{out[5:]}/index/ids.parquet"))["id"].to_pylist()
    assert sorted(ids) == sorted(table["id"].to_pylist())  # the index never read the orphan
    assert _rows_in_folder(s3, out) == table.num_rows
    _assert_exact(_s3_vectors(s3, out), table, encoder)
