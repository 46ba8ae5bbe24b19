"""Factory strings, memory estimates, auto rules and index settings validation (no Ray, no model)."""

import faiss
import numpy as np
import pytest

from embedpipe.config import JobError, load_job
from embedpipe.index.factory import FactoryError, check_spec, parse_factory
from embedpipe.index.plan import EXACT_MAX_ROWS, ModelFacts, auto_ladder, auto_nlist, plan_index
from tests.conftest import QUICKSTART, write_job

pytestmark = pytest.mark.usefixtures("one_faiss_thread")
MINILM = ModelFacts(dim=384, normalize=True, query_prompt="")


def _job(tmp_path, **output):
    return load_job(write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                              model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                              output={"path": str(tmp_path / "out"), "format": "faiss", **output}))


@pytest.mark.parametrize("text, kind, sharded, fields", [
    ("Flat", "flat", False, {}),
    ("IDMap2,Flat", "flat", False, {}),
    ("HNSW32", "hnsw", False, {"hnsw_m": 32}),
    ("HNSW32_SQ8", "hnsw", False, {"hnsw_m": 32, "code": "SQ8"}),
    ("IVF4096,PQ32", "ivf", True, {"nlist": 4096, "pq_m": 32, "pq_bits": 8}),
    ("IVF4096,PQ32x4fs", "ivf", True, {"pq_m": 32, "pq_bits": 4}),
    ("IVF1024,SQ8", "ivf", True, {"code": "SQ8"}),
    ("OPQ16_64,IVF65536_HNSW32,PQ16", "ivf", True, {"opq_m": 16, "transform_dim": 64, "coarse_hnsw": 32}),
    ("IVF256,PQ16,RFlat", "ivf", False, {"refine": "Flat"}),
    ("IVF256,PQ16,Refine(SQ8)", "ivf", False, {"refine": "SQ8"}),
    ("PQ32", "codes", False, {"pq_m": 32}),
])
def test_parse_kinds(text, kind, sharded, fields):
    spec = parse_factory(text)
    assert spec.kind == kind and spec.sharded == sharded
    for name, value in fields.items():
        assert getattr(spec, name) == value
    assert not spec.factory.startswith("IDMap")


@pytest.mark.parametrize("text, words", [
    ("Banana", "not an index embedpipe builds"),
    ("IVF4096", "must be followed by how vectors are stored"),
    ("IVF4096,,PQ8", "empty stage"),
    ("IVF4096,PQ8,Flat", "only a refine stage may follow"),
    ("OPQ16_64", "no index after it"),
    ("IVF0,Flat", "at least 1"),
])
def test_parse_rejects_with_a_reason(text, words):
    with pytest.raises(FactoryError, match=words):
        parse_factory(text)


def test_check_spec_needs_the_dimension_and_the_corpus():
    with pytest.raises(FactoryError, match="does not divide the dimension 384"):
        check_spec(parse_factory("IVF64,PQ36"), dim=384, rows=100_000)
    with pytest.raises(FactoryError, match="OPQ20 needs a dimension divisible by 20"):
        check_spec(parse_factory("OPQ20_64,IVF64,PQ16"), dim=384, rows=100_000)
    with pytest.raises(FactoryError, match="at least 4,096 vectors"):
        check_spec(parse_factory("IVF4096,Flat"), dim=384, rows=600)
    warnings = check_spec(parse_factory("IVF64,Flat"), dim=384, rows=1_000)
    assert warnings and "39 points per centroid" in warnings[0]
    assert check_spec(parse_factory("IVF16,PQ48"), dim=384, rows=100_000) == []


@pytest.mark.parametrize("factory", ["Flat", "HNSW16", "IVF32,PQ8x4", "IVF32,SQ8"])
def test_memory_estimate_is_close_to_the_written_index(factory):
    rng = np.random.default_rng(0)
    d, n = 32, 10_000
    x = rng.standard_normal((n, d)).astype(np.float32)
    spec = parse_factory(factory)
    index = faiss.index_factory(d, factory if spec.sharded else f"IDMap2,{factory}", faiss.METRIC_INNER_PRODUCT)
    index.train(x[:2000])
    index.add_with_ids(x, np.arange(n, dtype=np.int64))
    written = len(faiss.serialize_index(index))
    estimate = spec.memory_bytes(n, d)  # what the index holds: no fixed allowance any more (#18)
    assert 0.7 * written <= estimate <= 2.5 * written, (written, estimate)


