"""JSONL and CSV inputs through pyarrow: row-range units found by one scan, read as byte ranges.

Planning reads each file once, front to back, and cuts it every ``input.unit_rows`` records; a
unit is ``(first row, row count, first byte, end byte)``, so the same file always gives the same
units and a worker reads only its unit's bytes (a seek and one read, also on object stores).

A JSONL record is a non-blank line. A CSV record ends where pyarrow's default dialect (RFC 4180,
``newlines_in_values``) ends it: a ``"`` opens a quoted field only at the start of a field (a
``"`` inside an unquoted field, as in ``1,a 27" monitor``, is text), ``""`` inside a quoted
field is one quote, and a newline (``\n``, ``\r\n`` or ``\r``) outside a quoted field ends the
record. Blank lines are skipped, as pyarrow does. The planner refuses, naming the line, what the
parser would read as fewer rows than the file holds: a quoted field that never closes (pyarrow
would swallow the rest of the file into it), and a record whose field count differs from the
header's. A stray opening quote that a later quote happens to close, with the right field
count, reads as one value holding newlines, as RFC 4180 says.

Column types: CSV has none, so ids and texts are read as strings. JSONL ids keep their JSON type
(integer, number, string, bool), taken from the first record of each file; a JSONL text that is
not a string (a number, a list, an object) is a ``not_text`` bad row (``input.on_bad_row``).
"""

from __future__ import annotations

import codecs
import json
import re
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from embedpipe.io import fs
from embedpipe.io.reader import ScreeningReader
from embedpipe.units import InputError, Unit

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".snappy")
BLOCK = 1 << 20  # bytes read at a time while scanning
MAX_RECORD = 64 << 20  # a CSV record longer than this is an unclosed quote, not a text

# pyarrow's default CSV dialect as regular expressions, one match a record. A quoted field: `"`, then
# characters or `""` pairs, then a `"` not followed by another (so the match is unique, whatever the
# backtracking), then unquoted text up to the next delimiter, where a `"` is a literal character.
_QUOTED = rb'"[^"]*(?:""[^"]*)*"(?!")'
_FIELD = rb'(?:%s[^,\r\n]*|[^",\r\n][^,\r\n]*|)' % _QUOTED
_END = rb"(?:\r\n|\n|\r)"
_RECORD = re.compile(rb"%s(?:,%s)*%s" % (_FIELD, _FIELD, _END))  # any number of fields
_LAST = re.compile(rb"%s(?:,%s)*\Z" % (_FIELD, _FIELD))  # the file's last record, without a line end
_BLANK = re.compile(rb"[\r\n]+")  # empty lines, skipped as pyarrow skips them
_QUOTED_FIELD = re.compile(rb'(?:^|(?<=,))%s' % _QUOTED)  # a quoted field at a field start, for counting


def _record_of(fields: int) -> re.Pattern:
    """A record of exactly ``fields`` fields: the fast match once the header's count is known."""
    return re.compile(rb"%s(?:,%s){%d}%s" % (_FIELD, _FIELD, fields - 1, _END))


class Record(NamedTuple):
    start: int  # its bytes are [start, end) of the file
    end: int
    line: int  # the 1-based line it starts on
    fields: int  # CSV: the fields pyarrow will find in it; JSONL: 1


def scan_records(f: BinaryIO, *, csv: bool, name: str = "input") -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte offsets of each record of ``f``, in order (``name``: for errors)."""
    for record in _records(f, fmt="csv" if csv else "jsonl", name=name):
        yield record.start, record.end


def _jsonl_records(f: BinaryIO) -> Iterator[Record]:
    pos = 0
    for number, line in enumerate(f, 1):
        if line.strip():
            yield Record(pos, pos + len(line), number, 1)
        pos += len(line)


def csv_records(f: BinaryIO, *, name: str) -> Iterator[Record]:
    """Each CSV record of ``f`` as pyarrow's parser cuts it; an unclosed quoted field is an error."""
    buf, base, pos, line, eof = b"", 0, 0, 1, False  # buf: the file's bytes [base, base + len(buf))
    usual, width = None, 0  # once the header is read: the match of a record of its field count, and that count
    while True:
        blank = _BLANK.match(buf, pos)
        start = blank.end() if blank else pos
        if start < len(buf) or eof:  # a record starts at `start` (a `\r` at the end may be half a `\r\n`)
            if blank:
                line += _line_ends(buf, pos, start)
                pos = start
            m = usual.match(buf, pos) if usual is not None else None
            fields = width if m is not None else 0
            if m is None:
                m = _RECORD.match(buf, pos)
            if m is not None and (m.end() < len(buf) or eof):
                end = m.end()
                fields = fields or _fields(buf[pos:end])
                yield Record(base + pos, base + end, line, fields)
                if usual is None:
                    usual, width = _record_of(fields), fields
                line += _line_ends(buf, pos, end)
                pos = end
                continue
            if eof:
                if pos < len(buf):
                    if _LAST.match(buf, pos) is None:
                        raise _unclosed(name, line)
                    yield Record(base + pos, base + len(buf), line, _fields(buf[pos:]))
                return
        if len(buf) - pos > MAX_RECORD:
            raise _unclosed(name, line)
        more = f.read(max(BLOCK, len(buf) - pos))  # doubles while one record outgrows the buffer
        buf, base, pos, eof = buf[pos:] + more, base + pos, 0, not more


def _fields(record: bytes) -> int:
    if b'"' in record:
        record = _QUOTED_FIELD.sub(b"", record)  # the commas left are the delimiters
    return record.count(b",") + 1


