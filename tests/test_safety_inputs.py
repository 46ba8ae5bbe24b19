"""Input data safety: no row is silently lost, no id is silently wrong.

CSV records are cut where pyarrow's parser cuts them (a mid-field quote is text, an unclosed quote
or a wrong field count is an error naming the line); a unit reads exactly the rows planning
counted; null ids are bad rows and never hide duplicates; one id type across the input;
dictionary and large text columns are text; a JSONL text that is no string is a bad row.
"""

import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import InputConfig, parse_job
from embedpipe.io.formats import UnitReader, plan_input
from embedpipe.io.rows import screen_rows
from embedpipe.io import textfiles
from embedpipe.preflight import preflight
from embedpipe.units import InputError
from tests.conftest import assert_same_vectors, run_cli_job, write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _read_all(cfg: InputConfig):
    reader = UnitReader(text_column=cfg.text_column, id_column=cfg.id_column, on_bad_row=cfg.on_bad_row)
    rows = [reader(unit) for unit in plan_input(cfg).units]
    return (sum((r.ids.to_pylist() for r in rows), []), sum((r.texts for r in rows), []),
            sum((r.skipped.to_pylist() for r in rows), []))


def _job(tmp_path, path, **input):
    return parse_job({"input": {"path": str(path), **input}, "model": {"path": MODEL},
                      "output": {"path": str(tmp_path / "out")}})


# --------------------------------------------------------------------------- 1. CSV records and row counts

def test_csv_quote_inside_an_unquoted_field_is_text(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(b'id,text\n1,a 27" monitor\n2,b\n3,"quoted, with comma"\n')
    ids, texts, _ = _read_all(InputConfig(path=str(path), unit_rows=2))
    assert ids == ["1", "2", "3"] and texts == ['a 27" monitor', "b", "quoted, with comma"]


def test_csv_unclosed_quote_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(b'id,text\n1,ok\n2,"27 monitor\n3,b\n4,c\n')  # pyarrow reads 2 rows of these 4 lines
    assert pacsv.read_csv(str(path)).num_rows == 2
    with pytest.raises(InputError, match=r"a\.csv: line 3: a quoted field opens and never closes"):
        plan_input(InputConfig(path=str(path)))


def test_csv_record_with_more_fields_than_the_header_names_the_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(b'id,text\n1,a\n2,"b"c,d\n')
    with pytest.raises(InputError, match=r"a\.csv: line 3 has 3 fields where the header has 2"):
        plan_input(InputConfig(path=str(path)))


@pytest.mark.parametrize("bad, message", [(b'x,"never closed', "a quoted field opens and never closes"),
                                          (b"x,y,z", "has 3 fields where the header has 2")])
def test_csv_errors_deep_in_a_file_name_the_right_line(tmp_path, bad, message):
    before = [b'%d,"two\r\nlines"' % i if i % 7 == 0 else b"%d,text %d" % (i, i) for i in range(500)]
    after = [b"%d,text %d" % (i, i) for i in range(500, 600)]  # no quote that would close a stray one
    path = tmp_path / "a.csv"
    path.write_bytes(b"id,text\r\n" + b"\r\n".join(before + [bad] + after) + b"\r\n")
    line = 1 + 500 + len(range(0, 500, 7)) + 1  # the header, 500 rows, one more line in every 7th
    with pytest.raises(InputError, match=rf"a\.csv: line {line}: {message}|a\.csv: line {line} {message}"):
        plan_input(InputConfig(path=str(path), unit_rows=1000))


def _random_csv(rng: random.Random) -> bytes:
    """Rows of two fields made of pieces that quote, escape, break lines, or stray."""
    pieces = [b"a b", b"", b'x"y', b'"q, ""r""\nz"', b'"s"t', b'""', b"\r", b'"', b",", b"\r\n", b"\n"]
    field = lambda: b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 2)))  # noqa: E731
    rows = [field() + b"," + field() for _ in range(rng.randint(1, 12))]
    return b"h1,h2\n" + rng.choice([b"\n", b"\r\n", b"\r"]).join(rows) + rng.choice([b"", b"\n"])


