"""The int8/uint8 calibration sample's vectors kept for its rows (cluster/sampled.py): when they are kept, how rows
find them by text and what they count in their unit, and a worker that writes them for those rows instead of
embedding the rows again; with input.chunking (split and late), the chunks of the documents the sample holds."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedpipe.cluster import sampled
from embedpipe.cluster.sampled import SamplePiece, SampleVectors, documents_within
from embedpipe.cluster.worker import EmbedWorker, UnitResult, WorkerSetup
from embedpipe.config import load_job
from embedpipe.report.counters import Counters, DocumentCost
from embedpipe.units import Unit
from tests.conftest import write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _piece(vectors: np.ndarray, tokens: list[int], *, padded: int, encode: float) -> SamplePiece:
    """An unchunked piece: a row per text, truncated at 8 tokens."""
    counters = Counters(tokens=sum(tokens), padded_tokens=padded, stages={"tokenize": 0.0, "encode": encode})
    span = UnitResult(unit_id="calibration", worker=0, counters=counters.to_dict(), peak_rss_mb=0.0)
    n, lengths = len(tokens), np.asarray(tokens, dtype=np.int64)
    cost = DocumentCost(tokens=lengths, tokens_squared=lengths ** 2, truncated=(lengths >= 8).astype(np.int64),
                        chunks=np.ones(n, dtype=np.int64))
    return SamplePiece(vectors=vectors, size=n, embedded=np.arange(n), cost=cost, chunks=None, span=span)


def _vectors(rows: int, dim: int = 4) -> np.ndarray:
    return np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)


def test_kept_only_when_the_sample_holds_a_twentieth_of_the_input_and_fits_the_byte_bound(monkeypatch):
    texts = [f"text {i}" for i in range(10)]
    pieces = [_piece(_vectors(10), [3] * 10, padded=30, encode=1.0)]
    assert SampleVectors.kept(texts, pieces, input_rows=200) is not None  # 5 %
    assert SampleVectors.kept(texts, pieces, input_rows=201) is None  # less: not worth its lookups
    assert SampleVectors.kept([], [], input_rows=0) is None
    size = _vectors(10).nbytes + sum(map(len, texts))
    monkeypatch.setattr(sampled, "KEEP_BYTES", size)
    assert SampleVectors.kept(texts, pieces, input_rows=10) is not None
    monkeypatch.setattr(sampled, "KEEP_BYTES", size - 1)  # every worker would hold a copy: bounded
    assert SampleVectors.kept(texts, pieces, input_rows=10) is None


def test_rows_find_the_sample_by_text_and_count_in_their_unit_what_embedding_them_cost():
    """Two pieces: rows a, b (2 and 6 tokens, 10 computed, 1 s encode) and c (8 tokens, truncated, 8 computed,
    2 s). A unit's texts c, x, a, c: three rows from the sample (c twice), x encoded."""
    pieces = [_piece(_vectors(2), [2, 6], padded=10, encode=1.0), _piece(_vectors(1) + 100, [8], padded=8, encode=2.0)]
    kept = SampleVectors.kept(["a", "b", "c"], pieces, input_rows=3)
    assert kept.take(["x", "y"]) is None
    taken = kept.take(["c", "x", "a", "c"])
    assert taken.found.tolist() == [True, False, True, True]
    encoded = np.full((1, 4), -1, dtype=np.float32)  # x's vector
    want = np.stack([_vectors(1)[0] + 100, encoded[0], _vectors(2)[0], _vectors(1)[0] + 100])
    np.testing.assert_array_equal(taken.fill(encoded), want)
    counters = Counters(rows=1, tokens=5)  # x, encoded by the unit
    taken.count(counters)
    assert (counters.rows, counters.sampled_rows, counters.tokens) == (4, 3, 5 + 8 + 2 + 8)
    assert counters.sampled_tokens == 8 + 2 + 8  # computed by the pieces: the timeline puts them there
    assert counters.tokens_squared == 64 + 4 + 64 and counters.truncated_rows == 2
    assert counters.padded_tokens == round(8 + 10 * 2 / 8 + 8)  # a's share of its piece: 2 of 8 tokens
    assert counters.stages["encode"] == pytest.approx(2.0 + 1.0 * 2 / 8 + 2.0)
    assert "tokenize" not in counters.stages or counters.stages["tokenize"] == 0.0


@pytest.fixture(scope="module")
def worker(small_corpus, tmp_path_factory):
    _, path = small_corpus
    folder = tmp_path_factory.mktemp("sampled")
    job = load_job(write_job(folder / "job.yaml", name="sampled", input={"path": str(path)},
                             model={"path": MODEL, "dtype": "float32"}, output={"path": str(folder / "out")}))
    return EmbedWorker(job, model=None, index=0, threads=1)


