import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.units import InputError, list_files, plan_units


def _write(path, rows, rg):
    pq.write_table(pa.table({"id": list(range(rows)), "text": ["x"] * rows}), path, row_group_size=rg)


def test_units_group_row_groups_deterministically(tmp_path):
    _write(tmp_path / "a.parquet", 250, 50)  # 5 row groups
    _write(tmp_path / "b.parquet", 30, 50)  # 1 row group
    files = list_files(str(tmp_path))
    units = plan_units(files, unit_rows=100)
    assert [(u.id, u.row_groups, u.num_rows) for u in units] == [
        ("00000-00000", (0, 1), 100), ("00000-00002", (2, 3), 100), ("00000-00004", (4,), 50),
        ("00001-00000", (0,), 30)]
    assert plan_units(files, unit_rows=100) == units
    assert sum(u.num_rows for u in units) == 280


def test_list_files_glob_and_errors(tmp_path):
    _write(tmp_path / "a.parquet", 3, 3)
    assert list_files(str(tmp_path / "*.parquet")) == [str(tmp_path / "a.parquet")]
    with pytest.raises(InputError, match="matches no Parquet file"):
        list_files(str(tmp_path / "*.csv"))


def test_corrupt_file_is_named(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="bad.parquet"):
        plan_units([str(bad)], unit_rows=10)