@pytest.mark.parametrize("block, chunk", [(1 << 20, 256), (3, 2)])  # 3 bytes: records cut across reads
def test_csv_record_boundaries_agree_with_pyarrow(monkeypatch, block, chunk):
    """On random bytes full of quotes, commas and line ends: every file the planner accepts, pyarrow
    parses into as many rows, and each record's bytes, and each span of records cut at once, parse
    alone (after the header) to the same rows."""
    monkeypatch.setattr(textfiles, "BLOCK", block)
    monkeypatch.setattr(textfiles, "CHUNK", chunk)
    options = dict(parse_options=pacsv.ParseOptions(newlines_in_values=True),
                   convert_options=pacsv.ConvertOptions(column_types={"h1": pa.string(), "h2": pa.string()}))
    rng, accepted, bulk = random.Random(1234), 0, 0
    for _ in range(3000):
        data = _random_csv(rng)
        try:
            cuts = [_spans(data, 1), _spans(data, rng.randint(2, 5))]
        except InputError:
            continue  # an unclosed quote or a wrong field count: refused, naming the line
        accepted += 1
        whole = pacsv.read_csv(pa.BufferReader(data), **options).to_pylist()
        head = data[:data.index(b"\n") + 1]
        for spans in cuts:
            row = 0
            for start, end, rows in spans:
                got = pacsv.read_csv(pa.BufferReader(head + data[start:end]), **options).to_pylist()
                assert start >= len(head) and got == whole[row:row + rows], data
                row += rows
                bulk += rows > 1
            assert row == len(whole), data
    assert accepted > 200 and bulk > 100


def _spans(data: bytes, n: int) -> list[tuple[int, int, int]]:
    scanner = textfiles.CsvScanner(io.BytesIO(data), name="r.csv")
    scanner.take(1)  # the header
    spans = []
    while (span := scanner.take(n)) is not None:
        spans.append((span.start, span.end, span.rows))
    return spans


def test_a_unit_that_reads_other_rows_than_planned_fails(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["a", "b", "c"]}), path)
    units = plan_input(InputConfig(path=str(path))).units
    pq.write_table(pa.table({"id": [1, 2, 3, 4, 5], "text": list("abcde")}), path)  # rewritten after planning
    reader = UnitReader(text_column="text", id_column="id")
    with pytest.raises(InputError, match=r"a\.parquet.*read 5 rows where planning counted 3"):
        reader(units[0])


# --------------------------------------------------------------------------- 2. null ids

def test_duplicates_are_found_next_to_a_null_id(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3, 2, 3, None], "text": list("abcdef")}), path, row_group_size=3)
    job = _job(tmp_path, path, unit_rows=3, on_bad_row="skip")  # two units: [1, 2, 3] and [2, 3, None]
    with pytest.raises(InputError, match=r"2 rows repeat an id seen earlier, e\.g\. 2 .*, 3 "):
        preflight(job)
    plan = preflight(job.replace(input={"on_duplicate_id": "keep_first"}))
    assert [u.drop_rows for u in plan.units] == [(), (0, 1)] and plan.duplicate_rows == 2


def test_null_ids_are_not_duplicates_of_each_other(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["a", None, "b", None], "text": list("wxyz")}), path)
    assert preflight(_job(tmp_path, path, on_bad_row="skip")).duplicate_rows == 0


@pytest.mark.parametrize("policy", ["error", "skip", "embed_empty"])
def test_a_null_id_is_a_bad_row(tmp_path, policy):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1, 2, None, 4], "text": ["a", "b", "c", "d"]}), path, row_group_size=2)
    job = _job(tmp_path, path, unit_rows=2, on_bad_row=policy)
    if policy == "error":
        with pytest.raises(InputError, match=r"a\.parquet: row 2 has a null id.*input.on_bad_row"):
            preflight(job)
        return
    preflight(job)
    ids, texts, skipped = _read_all(job.input)
    assert ids == [1, 2, 4] and texts == ["a", "b", "d"]  # a vector without an id is never written
    assert skipped == [{"id": None, "reason": "null_id"}]


def test_screen_rows_names_a_null_id_row_under_error():
    with pytest.raises(InputError, match=r"f\.parquet: row 11 has a null id: give"):
        screen_rows(pa.array(["a", None]), pa.array(["x", "y"]), policy="error", drop=np.zeros(2, bool),
                    where="f.parquet", row_start=10)


# --------------------------------------------------------------------------- 3. one id type

def test_int_and_string_ids_across_files_fail_naming_both(tmp_path, monkeypatch):
    import embedpipe.cluster.driver as driver

    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("Ray was started for a bad input"))
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), tmp_path / "data" / "a.parquet")
    pq.write_table(pa.table({"id": ["x", "y"], "text": ["c", "d"]}), tmp_path / "data" / "b.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "data")}, model={"path": MODEL},
                    output={"path": str(tmp_path / "out")})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 3, result.output
    line = " ".join(result.output.split())  # the console may wrap the one line
    assert "a.parquet" in line and "int64" in line and "b.parquet" in line and "string" in line
    assert "cast the ids to one type" in line


