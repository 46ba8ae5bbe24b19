"""JSONL and CSV inputs through pyarrow: row-range units found by one scan, read as byte ranges.

Planning reads each file once, front to back, and cuts it every ``input.unit_rows`` records (a small
corpus twice, at the smaller size that gives every worker its units: ``embedpipe/units.py``); a
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
import functools
import json
import re
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from embedpipe.io import fs
from embedpipe.io.reader import ScreeningReader
from embedpipe.units import InputError, Unit, unit_size

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".snappy")
BLOCK = 1 << 20  # bytes read at a time while scanning
MAX_RECORD = 64 << 20  # a CSV record longer than this is an unclosed quote, not a text
CHUNK = 256  # CSV records cut by one match, at most

# pyarrow's default CSV dialect as regular expressions, one match a record. A quoted field: `"`, then
# characters or `""` pairs, then a `"` not followed by another (so the match is unique, whatever the
# backtracking), then unquoted text up to the next delimiter, where a `"` is a literal character.
_QUOTED = rb'"[^"]*(?:""[^"]*)*"(?!")'
_FIELD = rb'(?:%s[^,\r\n]*|[^",\r\n][^,\r\n]*|)' % _QUOTED
_END = rb"(?:\r\n|\n|\r(?!\n))"  # unambiguous: a failing match never retries a `\r\n` as two ends
_RECORD = re.compile(rb"%s(?:,%s)*%s" % (_FIELD, _FIELD, _END))  # any number of fields
_LAST = re.compile(rb"%s(?:,%s)*\Z" % (_FIELD, _FIELD))  # the file's last record, without a line end
_BLANK = re.compile(rb"[\r\n]+")  # empty lines, skipped as pyarrow skips them
_QUOTED_FIELD = re.compile(rb'(?:^|(?<=,))%s' % _QUOTED)  # a quoted field at a field start, for counting


@functools.lru_cache(maxsize=64)
def _records_of(fields: int, count: int) -> re.Pattern:
    """``count`` records of exactly ``fields`` fields (blank lines between them skipped): one match
    cuts many records at once, once the header's field count is known."""
    record = rb"%s(?:,%s){%d}%s" % (_FIELD, _FIELD, fields - 1, _END)
    return re.compile(rb"(?:[\r\n]*%s){%d}" % (record, count))


class Record(NamedTuple):
    start: int  # its bytes are [start, end) of the file
    end: int
    line: int  # the 1-based line it starts on
    fields: int  # CSV: the fields pyarrow will find in each record; JSONL: 1
    rows: int = 1  # a span of this many whole records


