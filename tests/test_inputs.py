"""Input formats without Ray: planning (deterministic units), reading, auto detection, fsspec URLs."""

import json
import os
import shutil

import fsspec
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from embedpipe.config import InputConfig, JobError, load_job
from embedpipe.io import fs
from embedpipe.io.formats import UnitReader, plan_input, resolve_format
from embedpipe.io.textfiles import scan_records
from embedpipe.units import InputError
from tests.conftest import write_job

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TEXTS = ['plain', 'with "quotes", and a comma', 'two\nlines', 'ünïcödé ✓', '', '  spaces  ', 'x' * 300]


def _table(n: int = 23) -> pa.Table:
    return pa.table({"id": [f"doc-{i}" for i in range(n)], "text": [TEXTS[i % len(TEXTS)] + f" #{i}" for i in range(n)],
                     "extra": list(range(n))})


def _read_all(cfg: InputConfig):
    units = plan_input(cfg).units
    reader = UnitReader(text_column=cfg.text_column, id_column=cfg.id_column, on_bad_row=cfg.on_bad_row)
    ids, texts = [], []
    for unit in units:
        rows = reader(unit)
        assert len(rows.texts) == unit.num_rows
        ids += rows.ids.to_pylist()
        texts += rows.texts
    return units, ids, texts


def _write_jsonl(table: pa.Table, path, *, blank_lines: bool = False, trailing_newline: bool = True) -> None:
    lines = [json.dumps(row, ensure_ascii=False) for row in table.to_pylist()]
    sep = "\n\n  \n" if blank_lines else "\n"
    path.write_text(sep.join(lines) + ("\n" if trailing_newline else ""), encoding="utf-8")


def _save_dataset(table: pa.Table, path, **splits):
    datasets = pytest.importorskip("datasets")
    if splits:
        datasets.DatasetDict({k: datasets.Dataset(v) for k, v in splits.items()}).save_to_disk(str(path))
    else:
        datasets.Dataset(table).save_to_disk(str(path), max_shard_size="4KB")  # several arrow shards
    return path


@pytest.mark.parametrize("blank_lines, trailing_newline", [(False, True), (True, False)])
def test_jsonl_units_are_whole_records_in_order(tmp_path, blank_lines, trailing_newline):
    table = _table()
    _write_jsonl(table, tmp_path / "a.jsonl", blank_lines=blank_lines, trailing_newline=trailing_newline)
    _write_jsonl(table.slice(0, 5), tmp_path / "b.jsonl")
    cfg = InputConfig(path=str(tmp_path), unit_rows=10)
    units, ids, texts = _read_all(cfg)
    assert [(u.id, u.row_start, u.num_rows, u.format) for u in units] == [
        ("00000-0000000000", 0, 10, "jsonl"), ("00000-0000000010", 10, 10, "jsonl"),
        ("00000-0000000020", 20, 3, "jsonl"), ("00001-0000000000", 0, 5, "jsonl")]
    assert plan_input(cfg).units == units  # deterministic
    assert ids == table["id"].to_pylist() + table["id"].to_pylist()[:5]
    assert texts == table["text"].to_pylist() + table["text"].to_pylist()[:5]
    data = (tmp_path / "a.jsonl").read_bytes()
    assert not data[units[0].byte_end:units[1].byte_start].strip()  # only blank lines between units
    assert data[units[1].byte_start:].startswith(b'{"id": "doc-10"')


def test_jsonl_ids_keep_their_json_type(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 7, "text": "a"}\n{"id": 8, "text": "b", "meta": {"deep": [1]}}\n{"id": 9, "text": "c", "meta": 3}\n')
    _, ids, texts = _read_all(InputConfig(path=str(path), unit_rows=2))
    assert ids == [7, 8, 9] and texts == ["a", "b", "c"]


def test_csv_rows_with_quoted_newlines_and_a_header(tmp_path):
    table = _table()
    pacsv.write_csv(table, tmp_path / "a.csv")
    units, ids, texts = _read_all(InputConfig(path=str(tmp_path / "a.csv"), unit_rows=4))
    assert [u.num_rows for u in units] == [4, 4, 4, 4, 4, 3] and units[0].byte_start > 0  # the header is no row
    assert ids == table["id"].to_pylist() and texts == table["text"].to_pylist()


def test_csv_ids_are_strings_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('id,text\n1,"a ""quoted""\nvalue"\n\n2,b\r\n3,c')
    units, ids, texts = _read_all(InputConfig(path=str(path), unit_rows=2))
    assert ids == ["1", "2", "3"] and texts == ['a "quoted"\nvalue', "b", "c"]
    assert [u.num_rows for u in units] == [2, 1]


