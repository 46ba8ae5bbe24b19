"""Input ids -> int64 index ids, and the id map written beside the index (``ids.parquet``).

Integer ids that fit int64 and are unique are used as they are (``native``). Anything else
(strings, uint64 past 2**63, duplicates, nulls) gets dense index ids by position: unit order,
then row order, so the same input always gets the same index ids. ``ids.parquet`` holds
(``index_id``, ``id``) in index-id order and is the source of truth either way. A chunked output
(input.chunking: one row per chunk) always gets dense ids, and ``ids.parquet`` adds each row's
``chunk``, ``start`` and ``end``: an index id names one (id, chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedpipe.io.layout import atomic_move, temp_path

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class IdPlan:
    """How a unit's rows get their index ids: the id column itself, or ``offset + row``."""

    native: bool
    offsets: dict[str, int]  # unit id -> index id of its first row (dense ids)

    def index_ids(self, unit_id: str, ids: pa.Array) -> np.ndarray:
        if self.native:
            return ids.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        start = self.offsets[unit_id]
        return np.arange(start, start + len(ids), dtype=np.int64)


class NativeIdCheck:
    """Fed every unit's id column (in unit order); says whether the ids can be index ids as they are."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.ok = True

    def __call__(self, ids: pa.Array) -> None:
        if not self.ok:
            return
        if not pa.types.is_integer(ids.type) or ids.null_count:
            self.ok, self.parts = False, []
            return
        if pa.types.is_uint64(ids.type) and len(ids) and pc.max(ids).as_py() > INT64_MAX:
            self.ok, self.parts = False, []
            return
        self.parts.append(ids.cast(pa.int64()).to_numpy(zero_copy_only=False))  # 8 bytes a row, ids only

    def unique(self) -> bool:
        if not self.ok:
            return False
        all_ids = np.concatenate(self.parts) if self.parts else np.empty(0, np.int64)
        return len(np.unique(all_ids)) == len(all_ids)


def plan_ids(unit_rows: list[tuple[str, int]], *, native: bool) -> IdPlan:
    """Dense offsets from (unit id, rows) in unit order."""
    offsets, start = {}, 0
    for unit_id, rows in unit_rows:
        offsets[unit_id] = start
        start += rows
    return IdPlan(native=native, offsets=offsets)


class IdMapWriter:
    """Streams (index_id, id) per unit, in unit order, to ``ids.parquet`` (temp name, then rename)."""

    def __init__(self, path: Path, plan: IdPlan):
        self.path, self.plan = Path(path), plan
        self.tmp = temp_path(self.path)
        self.writer: pq.ParquetWriter | None = None

    def __call__(self, unit_id: str, ids: pa.Array, chunks: pa.Table | None = None) -> None:
        """``chunks``: a chunked part's chunk, start and end columns, written beside each row's id."""
        table = pa.table({"index_id": self.plan.index_ids(unit_id, ids), "id": ids})
        for name in (chunks.column_names if chunks is not None else ()):
            table = table.append_column(name, chunks.column(name))
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp, table.schema)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            atomic_move(self.tmp, self.path)


class IdLookup:
    """index id -> input id, read from ``ids.parquet`` (memory-mapped); a chunked index's also -> its chunk."""

    def __init__(self, path: Path, *, native: bool):
        self.native = native
        # one file: ParquetFile, not read_table (which imports pyarrow.dataset, ~0.3 s of a cold search)
        self.table = pq.ParquetFile(path, memory_map=True).read()
        self.chunked = "chunk" in self.table.column_names  # input.chunking: dense ids, one per (id, chunk)

    def chunks(self, index_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """(chunk, start, end) of each index id of a chunked index (dense: index id == row)."""
        columns = [self.table.column(name) for name in ("chunk", "start", "end")]
        return [tuple(_at(column, row) for column in columns) for row in np.asarray(index_ids, dtype=np.int64)]

    def __call__(self, index_ids: np.ndarray) -> list:
        index_ids = np.asarray(index_ids, dtype=np.int64)
        if self.native:  # the input's own integer ids, as Python ints
            return [int(i) for i in index_ids]
        column = self.table.column("id")
        return [_at(column, row) for row in index_ids]  # dense: index id == row


def _at(column: pa.ChunkedArray, row: np.int64):
    """One value, by position: no ``take`` or ``pa.array`` (both import pandas, ~0.3 s of a cold search; a search
    looks up k ids per query)."""
    return column[int(row)].as_py()
