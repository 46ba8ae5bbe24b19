"""The duplicate-id check in bounded memory (embedpipe/io/duplicates.py): spilled to per-bucket files, it finds
exactly what the one-bucket check finds, in input order, for integer and text ids; preflight's answers (the
error naming the ids, keep_first's dropped rows) are the same with many buckets as with one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import embedpipe.io.duplicates as duplicates
from embedpipe.errors import InputError
from embedpipe.io.duplicates import IdOccurrences, id_keys
from tests.test_preflight import _job


def _later(units: list[pa.Array], *, bucket_rows: int) -> tuple[np.ndarray, int]:
    with IdOccurrences(rows=sum(len(u) for u in units), bucket_rows=bucket_rows) as seen:
        for i, ids in enumerate(units):
            seen.add(id_keys(ids), unit=i, rows=np.arange(len(ids)))
        return seen.later(), seen.buckets


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
    # the later occurrences, by a plain pass in input order
    seen, want = set(), []
    for u, unit in enumerate(units):
        for r, v in enumerate(unit.to_pylist()):
            (want.append([u, r]) if v in seen else seen.add(v))
    assert many.tolist() == want


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
