"""The duplicate-id check in bounded memory (embedpipe/io/duplicates.py): spilled to per-bucket files, it finds
exactly what the one-bucket check finds, in input order, for integer and text ids; preflight's answers (the
error naming the ids, keep_first's dropped rows) are the same with many buckets as with one. Text ids' keys are
a vectorised hash of their bytes: equal bytes give equal keys wherever the id sits in its array, different ids
different keys, and where two different ids do share a key (a hash made to collide) no unique id is ever
called a duplicate."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import embedpipe.io.duplicates as duplicates
from embedpipe.errors import InputError
from embedpipe.io.duplicates import IdOccurrences, id_keys
from tests.conftest import ROOT, needs_shared_data
from tests.test_preflight import _job


def _later(units: list[pa.Array], *, bucket_rows: int) -> tuple[np.ndarray, int]:
    with IdOccurrences(rows=sum(len(u) for u in units), bucket_rows=bucket_rows) as seen:
        for i, ids in enumerate(units):
            seen.add(id_keys(ids), unit=i, rows=np.arange(len(ids)))
        values = None if duplicates.exact_keys(units[0].type) else units.__getitem__
        return seen.later(values=values), seen.buckets


def _plain_later(units: list[pa.Array]) -> list[list[int]]:
    """The later occurrences, by a plain pass in input order."""
    seen, want = set(), []
    for u, unit in enumerate(units):
        for r, v in enumerate(unit.to_pylist()):
            (want.append([u, r]) if v in seen else seen.add(v))
    return want


@pytest.mark.parametrize("kind", ["int", "text"])
def test_spilled_buckets_find_what_one_bucket_finds(kind):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 3_000, size=5_000)  # ~40 % of the rows repeat an earlier id
    ids = values if kind == "int" else np.array([f"doc-{v}" for v in values], dtype=object)
    units = [pa.array(ids[i:i + 700]) for i in range(0, len(ids), 700)]
    one, buckets = _later(units, bucket_rows=10_000)
    assert buckets == 1
    many, buckets = _later(units, bucket_rows=400)
    assert buckets == 13
    np.testing.assert_array_equal(many, one)
    assert many.tolist() == _plain_later(units)


def test_the_spill_files_are_gone_after_the_check():
    with IdOccurrences(rows=10, bucket_rows=3) as seen:
        seen.add(id_keys(pa.array([1, 2, 1])), unit=0, rows=np.arange(3))
        folder = seen._dir.name
        assert seen.later().tolist() == [[0, 2]]
    import os

    assert not os.path.exists(folder)


def test_preflight_answers_the_same_with_many_buckets(tmp_path, monkeypatch):
    pq.write_table(pa.table({"id": [7, 8, 7, 5, 6], "text": list("abcde")}), tmp_path / "1.parquet", row_group_size=2)
    pq.write_table(pa.table({"id": [8, 9, 5], "text": list("fgh")}), tmp_path / "2.parquet")
    from embedpipe.preflight import preflight

    job = _job(tmp_path, tmp_path / "*.parquet", input={"on_duplicate_id": "keep_first", "unit_rows": 2})
    one = [(u.id, u.drop_rows) for u in preflight(job).units]
    monkeypatch.setattr(duplicates, "BUCKET_ROWS", 2)  # 8 rows: 4 buckets, spilled
    made = []
    monkeypatch.setattr(duplicates.IdOccurrences, "close",
                        lambda self, _close=duplicates.IdOccurrences.close: (made.append(self.buckets), _close(self)))
    plan = preflight(job)
    assert made == [4]
    assert [(u.id, u.drop_rows) for u in plan.units] == one and plan.duplicate_rows == 3
    with pytest.raises(InputError, match=r"3 rows repeat an id seen earlier, e\.g\. 7 .*, 8 .*, 5 "):
        preflight(_job(tmp_path, tmp_path / "*.parquet", input={"unit_rows": 2}))


def _texts() -> list[str]:
    """Ids that differ in one byte, at every position around the 8-byte words, in length alone, by a NUL."""
    ids = [f"doc-{i:09d}" for i in range(20_000)] + [f"https://example.org/{i}/" * (1 + i % 9) for i in range(2_000)]
    ids += ["", "a", "a\x00", "a\x00\x00", "\x00", "\x00a"] + ["x" * n for n in range(1, 70)]
    ids += ["y" * 23 + chr(65 + p) + "y" * (40 - p) for p in range(26)] + ["é" * 9, "é" * 9 + "e", "日本語"]
    return ids


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_different_text_ids_get_different_keys_and_equal_ones_equal_keys(kind):
    texts = _texts()
    values = [t.encode() for t in texts] if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) else texts
    ids = pa.array(values, type=kind)
    keys = id_keys(ids)
    assert keys.shape == (len(texts), 2) and keys.dtype == np.uint64
    assert len(np.unique(keys, axis=0)) == len(set(texts)) == len(texts)
    # the same ids sliced (a non-zero array offset), in chunks, or after a null: the same keys
    np.testing.assert_array_equal(id_keys(ids.slice(7, 300)), keys[7:307])
    shifted = pa.array([None, *values[:500]], type=kind)
    np.testing.assert_array_equal(id_keys(shifted)[1:], keys[:500])
    assert (id_keys(pa.array(values[::-1], type=kind))[::-1] == keys).all()


def test_other_id_types_keep_their_keys():
    dates = pa.array(np.array(["2026-01-01", "2026-01-02", "2026-01-01"], dtype="datetime64[D]"))
    keys = id_keys(dates)
    assert (keys[0] == keys[2]).all() and not (keys[0] == keys[1]).all()


def _collide(ids: pa.Array) -> np.ndarray:
    """A hash made to collide: every id of the same length (in bytes) shares one key."""
    lengths = pc.binary_length(ids).to_numpy(zero_copy_only=False).astype(np.uint64)
    return np.stack([lengths, lengths * np.uint64(3)], axis=1)


@pytest.mark.parametrize("bucket_rows", [10_000, 50])
def test_ids_sharing_a_key_are_told_apart_by_their_values(monkeypatch, bucket_rows):
    monkeypatch.setattr(duplicates, "_text_keys", _collide)
    rng = np.random.default_rng(1)
    values = rng.integers(0, 300, size=900)  # every key shared by up to 200 different ids
    units = [pa.array([f"id-{v}" for v in values[i:i + 100]]) for i in range(0, len(values), 100)]
    later, _ = _later(units, bucket_rows=bucket_rows)
    assert later.tolist() == _plain_later(units) and 0 < len(later) < len(values) - 250
    with IdOccurrences(rows=900, bucket_rows=bucket_rows) as seen:  # the keys alone would call nearly all repeats
        for i, ids in enumerate(units):
            seen.add(id_keys(ids), unit=i, rows=np.arange(len(ids)))
        assert len(seen.later()) > len(later) + 250


def test_preflight_drops_only_true_duplicates_when_keys_collide(tmp_path, monkeypatch):
    monkeypatch.setattr(duplicates, "_text_keys", _collide)
    pq.write_table(pa.table({"id": ["aa", "bb", "aa", "cc"], "text": list("abcd")}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"id": ["dd", "bb", "ee"], "text": list("efg")}), tmp_path / "2.parquet")
    from embedpipe.preflight import preflight

    plan = preflight(_job(tmp_path, tmp_path / "*.parquet", input={"on_duplicate_id": "keep_first"}))
    assert [u.drop_rows for u in plan.units] == [(2,), (1,)] and plan.duplicate_rows == 2
    pq.write_table(pa.table({"id": ["dd", "ff", "ee"], "text": list("efg")}), tmp_path / "2.parquet")
    pq.write_table(pa.table({"id": ["aa", "bb", "gg", "cc"], "text": list("abcd")}), tmp_path / "1.parquet")
    assert preflight(_job(tmp_path, tmp_path / "*.parquet")).duplicate_rows == 0  # 7 ids of one length: no repeat


@needs_shared_data
def test_bench_duplicates_runs_and_every_contender_drops_the_repeats():
    """scripts/bench_duplicates.py on a small sample, so it cannot rot (it asserts each contender's drops)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_duplicates.py"), "--rows", "30000",
                           "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "30,000 string ids (300 repeats" in done.stdout and "| numpy |" in done.stdout
