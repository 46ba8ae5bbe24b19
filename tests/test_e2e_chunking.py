"""Chunked runs end to end through the real CLI on a real local Ray (2 workers): every (id, chunk) exactly once
with the vector of its own text, a SIGKILLed worker, bad rows, an incremental night."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import BatchingConfig, ChunkingConfig, ModelConfig, RuntimeConfig, load_job
from embedpipe.runtime import Encoder
from tests.conftest import shared_data, write_job
from tests.test_reliability import _run_and_signal_a_worker

pytestmark = pytest.mark.slow
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
CHUNKING = {"mode": "split", "max_tokens": 64, "overlap": 8}


@pytest.fixture(scope="module")
def documents() -> pa.Table:
    """40 real documents: runs of 4 consecutive kernel-docs paragraphs (ids int64: their type is kept)."""
    texts = pq.read_table(shared_data("linux_kernel_docs_paragraphs.parquet"), columns=["text"]).slice(0, 160)
    paragraphs = texts.column("text").to_pylist()
    docs = ["\n\n".join(paragraphs[i:i + 4]) for i in range(0, 160, 4)]
    return pa.table({"id": pa.array(np.arange(1000, 1040), pa.int64()), "text": docs})


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder(model=ModelConfig(path=MODEL), batching=BatchingConfig(max_tokens=2048),
                   runtime=RuntimeConfig(warmup_check=False), chunking=ChunkingConfig(**CHUNKING))


def expected(encoder: Encoder, table: pa.Table) -> dict:
    """(id, chunk) -> (start, end, vector) as one in-process encoder makes them."""
    ids, texts = table["id"].to_pylist(), table["text"].to_pylist()
    chunks, vectors = encoder.embed_chunks(texts)
    return {(ids[d], c): (s, e, v) for d, c, s, e, v in zip(chunks.doc.tolist(), chunks.chunk.tolist(),
                                                           chunks.start.tolist(), chunks.end.tolist(), vectors)}


def check_output(vectors_dir: Path, want: dict) -> pa.Table:
    """Every (id, chunk) exactly once, with its offsets and the vector of its text."""
    out = ds.dataset(vectors_dir, format="parquet").to_table()
    assert out.schema.field("id").type == pa.int64() and out.schema.field("chunk").type == pa.int32()
    keys = list(zip(out["id"].to_pylist(), out["chunk"].to_pylist()))
    assert len(keys) == len(set(keys)) == len(want) and set(keys) == set(want)
    assert [(s, e) for s, e in zip(out["start"].to_pylist(), out["end"].to_pylist())] == \
        [want[k][:2] for k in keys]
    got = np.asarray(out["embedding"].to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(got, np.stack([want[k][2] for k in keys]), atol=2e-5)
    return out


def job_file(tmp_path: Path, data: Path, **over) -> Path:
    sections = {"input": {"path": str(data), "unit_rows": 5, "chunking": CHUNKING}, "model": {"path": MODEL},
                "batching": {"max_tokens": 2048}, "output": {"path": str(tmp_path / "out")},
                "cluster": {"workers": 2, "cpus_per_worker": 1}}
    for key, value in over.items():
        sections[key] = {**sections.get(key, {}), **value}
    return write_job(tmp_path / "job.yaml", **sections)


def test_two_workers_every_chunk_once(tmp_path, documents, encoder, ray_session):
    data = tmp_path / "docs.parquet"
    pq.write_table(documents, data, row_group_size=5)  # 8 units
    job = job_file(tmp_path, data, output={"document_vectors": "mean"})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    want = expected(encoder, documents)
    assert len(want) > 2 * documents.num_rows
    check_output(tmp_path / "out" / "vectors", want)
    # output.document_vectors: mean: one row per document, the normalised mean of its chunks' vectors
    docs = ds.dataset(tmp_path / "out" / "document_vectors", format="parquet").to_table()
    assert sorted(docs["id"].to_pylist()) == documents["id"].to_pylist()
    for i, vector in zip(docs["id"].to_pylist(), np.asarray(docs["embedding"].to_pylist(), dtype=np.float32)):
        mean = np.mean([v for (d, _), (_, _, v) in want.items() if d == i], axis=0)
        np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=2e-5)
    records = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_manifest" / "units").glob("*.json")]
    assert all(r["document_parts"][0]["path"].startswith("document_vectors/") for r in records)
    # embed() in this process with the job's chunking: the CLI's chunk rows and document vectors
    import embedpipe

    out = ds.dataset(tmp_path / "out" / "vectors", format="parquet").to_table()
    cli = {(i, c): (s, e, v) for i, c, s, e, v in zip(out["id"].to_pylist(), out["chunk"].to_pylist(),
                                                     out["start"].to_pylist(), out["end"].to_pylist(),
                                                     np.asarray(out["embedding"].to_pylist(), dtype=np.float32))}
    got = embedpipe.embed(documents, model=MODEL, chunking=CHUNKING)
    ids = documents["id"].to_numpy()[got.row]
    assert len(got) == len(cli) and list(zip(ids.tolist(), got.chunk.tolist())) == sorted(cli)
    assert [(s, e) for s, e in zip(got.start.tolist(), got.end.tolist())] == [cli[k][:2] for k in sorted(cli)]
    np.testing.assert_allclose(got.vectors, np.stack([cli[k][2] for k in sorted(cli)]), atol=2e-5)
    means = embedpipe.embed(documents, model=MODEL, chunking=CHUNKING, document_vectors="mean")
    by_id = dict(zip(docs["id"].to_pylist(), np.asarray(docs["embedding"].to_pylist(), dtype=np.float32)))
    assert means.shape == (40, 384)
    np.testing.assert_allclose(means, np.stack([by_id[i] for i in documents["id"].to_pylist()]), atol=2e-5)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    per_doc = np.bincount([i - 1000 for i, _ in want])
    assert report["chunking"] == {"documents": 40, "chunks": len(want), "chunks_per_document_mean":
                                  round(len(want) / 40, 2), "chunks_per_document_max": int(per_doc.max()),
                                  "tokens": report["tokens"]}
    assert report["rows"] == len(want) and report["truncated_rows"] == 0


def test_sigkill_a_worker_loses_and_duplicates_no_chunk(tmp_path, documents, encoder, ray_session):
    data = tmp_path / "docs.parquet"
    pq.write_table(documents, data, row_group_size=4)  # 10 units
    out = tmp_path / "out"
    job = load_job(job_file(tmp_path, data, input={"unit_rows": 4}))
    runner, outcome, _ = _run_and_signal_a_worker(job, out, signal.SIGKILL, after=1, units=10)
    runner.join(timeout=600)
    report = outcome["result"].report
    assert report["units"]["retried"] >= 1 and report["units"]["failed"] == 0
    check_output(out / "vectors", expected(encoder, documents))


@pytest.mark.parametrize("policy", ["skip", "embed_empty", "error"])
def test_empty_and_whitespace_documents_follow_on_bad_row(tmp_path, documents, encoder, ray_session, policy):
    table = pa.table({"id": pa.array([1, 2, 3, 4], pa.int64()),
                      "text": [documents["text"][0].as_py(), "", "  \n\t ", documents["text"][1].as_py()]})
    data = tmp_path / "docs.parquet"
    pq.write_table(table, data)
    job = job_file(tmp_path, data, input={"on_bad_row": policy}, cluster={"workers": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    if policy == "error":
        assert result.exit_code == 3 and "input.on_bad_row" in result.output
        return
    assert result.exit_code == 0, result.output
    out = ds.dataset(tmp_path / "out" / "vectors", format="parquet").to_table()
    if policy == "skip":
        assert set(out["id"].to_pylist()) == {1, 4}
        assert sorted(pq.read_table(tmp_path / "out" / "skipped.parquet")["id"].to_pylist()) == [2, 3]
    else:  # embed_empty: one chunk of '' each
        empty = out.filter(pa.compute.is_in(out["id"], pa.array([2, 3], pa.int64())))
        assert empty["chunk"].to_pylist() == [0, 0] and empty["start"].to_pylist() == [0, 0]
        assert empty["end"].to_pylist() == [0, 0]
        got = np.asarray(empty["embedding"].to_pylist(), dtype=np.float32)
        np.testing.assert_allclose(got, encoder.embed(["", ""]), atol=2e-5)


def test_incremental_night_reencodes_exactly_changed_and_added_documents(tmp_path, documents, encoder,
                                                                           ray_session):
    data, root = tmp_path / "docs.parquet", tmp_path / "index"
    pq.write_table(documents, data, row_group_size=10)
    job = job_file(tmp_path, data, input={"unit_rows": 10},
                   output={"path": str(root), "versioned": True, "incremental": True})
    first = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert first.exit_code == 0, first.output
    night1 = (root / "CURRENT").read_text().strip()

    ids, texts = documents["id"].to_pylist(), documents["text"].to_pylist()
    changed, deleted = set(ids[0:4]), set(ids[10:13])
    new = {i: (t + "\n\nA revised closing paragraph." if i in changed else t)
           for i, t in zip(ids, texts) if i not in deleted}
    extra = pq.read_table(shared_data("linux_kernel_docs_paragraphs.parquet"), columns=["text"]).slice(400, 12)
    added = {2000 + k: "\n\n".join(extra["text"].to_pylist()[3 * k:3 * k + 3]) for k in range(4)}
    new.update(added)
    table = pa.table({"id": pa.array(list(new), pa.int64()), "text": list(new.values())})
    pq.write_table(table, data, row_group_size=10)
    second = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert second.exit_code == 0, second.output
    night2 = (root / "CURRENT").read_text().strip()
    assert night2 != night1

    want = expected(encoder, table)
    before = expected(encoder, documents)
    fresh = sum(1 for i, _ in want if i in changed or i in added)
    dropped = sum(1 for i, _ in before if i in deleted)
    report = json.loads((root / "versions" / night2 / "report.json").read_text())
    assert report["incremental"]["encoded"] == fresh and report["incremental"]["reused"] == len(want) - fresh
    assert report["incremental"]["dropped"] == dropped
    diff = report["incremental"]["diff"]  # the deleted rows shift documents across row groups: both paths serve
    assert diff["same_unit"] > 0 and diff["joined"] > 0, diff
    check_output(root / "versions" / night2 / "vectors", want)


def test_faiss_over_chunks_and_search_per_document(tmp_path, documents, encoder, ray_session, one_faiss_thread):
    from embedpipe.index.search import ChunkHit, open_index

    data = tmp_path / "docs.parquet"
    pq.write_table(documents, data, row_group_size=10)
    job = job_file(tmp_path, data, input={"unit_rows": 10}, output={"format": "faiss", "index": "Flat"})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    ids = pq.read_table(out / "index" / "ids.parquet")
    vectors = check_output(out / "vectors", expected(encoder, documents))
    assert ids.column_names == ["index_id", "id", "chunk", "start", "end"] and ids.num_rows == vectors.num_rows
    assert ids["index_id"].to_pylist() == list(range(ids.num_rows))  # dense: one index id per (id, chunk)

    texts = dict(zip(documents["id"].to_pylist(), documents["text"].to_pylist()))
    query = "how does the endpoint controller establish a link with the host"
    index = open_index(out)
    [hits] = index.search([query], k=30)
    assert index.chunked and len(hits) == 30 and all(isinstance(h, ChunkHit) for h in hits)
    assert all(h.text == texts[h.id][h.start:h.end] for h in hits)
    assert len({h.id for h in hits}) < 30  # several chunks of one document among the hits
    # the exact best chunk of each document, from the output's own vectors
    q = encoder.embed([query])[0]
    got = np.asarray(vectors["embedding"].to_pylist(), dtype=np.float32) @ q
    best: dict = {}
    for i, c, s, e, score in zip(vectors["id"].to_pylist(), vectors["chunk"].to_pylist(), vectors["start"].to_pylist(),
                                 vectors["end"].to_pylist(), got):
        if i not in best or score > best[i][0]:
            best[i] = (score, c, s, e)
    top = sorted(best, key=lambda i: -best[i][0])[:5]
    [docs] = index.search([query], k=5, per_document=True)
    assert [h.id for h in docs] == top
    assert [(h.chunk, h.start, h.end) for h in docs] == [best[i][1:] for i in top]

    cli = CliRunner().invoke(app, ["search", str(out), query, "-k", "5", "--per-document"])
    assert cli.exit_code == 0, cli.output
    lines = cli.output.strip().splitlines()
    assert len(lines) == 5
    for line, i in zip(lines, top):
        _, c, s, e = best[i]
        assert f" {i}  #{c} [{s}:{e}]  " in line
        assert " ".join(texts[i][s:e].split())[:60] in line