def test_a_piece_of_the_sample_carries_each_rows_tokens_and_its_span(worker, small_corpus):
    table, _ = small_corpus
    texts = table["text"].to_pylist()[:50]
    piece = worker.embed_sample(texts)
    np.testing.assert_array_equal(piece.vectors, worker.encoder.embed(texts))
    tok = worker.encoder.tokenizer(texts)
    assert piece.size == 50 and piece.embedded.tolist() == list(range(50)) and piece.chunks is None
    np.testing.assert_array_equal(piece.cost.tokens, tok.lengths)
    np.testing.assert_array_equal(piece.cost.tokens_squared, tok.lengths.astype(np.int64) ** 2)
    np.testing.assert_array_equal(piece.cost.truncated, tok.truncated)
    assert piece.cost.chunks.tolist() == [1] * 50
    span = Counters.from_dict(piece.span.counters)
    assert span.tokens == tok.lengths.sum() and span.rows == 0  # its rows count in the units that take them
    assert piece.span.unit_id == "calibration" and piece.span.worker == 0
    assert piece.span.started <= piece.span.finished and span.stages["encode"] > 0


def test_a_worker_writes_the_sample_vectors_for_the_rows_the_sample_holds_and_encodes_the_others(worker,
                                                                                                   small_corpus,
                                                                                                   tmp_path):
    table, path = small_corpus
    texts, ids = table["text"].to_pylist()[:100], table["id"].to_pylist()[:100]
    held = [texts[i] for i in range(0, 100, 3)] + ["in no unit"]  # every third row of the unit, and no row's text
    piece = worker.embed_sample(held)
    piece.vectors = -piece.vectors  # vectors no encode of these rows would give: the test sees which were taken
    worker.configure(WorkerSetup(output_path=str(tmp_path), sampled=SampleVectors.kept(held, [piece],
                                                                                        input_rows=100)))
    result = worker.process(Unit(id="00000-00000", file=str(path), row_groups=(0,), num_rows=100))

    sample = set(held)
    plain, counted = worker.encoder.embed(texts), Counters()  # every row encoded, as without the sample
    worker.encoder.embed(texts, counted)
    got = pq.read_table(next((tmp_path / "vectors").glob("part-*.parquet")))
    by_id = dict(zip(got["id"].to_pylist(), np.asarray(got["embedding"].to_pylist(), dtype=np.float32)))
    for row, (row_id, text) in enumerate(zip(ids, texts)):
        want = piece.vectors[held.index(text)] if text in sample else plain[row]
        np.testing.assert_allclose(by_id[row_id], want, atol=1e-6, err_msg=f"row {row}")
    unit = Counters.from_dict(result.counters)
    assert unit.rows == 100 and unit.sampled_rows == sum(t in sample for t in texts) >= 34
    # the unit counts the rows it took as if it had encoded them: tokens, their squares, truncation
    assert (unit.tokens, unit.tokens_squared, unit.truncated_rows) == (counted.tokens, counted.tokens_squared,
                                                                       counted.truncated_rows)


def test_a_run_keeps_its_sample_chunked_or_not_unless_it_fitted_none(tmp_path):
    from embedpipe.cluster.driver import _kept_sample

    units = [Unit(id="00000-00000", file="f", row_groups=(0,), num_rows=3)]
    sample = [(["a", "b", "c"], [_piece(_vectors(3), [1, 2, 3], padded=6, encode=1.0)])]
    assert _kept_sample(sample, units).texts == ["a", "b", "c"]
    assert _kept_sample([], units) is None  # no fit this run (resumed, or an incremental night)


@pytest.fixture(scope="module", params=["split", "late"])
def chunked_worker(request, small_corpus, tmp_path_factory):
    _, path = small_corpus
    folder = tmp_path_factory.mktemp(f"chunked-{request.param}")
    job = load_job(write_job(folder / "job.yaml", name="chunked", output={"path": str(folder / "out")},
                             input={"path": str(path), "chunking": {"mode": request.param, "max_tokens": 24}},
                             model={"path": MODEL, "dtype": "float32"}))
    return EmbedWorker(job, model=None, index=0, threads=1)


