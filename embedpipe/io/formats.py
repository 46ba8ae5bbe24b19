"""Input formats, keyed by ``input.format``: how to list, plan and read each one.

| format      | files                                  | unit                                          |
| ----------- | -------------------------------------- | --------------------------------------------- |
| parquet     | ``*.parquet`` (file, folder, glob)     | consecutive row groups, ``<file>-<row group>``, or a row range of one (``-<row>``) |
| jsonl       | ``*.jsonl``, ``*.ndjson``              | ``unit_rows`` records as one byte range        |
| csv         | ``*.csv`` (with a header row)          | ``unit_rows`` rows as one byte range           |
| huggingface | a ``save_to_disk`` folder or a cache name | ``unit_rows`` rows of one arrow shard       |

``auto`` (the default) picks by what ``input.path`` holds: a ``save_to_disk`` folder is
huggingface, files go by their extension (``.parquet``, ``.jsonl``/``.ndjson``, ``.csv``); mixed
or unknown extensions are an error that asks for ``input.format``. A folder walk collects the
format's extensions; a named file or a glob is taken as it is (``data/*.json`` with
``input.format: jsonl`` reads JSON-lines files named ``.json``).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pyarrow as pa

from embedpipe.config import InputConfig
from embedpipe.io import fs
from embedpipe.io.hf import ArrowShardReader, dataset_files, is_saved_dataset, plan_arrow_units
from embedpipe.io.reader import ParquetReader, check_schema
from embedpipe.io.rows import ScreenedRows, is_text_type
from embedpipe.io.textfiles import TextFileReader, plan_text_units
from embedpipe.units import InputError, Unit, list_files, plan_units, read_footers

Reader = Callable[[Unit], ScreenedRows]  # and .columns(unit, names) -> pa.Table, the raw rows


@dataclass(frozen=True)
class InputFormat:
    extensions: tuple[str, ...]  # what a folder walk collects, and what `auto` maps to this format
    list_files: Callable[[InputConfig], list[str]]
    plan_units: Callable[..., list[Unit]]  # (files, cfg, workers=) checks the columns, cuts the units
    reader: Callable[..., Reader]  # reader(text_column=, id_column=, on_bad_row=): built once per worker


def _plan_parquet(files: list[str], cfg: InputConfig, *, workers: int = 1) -> list[Unit]:
    footers = read_footers(files)  # in parallel; a bad file fails here, before any model is loaded
    for file, footer in zip(files, footers):
        check_schema(file, footer.schema, text_column=cfg.text_column, id_column=cfg.id_column)
        text_type = footer.schema.field(cfg.text_column).type
        if not is_text_type(text_type) and cfg.on_bad_row == "error":
            raise InputError(f"{file}: column {cfg.text_column!r} holds {text_type}, not text: set "
                             f"input.text_column to a text column (or input.on_bad_row to skip them)")
    return plan_units(files, unit_rows=cfg.unit_rows, workers=workers, footers=footers)


def _plan_text(files: list[str], cfg: InputConfig, *, fmt: str, workers: int = 1) -> list[Unit]:
    return plan_text_units(files, fmt=fmt, text_column=cfg.text_column, id_column=cfg.id_column,
                           unit_rows=cfg.unit_rows, workers=workers)


def _plan_hf(files: list[str], cfg: InputConfig, *, workers: int = 1) -> list[Unit]:
    return plan_arrow_units(files, text_column=cfg.text_column, id_column=cfg.id_column, unit_rows=cfg.unit_rows,
                            on_bad_row=cfg.on_bad_row, workers=workers)


def _files(cfg: InputConfig, *, extensions: tuple[str, ...], kind: str) -> list[str]:
    return list_files(cfg.path, suffixes=extensions, kind=kind)


def _hf_files(cfg: InputConfig) -> list[str]:
    return dataset_files(cfg.path, split=cfg.split)


_PARQUET, _JSONL, _CSV = (".parquet",), (".jsonl", ".ndjson"), (".csv",)
FORMATS: dict[str, InputFormat] = {
    "parquet": InputFormat(_PARQUET, partial(_files, extensions=_PARQUET, kind="Parquet"), _plan_parquet,
                           ParquetReader),
    "jsonl": InputFormat(_JSONL, partial(_files, extensions=_JSONL, kind="JSONL"), partial(_plan_text, fmt="jsonl"),
                         partial(TextFileReader, fmt="jsonl")),
    "csv": InputFormat(_CSV, partial(_files, extensions=_CSV, kind="CSV"), partial(_plan_text, fmt="csv"),
                       partial(TextFileReader, fmt="csv")),
    "huggingface": InputFormat((), _hf_files, _plan_hf, ArrowShardReader),
}


def resolve_format(cfg: InputConfig) -> str:
    """``input.format``, with ``auto`` replaced by what ``input.path`` holds."""
    if cfg.format != "auto":
        return cfg.format
    if fs.isdir(cfg.path) and is_saved_dataset(cfg.path):
        return "huggingface"
    known = {s: name for name, f in FORMATS.items() for s in f.extensions}
    files = fs.expand(cfg.path, suffixes=tuple(known))
    if not files:
        raise InputError(f"input.path {cfg.path!r} matches no input file ({', '.join('*' + s for s in known)}): "
                         f"point it at a file, a folder or a glob; for a dataset in the Hugging Face cache "
                         f"set input.format: huggingface")
    found: dict[str, list[str]] = {}
    for file in files:
        name = next((fmt for s, fmt in known.items() if file.lower().endswith(s)), None)
        found.setdefault(name or "unknown", []).append(posixpath.basename(file))
    if len(found) > 1 or "unknown" in found:
        kinds = "; ".join(f"{k}: {', '.join(v[:3])}{', …' if len(v) > 3 else ''}" for k, v in found.items())
        raise InputError(f"input.format auto cannot tell the format of {cfg.path!r} ({kinds}): set input.format "
                         f"to one of {', '.join(FORMATS)}, or narrow input.path to one kind of file")
    return next(iter(found))


@dataclass(frozen=True)
class InputPlan:
    format: str  # the resolved input.format
    files: list[str]  # what the input listed (local paths or URLs), in unit order
    units: list[Unit]


def plan_input(cfg: InputConfig, *, workers: int = 1) -> InputPlan:
    """The job's work units: list the input, check its columns, cut it into deterministic units of at most
    ``input.unit_rows`` rows, about ``UNITS_PER_WORKER`` or more per worker (``embedpipe/units.py: unit_size``)."""
    name = resolve_format(cfg)
    fmt = FORMATS[name]
    files = fmt.list_files(cfg)
    return InputPlan(format=name, files=files, units=fmt.plan_units(files, cfg, workers=workers))


class UnitReader:
    """Built once per worker; reads each unit with the reader of the unit's format."""

    def __init__(self, *, text_column: str, id_column: str, on_bad_row: str = "error"):
        self.text_column, self.id_column, self.on_bad_row = text_column, id_column, on_bad_row
        self.readers: dict[str, Reader] = {}

    def __call__(self, unit: Unit) -> ScreenedRows:
        """The unit's rows through the bad-row policy (and without its duplicate-id rows)."""
        return self._reader(unit.format)(unit)

    def columns(self, unit: Unit, names: list[str]) -> pa.Table:
        """The unit's rows, these columns only, unscreened."""
        return self._reader(unit.format).columns(unit, names)

    def _reader(self, fmt: str) -> Reader:
        if fmt not in self.readers:
            self.readers[fmt] = FORMATS[fmt].reader(text_column=self.text_column, id_column=self.id_column,
                                                    on_bad_row=self.on_bad_row)
        return self.readers[fmt]
