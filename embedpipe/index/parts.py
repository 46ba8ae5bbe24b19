"""Read the vector parts back, one unit at a time, and draw the uniform sample the index trains on.

The driver never holds the corpus: each pass reads one part (one work unit) at a time and keeps
only what it samples (training rows, hold-out queries) and, for integer ids, the ids themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedpipe.io.store import store_for, tree_path


@dataclass(frozen=True)
class Part:
    """One unit's vector part; ``id``/``label``/``file``/``row_groups`` let the cluster Scheduler run it."""

    unit_id: str
    path: str
    rows: int

    @property
    def id(self) -> str:
        return self.unit_id

    @property
    def file(self) -> str:
        return self.path

    @property
    def row_groups(self) -> tuple[int, ...]:
        return ()

    @property
    def label(self) -> str:
        return f"index shard of unit {self.unit_id} ({self.path})"


def existing_parts(planned: list[Part], *, recorded: dict[str, str] | None = None) -> list[Part]:
    """The planned parts that exist, with the rows they hold (rows skipped by on_bad_row are not there).

    ``recorded`` (the driver's: unit id -> the part its manifest record names) decides which exist: a part
    that no record names (an orphan of a killed attempt) is never read, and the folder is not listed."""
    if recorded is not None:
        planned = [Part(p.unit_id, recorded[p.unit_id], p.rows) for p in planned if p.unit_id in recorded]
    else:
        planned = [p for p in planned if Path(p.path).is_file()]
    return [Part(p.unit_id, p.path, _num_rows(p.path)) for p in planned]


def _num_rows(path: str) -> int:
    source = store_for(path).arrow_source(tree_path(path))  # object stores: the footer by ranged reads
    try:
        return pq.ParquetFile(source).metadata.num_rows
    finally:
        _close(source)


def _read_table(path: str | Path, columns: list[str]) -> pa.Table:
    """A part's columns, local or in an object store (through the output's store and its options)."""
    source = store_for(path).arrow_source(tree_path(path))
    try:
        return pq.read_table(source, columns=columns)
    finally:
        _close(source)


def _close(source) -> None:
    if hasattr(source, "close"):
        source.close()


def read_vectors(path: str | Path) -> tuple[pa.Array, np.ndarray]:
    """A part's ids (type kept) and vectors [N, D] float32."""
    table = _read_table(path, columns=["id", "embedding"])
    emb = table.column("embedding").combine_chunks()
    dim = emb.type.list_size
    flat = emb.flatten().to_numpy(zero_copy_only=False)
    return table.column("id").combine_chunks(), np.ascontiguousarray(flat.reshape(len(emb), dim), dtype=np.float32)


def read_ids(path: str | Path) -> pa.Array:
    return _read_table(path, columns=["id"]).column("id").combine_chunks()


CHUNK_COLUMNS = ("chunk", "start", "end")  # a chunked part's (input.chunking) place of each row in its document


def read_chunk_columns(path: str | Path) -> pa.Table | None:
    """A chunked part's chunk, start and end columns; None for a part of one row per input row."""
    source = store_for(path).arrow_source(tree_path(path))
    try:
        names = pq.ParquetFile(source).schema_arrow.names
    finally:
        _close(source)
    return _read_table(path, columns=list(CHUNK_COLUMNS)) if "chunk" in names else None


@dataclass
class Sample:
    train: np.ndarray  # [n_train, D] float32, in random order: any prefix is a uniform sample too
    queries: np.ndarray  # [n_queries, D] float32, in position order
    query_positions: np.ndarray  # [n_queries] row positions in unit order
    query_ids: pa.Array  # [n_queries] the queries' input ids


class UniformSampler:
    """Rows drawn uniformly (seeded) from the whole corpus by position; fed every part in unit order."""

    def __init__(self, *, total: int, train: int, queries: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        drawn = rng.choice(total, size=min(train, total), replace=False)
        self.train_order = np.argsort(np.argsort(drawn))  # sorted position -> draw order
        self.train_pos = np.sort(drawn)
        self.query_pos = np.sort(rng.choice(total, size=min(queries, total), replace=False))
        self.train_rows: list[np.ndarray] = []
        self.query_rows: list[np.ndarray] = []
        self.query_ids: list[pa.Array] = []
        self.start = 0

    def __call__(self, ids: pa.Array, vectors: np.ndarray) -> None:
        end = self.start + len(vectors)
        lo, hi = np.searchsorted(self.train_pos, [self.start, end])
        self.train_rows.append(vectors[self.train_pos[lo:hi] - self.start].copy())
        lo, hi = np.searchsorted(self.query_pos, [self.start, end])
        rows = self.query_pos[lo:hi] - self.start
        self.query_rows.append(vectors[rows].copy())
        self.query_ids.append(ids.take(pa.array(rows)))
        self.start = end

    def result(self, dim: int) -> Sample:
        empty = np.empty((0, dim), np.float32)
        train = np.concatenate(self.train_rows) if self.train_rows else empty
        return Sample(train[self.train_order] if len(train) else train,
                      np.concatenate(self.query_rows) if self.query_rows else empty, self.query_pos,
                      pa.concat_arrays(self.query_ids) if self.query_ids else pa.array([]))
