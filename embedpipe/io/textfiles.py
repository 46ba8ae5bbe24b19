"""JSONL and CSV inputs through pyarrow: row-range units found by one scan, read as byte ranges.

Planning reads each file once, front to back, and cuts it every ``input.unit_rows`` records; a
unit is ``(first row, row count, first byte, end byte)``, so the same file always gives the same
units and a worker reads only its unit's bytes (a seek and one read, also on object stores).

A record is a non-blank line (JSONL), or a CSV row: a newline ends it only outside a quoted
field, found by the parity of ``"`` characters so far (RFC 4180 quoting, pyarrow's default
dialect), so quoted fields may hold newlines. Blank lines are skipped, as pyarrow does.

Column types: CSV has none, so ids and texts are read as strings. JSONL ids keep their JSON type
(integer, number, string, bool), taken from the first record of each file; a JSONL text that is
not a string (a number, a list) cannot be parsed as the text column and stops the run naming its unit.
"""

from __future__ import annotations

import json
from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from embedpipe.io import fs
from embedpipe.io.reader import ScreeningReader
from embedpipe.units import InputError, Unit

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".snappy")


def scan_records(f: BinaryIO, *, csv: bool) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte offsets of each record of ``f``, in order."""
    start = pos = 0
    quotes = 0  # `"` seen since the record started; odd: inside a quoted field
    for line in f:
        pos += len(line)
        if csv:
            quotes += line.count(b'"')
            if quotes & 1:
                continue  # a newline inside a quoted field: the record goes on
            quotes = 0
            blank = line in (b"\n", b"\r\n")  # a record that spans lines holds a quote, so is never blank
        else:
            blank = not line.strip()
        if not blank:
            yield start, pos
        start = pos


def plan_text_units(files: list[str], *, fmt: str, text_column: str, id_column: str, unit_rows: int) -> list[Unit]:
    """Cut every file into units of ``unit_rows`` records; checks the columns on the way."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        if file.lower().endswith(COMPRESSED):
            raise InputError(f"{file}: compressed {fmt.upper()} cannot be split into byte ranges: "
                             f"decompress it first (or convert it to Parquet)")
        with fs.open_binary(file) as f:
            head = first_record(f, csv=fmt == "csv")
            if not head:
                continue  # an empty file has no rows
            _check_columns(file, head, fmt=fmt, text_column=text_column, id_column=id_column)
            f.seek(0)
            records = scan_records(f, csv=fmt == "csv")
            if fmt == "csv":
                next(records)  # the header
            units += _cut(records, file=file, file_index=file_index, fmt=fmt, unit_rows=unit_rows)
    return units


def first_record(f: BinaryIO, *, csv: bool) -> bytes:
    """The bytes of the first record (a CSV's header); ``b""`` for a file without one."""
    start, end = next(scan_records(f, csv=csv), (0, 0))
    f.seek(start)
    return f.read(end - start)


def _cut(records: Iterator[tuple[int, int]], *, file: str, file_index: int, fmt: str, unit_rows: int) -> list[Unit]:
    units: list[Unit] = []
    row = count = byte_start = byte_end = 0
    for start, end in records:
        if count == 0:
            byte_start = start
        count += 1
        byte_end = end
        if count == unit_rows:
            units.append(_unit(file, file_index, fmt, row, count, byte_start, byte_end))
            row, count = row + count, 0
    if count:
        units.append(_unit(file, file_index, fmt, row, count, byte_start, byte_end))
    return units


def _unit(file: str, file_index: int, fmt: str, row: int, count: int, start: int, end: int) -> Unit:
    return Unit(f"{file_index:05d}-{row:010d}", file, (), count, format=fmt, row_start=row,
                byte_start=start, byte_end=end)


class TextFileReader(ScreeningReader):
    """JSONL or CSV: one unit's byte range (plus a CSV's header)."""

    def __init__(self, *, fmt: str, text_column: str, id_column: str, on_bad_row: str = "error"):
        super().__init__(text_column=text_column, id_column=id_column, on_bad_row=on_bad_row)
        self.fmt = fmt

    def columns(self, unit: Unit, names: list[str]) -> pa.Table:
        """The unit's rows, these columns only, unscreened."""
        names = list(dict.fromkeys(names))
        with fs.open_binary(unit.file) as f:
            head = first_record(f, csv=self.fmt == "csv")
            f.seek(unit.byte_start)
            data = f.read(unit.byte_end - unit.byte_start)
        try:
            if self.fmt == "csv":
                table = _parse_csv(head + data, columns=names)
            else:
                id_type = _json_type(json.loads(head.decode("utf-8-sig"))[self.id_column], unit.file, self.id_column)
                table = _parse_jsonl(data, fields={n: id_type if n == self.id_column else pa.string() for n in names})
        except (pa.ArrowInvalid, ValueError, KeyError) as exc:
            raise InputError(f"{unit.label}: cannot parse {self.fmt.upper()} ({exc}): fix or remove the bad "
                             f"record, or set input.format to the file's real format") from exc
        if table.num_rows != unit.num_rows:
            raise InputError(f"{unit.label}: read {table.num_rows} rows where planning counted {unit.num_rows}: "
                             f"the file changed while the job ran; run the job again")
        return table


def _parse_csv(data: bytes, *, columns: list[str]) -> pa.Table:
    return pacsv.read_csv(
        pa.BufferReader(data),
        read_options=pacsv.ReadOptions(block_size=max(len(data) + 1, 1 << 20)),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(include_columns=columns,
                                             column_types={c: pa.string() for c in columns}))


def _parse_jsonl(data: bytes, *, fields: dict[str, pa.DataType]) -> pa.Table:
    table = pajson.read_json(
        pa.BufferReader(data),
        read_options=pajson.ReadOptions(block_size=max(len(data) + 1, 1 << 20)),
        parse_options=pajson.ParseOptions(explicit_schema=pa.schema(list(fields.items())),
                                          unexpected_field_behavior="ignore"))
    return table.select(list(fields))


def _json_type(value, file: str, id_column: str) -> pa.DataType:
    for py, arrow in ((bool, pa.bool_()), (int, pa.int64()), (float, pa.float64()), (str, pa.string())):
        if isinstance(value, py):
            return arrow
    raise InputError(f"{file}: the first record's {id_column!r} is {type(value).__name__}, not a string or a "
                     f"number: set input.id_column to a column of scalar ids")


def _check_columns(file: str, head: bytes, *, fmt: str, text_column: str, id_column: str) -> None:
    try:
        if fmt == "csv":
            names = pacsv.read_csv(pa.BufferReader(head)).column_names
        else:
            record = json.loads(head.decode("utf-8-sig"))
            if not isinstance(record, dict):
                raise ValueError(f"the first line is a JSON {type(record).__name__}, not an object")
            names = list(record)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise InputError(f"{file}: cannot read the first {'line' if fmt == 'jsonl' else 'row'} as {fmt.upper()} "
                         f"({exc}): set input.format to the file's real format") from exc
    for column, field in ((text_column, "input.text_column"), (id_column, "input.id_column")):
        if column not in names:
            raise InputError(f"{file}: no column {column!r} (columns: {', '.join(map(str, names))}): "
                             f"set {field} to the right column")
    if fmt == "jsonl":
        _json_type(record[id_column], file, id_column)
