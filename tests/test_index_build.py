"""The index build on synthetic vector parts, in process (no Ray, no model): ids, sampling, shards,
merge, recall, on-disk IVF, fallbacks. The end-to-end runs are in test_index_e2e.py."""

import dataclasses
import json

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.config import load_job
from embedpipe.index.build import IndexBuild
from embedpipe.index.factory import parse_factory
from embedpipe.index.ids import IdLookup, NativeIdCheck, plan_ids
from embedpipe.index.merge import merge_in_memory
from embedpipe.index.parts import Part, UniformSampler
from embedpipe.index.plan import ModelFacts, plan_index
from embedpipe.index.search import open_index
from embedpipe.index.shard import ShardBuilder, ShardContext
from embedpipe.io.writer import ParquetPartWriter
from tests.conftest import QUICKSTART, write_job
from tests.index_helpers import assert_same_neighbours, recompute_recall

DIM, ROWS, UNITS = 32, 4000, 4


@pytest.fixture(autouse=True, scope="module")
def one_faiss_thread():
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # shared test machine: spinning OpenMP threads cost minutes
    yield
    faiss.omp_set_num_threads(before)


def clustered(rows: int, dim: int, *, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((64, dim)).astype(np.float32)
    x = centers[rng.integers(0, 64, rows)] + 0.6 * rng.standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def write_parts(out, vectors: np.ndarray, ids: pa.Array) -> list[Part]:
    writer, per, parts = ParquetPartWriter(output_path=str(out)), len(vectors) // UNITS, []
    for u in range(UNITS):
        unit_id = f"00000-{u:05d}"
        rows = slice(u * per, (u + 1) * per if u < UNITS - 1 else len(vectors))
        path = writer(unit_id, ids[rows], vectors[rows])
        parts.append(Part(unit_id, path, len(vectors[rows])))
    return parts


@pytest.fixture(scope="module")
def vectors():
    return clustered(ROWS, DIM)


def build(tmp_path, vectors, *, ids=None, fmt="both", **output):
    ids = ids if ids is not None else pa.array([f"doc-{i}" for i in range(len(vectors))])
    out = tmp_path / "out"
    job = load_job(write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                             output={"path": str(out), "format": fmt, **output}))
    parts = write_parts(out, vectors, ids)
    plan = plan_index(job, rows=len(vectors), model=ModelFacts(dim=DIM, normalize=True, query_prompt=""))
    return IndexBuild(job, plan, parts=parts), out


def test_flat_is_exact_and_ids_map_back(tmp_path, vectors):
    index_build, out = build(tmp_path, vectors, index="Flat")
    report = index_build()
    assert report["factory"] == "Flat" and report["ntotal"] == ROWS and report["ids"] == "dense"
    assert report["recall_at_10"] == report["recall_at_1"] == 1.0 and report["target_reached"]
    assert report["search_params"] == {}
    ids = pq.read_table(out / "index" / "ids.parquet")
    assert ids["index_id"].to_pylist() == list(range(ROWS)) and ids["id"][7].as_py() == "doc-7"
    hits = open_index(out).search_vectors(vectors[[7, 3999]], k=3)
    assert hits[0][0][0] == "doc-7" and hits[1][0][0] == "doc-3999" and hits[0][0][1] == pytest.approx(1.0, abs=1e-5)
    assert (out / "vectors").is_dir() and len(list((out / "vectors").iterdir())) == UNITS  # format both keeps them
    assert not (out / "index" / "_build").exists()
    assert set(report["stages"]) == {"sample", "train", "add", "tune", "write"} and report["build_seconds"] > 0


@pytest.mark.parametrize("factory, parameter", [("IVF32,PQ8x4", "nprobe"), ("HNSW16", "efSearch"),
                                                ("IVF32,SQ8", "nprobe"), ("IVF32,PQ8x4,RFlat", "nprobe")])
def test_reported_recall_equals_recomputed(tmp_path, vectors, factory, parameter):
    index_build, out = build(tmp_path, vectors, index=factory, target_recall=0.9)
    report = index_build()
    index_ids = np.array(pq.read_table(out / "index" / "ids.parquet")["index_id"].to_pylist())
    r10, r1, stored_exact, exact = recompute_recall(out / "index", index_ids, vectors)
    assert parameter in report["search_params"]
    assert ("merge" in report["stages"]) == parse_factory(factory).sharded
    assert_same_neighbours(stored_exact, exact)
    assert (report["recall_at_10"], report["recall_at_1"]) == (r10, r1)
    meta = json.loads((out / "index" / "index.json").read_text())
    assert meta["search_params"] == report["search_params"] and meta["factory"] == factory