def test_a_chunked_runs_sample_is_embedded_as_its_parts_store_it_chunk_by_chunk(chunked_worker, small_corpus,
                                                                                monkeypatch):
    """Its ranges must be those of the chunk vectors its parts store, not of whole (truncated) documents. Its
    documents are tokenized once: those it embeds are taken from the chunking that counted their chunks."""
    table, _ = small_corpus
    worker, texts = chunked_worker, table["text"].to_pylist()[:12]
    assert len(worker.encoder.embed_chunks(texts)[1]) > len(texts)  # every chunk: more than the 12 rows asked
    tokenizer, tokenized = worker.encoder.chunker.tokenizer, []
    documents = tokenizer.documents
    monkeypatch.setattr(tokenizer, "documents", lambda some, **kw: tokenized.extend(some) or documents(some, **kw))
    piece = worker.embed_sample(texts)
    monkeypatch.undo()
    assert tokenized == texts
    assert Counters.from_dict(piece.span.counters).stages["tokenize"] > 0
    _, chunks = worker.encoder.chunker(texts)
    keep = documents_within(chunks.per_document_of(len(texts)), rows=len(texts))
    counted = Counters()
    want_chunks, want = worker.encoder.embed_chunks([texts[i] for i in keep], counted)  # the documents it kept
    assert 0 < len(want) <= len(texts) and piece.size == 12 and piece.embedded.tolist() == keep.tolist()
    np.testing.assert_array_equal(piece.vectors, want)
    for name in ("doc", "chunk", "start", "end"):
        np.testing.assert_array_equal(piece.chunks[name], getattr(want_chunks, name))
    # what each document cost adds up to what embedding them counted
    assert piece.cost.chunks.tolist() == want_chunks.per_document_of(len(keep)).tolist()
    assert (piece.cost.tokens.sum(), piece.cost.tokens_squared.sum()) == (counted.tokens, counted.tokens_squared)
    assert Counters.from_dict(piece.span.counters).documents == len(keep)


def test_a_chunked_unit_takes_the_chunks_of_the_documents_the_sample_holds_and_counts_them_as_its_own(
        chunked_worker, small_corpus, tmp_path):
    """Every other row's document in the sample, with (negated, so recognisable) vectors: those documents' chunk
    rows carry the sample's vectors and columns, the others are encoded; the unit's counters are those of
    encoding every document."""
    table, path = small_corpus
    worker = chunked_worker
    texts, ids = table["text"].to_pylist()[:100], table["id"].to_pylist()[:100]
    sample_texts = texts[::2]
    piece = worker.embed_sample(sample_texts)
    piece.vectors = -piece.vectors
    held = [sample_texts[i] for i in piece.embedded.tolist()]
    assert len(held) >= 5
    worker.configure(WorkerSetup(output_path=str(tmp_path), sampled=SampleVectors.kept(sample_texts, [piece],
                                                                                        input_rows=100)))
    result = worker.process(Unit(id="00000-00000", file=str(path), row_groups=(0,), num_rows=100))

    counted = Counters()
    chunks, plain = worker.encoder.embed_chunks(texts, counted)  # every document encoded, as without the sample
    got = pq.read_table(next((tmp_path / "vectors").glob("part-*.parquet")))
    assert got["id"].to_pylist() == [ids[d] for d in chunks.doc.tolist()]  # documents in order, chunks in order
    for name in ("chunk", "start", "end"):
        assert got[name].to_pylist() == getattr(chunks, name).tolist()
    vectors = np.asarray(got["embedding"].to_pylist(), dtype=np.float32)
    of_held = {text: piece.vectors[piece.chunks["doc"] == i] for i, text in enumerate(held)}
    sampled = 0
    for doc, text in enumerate(texts):
        mine = chunks.doc == doc
        want = of_held.get(text, plain[mine])
        sampled += int(mine.sum()) if text in of_held else 0
        np.testing.assert_allclose(vectors[mine], want, atol=1e-6, err_msg=f"document {doc}")
    unit = Counters.from_dict(result.counters)
    assert unit.sampled_rows == sampled > 0 and unit.rows == len(chunks)
    assert (unit.tokens, unit.tokens_squared, unit.truncated_rows) == (counted.tokens, counted.tokens_squared,
                                                                       counted.truncated_rows)
    assert (unit.documents, unit.chunks_max) == (counted.documents, counted.chunks_max) == (100, counted.chunks_max)


def test_a_chunked_piece_keeps_documents_whose_chunks_fit_the_rows_asked_the_same_ones_every_time():
    chunks = np.array([3, 1, 4, 1, 5, 9, 2, 6])  # 31 chunks in all
    keep = documents_within(chunks, rows=10)
    assert 0 < chunks[keep].sum() <= 10 and list(keep) == sorted(set(keep))
    np.testing.assert_array_equal(documents_within(chunks, rows=10), keep)  # the piece alone decides
    assert documents_within(chunks, rows=31).tolist() == list(range(8))  # all fit: all kept
    assert documents_within(chunks, rows=30).tolist() != list(range(8))
    assert len(documents_within(np.array([40, 50]), rows=10)) == 1  # at least one document
