"""Work units: deterministic ranges of one input file, with stable ids.

Parquet units are consecutive row groups (``<file:05d>-<first row group:05d>``); row-range
formats (JSONL, CSV, Hugging Face arrow shards; see ``embedpipe/io/formats.py``) use
``<file:05d>-<first row:010d>``. The same input listing always gives the same units in the same
order, so a unit id names the same rows across runs (the manifest and resume rely on this).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.parquet as pq

from embedpipe.errors import InputError, StorageError  # noqa: F401 - raised here, imported from here by many
from embedpipe.io import fs


@dataclass(frozen=True)
class Unit:
    id: str  # "<file index:05d>-<first row group:05d>", zero-padded so names sort in input order
    file: str  # a local path or a URL (fsspec)
    row_groups: tuple[int, ...]  # Parquet: the row groups; () for row-range formats
    num_rows: int
    drop_rows: tuple[int, ...] = ()  # rows (unit-local) removed as duplicate ids (input.on_duplicate_id: keep_first)
    format: str = "parquet"  # the input.format that reads it (never "auto")
    row_start: int = 0  # the unit holds rows [row_start, row_start + num_rows) of the file
    byte_start: int = 0  # JSONL/CSV: the bytes [byte_start, byte_end) holding exactly those rows
    byte_end: int = 0

    @property
    def label(self) -> str:
        if self.row_groups:
            return f"unit {self.id} ({self.file}, row groups {self.row_groups[0]}..{self.row_groups[-1]})"
        return f"unit {self.id} ({self.file}, rows {self.row_start}..{self.row_start + self.num_rows - 1})"


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


def plan_units(files: list[str], *, unit_rows: int, footers: list[Footer] | None = None) -> list[Unit]:
    """Group each file's consecutive row groups into units of about ``unit_rows`` rows (``footers``: the
    files' footers when the caller read them already)."""
    units: list[Unit] = []
    for file_index, (file, footer) in enumerate(zip(files, footers if footers is not None else read_footers(files))):
        start, rows, first_row = 0, 0, 0
        for rg, rg_rows in enumerate(footer.row_group_rows):
            rows += rg_rows
            last = rg == len(footer.row_group_rows) - 1
            if rows >= unit_rows or last:
                if rows:
                    units.append(Unit(f"{file_index:05d}-{start:05d}", file, tuple(range(start, rg + 1)), rows,
                                      row_start=first_row))
                start, rows, first_row = rg + 1, 0, first_row + rows
    return units
