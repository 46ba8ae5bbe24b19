"""Stored vector types against sentence-transformers' quantize_embeddings, the Parquet columns
they make, the calibration sample, and MiniLM end to end against sentence-transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.io.quantize import METADATA_KEY, OUTPUT_TYPES, RECORD, Calibration, fit_calibration, quantize
from embedpipe.cluster.calibrate import prepare_quantization, sample_texts
from embedpipe.config import InputConfig
from embedpipe.io.writer import ParquetPartWriter, vector_column
from embedpipe.units import plan_units
from tests.conftest import QUICKSTART, split_corpus

st_quantize = pytest.importorskip("sentence_transformers").quantize_embeddings


def _vectors(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
@pytest.mark.parametrize("dim", [384, 100])  # 100: the last packed byte is partial
def test_same_as_sentence_transformers_bit_for_bit(precision, dim):
    calib_vectors, vectors = _vectors(500, dim, 0), _vectors(300, dim, 1)
    calibration = fit_calibration(calib_vectors, precision=precision, seed=0, input_rows=500)
    ours = quantize(vectors, dtype=precision, calibration=calibration if "int8" in precision else None)
    ref = st_quantize(vectors, precision=precision, calibration_embeddings=calib_vectors)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)
    if "int8" in precision:  # the ranges survive the JSON round trip exactly
        again = Calibration.from_json(calibration.to_json())
        np.testing.assert_array_equal(quantize(vectors, dtype=precision, calibration=again), ref)


def test_constant_dimension_and_out_of_range_values():
    calib = _vectors(50, 16, 0)
    calib[:, 3] = 0.25  # min == max: sentence-transformers uses step 1
    vectors = _vectors(20, 16, 1) * 3  # values outside the calibrated range are clipped
    calibration = fit_calibration(calib, precision="int8", seed=0, input_rows=50)
    np.testing.assert_array_equal(quantize(vectors, dtype="int8", calibration=calibration),
                                  st_quantize(vectors, precision="int8", ranges=calibration.ranges_array))


def test_int8_without_calibration_is_refused():
    with pytest.raises(ValueError, match="needs a Calibration"):
        quantize(_vectors(2, 8, 0), dtype="int8")
    with pytest.raises(ValueError, match="not one of"):
        quantize(_vectors(2, 8, 0), dtype="int4")


@pytest.mark.parametrize("dtype, arrow, width", [
    ("float32", pa.float32(), 384), ("float16", pa.float16(), 384), ("int8", pa.int8(), 384),
    ("uint8", pa.uint8(), 384), ("binary", pa.int8(), 48), ("ubinary", pa.uint8(), 48),
])
def test_part_column_types_and_metadata(tmp_path, dtype, arrow, width):
    assert set(OUTPUT_TYPES) == {"float32", "float16", "int8", "uint8", "binary", "ubinary"}
    vectors = _vectors(10, 384, 2)
    calibration = fit_calibration(vectors, precision=dtype, seed=3, input_rows=99) if "int8" in dtype else None
    writer = ParquetPartWriter(output_path=str(tmp_path), dtype=dtype, calibration=calibration)
    part = pq.read_table(writer("00000-00000", pa.array(range(10)), vectors))
    assert part.schema.field("embedding").type == pa.list_(arrow, width)
    stored = np.asarray(part["embedding"].to_pylist())
    np.testing.assert_array_equal(stored, quantize(vectors, dtype=dtype, calibration=calibration))
    meta = part.schema.metadata or {}
    if dtype.startswith("float"):
        assert METADATA_KEY not in meta
    else:
        record = json.loads(meta[METADATA_KEY])
        assert record["dtype"] == dtype and record["dim"] == 384 and record["width"] == width
        if calibration is not None:
            assert Calibration(**record["calibration"]) == calibration
            assert record["calibration"]["seed"] == 3 and record["calibration"]["input_rows"] == 99


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint8"])
def test_vector_column_is_what_pa_array_builds(dtype):
    """io/writer.vector_column, the one builder of a vector column (parts, the in-process API's tables): the same
    type and values as through pa.array, for contiguous, strided and empty input."""
    values = (_vectors(7, 12, 5) * 100).astype(dtype)  # [7, 12]
    for case in (values, values[::2], values[:, ::-1], values.T, values[:0]):
        got = vector_column(case)
        want = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(case).reshape(-1)), case.shape[1])
        assert got.type == want.type == pa.list_(pa.from_numpy_dtype(np.dtype(dtype)), case.shape[1])
        assert got.equals(want) and len(got) == case.shape[0]


@pytest.mark.parametrize("dtype, dictionary", [("float32", False), ("float16", False), ("int8", True),
                                               ("uint8", True), ("binary", True)])
def test_vector_columns_are_dictionary_encoded_only_where_it_pays(tmp_path, dtype, dictionary):
    """io/store.parquet_options, for a part on a folder and on an object store (table_bytes): float vectors are
    written plain (a dictionary of near-unique values only grew the file: 1.56x for float32), integer vectors keep
    pyarrow's dictionary (8 bits a value instead of INT32's 32); the values read back are the same."""
    from embedpipe.io.store import table_bytes

    vectors = _vectors(500, 384, 6)
    calibration = fit_calibration(vectors, precision=dtype, seed=3, input_rows=500) if "int8" in dtype else None
    writer = ParquetPartWriter(output_path=str(tmp_path), dtype=dtype, calibration=calibration)
    ids = pa.array([f"p{i:06d}" for i in range(500)])
    path = writer("00000-00000", ids, vectors)
    table = pq.read_table(path)
    for source in (path, pa.BufferReader(table_bytes(table))):
        chunks = pq.ParquetFile(source).metadata.row_group(0)
        encodings = {chunks.column(i).path_in_schema.split(".")[0]: chunks.column(i).encodings
                     for i in range(chunks.num_columns)}
        assert any("DICTIONARY" in e for e in encodings["embedding"]) == dictionary, encodings
        assert any("DICTIONARY" in e for e in encodings["id"]), encodings  # other columns as pyarrow writes them
    np.testing.assert_array_equal(np.asarray(table["embedding"].to_pylist()),
                                  quantize(vectors, dtype=dtype, calibration=calibration))
    if not dictionary:  # plain: about the values' own bytes
        stored = quantize(vectors, dtype=dtype, calibration=calibration)
        assert os.path.getsize(path) < 1.05 * stored.nbytes + 20_000


def test_stored_rows_are_written_as_they_are(tmp_path):
    """Incremental runs write reused stored values next to fresh ones: no second quantization."""
    vectors = _vectors(6, 100, 4)
    calibration = fit_calibration(vectors, precision="int8", seed=0, input_rows=6)
    writer = ParquetPartWriter(output_path=str(tmp_path), dtype="int8", calibration=calibration, dim=100)
    stored = writer.store(vectors)  # [6, 100] int8
    part = pq.read_table(writer("00000-00000", pa.array(range(6)), stored, stored=True))
    np.testing.assert_array_equal(np.asarray(part["embedding"].to_pylist(), dtype=np.int8), stored)
    assert json.loads(part.schema.metadata[METADATA_KEY])["dim"] == 100
    with pytest.raises(ValueError, match="calibration"):
        ParquetPartWriter(output_path=str(tmp_path), dtype="uint8")


def test_calibration_sample_is_seeded_spread_and_skips_bad_rows(tmp_path, quickstart_table):
    table = quickstart_table.slice(0, 600)
    texts = table["text"].to_pylist()
    texts[5] = None  # a bad row is never sampled, whatever input.on_bad_row says
    table = table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts))
    split_corpus(table, tmp_path, files=3, row_group_size=100)
    units = plan_units(sorted(str(p) for p in tmp_path.glob("*.parquet")), unit_rows=100)  # 6 units
    cfg = InputConfig(path=str(tmp_path))
    sample = sample_texts(cfg, units, rows=150, seed=7)  # 2 units: enough to hold 150 rows
    assert sample == sample_texts(cfg, units, rows=150, seed=7)  # seeded
    assert sample != sample_texts(cfg, units, rows=150, seed=8)
    assert len(sample) == 150 and all(isinstance(t, str) and t for t in sample)
    assert len(sample_texts(cfg, units, rows=1500, seed=7)) == 599  # 6 units (every good row): 1 per 1,000 asked
    assert set(sample) <= set(t for t in texts if t)
    small = sample_texts(cfg, units, rows=50, seed=7)  # one unit, 50 of its rows, in input order
    order = {t: i for i, t in enumerate(texts) if t}
    assert len(small) == 50 and [order[t] for t in small] == sorted(order[t] for t in small)
    assert len({order[t] // 100 for t in small}) == 1
    everything = sample_texts(cfg, units, rows=10**6, seed=0)  # all units, every good row
    assert sorted(everything) == sorted(t for t in texts if t)


def test_calibration_is_kept_once_fitted(tmp_path):
    """A resumed run reads its own record; an incremental run takes the previous version's (no embed given:
    reaching a fit would raise, and fail the test)."""
    from embedpipe.config import job_from_dict

    calibration = fit_calibration(_vectors(40, 384, 5), precision="int8", seed=9, input_rows=40)
    previous, out = tmp_path / "previous", tmp_path / "out"
    previous.mkdir(), out.mkdir()
    (previous / RECORD).write_text(json.dumps({"dtype": "int8", "dim": 384, "width": 384,
                                               "calibration": json.loads(calibration.to_json())}))
    job = job_from_dict({"input": {"path": str(tmp_path)}, "model": {"path": "sentence-transformers/all-MiniLM-L6-v2"},
                         "output": {"path": str(out), "dtype": "int8"}})
    got = prepare_quantization(job, [], out, dim=384, previous=previous)
    assert got == calibration
    assert json.loads((out / RECORD).read_text())["calibration"] == json.loads(calibration.to_json())
    assert prepare_quantization(job, [], out, dim=384, previous=None) == calibration  # resumed: its own
    binary = job.replace(output={"dtype": "binary"})
    assert prepare_quantization(binary, [], out, dim=384, previous=None) is None
    assert json.loads((out / RECORD).read_text()) == {"dtype": "binary", "dim": 384, "width": 48}


# ---- the real MiniLM: our stored vectors vs sentence-transformers' quantization of its own ----


@pytest.fixture(scope="module")
def minilm_pair(minilm_dir):
    from sentence_transformers import SentenceTransformer

    from embedpipe.runtime import Encoder

    texts = pq.read_table(QUICKSTART)["text"].to_pylist()[:300]
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    return texts, st, lambda **kw: Encoder.from_options(str(minilm_dir), **kw)


@pytest.mark.parametrize("dim", [None, 128])
def test_minilm_stored_types_match_sentence_transformers(minilm_pair, dim):
    texts, st, encoder = minilm_pair
    ours = encoder(dim=dim).embed(texts)  # [N, D] float32
    ref = st.encode(texts, truncate_dim=dim, normalize_embeddings=True)
    calib = ours[::3]  # the run's calibration: a sample of our own vectors
    for dtype in ("float16", "int8", "uint8", "binary", "ubinary"):
        calibration = fit_calibration(calib, precision=dtype, seed=0, input_rows=len(texts)) if "int8" in dtype else None
        got = quantize(ours, dtype=dtype, calibration=calibration)
        if dtype == "float16":
            np.testing.assert_allclose(got.astype(np.float32), ref, atol=1e-3)
            continue
        want = st_quantize(ref, precision=dtype, ranges=None if calibration is None else calibration.ranges_array)
        assert got.dtype == want.dtype and got.shape == want.shape
        differ = got != want
        if "binary" in dtype:
            bits_near_zero = np.packbits(np.abs(ref) < 1e-6, axis=-1) > 0  # bytes with a value on the sign boundary
            assert not (differ & ~bits_near_zero).any(), dtype
        else:
            # Same buckets except where sentence-transformers' own float sits within 1e-3 of a bucket
            # edge: our floats differ from its by ~1e-7 (cos >= 0.99999), a bucket is ~1e-3 wide.
            r = calibration.ranges_array
            edge = (ref - r[0]) / ((r[1] - r[0]) / 255)
            near_edge = np.abs(edge - np.round(edge)) < 1e-3
            assert not (differ & ~near_edge).any(), dtype
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
            # Most of those are the calibration rows' own extremes: each dimension's max lands exactly on 255.0.
            assert differ.mean() < 2e-3, f"{dtype}: {differ.sum()} of {differ.size} values differ"