def scan_records(f: BinaryIO, *, csv: bool, name: str = "input") -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte offsets of each record of ``f``, in order (``name``: for errors)."""
    scanner = _scanner(f, fmt="csv" if csv else "jsonl", name=name)
    while (record := scanner.take(1)) is not None:
        yield record.start, record.end


class JsonlScanner:
    """A JSONL file front to back: each non-blank line is a record."""

    def __init__(self, f: BinaryIO, *, name: str):
        self.lines, self.pos, self.line = iter(f), 0, 0

    def take(self, n: int) -> Record | None:
        """The next record (``n`` is a bound; one at a time here), None after the last."""
        for line in self.lines:
            self.line += 1
            self.pos += len(line)
            if line.strip():
                return Record(self.pos - len(line), self.pos, self.line, 1)
        return None


class CsvScanner:
    """A CSV file front to back, cut into records where pyarrow's parser cuts them.

    The first record is the header; every later one must have its field count. Most records are
    cut many at a time by one match of ``_records_of``; a record that match cannot take (the end of
    the buffer or the file, another field count, an unclosed quote) is cut alone, and errors name
    its line."""

    def __init__(self, f: BinaryIO, *, name: str):
        self.f, self.name = f, name
        self.buf, self.base, self.pos, self.line, self.eof = b"", 0, 0, 1, False  # buf: bytes [base, base + len(buf))
        self.width = 0  # the header's field count, once it is read
        self.chunk = CHUNK  # records per bulk match: halved when one fails, doubled when one succeeds

    def take(self, n: int) -> Record | None:
        """The next ``n`` records as one span, or fewer (at least one); None after the last record."""
        if self.width > 1 and n > 1:  # (with one column, a blank line would read as an empty record)
            self._fill()
            span = self._bulk(min(n, self.chunk))
            self.chunk = min(CHUNK, self.chunk * 2) if span is not None else max(1, self.chunk // 2)
            if span is not None:
                return span
        record = self._one()
        if record is not None and record.fields != (self.width or record.fields):
            raise InputError(f"{self.name}: line {record.line} has {record.fields} fields where the header has "
                             f"{self.width} (a stray quote, or a comma in an unquoted field?): quote a field that "
                             f"holds commas, quotes or line ends (\"a, b\"), write a quote inside it as \"\"")
        self.width = self.width or (record.fields if record is not None else 0)
        return record

    def _bulk(self, n: int) -> Record | None:
        m = _records_of(self.width, n).match(self.buf, self.pos)
        if m is None or (m.end() == len(self.buf) and not self.eof):  # a `\r` at the end may be half a `\r\n`
            return None
        blank = _BLANK.match(self.buf, self.pos)
        start = blank.end() if blank else self.pos
        line = self.line + _line_ends(self.buf, self.pos, start)
        self.line = line + _line_ends(self.buf, start, m.end())
        self.pos = m.end()
        return Record(self.base + start, self.base + m.end(), line, self.width, n)

    def _one(self) -> Record | None:
        while True:
            buf, pos = self.buf, self.pos
            blank = _BLANK.match(buf, pos)
            start = blank.end() if blank else pos
            if start < len(buf) or self.eof:  # a record starts at `start`
                self.line += _line_ends(buf, pos, start)
                self.pos = pos = start
                m = _RECORD.match(buf, pos)
                end = m.end() if m is not None else -1
                if end == -1 and self.eof and pos < len(buf):  # the last record, without a line end
                    if _LAST.match(buf, pos) is None:
                        raise _unclosed(self.name, self.line)
                    end = len(buf)
                if end != -1 and (end < len(buf) or self.eof):
                    record = Record(self.base + pos, self.base + end, self.line, _fields(buf[pos:end]))
                    self.line += _line_ends(buf, pos, end)
                    self.pos = end
                    return record
                if self.eof:
                    return None
            if len(buf) - pos > MAX_RECORD:
                raise InputError(f"{self.name}: line {self.line}: a record longer than {MAX_RECORD >> 20} MiB (a quoted "
                                 f"field that never closes?): close the quote, or split the text")
            self._fill(max(BLOCK, 2 * (len(buf) - pos)))  # doubles while one record outgrows the buffer

    def _fill(self, want: int = BLOCK) -> None:
        """Hold at least ``want`` bytes past the position (or the rest of the file)."""
        if self.eof or len(self.buf) - self.pos >= want:
            return
        more = self.f.read(want)
        self.buf, self.base, self.pos, self.eof = self.buf[self.pos:] + more, self.base + self.pos, 0, not more


def _scanner(f: BinaryIO, *, fmt: str, name: str) -> CsvScanner | JsonlScanner:
    return CsvScanner(f, name=name) if fmt == "csv" else JsonlScanner(f, name=name)


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


def plan_text_units(files: list[str], *, fmt: str, text_column: str, id_column: str, unit_rows: int,
                    workers: int = 1) -> list[Unit]:
    """Cut every file into units of ``unit_size(...)`` records (at most ``unit_rows``); checks the columns on the
    way. The scan cuts at ``unit_rows``; when that gives too few units for the workers, the files are scanned
    again at the smaller size (a second read only of a corpus under ``4 x workers x unit_rows`` rows)."""
    units = _plan_text(files, fmt=fmt, text_column=text_column, id_column=id_column, unit_rows=unit_rows)
    size = unit_size(sum(u.num_rows for u in units), unit_rows=unit_rows, workers=workers)
    if size < unit_rows:
        units = _plan_text(files, fmt=fmt, text_column=text_column, id_column=id_column, unit_rows=size)
    return units


def _plan_text(files: list[str], *, fmt: str, text_column: str, id_column: str, unit_rows: int) -> list[Unit]:
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        if file.lower().endswith(COMPRESSED):
            raise InputError(f"{file}: compressed {fmt.upper()} cannot be split into byte ranges: "
                             f"decompress it first (or convert it to Parquet)")
        with fs.open_binary(file) as f:
            head = first_record(f, fmt=fmt, name=file)
            if not head:
                continue  # an empty file has no rows
            _check_columns(file, head, fmt=fmt, text_column=text_column, id_column=id_column)
            f.seek(0)
            scanner = _scanner(f, fmt=fmt, name=file)  # a fresh scan from the top
            if fmt == "csv":
                scanner.take(1)  # the header
            units += _cut(scanner, file=file, file_index=file_index, fmt=fmt, unit_rows=unit_rows)
    return units


def first_record(f: BinaryIO, *, fmt: str, name: str) -> bytes:
    """The bytes of the first record (a CSV's header); ``b""`` for a file without one."""
    head = _scanner(f, fmt=fmt, name=name).take(1)
    if head is None:
        return b""
    f.seek(head.start)
    return f.read(head.end - head.start)


def _cut(scanner: CsvScanner | JsonlScanner, *, file: str, file_index: int, fmt: str, unit_rows: int) -> list[Unit]:
    units: list[Unit] = []
    row = 0
    while (first := scanner.take(unit_rows)) is not None:
        end, count = first.end, first.rows
        while count < unit_rows and (more := scanner.take(unit_rows - count)) is not None:
            end, count = more.end, count + more.rows
        units.append(_unit(file, file_index, fmt, row, count, first.start, end))
        row += count
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
                return _parse_jsonl_rows(data, fields=fields, text_column=self.text_column)
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


def _parse_jsonl_rows(data: bytes, *, fields: dict[str, pa.DataType], text_column: str) -> pa.Table:
    """The slow path, one ``json.loads`` a record, for units whose values pyarrow cannot convert.

    The text may then hold other JSON values: it becomes a union of the strings and a null-typed
    member for the rest, which screening counts as ``not_text``; any other field keeps its type."""
    data = data.removeprefix(codecs.BOM_UTF8)  # the first unit of a file may start with one
    records = [json.loads(line) for line in data.split(b"\n") if line.strip()]
    if any(not isinstance(r, dict) for r in records):
        raise ValueError("a record is not a JSON object")
    return pa.table({name: _text_or_other([r.get(name) for r in records]) if name == text_column
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