def test_compression_limit_is_reported_not_hidden(tmp_path, vectors):
    index_build, out = build(tmp_path, vectors, index="IVF16,PQ4x4", target_recall=0.99)
    report = index_build()
    assert not report["target_reached"] and report["recall_at_10"] < 0.9
    assert report["search_params"]["nprobe"] <= 16
    assert any("refine stage" in w and "RFlat" in w for w in report["warnings"])


def test_auto_falls_back_to_the_next_candidate(tmp_path, vectors):
    index_build, out = build(tmp_path, vectors, target_recall=0.97)
    candidates = (parse_factory("IVF16,PQ4x4"), parse_factory("IVF16,Flat"))
    index_build.plan = dataclasses.replace(index_build.plan, candidates=candidates, auto=True)
    report = index_build()
    assert [t["factory"] for t in report["tried"]] == ["IVF16,PQ4x4", "IVF16,Flat"]
    assert report["factory"] == "IVF16,Flat" and report["target_reached"] and report["recall_at_10"] >= 0.97


def test_shards_from_two_workers_merge_to_the_same_index(tmp_path, vectors):
    """Units processed by two builders in any order, merged in unit-id order = one builder in unit order."""
    index_build, out = build(tmp_path, vectors, index="IVF16,PQ8x4")
    spec = index_build.plan.candidates[0]
    trained = faiss.index_factory(DIM, spec.factory, faiss.METRIC_INNER_PRODUCT)
    trained.train(vectors[:2000])
    ids = plan_ids([(p.unit_id, p.rows) for p in index_build.planned], native=False)

    def merged(groups):
        shards = {}
        for g, parts in enumerate(groups):
            context = ShardContext(faiss.serialize_index(trained), ids, vectors[:5], 3, "inner_product",
                                   str(tmp_path / f"shards-{len(groups)}-{g}"))
            builder = ShardBuilder(context)
            for part in parts:
                shards[part.unit_id] = builder(part).shard
        index = faiss.deserialize_index(faiss.serialize_index(trained))
        merge_in_memory(index, [shards[p.unit_id] for p in index_build.planned])
        return index

    parts = index_build.planned
    one = merged([parts])
    two = merged([[parts[3], parts[0]], [parts[2], parts[1]]])
    assert one.ntotal == two.ntotal == ROWS
    assert faiss.serialize_index(one).tobytes() == faiss.serialize_index(two).tobytes()


def test_ivf_over_budget_merges_on_disk(tmp_path, vectors):
    index_build, out = build(tmp_path, vectors, index="IVF16,Flat", index_memory_gb=0.0003)  # 0.55 MB needed (#18: no fixed 1 MiB)
    assert index_build.plan.on_disk(index_build.plan.candidates[0])
    report = index_build()
    assert report["on_disk"] and (out / "index" / "index.ivfdata").is_file()
    assert report["bytes"] >= (out / "index" / "index.ivfdata").stat().st_size
    moved = tmp_path / "moved"
    (out / "index").rename(moved)  # the ivfdata is found beside index.faiss wherever it goes
    hits = open_index(moved).search_vectors(vectors[[11]], k=1)
    assert hits[0][0][0] == "doc-11"


def test_a_rerun_over_the_same_parts_keeps_the_index(tmp_path, vectors):
    index_build, out = build(tmp_path, vectors, fmt="faiss", index="IVF16,Flat")
    first = index_build()
    assert len(list((out / "vectors").glob("*.parquet"))) == UNITS  # the parts stay: resume rests on them
    written = (out / "index" / "index.faiss").stat().st_mtime_ns
    again, _ = build(tmp_path, vectors, fmt="faiss", index="IVF16,Flat")  # rewrites the same parts
    assert again()["build_seconds"] > 0
    rebuilt = (out / "index" / "index.faiss").stat().st_mtime_ns
    assert rebuilt > written  # new parts: built again
    kept = IndexBuild(again.job, again.plan, parts=again.planned)()
    assert (out / "index" / "index.faiss").stat().st_mtime_ns == rebuilt  # same parts: kept
    assert kept == json.loads((out / "index" / "index.json").read_text())["report"]
    assert kept["factory"] == first["factory"] and kept["ntotal"] == first["ntotal"]