def test_scan_records_matches_pyarrow_on_the_same_bytes(tmp_path):
    data = b'id,text\n1,"x\n\ny"\n2,"""a"",b"\n\n3,z\n'
    spans = list(scan_records(__import__("io").BytesIO(data), csv=True))
    assert len(spans) == 1 + pacsv.read_csv(pa.BufferReader(data)).num_rows
    assert b"".join(data[a:b] for a, b in spans).replace(b"\n\n3", b"\n3") == data.replace(b"\n\n3", b"\n3")


def test_hf_saved_dataset_units_are_row_ranges_of_its_shards(tmp_path):
    table = _table(60)
    path = _save_dataset(table, tmp_path / "saved")
    cfg = InputConfig(path=str(path), unit_rows=8)
    assert resolve_format(cfg) == "huggingface"
    units, ids, texts = _read_all(cfg)
    assert len({u.file for u in units}) > 1, "expected several arrow shards"
    assert all(u.format == "huggingface" and u.num_rows <= 8 for u in units)
    assert ids == table["id"].to_pylist() and texts == table["text"].to_pylist()
    assert plan_input(cfg).units == units


def test_hf_dataset_dict_needs_a_split(tmp_path):
    table = _table(10)
    path = _save_dataset(table, tmp_path / "dd", train=table.slice(0, 6), test=table.slice(6))
    with pytest.raises(InputError, match=r"several splits \(train, test\): set input.split"):
        plan_input(InputConfig(path=str(path)))
    with pytest.raises(InputError, match="no split 'dev'"):
        plan_input(InputConfig(path=str(path), split="dev"))
    _, ids, _ = _read_all(InputConfig(path=str(path), split="test"))
    assert ids == table["id"].to_pylist()[6:]


def test_hf_dataset_from_the_local_cache_by_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    table = _table(60)
    saved = _save_dataset(table, tmp_path / "saved")
    # The cache layout `load_dataset` leaves behind: <cache>/<org>___<name>/<config>/<version>/<hash>/
    cached = tmp_path / "hf-cache" / "testorg___tiny" / "default" / "0.0.0" / "0123abcd"
    cached.mkdir(parents=True)
    shards = sorted(saved.glob("*.arrow"))
    assert len(shards) > 1
    lengths = []
    for i, shard in enumerate(shards):
        shutil.copy(shard, cached / f"tiny-train-{i:05d}-of-{len(shards):05d}.arrow")
        lengths.append(pa.ipc.open_stream(pa.memory_map(str(shard))).read_all().num_rows)
    info = json.loads((saved / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name="tiny",
                version={"version_str": "0.0.0", "major": 0, "minor": 0, "patch": 0},
                splits={"train": {"name": "train", "num_bytes": 0, "num_examples": 60, "dataset_name": "tiny",
                                  "shard_lengths": lengths}})
    (cached / "dataset_info.json").write_text(json.dumps(info))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")

    job = load_job(write_job(tmp_path / "job.yaml", input={"path": "testorg/tiny", "format": "huggingface"},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": "out"}))
    assert job.input.path == "testorg/tiny"  # a dataset name stays a name
    units, ids, texts = _read_all(InputConfig(path="testorg/tiny", format="huggingface", unit_rows=7))
    assert ids == table["id"].to_pylist() and texts == table["text"].to_pylist()
    assert units[0].file.startswith(str(cached))
    with pytest.raises(InputError, match="not whole arrow shards"):
        plan_input(InputConfig(path="testorg/tiny", format="huggingface", split="train[:5]"))
    with pytest.raises(InputError, match="neither a saved dataset folder nor a dataset in the local"):
        plan_input(InputConfig(path="testorg/absent", format="huggingface"))


def test_auto_format_by_extension_and_its_errors(tmp_path):
    pq.write_table(_table(3), tmp_path / "a.parquet")
    pacsv.write_csv(_table(3), tmp_path / "b.csv")
    (tmp_path / "notes.txt").write_text("x")
    assert resolve_format(InputConfig(path=str(tmp_path / "a.parquet"))) == "parquet"
    assert resolve_format(InputConfig(path=str(tmp_path / "*.csv"))) == "csv"
    with pytest.raises(InputError, match="cannot tell the format .*parquet: a.parquet; csv: b.csv.*set input.format"):
        resolve_format(InputConfig(path=str(tmp_path)))
    with pytest.raises(InputError, match="unknown: notes.txt"):
        resolve_format(InputConfig(path=str(tmp_path / "*.txt")))
    assert resolve_format(InputConfig(path=str(tmp_path / "*.txt"), format="csv")) == "csv"  # explicit wins


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "huggingface"])
def test_a_missing_column_names_the_file_and_the_field(tmp_path, fmt):
    table = _table(5)
    path = {"parquet": tmp_path / "a.parquet", "jsonl": tmp_path / "a.jsonl", "csv": tmp_path / "a.csv",
            "huggingface": tmp_path / "hf"}[fmt]
    {"parquet": lambda: pq.write_table(table, path), "jsonl": lambda: _write_jsonl(table, path),
     "csv": lambda: pacsv.write_csv(table, path), "huggingface": lambda: _save_dataset(table, path)}[fmt]()
    with pytest.raises(InputError, match=r"no column 'body' .*set input.text_column"):
        plan_input(InputConfig(path=str(path), text_column="body"))


def test_compressed_text_files_are_refused(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(InputError, match="compressed JSONL cannot be split"):
        plan_input(InputConfig(path=str(tmp_path / "a.jsonl.gz"), format="jsonl"))


def test_every_format_reads_from_a_memory_url(tmp_path):
    mem = fsspec.filesystem("memory")
    table = _table(20)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)
    _write_jsonl(table, tmp_path / "a.jsonl")
    pacsv.write_csv(table, tmp_path / "a.csv")
    _save_dataset(table, tmp_path / "hf")
    root = f"/embedpipe-test-{os.getpid()}"
    for name in ("a.parquet", "a.jsonl", "a.csv"):
        mem.put(str(tmp_path / name), f"{root}/{name.split('.')[1]}/{name}")
    mem.put(str(tmp_path / "hf"), f"{root}/hf", recursive=True)
    try:
        for fmt in ("parquet", "jsonl", "csv", "hf"):
            units, ids, texts = _read_all(InputConfig(path=f"memory://{root}/{fmt}", unit_rows=5))
            assert ids == table["id"].to_pylist() and texts == table["text"].to_pylist(), fmt
            assert all(u.file.startswith("memory://") for u in units)
        stamp = fs.stamp(f"memory://{root}/csv/a.csv")  # what the manifest's fingerprint records
        assert stamp["path"] == f"memory://{root}/csv/a.csv" and stamp["size"] == (tmp_path / "a.csv").stat().st_size
    finally:
        mem.rm(root, recursive=True)


def test_job_schema_accepts_formats_urls_and_dataset_names(tmp_path):
    model = {"path": "sentence-transformers/all-MiniLM-L6-v2"}
    job = load_job(write_job(tmp_path / "a.yaml", input={"path": "s3://bucket/corpus/*.jsonl"}, model=model,
                             output={"path": "out"}))
    assert job.input.path == "s3://bucket/corpus/*.jsonl" and job.input.format == "auto" and job.input.split is None
    out = load_job(write_job(tmp_path / "a.yaml", input={"path": "s3://b/x"}, model=model, output={"path": "gs://bucket/out"}))
    assert out.output.path == "gs://bucket/out"  # object-store outputs: same layout, same guarantees
    (tmp_path / "data").mkdir()
    job = load_job(write_job(tmp_path / "b.yaml", input={"path": "data/*.csv", "format": "csv"}, model=model,
                             output={"path": "out"}))
    assert job.input.path == str(tmp_path / "data" / "*.csv")  # a relative glob resolves against the job file
    with pytest.raises(JobError, match="input.format: 'tsv' is not one of auto, parquet, jsonl, csv, huggingface"):
        load_job(write_job(tmp_path / "c.yaml", input={"path": "data", "format": "tsv"}, model=model,
                           output={"path": "out"}))
    with pytest.raises(JobError, match="does not exist.*input.format: huggingface"):
        load_job(write_job(tmp_path / "d.yaml", input={"path": "imdb"}, model=model, output={"path": "out"}))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "huggingface"])