def test_int_widths_are_two_types(tmp_path):
    pq.write_table(pa.table({"id": pa.array([1], pa.int32()), "text": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([2], pa.int64()), "text": ["b"]}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"a\.parquet.*int32.*b\.parquet.*int64"):
        preflight(_job(tmp_path, tmp_path / "*.parquet"))


# --------------------------------------------------------------------------- 4. text column types

TEXT_COLUMNS = {
    "dictionary": lambda texts: pa.array(texts).dictionary_encode(),
    "large_string": lambda texts: pa.array(texts, pa.large_string()),
}


@pytest.mark.parametrize("kind", list(TEXT_COLUMNS))
def test_dictionary_and_large_text_columns_are_text(tmp_path, kind):
    texts = ["first text", "second", "first text", None]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "text": TEXT_COLUMNS[kind](texts)}), path)
    assert not pa.types.is_string(pq.read_schema(path).field("text").type)  # read back as written
    with pytest.raises(InputError, match=r"id 4 has a bad text \(null\)"):  # accepted at planning, screened per row
        _read_all(InputConfig(path=str(path)))
    ids, got, skipped = _read_all(InputConfig(path=str(path), on_bad_row="skip"))
    assert ids == [1, 2, 3] and got == texts[:3] and skipped == [{"id": 4, "reason": "null"}]


def test_string_view_text_is_text():
    if not hasattr(pa, "string_view"):
        pytest.skip("this pyarrow has no string_view")
    out = screen_rows(pa.array([1, 2]), pa.array(["a", " "], pa.string_view()), policy="skip",
                      drop=np.zeros(2, bool), where="f")
    assert out.texts == ["a"] and out.skipped.to_pylist() == [{"id": 2, "reason": "empty"}]


# --------------------------------------------------------------------------- 5. JSONL values that are not text

@pytest.mark.parametrize("policy, want_ids, want_texts, want_skipped", [
    ("skip", [1, 4], ["a", "d"], [{"id": 2, "reason": "not_text"}, {"id": 3, "reason": "not_text"}]),
    ("embed_empty", [1, 2, 3, 4], ["a", "", "", "d"], []),
])
def test_jsonl_text_that_is_no_string_is_a_bad_row(tmp_path, policy, want_ids, want_texts, want_skipped):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": 5}\n{"id": 3, "text": ["x"]}\n{"id": 4, "text": "d"}\n')
    assert _read_all(InputConfig(path=str(path), on_bad_row=policy)) == (want_ids, want_texts, want_skipped)
    with pytest.raises(InputError, match=r"id 2 has a bad text \(not_text\)"):
        _read_all(InputConfig(path=str(path)))


def test_jsonl_id_of_another_type_is_a_parse_error_naming_the_unit(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": 2, "text": 3}\n')
    with pytest.raises(InputError, match=r"unit 00000-0000000000 \(.*a\.jsonl, rows 0\.\.1\): cannot parse JSONL"):
        _read_all(InputConfig(path=str(path), on_bad_row="skip"))


# --------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_text_types_and_null_ids_through_the_cli(tmp_path, ray_session):
    """One run: the same texts as string, dictionary and large_string files give the same vectors; each
    file's null-id row gets no vector and is counted and listed as null_id."""
    texts = ['a 27" monitor', "kernel memory barriers", "the quick brown fox", "a gloss of a word"]
    data = tmp_path / "data"
    data.mkdir()
    for i, make in enumerate([lambda t: pa.array(t), *TEXT_COLUMNS.values()]):
        ids = [f"{i}-{j}" for j in range(len(texts))]
        pq.write_table(pa.table({"id": ids + [None], "text": make(texts + ["orphan"])}), data / f"{i}.parquet")
    got = run_cli_job(tmp_path, input={"path": str(data), "on_bad_row": "skip"})
    assert sorted(got) == sorted(f"{i}-{j}" for i in range(3) for j in range(len(texts)))
    for i in (1, 2):
        assert_same_vectors([got[f"{i}-{j}"] for j in range(4)], [got[f"0-{j}"] for j in range(4)])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rows"] == 12 and report["skipped_rows"] == 3 and report["bad_rows"] == {"null_id": 3}
    skipped = pq.read_table(tmp_path / "out" / "skipped.parquet").to_pylist()
    assert skipped == [{"id": None, "reason": "null_id"}] * 3