@pytest.mark.parametrize("ids, native", [
    (pa.array(np.arange(ROWS) * 3 + 10**12, pa.int64()), True),
    (pa.array(np.arange(ROWS), pa.uint32()), True),
    (pa.array(np.r_[np.arange(ROWS - 1), 0], pa.int64()), False),  # a duplicate
    (pa.array(np.arange(ROWS, dtype=np.uint64) + 2**63), False),  # past int64
    (pa.array([f"doc-{i}" for i in range(ROWS)]), False),
])
def test_ids_native_when_unique_integers(tmp_path, vectors, ids, native):
    index_build, out = build(tmp_path, vectors, ids=ids, index="Flat")
    report = index_build()
    assert report["ids"] == ("native" if native else "dense")
    table = pq.read_table(out / "index" / "ids.parquet")
    assert table.schema.field("id").type == ids.type and table["id"].to_pylist() == ids.to_pylist()
    lookup = IdLookup(out / "index" / "ids.parquet", native=native)
    index_ids = np.array(table["index_id"].to_pylist())
    assert lookup(index_ids[[5, 17]]) == [ids[5].as_py(), ids[17].as_py()]
    hits = open_index(out).search_vectors(vectors[[17]], k=1)
    assert hits[0][0][0] == ids[17].as_py()


def test_native_id_check_streams():
    check = NativeIdCheck()
    check(pa.array([1, 2], pa.int64()))
    check(pa.array([3, None], pa.int64()))
    assert not check.unique()


def test_sampler_is_uniform_over_the_corpus_not_the_first_rows():
    sampler = UniformSampler(total=100_000, train=2_000, queries=500, seed=0)
    for start in range(0, 100_000, 7_000):  # parts of uneven length, in unit order
        n = min(7_000, 100_000 - start)
        rows = np.arange(start, start + n, dtype=np.float32)[:, None]
        sampler(pa.array(np.arange(start, start + n)), rows)
    sample = sampler.result(1)
    drawn = sample.train[:, 0]
    assert len(set(drawn)) == 2_000 and drawn.max() > 95_000 and drawn.min() < 5_000
    assert abs(np.median(drawn[:500]) - 50_000) < 8_000  # a prefix is a uniform sample too
    assert sample.query_ids.to_pylist() == sample.query_positions.tolist()


def test_ties_count_as_hits():
    """Query 0's neighbours 5 and 6 are duplicates (same score): either one at rank 1 is right."""
    from embedpipe.index.recall import Neighbours, recall

    exact = Neighbours(np.array([[0, 5, 6, 7, -1]]), np.array([[1.0, 0.9, 0.9, 0.5, -np.inf]], np.float32))
    qids = np.array([0])
    assert recall(np.array([[0, 6, 5]]), exact, qids, k=1, at=1) == 1.0
    assert recall(np.array([[6, 0, 7]]), exact, qids, k=1, at=1) == 1.0  # the query itself is skipped
    assert recall(np.array([[0, 7, 6]]), exact, qids, k=1, at=1) == 0.0
    assert recall(np.array([[0, 6, 7]]), exact, qids, k=2, at=2) == 0.5  # 5 or 6 found, 7 is not in the top 2
    assert recall(np.array([[5, 6, 0]]), exact, qids, k=2, at=2) == 1.0


def test_exact_index_scores_one_with_duplicate_vectors(tmp_path, vectors):
    dup = vectors.copy()
    dup[1::2] = dup[0::2]  # every vector twice
    index_build, _ = build(tmp_path, dup, index="Flat")
    report = index_build()
    assert report["recall_at_10"] == report["recall_at_1"] == 1.0


@pytest.mark.parametrize("factory", ["IVF16,PQ8x4fs", "HNSW16_SQ8", "OPQ8_32,IVF16,PQ8x4", "IVF16_HNSW8,Flat",
                                     "PCA16,IVF16,Flat", "SQ8", "IVF16,PQ8x4,Refine(SQ8)"])
def test_every_supported_kind_builds_and_finds_its_rows(tmp_path, vectors, factory):
    index_build, out = build(tmp_path, vectors, index=factory, target_recall=0.5)
    report = index_build()
    assert report["ntotal"] == ROWS and report["factory"] == factory
    hits = open_index(out).search_vectors(vectors[[5, 2222]], k=5)
    assert "doc-5" in [i for i, _ in hits[0]] and "doc-2222" in [i for i, _ in hits[1]]