def test_bad_rows_and_duplicate_ids_follow_the_job_policies_in_every_format(tmp_path, fmt):
    from embedpipe.preflight import preflight

    table = pa.table({"id": ["a", "b", "c", "b", "d"], "text": ["one", None, "three", "again", "   "]})
    path = {"jsonl": tmp_path / "a.jsonl", "csv": tmp_path / "a.csv", "huggingface": tmp_path / "hf"}[fmt]
    {"jsonl": lambda: _write_jsonl(table, path), "csv": lambda: pacsv.write_csv(table, path),
     "huggingface": lambda: _save_dataset(table, path)}[fmt]()
    sections = dict(model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "o")})

    job = load_job(write_job(tmp_path / "j.yaml", input={"path": str(path), "unit_rows": 2}, **sections))
    with pytest.raises(InputError, match=r"1 rows repeat an id seen earlier, e.g. 'b'"):
        preflight(job)

    job = job.replace(input={"on_duplicate_id": "keep_first", "on_bad_row": "skip"})
    plan = preflight(job)
    assert plan.duplicate_rows == 1 and [u.drop_rows for u in plan.units] == [(), (1,), ()]
    reader = UnitReader(text_column="text", id_column="id", on_bad_row="skip")
    rows = [reader(u) for u in plan.units]
    assert sum((r.ids.to_pylist() for r in rows), []) == ["a", "c"]
    skipped = pa.concat_tables([r.skipped for r in rows]).to_pylist()
    # CSV has no nulls: an empty field is the empty string
    assert skipped == [{"id": "b", "reason": "empty" if fmt == "csv" else "null"},
                       {"id": "b", "reason": "duplicate_id"}, {"id": "d", "reason": "empty"}]
