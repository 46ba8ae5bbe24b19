"""Work units: deterministic ranges of one input file, with stable ids.

Parquet units are consecutive row groups (``<file:05d>-<first row group:05d>``); row-range
formats (JSONL, CSV, Hugging Face arrow shards; see ``embedpipe/io/formats.py``) use
``<file:05d>-<first row:010d>``. The same input listing always gives the same units in the same
order, so a unit id names the same rows across runs (the manifest and resume rely on this).
"""

from __future__ import annotations

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


def plan_units(files: list[str], *, unit_rows: int) -> list[Unit]:
    """Group each file's consecutive row groups into units of about ``unit_rows`` rows."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        try:
            with pq.ParquetFile(fs.arrow_source(file)) as pf:
                meta = pf.metadata
        except StorageError:  # the store's own line already names the URL and the fix
            raise
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise InputError(f"cannot read Parquet file {file!r} ({exc}): replace or remove the file") from exc
        start, rows, first_row = 0, 0, 0
        for rg in range(meta.num_row_groups):
            rows += meta.row_group(rg).num_rows
            last = rg == meta.num_row_groups - 1
            if rows >= unit_rows or last:
                if rows:
                    units.append(Unit(f"{file_index:05d}-{start:05d}", file, tuple(range(start, rg + 1)), rows,
                                      row_start=first_row))
                start, rows, first_row = rg + 1, 0, first_row + rows
    return units
