"""The int8/uint8 calibration sample's vectors kept for its rows (cluster/sampled.py): when they are kept, how rows
find them by text, and a worker that writes them for those rows instead of embedding the rows again."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from embedpipe.cluster import sampled
from embedpipe.cluster.sampled import SampleVectors, fill
from embedpipe.cluster.worker import EmbedWorker, WorkerSetup
from embedpipe.config import load_job
from embedpipe.units import Unit
from tests.conftest import write_job


def _vectors(rows: int, dim: int = 4) -> np.ndarray:
    return np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)


def test_kept_only_when_the_sample_holds_a_quarter_of_the_input_and_fits_the_byte_bound(monkeypatch):
    texts = [f"text {i}" for i in range(10)]
    assert SampleVectors.kept(texts, _vectors(10), input_rows=40) is not None  # a quarter
    assert SampleVectors.kept(texts, _vectors(10), input_rows=41) is None  # less than a quarter: not worth it
    assert SampleVectors.kept([], _vectors(0), input_rows=0) is None
    size = _vectors(10).nbytes + sum(map(len, texts))
    monkeypatch.setattr(sampled, "KEEP_BYTES", size)
    assert SampleVectors.kept(texts, _vectors(10), input_rows=10) is not None
    monkeypatch.setattr(sampled, "KEEP_BYTES", size - 1)  # every worker would hold a copy: bounded
    assert SampleVectors.kept(texts, _vectors(10), input_rows=10) is None


def test_rows_find_the_sample_vectors_by_text_in_order_and_fill_puts_them_back_among_the_encoded():
    kept = SampleVectors.kept(["a", "b", "c"], _vectors(3), input_rows=3)
    assert kept.lookup(["x", "y"]) is None
    found, known = kept.lookup(["c", "x", "a", "c"])  # a text twice: the same vector twice
    assert found.tolist() == [True, False, True, True]
    np.testing.assert_array_equal(known, _vectors(3)[[2, 0, 2]])
    encoded = np.full((1, 4), -1, dtype=np.float32)
    np.testing.assert_array_equal(fill(found, known, encoded), np.stack([known[0], encoded[0], known[1], known[2]]))


def test_a_worker_writes_the_sample_vectors_for_the_rows_the_sample_holds_and_encodes_the_others(small_corpus,
                                                                                                   tmp_path):
    table, path = small_corpus
    out = tmp_path / "out"
    job = load_job(write_job(tmp_path / "job.yaml", name="sampled", input={"path": str(path)},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2", "dtype": "float32"},
                             output={"path": str(out)}))
    out.mkdir()
    worker = EmbedWorker(job, model=None, index=0, threads=1)
    texts, ids = table["text"].to_pylist()[:100], table["id"].to_pylist()[:100]
    held = list(range(0, 100, 3))  # the sample holds every third row of the unit, and one text of no row
    marks = -worker.encoder.embed([texts[i] for i in held])  # vectors no encode of these rows would give
    kept = SampleVectors.kept([texts[i] for i in held] + ["in no unit"], np.vstack([marks, marks[:1]]),
                              input_rows=100)
    worker.configure(WorkerSetup(output_path=str(out), sampled=kept))
    result = worker.process(Unit(id="00000-00000", file=str(path), row_groups=(0,), num_rows=100))

    sample = set(texts[i] for i in held)
    assert result.counters["rows"] == 100 and result.counters["sampled_rows"] == len(sample)
    plain = worker.encoder.embed(texts)  # [100, D] every row encoded
    got = pq.read_table(next((out / "vectors").glob("part-*.parquet")))
    by_id = dict(zip(got["id"].to_pylist(), np.asarray(got["embedding"].to_pylist(), dtype=np.float32)))
    for row, (row_id, text) in enumerate(zip(ids, texts)):
        want = marks[held.index(texts.index(text))] if text in sample else plain[row]
        np.testing.assert_allclose(by_id[row_id], want, atol=1e-6, err_msg=f"row {row}")
    others = worker.encoder.tokenizer([t for t in texts if t not in sample]).lengths.sum()
    assert result.counters["tokens"] == others  # the sample's rows were not tokenized or encoded again


def test_a_chunked_run_keeps_no_sample(tmp_path):
    """Its rows are chunks of documents, not the texts the calibration embedded."""
    from embedpipe.cluster.driver import _kept_sample

    job = load_job(write_job(tmp_path / "job.yaml", input={"path": str(tmp_path), "chunking": {"mode": "split"}},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                             output={"path": str(tmp_path / "out"), "dtype": "int8"}))
    units = [Unit(id="00000-00000", file="f", row_groups=(0,), num_rows=3)]
    sample = [(["a", "b", "c"], _vectors(3))]
    assert _kept_sample(job, sample, units) is None
    plain = load_job(write_job(tmp_path / "plain.yaml", input={"path": str(tmp_path)},
                               model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                               output={"path": str(tmp_path / "out"), "dtype": "int8"}))
    assert _kept_sample(plain, sample, units).texts == ["a", "b", "c"]
    assert _kept_sample(plain, [], units) is None  # no fit this run (resumed, or an incremental night)
