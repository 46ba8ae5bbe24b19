"""The embedding worker's read-ahead, in this process (no Ray): each call names the unit the driver holds for
the worker next; the worker reads and tokenizes that one on its own thread while the call encodes its unit, and
the next call finds it ready. Calls arrive one at a time, in order, as on the (non-threaded) actor."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.dataset as ds
import pytest

from embedpipe.cluster.worker import EmbedWorker, ReadAhead, WorkerSetup
from embedpipe.config import load_job
from embedpipe.units import Unit
from tests.conftest import write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def worker(small_corpus, tmp_path_factory):
    _, path = small_corpus
    out = tmp_path_factory.mktemp("readahead") / "out"
    job = load_job(write_job(out.parent / "job.yaml", name="readahead", input={"path": str(path)},
                             model={"path": MODEL, "dtype": "float32"}, output={"path": str(out)}))
    out.mkdir()
    worker = EmbedWorker(job, model=None, index=0, threads=1)
    worker.configure(WorkerSetup(output_path=str(out)))
    return worker, path, out


def _unit(path, group: int, copy: int = 0) -> Unit:
    """Row group ``group`` (0-2) of the corpus; ``copy`` > 0: the same rows as another unit (its own id)."""
    return Unit(id=f"{copy:05d}-{group:05d}", file=str(path), row_groups=(group,), num_rows=100)


def _reads_on(worker: EmbedWorker) -> list[tuple[str, str]]:
    """Wrap the worker's read: it logs (unit id, thread name) of each read."""
    log: list[tuple[str, str]] = []
    read = worker._read

    def logged(unit):
        log.append((unit.id, threading.current_thread().name))
        return read(unit)

    worker._read = logged
    return log


def test_the_named_next_unit_is_read_beside_the_encode_and_the_vectors_do_not_change(worker, small_corpus):
    w, path, out = worker
    table, _ = small_corpus
    w._ahead = ReadAhead()  # a fresh actor
    reads = _reads_on(w)
    try:
        first = w.process(_unit(path, 0), ahead=_unit(path, 1))
        second = w.process(_unit(path, 1))
    finally:
        del w._read
    main = threading.main_thread().name
    assert reads[0] == ("00000-00000", main)  # nothing read ahead for the first call: read in the call
    assert reads[1] == ("00000-00001", "read-ahead 00000-00001")  # the second: on the read-ahead thread
    assert len(reads) == 2  # the second call took it, it did not read it again
    assert first.unit_id == "00000-00000" and second.unit_id == "00000-00001"
    assert first.finished <= second.started
    assert second.counters["stages"]["read"] > 0 and second.counters["stages"]["tokenize"] > 0
    assert first.counters["rows"] == second.counters["rows"] == 100
    got = ds.dataset(out / "vectors", format="parquet").to_table()
    by_id = dict(zip(got["id"].to_pylist(), np.asarray(got["embedding"].to_pylist(), dtype=np.float32)))
    texts, ids = table["text"].to_pylist()[:200], table["id"].to_pylist()[:200]
    want = w.encoder.embed(texts[:100]), w.encoder.embed(texts[100:])
    assert np.array_equal(np.stack([by_id[i] for i in ids]), np.concatenate(want))  # the read-ahead changes no bit


def test_a_unit_whose_read_fails_fails_in_its_own_call_and_the_next_unit_still_runs(worker, tmp_path):
    w, path, _ = worker
    w._ahead = ReadAhead()
    missing = Unit(id="00009-00000", file=str(tmp_path / "gone.parquet"), row_groups=(0,), num_rows=100)
    before = w.process(_unit(path, 2), ahead=missing)  # the read-ahead fails: not this call's business
    assert before.unit_id == "00000-00002" and before.counters["rows"] == 100
    with pytest.raises(Exception, match="gone.parquet"):
        w.process(missing, ahead=_unit(path, 0, copy=1))
    after = w.process(_unit(path, 0, copy=1))  # read ahead by the failed call
    assert after.unit_id == "00001-00000" and after.counters["rows"] == 100


def test_a_call_for_another_unit_than_the_one_read_ahead_reads_its_own(worker):
    w, path, _ = worker
    w._ahead = ReadAhead()
    reads = _reads_on(w)
    try:
        w.process(_unit(path, 1, copy=2), ahead=_unit(path, 2, copy=2))  # then held by another worker
        result = w.process(_unit(path, 0, copy=2))
    finally:
        del w._read
    assert [unit for unit, _ in reads] == ["00002-00001", "00002-00002", "00002-00000"]
    assert reads[2][1] == threading.main_thread().name
    assert result.unit_id == "00002-00000" and result.counters["rows"] == 100


def test_a_unit_before_configure_is_refused_and_nothing_is_written(small_corpus, tmp_path):
    """The worker's start needs nothing of the run's planning; its first unit needs the run's settings."""
    _, path = small_corpus
    out = tmp_path / "out"
    job = load_job(write_job(tmp_path / "job.yaml", name="unconfigured", input={"path": str(path)},
                             model={"path": MODEL, "dtype": "float32"}, output={"path": str(out)}))
    worker = EmbedWorker(job, model=None, index=3, threads=1)
    with pytest.raises(RuntimeError, match=r"worker 3 was given .* before configure\(\)"):
        worker.process(_unit(path, 0))
    assert not out.exists()
