"""The embedding worker's read-ahead, in this process (no Ray): two calls at once, as the driver's queue of one unit
per worker makes them; the later call reads and tokenizes beside the earlier one's encode, and encodes after it."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.dataset as ds
import pytest

from embedpipe.cluster.worker import EmbedWorker, Turns
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
    return EmbedWorker(job, model=None, index=0, threads=1), path, out


def _unit(path, group: int) -> Unit:
    return Unit(id=f"00000-{group:05d}", file=str(path), row_groups=(group,), num_rows=100)


def _in_threads(worker: EmbedWorker, calls: list[tuple[Unit, int]]) -> dict[int, object]:
    """Start each (unit, seq) call on its own thread, in the list's order; {seq: result or exception}."""
    answers: dict[int, object] = {}
    worker._turns = Turns()  # a fresh actor's order: its first call is seq 0

    def call(unit: Unit, seq: int) -> None:
        try:
            answers[seq] = worker.process(unit, seq=seq)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            answers[seq] = exc

    threads = [threading.Thread(target=call, args=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call never got its turn"
    return answers


def test_calls_encode_in_submission_order_whatever_order_they_arrive(worker, small_corpus):
    w, path, out = worker
    table, _ = small_corpus
    answers = _in_threads(w, [(_unit(path, 1), 1), (_unit(path, 0), 0)])  # the later one arrives first
    first, second = answers[0], answers[1]
    assert first.unit_id == "00000-00000" and second.unit_id == "00000-00001"
    assert first.finished <= second.started  # one encode at a time, in seq order
    assert second.counters["stages"]["read"] > 0 and second.counters["stages"]["tokenize"] > 0
    assert first.counters["rows"] == second.counters["rows"] == 100
    got = ds.dataset(out / "vectors", format="parquet").to_table()
    by_id = dict(zip(got["id"].to_pylist(), np.asarray(got["embedding"].to_pylist(), dtype=np.float32)))
    texts, ids = table["text"].to_pylist()[:200], table["id"].to_pylist()[:200]
    want = w.encoder.embed(texts[:100]), w.encoder.embed(texts[100:])
    assert np.array_equal(np.stack([by_id[i] for i in ids]), np.concatenate(want))  # the read-ahead changes no bit


def test_a_unit_whose_read_fails_fails_in_its_turn_and_the_next_unit_still_runs(worker, tmp_path):
    w, path, _ = worker
    missing = Unit(id="00001-00000", file=str(tmp_path / "gone.parquet"), row_groups=(0,), num_rows=100)
    answers = _in_threads(w, [(missing, 0), (_unit(path, 2), 1)])
    assert isinstance(answers[0], Exception) and "gone.parquet" in str(answers[0])
    assert answers[1].unit_id == "00000-00002" and answers[1].counters["rows"] == 100
