"""Balanced work units: every worker gets its share of a small corpus, unit_rows is an upper bound, and a
record of another cut is never reused (each row is written once)."""

import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import InputConfig
from embedpipe.io.formats import UnitReader, plan_input
from embedpipe.io.manifest import covers
from embedpipe.units import MIN_UNIT_ROWS, Unit, plan_units
from tests.conftest import write_job


def _table(n: int) -> pa.Table:
    return pa.table({"id": list(range(n)), "text": [f"row {i}" for i in range(n)]})


def _read_ids(units) -> list:
    reader = UnitReader(text_column="text", id_column="id")
    return [i for u in units for i in reader(u).ids.to_pylist()]


def test_one_large_row_group_is_cut_into_row_ranges_for_two_workers(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(_table(3000), path, row_group_size=3000)  # one row group
    units = plan_units([str(path)], unit_rows=10_000, workers=2)
    assert len(units) >= 8 and max(u.num_rows for u in units) - min(u.num_rows for u in units) <= 1
    assert all(u.row_groups == (0,) and u.in_row_group for u in units)
    assert [u.id for u in units] == sorted(u.id for u in units) and len({u.id for u in units}) == len(units)
    assert _read_ids(units) == list(range(3000))  # every row once, in order
    assert plan_units([str(path)], unit_rows=10_000, workers=2) == units  # deterministic


def test_unit_rows_is_an_upper_bound_and_whole_row_groups_keep_their_ids(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(_table(5600), path, row_group_size=2500)  # row groups of 2500, 2500 and 600
    units = plan_units([str(path)], unit_rows=1000, workers=1)  # one worker: cut by unit_rows alone
    assert max(u.num_rows for u in units) <= 1000
    assert [u.id for u in units] == ["00000-00000-0000000000", "00000-00000-0000000833", "00000-00000-0000001666",
                                     "00000-00001-0000000000", "00000-00001-0000000833", "00000-00001-0000001666",
                                     "00000-00002"]
    assert _read_ids(units) == list(range(5600))


def test_a_tiny_corpus_is_not_cut_below_the_floor(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(_table(300), path)
    assert [u.num_rows for u in plan_units([str(path)], unit_rows=10_000, workers=2)] == [150, 150]
    assert [u.num_rows for u in plan_units([str(path)], unit_rows=10_000, workers=1)] == [300]
    assert MIN_UNIT_ROWS <= 300


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "huggingface"])
def test_row_range_formats_are_balanced_too(tmp_path, fmt):
    table = _table(3000)
    if fmt == "jsonl":
        path = tmp_path / "a.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    elif fmt == "csv":
        path = tmp_path / "a.csv"
        pacsv.write_csv(table, path)
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "saved"
        datasets.Dataset(table).save_to_disk(str(path))
    units = plan_input(InputConfig(path=str(path)), workers=2).units
    assert len(units) >= 8 and max(u.num_rows for u in units) <= 375
    ids = _read_ids(units)
    assert [int(i) for i in ids] == list(range(3000))


def test_a_record_of_another_cut_does_not_cover_a_unit(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(_table(3000), path, row_group_size=3000)
    for_two = plan_units([str(path)], unit_rows=10_000, workers=2)  # 8 units of 375
    for_three = plan_units([str(path)], unit_rows=10_000, workers=3)  # 12 units of 250
    assert for_three[0].id == for_two[0].id  # the same id, other rows
    record = {"unit_id": for_three[0].id, "row_groups": [0], "row_start": 0, "num_rows": for_three[0].num_rows}
    assert covers(record, for_three[0]) and not covers(record, for_two[0])
    legacy = {"unit_id": "00000-00000", "row_groups": [0], "counters": {"rows": 2990, "skipped_rows": 10}}
    whole = Unit("00000-00000", str(path), (0,), 3000)  # how embedpipe cut this file before
    assert covers(legacy, whole) and not covers(legacy, for_two[0])


# --------------------------------------------------------------------------- end to end on the session Ray

@pytest.mark.slow
def test_two_workers_share_a_3000_row_single_file_job(tmp_path, quickstart_table, ray_session, minilm_dir):
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(quickstart_table.select(["id", "text"]), corpus, row_group_size=3000)  # one file, one row group
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus)},  # the default unit_rows (10,000)
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "max_seq_len": 16},
                    batching={"max_tokens": 4096}, output={"path": str(tmp_path / "out")},
                    cluster={"workers": 2, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["units"]["total"] >= 8
    rows = [w["rows"] for w in report["per_worker"]]
    assert len(rows) == 2 and sum(rows) == 3000 and min(rows) > 0
    # units of even size, and every worker has work to the end whenever it started (one started later under load
    # takes fewer units: 5 and 3 were seen): when the first worker runs out of units, the other holds two at most,
    # the one it encodes and the one held behind it, so it finishes within those two units' time
    spans = sorted((w["timeline"] for w in report["per_worker"]), key=lambda s: s[-1][1])  # [start, end, rows, ...]
    sizes = [size for s in spans for _, _, size, *_ in s]
    assert all(len(s) >= 2 for s in spans) and max(sizes) <= 2 * min(sizes), spans
    first_out, last = spans[0][-1][1], spans[1]
    assert last[-1][1] - first_out <= sum(end - start for start, end, *_ in last[-2:]) + 0.5, spans  # + round trips
    ids = ds.dataset(tmp_path / "out" / "vectors", format="parquet").to_table()["id"].to_pylist()
    assert sorted(ids) == sorted(quickstart_table["id"].to_pylist())  # every row once
