"""Work units: deterministic ranges of one input file, with stable ids.

Parquet units are consecutive whole row groups (``<file:05d>-<first row group:05d>``) or, for a row
group larger than a unit, a row range inside it (``<file:05d>-<row group:05d>-<first row in it:010d>``);
row-range formats (JSONL, CSV, Hugging Face arrow shards; see ``embedpipe/io/formats.py``) use
``<file:05d>-<first row:010d>``. The same input listing and worker count always give the same units in
the same order; a manifest record carries its unit's rows, so a record is reused only for a unit of
exactly those rows (``embedpipe/io/manifest.py: covers``).

How many rows a unit holds (``unit_size``): at most ``input.unit_rows``, and, with two or more workers,
few enough that every worker gets about ``UNITS_PER_WORKER`` units, but never fewer than
``MIN_UNIT_ROWS`` (a tiny corpus is not cut into units that cost more to schedule than to encode).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.parquet as pq

from embedpipe.errors import InputError, StorageError  # noqa: F401 - raised here, imported from here by many
from embedpipe.io import fs

UNITS_PER_WORKER = 4  # units each worker should get, when the corpus allows: a slow or late worker holds no tail
MIN_UNIT_ROWS = 256  # the smallest unit the balance cuts (unit_rows itself may be smaller)


@dataclass(frozen=True)
class Unit:
    id: str  # "<file index:05d>-<first row group:05d>", zero-padded so names sort in input order
    file: str  # a local path or a URL (fsspec)
    row_groups: tuple[int, ...]  # Parquet: the row groups (one, for a row range inside it); () for row-range formats
    num_rows: int
    drop_rows: tuple[int, ...] = ()  # rows (unit-local) removed as duplicate ids (input.on_duplicate_id: keep_first)
    format: str = "parquet"  # the input.format that reads it (never "auto")
    row_start: int = 0  # the unit holds rows [row_start, row_start + num_rows) of the file
    byte_start: int = 0  # JSONL/CSV: the bytes [byte_start, byte_end) holding exactly those rows
    byte_end: int = 0

    @property
    def in_row_group(self) -> bool:
        """A Parquet row range inside one row group (its id names the row group and the range's first row)."""
        return bool(self.row_groups) and self.id.count("-") == 2

    @property
    def label(self) -> str:
        rows = f"rows {self.row_start}..{self.row_start + self.num_rows - 1}"
        if self.in_row_group:
            return f"unit {self.id} ({self.file}, row group {self.row_groups[0]}, {rows})"
        if self.row_groups:
            return f"unit {self.id} ({self.file}, row groups {self.row_groups[0]}..{self.row_groups[-1]})"
        return f"unit {self.id} ({self.file}, {rows})"


def unit_size(total_rows: int, *, unit_rows: int, workers: int) -> int:
    """Rows per unit: ``unit_rows`` at most (an upper bound); with two or more workers also small enough for
    ``UNITS_PER_WORKER`` units per worker, but not below ``MIN_UNIT_ROWS`` (unless unit_rows is smaller).
    One worker has nobody to share with: its units are cut by unit_rows alone."""
    if workers <= 1:
        return max(1, unit_rows)
    balanced = -(-total_rows // (UNITS_PER_WORKER * max(workers, 1)))  # ceil
    return max(1, min(unit_rows, max(balanced, MIN_UNIT_ROWS)))


def list_files(path: str, *, suffixes: tuple[str, ...] = (".parquet",), kind: str = "Parquet") -> list[str]:
    """The files behind ``input.path`` (a file, a directory or a glob; local or a URL), sorted.

    A directory is walked for ``suffixes``; a file or a glob is taken as it is.
    """
    files = fs.expand(path, suffixes=suffixes)
    if not files:
        raise InputError(f"input.path {path!r} matches no {kind} file: point it at a file, a directory "
                         f"holding {' or '.join('*' + s for s in suffixes)} files, or a glob such as "
                         f"'data/*{suffixes[0]}'")
    return files


FOOTER_THREADS = 32  # footers read at once: each is one or two small GETs on an object store, a local read here


@dataclass(frozen=True)
class Footer:
    """What planning keeps of a Parquet file's footer: its schema and its row groups' row counts."""

    schema: object  # pa.Schema
    row_group_rows: tuple[int, ...]


def plan_units(files: list[str], *, unit_rows: int, workers: int = 1, footers: list[Footer] | None = None) -> list[Unit]:
    """Cut each file into units of at most ``unit_size(...)`` rows: consecutive whole row groups, or row
    ranges of a row group larger than that (split into equal pieces). ``footers``: the files' footers when
    the caller read them already."""
    groups = [list(f.row_group_rows) for f in (footers if footers is not None else read_footers(files))]
    size = unit_size(sum(map(sum, groups)), unit_rows=unit_rows, workers=workers)
    return [unit for file_index, (file, rows) in enumerate(zip(files, groups))
            for unit in cut_row_groups(file, file_index, rows, size=size)]


def read_footer(file: str) -> Footer:
    try:
        with pq.ParquetFile(fs.arrow_source(file)) as pf:
            meta = pf.metadata
            return Footer(schema=pf.schema_arrow, row_group_rows=tuple(meta.row_group(rg).num_rows
                                                                      for rg in range(meta.num_row_groups)))
    except StorageError:  # the store's own line already names the URL and the fix
        raise
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"cannot read Parquet file {file!r} ({exc}): replace or remove the file") from exc


def read_footers(files: list[str], *, threads: int = FOOTER_THREADS) -> list[Footer]:
    """Every file's footer, ``threads`` at a time; the driver keeps only the small ``Footer`` of each. A bad
    file raises as a serial read would: the first one in listing order."""
    if len(files) <= 1:
        return [read_footer(f) for f in files]
    with ThreadPoolExecutor(min(threads, len(files))) as pool:
        return list(pool.map(read_footer, files))


def cut_row_groups(file: str, file_index: int, group_rows: list[int], *, size: int) -> list[Unit]:
    """One file's units from its row groups' sizes: whole row groups gathered up to ``size`` rows; a row group
    over ``size`` becomes ``ceil(rows / size)`` row ranges of (nearly) equal size."""
    units: list[Unit] = []
    start, rows, first_row = 0, 0, 0  # the open unit: first row group, rows, first row of the file
    for rg, n in enumerate(group_rows):
        if rows and rows + n > size:  # the open unit is full: close it
            units.append(Unit(f"{file_index:05d}-{start:05d}", file, tuple(range(start, rg)), rows, row_start=first_row))
            first_row, rows = first_row + rows, 0
        if n > size:  # a large row group: row ranges inside it
            pieces = -(-n // size)
            for p in range(pieces):
                lo, hi = n * p // pieces, n * (p + 1) // pieces
                units.append(Unit(f"{file_index:05d}-{rg:05d}-{lo:010d}", file, (rg,), hi - lo, row_start=first_row + lo))
            first_row += n
            start = rg + 1
            continue
        if not rows:
            start = rg
        rows += n
    if rows:
        units.append(Unit(f"{file_index:05d}-{start:05d}", file, tuple(range(start, len(group_rows))), rows,
                          row_start=first_row))
    return units
