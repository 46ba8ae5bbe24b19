"""output.index: auto on real MiniLM vectors: the size model counts what the index holds (so SQ6/SQ4 fit small
budgets), and PQ/OPQ are chosen only where they train on enough vectors to be cheap and good."""

import os
import time

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.config import load_job
from embedpipe.index.build import IndexBuild
from embedpipe.index.factory import parse_factory
from embedpipe.index.parts import Part
from embedpipe.index.plan import PQ_MIN_TRAIN_ROWS, ModelFacts, plan_index
from embedpipe.io.writer import ParquetPartWriter
from tests.conftest import QUICKSTART, SHARED_DATA, write_job

ROWS, DIM = 5000, 384
MINILM = ModelFacts(dim=DIM, normalize=True, query_prompt="")


@pytest.fixture(scope="module")
def minilm_vectors(minilm_dir, one_faiss_thread):
    """5,000 real texts embedded once: WordNet glosses (short: quick to encode), else the quickstart's texts."""
    from embedpipe.runtime import Encoder

    glosses = SHARED_DATA / "wordnet_glosses.parquet"
    if glosses.exists():
        texts = pq.read_table(glosses, columns=["text"]).slice(0, ROWS)["text"].to_pylist()
    else:  # a checkout without the shared data: the quickstart's paragraphs and glosses, and a second form of them
        texts = pq.read_table(QUICKSTART)["text"].to_pylist()
        texts += [f"In short: {t}" for t in texts[: ROWS - len(texts)]]
    import torch

    before = torch.get_num_threads()  # 1 under one_faiss_thread: torch and FAISS share OpenMP's thread count here
    try:  # the machine's cores for the encode (half the time), then FAISS's one thread again
        vectors = Encoder.from_options(str(minilm_dir), max_seq_len=32, threads=os.cpu_count() or 1).embed(texts[:ROWS])
    finally:
        torch.set_num_threads(before)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def _job(tmp_path, **output):
    return load_job(write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                              model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                              output={"path": str(tmp_path / "out"), "format": "both", **output}))


@pytest.mark.parametrize("factory", ["IVF128,SQ6", "IVF128,SQ4", "IVF128,SQ8", "IVF64,Flat"])
def test_the_size_model_is_what_faiss_writes(factory, one_faiss_thread):
    x = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add_with_ids(x, np.arange(ROWS, dtype=np.int64))
    written = len(faiss.serialize_index(index))
    assert 0.98 * written <= parse_factory(factory).memory_bytes(ROWS, DIM) <= 1.05 * written


@pytest.mark.slow  # encoding 5,000 texts on a CPU: the fixture, once per module
def test_auto_at_2_mb_on_5000_minilm_vectors_reaches_its_target_in_seconds(tmp_path, minilm_vectors):
    job = _job(tmp_path, index="auto", index_memory_gb=0.002)
    plan = plan_index(job, rows=ROWS, model=MINILM)
    assert plan.candidates[0].factory == "IVF128,SQ6"  # fits in about 1.7 MB; no OPQ/PQ on 5,000 vectors
    writer = ParquetPartWriter(output_path=str(tmp_path / "out"))
    ids = pa.array([f"doc-{i}" for i in range(ROWS)])
    parts = [Part(f"00000-{u:05d}", writer(f"00000-{u:05d}", ids[u * 1000:(u + 1) * 1000],
                                           minilm_vectors[u * 1000:(u + 1) * 1000]), 1000) for u in range(5)]
    started = time.perf_counter()
    report = IndexBuild(job, plan, parts=parts)()
    seconds = time.perf_counter() - started
    assert report["target_reached"] and report["recall_at_10"] >= 0.95, report
    assert report["bytes"] <= 2_000_000
    assert seconds < 30, f"the build took {seconds:.1f} s"


@pytest.mark.parametrize("dim", [64, 384, 768, 1024])
def test_no_auto_choice_trains_pq_or_opq_on_fewer_than_10000_vectors(tmp_path, dim):
    for rows in (2_000, 5_000, 9_999, 12_000, 50_000, 200_000, 2_000_000):
        for budget in (0.0005, 0.001, 0.002, 0.005, 0.02, 0.1, 0.5, 2, 8):
            try:
                plan = plan_index(_job(tmp_path, index="auto", index_memory_gb=budget), rows=rows,
                                  model=ModelFacts(dim=dim, normalize=True, query_prompt=""))
            except Exception as exc:  # too small a budget for any index: a JobError naming the field
                assert "output.index_memory_gb" in str(exc)
                continue
            for spec in plan.candidates:
                if spec.pq_m or spec.opq_m:
                    assert plan.train_rows(spec) >= PQ_MIN_TRAIN_ROWS, (rows, budget, dim, spec.factory)


def test_a_chunked_runs_auto_index_is_chosen_for_its_chunks(tmp_path):
    """Preflight counts documents; the parts hold chunks: auto chooses again for what is there (Flat fits 600
    documents in 1.2 MB, not the 3,000 chunks they were cut into), and an unchunked run keeps its candidates."""
    from embedpipe.index.plan import plan_for_vectors

    budget = dict(index="auto", index_memory_gb=0.0012)
    documents = plan_index(_job(tmp_path, **budget), rows=600, model=MINILM)
    assert documents.candidates[0].factory == "Flat"
    chunked = load_job(write_job(tmp_path / "chunked.yaml", input={"path": str(QUICKSTART),
                                                                   "chunking": {"mode": "split"}},
                                 model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                                 output={"path": str(tmp_path / "out"), "format": "both", **budget}))
    chunks = plan_for_vectors(chunked, documents, rows=3000)
    assert chunks.rows == 3000 and chunks.candidates[0].factory != "Flat"
    assert chunks.candidates[0].memory_bytes(3000, DIM) <= chunks.budget_bytes
    assert chunks.candidates == plan_index(chunked, rows=3000, model=MINILM).candidates
    kept = plan_for_vectors(_job(tmp_path, **budget), documents, rows=590)  # 10 rows skipped: same choice
    assert kept.rows == 590 and kept.candidates == documents.candidates