def test_auto_nlist_keeps_39_rows_per_list():
    assert auto_nlist(600) == 8 and auto_nlist(1_000_000) == 4096
    for rows in (100, 5_000, 123_456, 10**8):
        assert rows >= 39 * auto_nlist(rows) or auto_nlist(rows) == 1


def test_auto_ladder_order():
    small = [s.factory for s in auto_ladder(10_000, 384)]
    assert small[:5] == ["Flat", "HNSW32", "IVF256,Flat", "IVF256,SQfp16", "IVF256,SQ8"]
    big = [s.factory for s in auto_ladder(EXACT_MAX_ROWS + 1, 384)]
    assert big[0] == "HNSW32"
    pq = [s for s in auto_ladder(10**6, 384) if s.pq_m]
    assert pq and all(384 % s.pq_m == 0 for s in pq)
    assert [s.pq_m for s in pq] == sorted((s.pq_m for s in pq), reverse=True)  # largest code first


@pytest.mark.parametrize("rows, budget_gb, first", [
    (20_000, 8, "Flat"),
    (1_000_000, 8, "HNSW32"),
    (1_000_000, 1.6, "IVF4096,Flat"),
    (1_000_000, 0.8, "IVF4096,SQfp16"),
    (1_000_000, 0.5, "IVF4096,SQ8"),
    (1_000_000, 0.25, "IVF4096,SQ4"),
    (1_000_000, 0.15, "OPQ96_384,IVF4096,PQ96"),
    (1_000_000, 0.09, "OPQ64_384,IVF4096,PQ64"),
])
def test_auto_picks_the_best_that_fits(tmp_path, rows, budget_gb, first):
    plan = plan_index(_job(tmp_path, index_memory_gb=budget_gb), rows=rows, model=MINILM)
    assert plan.auto and plan.candidates[0].factory == first
    assert all(s.memory_bytes(rows, 384) <= budget_gb * 1e9 for s in plan.candidates)


def test_budget_too_small_for_any_index(tmp_path):
    with pytest.raises(JobError) as err:
        plan_index(_job(tmp_path, index_memory_gb=0.001), rows=10**7, model=MINILM)
    assert err.value.field_path == "output.index_memory_gb" and "too small for any index" in str(err.value)


def test_explicit_index_over_budget(tmp_path):
    with pytest.raises(JobError) as err:
        plan_index(_job(tmp_path, index="HNSW32", index_memory_gb=1), rows=10**7, model=MINILM)
    assert err.value.field_path == "output.index_memory_gb" and "only IVF indexes can stay on disk" in str(err.value)
    plan = plan_index(_job(tmp_path, index="IVF4096,Flat", index_memory_gb=1), rows=10**7, model=MINILM)
    assert plan.on_disk(plan.candidates[0]) and "on disk" in plan.warnings[-1]


@pytest.mark.parametrize("output, field, words", [
    ({"index": "IVF4096,PQ"}, "output.index", "must be followed by how vectors are stored"),
    ({"index": "Banana"}, "output.index", "supported forms"),
    ({"dtype": "int8"}, "output.dtype", "FAISS compresses vectors itself"),
])
def test_bad_index_settings_fail_in_preflight(tmp_path, output, field, words):
    """The factory string and the stored dtype against FAISS: checked by preflight (config.py is the
    schema alone), before the input or the model is read."""
    from embedpipe.preflight import preflight

    with pytest.raises(JobError) as err:
        preflight(_job(tmp_path, **output))
    assert err.value.field_path == field and words in str(err.value) and "fix:" in str(err.value)


@pytest.mark.parametrize("output, field, words", [
    ({"target_recall": 1.5}, "output.target_recall", "not in (0, 1]"),
    ({"index_memory_gb": 0}, "output.index_memory_gb", "must be positive"),
    ({"format": "hnsw"}, "output.format", "not one of parquet, faiss, both"),
])
def test_bad_index_settings_fail_at_load(tmp_path, output, field, words):
    with pytest.raises(JobError) as err:
        _job(tmp_path, **output)
    assert err.value.field_path == field and words in str(err.value) and "fix:" in str(err.value)


def test_pq_not_dividing_the_dimension_fails_at_plan(tmp_path):
    with pytest.raises(JobError) as err:
        plan_index(_job(tmp_path, index="IVF16,PQ36"), rows=3000, model=MINILM)
    assert err.value.field_path == "output.index" and "does not divide the dimension 384" in str(err.value)