def _line_ends(buf: bytes, start: int, end: int) -> int:
    """Line ends (``\n``, ``\r\n`` or ``\r``) in ``buf[start:end]``."""
    n = buf.count(b"\n", start, end)
    if buf.find(b"\r", start, end) >= 0:
        n += buf.count(b"\r", start, end) - buf.count(b"\r\n", start, end)
    return n


def _unclosed(name: str, line: int) -> InputError:
    return InputError(f"{name}: line {line}: a quoted field opens and never closes (a stray \" at the start of a "
                      f"field?), so the rest of the file would read as one value: close the quote, write a quote "
                      f"inside a quoted field as \"\", or remove it")


def plan_text_units(files: list[str], *, fmt: str, text_column: str, id_column: str, unit_rows: int) -> list[Unit]:
    """Cut every file into units of ``unit_rows`` records; checks the columns on the way."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        if file.lower().endswith(COMPRESSED):
            raise InputError(f"{file}: compressed {fmt.upper()} cannot be split into byte ranges: "
                             f"decompress it first (or convert it to Parquet)")
        with fs.open_binary(file) as f:
            records = _records(f, fmt=fmt, name=file)
            head = next(records, None)
            if head is None:
                continue  # an empty file has no rows
            f.seek(head.start)
            _check_columns(file, f.read(head.end - head.start), fmt=fmt, text_column=text_column, id_column=id_column)
            f.seek(0)
            records = _records(f, fmt=fmt, name=file)  # a fresh scan from the top
            if fmt == "csv":
                next(records)  # the header
            units += _cut(_same_fields(records, file=file, fields=head.fields), file=file, file_index=file_index,
                          fmt=fmt, unit_rows=unit_rows)
    return units


def first_record(f: BinaryIO, *, fmt: str, name: str) -> bytes:
    """The bytes of the first record (a CSV's header); ``b""`` for a file without one."""
    head = next(_records(f, fmt=fmt, name=name), None)
    if head is None:
        return b""
    f.seek(head.start)
    return f.read(head.end - head.start)


def _records(f: BinaryIO, *, fmt: str, name: str) -> Iterator[Record]:
    return csv_records(f, name=name) if fmt == "csv" else _jsonl_records(f)


def _same_fields(records: Iterator[Record], *, file: str, fields: int) -> Iterator[Record]:
    """The records, each checked to have the header's field count (pyarrow refuses any other)."""
    for record in records:
        if record.fields != fields:
            raise InputError(f"{file}: line {record.line} has {record.fields} fields where the header has {fields} "
                             f"(a stray quote, or a comma in an unquoted field?): quote a field that holds commas, "
                             f"quotes or line ends (\"a, b\"), write a quote inside it as \"\"")
        yield record


def _cut(records: Iterator[Record], *, file: str, file_index: int, fmt: str, unit_rows: int) -> list[Unit]:
    units: list[Unit] = []
    row = count = byte_start = byte_end = 0
    for record in records:
        if count == 0:
            byte_start = record.start
        count += 1
        byte_end = record.end
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

    def read(self, unit: Unit, names: list[str]) -> pa.Table:
        with fs.open_binary(unit.file) as f:
            head = first_record(f, fmt=self.fmt, name=unit.file)
            f.seek(unit.byte_start)
            data = f.read(unit.byte_end - unit.byte_start)
        try:
            if self.fmt == "csv":
                return _parse_csv(head + data, columns=names)
            id_type = _json_type(json.loads(head.decode("utf-8-sig")).get(self.id_column), unit.file, self.id_column)
            fields = {n: id_type if n == self.id_column else pa.string() for n in names}
            try:
                return _parse_jsonl(data, fields=fields)
            except pa.ArrowInvalid:  # a value of another type, such as a text that is a number
                return _parse_jsonl_rows(data, fields=fields)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, KeyError) as exc:
            raise InputError(f"{unit.label}: cannot parse {self.fmt.upper()} ({exc}): fix or remove the bad "
                             f"record, or set input.format to the file's real format") from exc


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


def _parse_jsonl_rows(data: bytes, *, fields: dict[str, pa.DataType]) -> pa.Table:
    """The slow path, one ``json.loads`` a record, for units whose values pyarrow cannot convert.

    A string field (the text) may then hold other JSON values: it becomes a union of the strings
    and a null-typed member for the rest, which screening counts as ``not_text``."""
    data = data.removeprefix(codecs.BOM_UTF8)  # the first unit of a file may start with one
    records = [json.loads(line) for line in data.split(b"\n") if line.strip()]
    if any(not isinstance(r, dict) for r in records):
        raise ValueError("a record is not a JSON object")
    return pa.table({name: _text_or_other([r.get(name) for r in records]) if pa.types.is_string(tp)
                     else pa.array([r.get(name) for r in records], tp) for name, tp in fields.items()})


def _text_or_other(values: list) -> pa.Array:
    """Strings (and nulls) as a string member; any other JSON value as a null-typed member."""
    text = np.array([v is None or isinstance(v, str) for v in values], dtype=bool)  # [N]
    offsets = np.where(text, np.cumsum(text) - 1, np.cumsum(~text) - 1)  # [N] each row's place in its member
    return pa.UnionArray.from_dense(pa.array((~text).astype(np.int8)), pa.array(offsets.astype(np.int32)),
                                    [pa.array([v for v, t in zip(values, text) if t], pa.string()),
                                     pa.nulls(int((~text).sum()))], ["text", "other"])


def _json_type(value, file: str, id_column: str) -> pa.DataType:
    if value is None:
        raise InputError(f"{file}: the first record's {id_column!r} is null or missing, and each file's first "
                         f"record gives its ids' type: give that record an id, or move a record with an id first")
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
