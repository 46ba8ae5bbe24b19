"""Hugging Face datasets: a ``save_to_disk`` folder, or a dataset in the local HF cache by name.

Either way the rows live in Arrow stream files (the dataset's shards). Units are row ranges of
one shard, ``unit_rows`` at a time, and a worker reads its range from the memory-mapped shard
(zero copy; on a URL it streams the shard up to the range's end), so the dataset is never
loaded whole. Planning reads no rows: it counts them from the record batches' headers.

A saved folder (``state.json``; a ``DatasetDict`` has ``dataset_dict.json`` and a folder per
split) is read with pyarrow alone, locally or at any fsspec URL. A cache name (``org/name``)
is looked up with ``datasets.load_dataset`` in offline mode, never the network; its shard paths
must be readable on every worker (one machine, or a shared cache folder).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import pyarrow as pa

from embedpipe.io import fs
from embedpipe.io.reader import ScreeningReader
from embedpipe.io.rows import is_text_type
from embedpipe.units import InputError, Unit, unit_size


def is_saved_dataset(path: str) -> bool:
    """True for a ``save_to_disk`` folder (a Dataset or a DatasetDict)."""
    return any(fs.exists(fs.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def dataset_files(path: str, *, split: str | None) -> list[str]:
    """The arrow shards of the saved dataset at ``path``, or of the cached dataset named ``path``."""
    state = fs.join(path, "state.json")
    if fs.exists(state):
        files = json.loads(fs.read_text(state))["_data_files"]
        return [fs.join(path, f["filename"]) for f in files]
    splits_file = fs.join(path, "dataset_dict.json")
    if fs.exists(splits_file):
        split = _choose_split(json.loads(fs.read_text(splits_file))["splits"], split, where=path)
        return dataset_files(fs.join(path, split), split=None)
    if fs.exists(path):
        raise InputError(f"input.path {path!r} is no saved Hugging Face dataset (no state.json or "
                         f"dataset_dict.json): save it with Dataset.save_to_disk, or set input.format "
                         f"to the format of its files")
    return _cached_dataset_files(path, split=split)


def plan_arrow_units(files: list[str], *, text_column: str, id_column: str, unit_rows: int,
                     on_bad_row: str = "error", workers: int = 1) -> list[Unit]:
    """Row ranges of ``unit_size(...)`` rows (at most ``unit_rows``) within each shard; checks the columns on
    the way."""
    shard_rows: list[int] = []
    for file in files:
        with _open_stream(file) as reader:
            _check_columns(file, reader.schema, text_column=text_column, id_column=id_column)
            text_type = reader.schema.field(text_column).type
            if not is_text_type(text_type) and on_bad_row == "error":
                raise InputError(f"{file}: column {text_column!r} holds {text_type}, not text: set "
                                 f"input.text_column to a text column (or input.on_bad_row to skip them)")
            shard_rows.append(sum(batch.num_rows for batch in reader))
    size = unit_size(sum(shard_rows), unit_rows=unit_rows, workers=workers)
    return [Unit(f"{file_index:05d}-{start:010d}", file, (), min(size, rows - start), format="huggingface",
                 row_start=start)
            for file_index, (file, rows) in enumerate(zip(files, shard_rows)) for start in range(0, rows, size)]


class ArrowShardReader(ScreeningReader):
    """A saved Hugging Face dataset: one unit's rows from its memory-mapped arrow shard."""

    def read(self, unit: Unit, columns: list[str]) -> pa.Table:
        start, end = unit.row_start, unit.row_start + unit.num_rows
        with _open_stream(unit.file) as reader:
            _check_columns(unit.file, reader.schema, text_column=self.text_column, id_column=self.id_column)
            schema = pa.schema([reader.schema.field(c) for c in columns])
            pieces, row = [], 0
            for batch in reader:
                lo, hi = max(start - row, 0), min(end - row, batch.num_rows)
                if hi > lo:
                    pieces.append(batch.select(columns).slice(lo, hi - lo))
                row += batch.num_rows
                if row >= end:
                    break
        return pa.Table.from_batches(pieces, schema=schema)


@contextmanager
def _open_stream(file: str) -> Iterator[pa.ipc.RecordBatchStreamReader]:
    source = fs.arrow_source(file, memory_map=True)
    try:
        with pa.ipc.open_stream(source) as reader:
            yield reader
    except pa.ArrowInvalid as exc:
        raise InputError(f"cannot read arrow shard {file!r} ({exc}): save the dataset again") from exc
    finally:
        if not isinstance(source, str):
            source.close()


def _check_columns(file: str, schema: pa.Schema, *, text_column: str, id_column: str) -> None:
    for column, field in ((text_column, "input.text_column"), (id_column, "input.id_column")):
        if column not in schema.names:
            raise InputError(f"{file}: no column {column!r} (columns: {', '.join(schema.names)}): "
                             f"set {field} to the right column")


def _choose_split(splits: list[str], split: str | None, *, where: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split not in splits:
        problem = "has several splits" if split is None else f"has no split {split!r}"
        raise InputError(f"input.path {where!r} {problem} ({', '.join(splits)}): set input.split to one of them")
    return split


def _cached_dataset_files(name: str, *, split: str | None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"input.path {name!r} is no local path; reading a dataset from the Hugging Face "
                         f"cache by name needs the `datasets` package: pip install 'embedpipe[hf]'") from None
    with _offline():
        try:
            found = datasets.load_dataset(name, split=split)
        except Exception as exc:  # datasets raises many types for "not cached"
            raise InputError(f"input.path {name!r} is neither a saved dataset folder nor a dataset in the local "
                             f"Hugging Face cache ({type(exc).__name__}: {exc}): load it once online with "
                             f"datasets.load_dataset, or save_to_disk and point input.path at the folder") from None
    if isinstance(found, datasets.DatasetDict):
        found = found[_choose_split(list(found), split, where=name)]
    files = [f["filename"] for f in found.cache_files]
    if not files or found._indices is not None or len(found) != _count_rows(files):
        raise InputError(f"input.split {split!r} of {name!r} is not whole arrow shards (a sliced split such as "
                         f"'train[:10%]' or an in-memory dataset): use a whole split, or save_to_disk the rows "
                         f"you want and point input.path at that folder")
    return files


def _count_rows(files: list[str]) -> int:
    total = 0
    for file in files:
        with _open_stream(file) as reader:
            total += sum(batch.num_rows for batch in reader)
    return total


@contextmanager
def _offline() -> Iterator[None]:
    """Force the datasets library offline for one call, whatever the environment said at import."""
    import datasets.config

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
