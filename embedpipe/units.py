"""Work units: consecutive row-group ranges of one Parquet file, with deterministic ids.

The same input listing always gives the same units in the same order, so a unit id names
the same rows across runs (the manifest and resume rely on this).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq


@dataclass(frozen=True)
class Unit:
    id: str  # "<file index:05d>-<first row group:05d>", zero-padded so names sort in input order
    file: str
    row_groups: tuple[int, ...]
    num_rows: int
    drop_rows: tuple[int, ...] = ()  # rows (unit-local) removed as duplicate ids (input.on_duplicate_id: keep_first)

    @property
    def label(self) -> str:
        return f"unit {self.id} ({self.file}, row groups {self.row_groups[0]}..{self.row_groups[-1]})"


class InputError(ValueError):
    """The input cannot be read as the job asks: names the file and the fix."""


def list_files(path: str) -> list[str]:
    """The Parquet files behind ``input.path`` (a file, a directory or a glob), sorted."""
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*.parquet") if p.is_file())
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise InputError(f"input.path {path!r} matches no Parquet file: point it at a file, a directory "
                         f"holding *.parquet files, or a glob such as 'data/*.parquet'")
    return files


def plan_units(files: list[str], *, unit_rows: int) -> list[Unit]:
    """Group each file's consecutive row groups into units of about ``unit_rows`` rows."""
    units: list[Unit] = []
    for file_index, file in enumerate(files):
        try:
            meta = pq.ParquetFile(file).metadata
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise InputError(f"cannot read Parquet file {file!r} ({exc}): replace or remove the file") from exc
        start, rows = 0, 0
        for rg in range(meta.num_row_groups):
            rows += meta.row_group(rg).num_rows
            last = rg == meta.num_row_groups - 1
            if rows >= unit_rows or last:
                if rows:
                    units.append(Unit(f"{file_index:05d}-{start:05d}", file, tuple(range(start, rg + 1)), rows))
                start, rows = rg + 1, 0
    return units
