"""Write one unit's vectors as a Parquet part: temp name, then an atomic rename."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def vectors_table(ids: pa.Array, vectors: np.ndarray) -> pa.Table:
    """``id`` (type kept) and ``embedding`` (fixed-size list of float32)."""
    n, dim = vectors.shape
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
    return pa.table({"id": ids, "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})


def write_table_atomic(table: pa.Table, path: Path) -> Path:
    """Write to a temporary name in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


class ParquetPartWriter:
    """Built once per worker; writes ``<output>/vectors/part-<unit id>.parquet`` per unit."""

    def __init__(self, *, output_path: str):
        self.dir = Path(output_path) / "vectors"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, unit_id: str) -> Path:
        return self.dir / f"part-{unit_id}.parquet"

    def __call__(self, unit_id: str, ids: pa.Array, vectors: np.ndarray,
                 extra: dict[str, pa.Array] | None = None) -> str:
        table = vectors_table(ids, vectors)
        for name, column in (extra or {}).items():  # e.g. content_hash of incremental runs
            table = table.append_column(name, column)
        return str(write_table_atomic(table, self.path_for(unit_id)))
