"""Write one unit's vectors as a Parquet part: temp name, then an atomic rename (object stores: one PUT under
an attempt-unique name; the unit's manifest record, written after it, is the commit point)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from embedpipe.io.describe import OutputDescription, with_description
from embedpipe.io.layout import OutputLayout, atomic_write_table
from embedpipe.io.store import TreePath, Written, attempt_token
from embedpipe.io.quantize import METADATA_KEY, Calibration, quantization_record, quantize, stored_type


def vector_column(values: np.ndarray) -> pa.FixedSizeListArray:
    """[N, W] numbers (float32, float16, int8, uint8) as a fixed-size list column of W, its Arrow type the values'
    own, over their buffer (copied only when not contiguous): not through pa.array, which imports pandas (0.2 s of a
    process's CPU)."""
    flat = np.ascontiguousarray(values).reshape(-1)  # [N * W]
    array = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), len(flat), [None, pa.py_buffer(flat)])
    return pa.FixedSizeListArray.from_arrays(array, values.shape[1])


def vectors_table(ids: pa.Array, vectors: np.ndarray, *, dtype: str = "float32",
                  calibration: Calibration | None = None, stored: bool = False, dim: int | None = None) -> pa.Table:
    """``id`` (type kept) and ``embedding``: a fixed-size list of ``dtype``'s stored type
    (float32, halffloat, int8 or uint8; dim/8 packed bytes for binary/ubinary). Quantized parts
    carry the quantization record (dtype, dim, calibration) in the schema metadata.

    ``vectors``: float vectors [N, D], or with ``stored=True`` values already of the stored type
    [N, W] (an incremental run's reused rows next to fresh ones), ``dim`` then giving D."""
    if stored:
        if dim is None:
            raise ValueError("stored vectors need their float dimension: pass dim")
    else:
        dim = vectors.shape[1]
        vectors = quantize(vectors, dtype=dtype, calibration=calibration)  # [N, W]
    values = np.ascontiguousarray(vectors, dtype=stored_type(dtype).arrow.to_pandas_dtype())  # [N, W]
    table = pa.Table.from_arrays([ids, vector_column(values)], names=["id", "embedding"])  # not pa.table: see there
    if not stored_type(dtype).quantized:
        return table
    record = quantization_record(dtype=dtype, dim=dim, calibration=calibration)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(record).encode()})


def write_table_atomic(table: pa.Table, path: TreePath) -> TreePath:
    """Write to a temporary name in the same folder, then rename: readers never see half a file."""
    return atomic_write_table(table, path)



def document_means(vectors: np.ndarray, *, doc: np.ndarray, documents: int) -> np.ndarray:
    """[N, D] float32: each document's normalised mean of its chunks' vectors (``vectors`` [C, D], float or
    float16 stored values; ``doc`` [C] each chunk's document, 0..N-1), summed in float64."""
    sums = np.zeros((documents, vectors.shape[1]), dtype=np.float64)
    np.add.at(sums, doc, vectors.astype(np.float64))
    return (sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)).astype(np.float32)

class ParquetPartWriter:
    """Built once per worker; writes ``<output>/vectors/part-<unit id>.parquet`` per unit
    (``part-<unit id>.<attempt>.parquet`` on an object store, a new name for every attempt).

    int8/uint8 need the run's ``calibration`` (the same on every worker: the driver fits it). ``description``:
    the output's record (embedpipe/io/describe.py), put in every part's schema metadata."""

    def __init__(self, *, output_path: str, dtype: str = "float32", calibration: Calibration | None = None,
                 dim: int | None = None, description: OutputDescription | None = None):
        self.layout = OutputLayout(output_path)
        self.description = description
        self.dir = self.layout.vectors
        self.layout.store.mkdir(self.dir)
        self.dtype, self.calibration, self.dim = dtype, calibration, dim
        if stored_type(dtype).calibrated and calibration is None:  # fail at startup, not at the first unit
            raise ValueError(f"output.dtype {dtype!r} needs the run's calibration ranges")

    def path_for(self, unit_id: str) -> TreePath:
        """Where this attempt writes the unit's part (attempt-unique where the store cannot rename)."""
        return self.layout.part(unit_id, attempt_token() if self.layout.store.unique_parts else None)

    def store(self, vectors: np.ndarray) -> np.ndarray:
        """Float vectors [N, D] -> the stored values [N, W] this writer writes."""
        return quantize(vectors, dtype=self.dtype, calibration=self.calibration)

    def __call__(self, unit_id: str, ids: pa.Array, vectors: np.ndarray,
                 extra: dict[str, pa.Array] | None = None, *, stored: bool = False) -> str:
        """``vectors``: float [N, D], or stored values [N, W] from ``store`` (and reused rows) with ``stored``."""
        return str(self.write(unit_id, ids, vectors, extra, stored=stored).path)

    def write_documents(self, unit_id: str, ids: pa.Array, doc: np.ndarray, vectors: np.ndarray) -> Written:
        """output.document_vectors: mean: one row per document (``ids``), the normalised mean of its chunks'
        vectors (``vectors`` [C, D] float or float16 stored values, ``doc`` [C] each chunk's document), to
        ``document_vectors/part-<unit>.parquet``."""
        table = vectors_table(ids, document_means(vectors, doc=doc, documents=len(ids)), dtype=self.dtype)
        unique = attempt_token() if self.layout.store.unique_parts else None
        return self.layout.store.write_table(table, self.layout.document_part(unit_id, unique))

    def write(self, unit_id: str, ids: pa.Array, vectors: np.ndarray,
              extra: dict[str, pa.Array] | None = None, *, stored: bool = False) -> Written:
        """As ``__call__``; returns the part as written (path, size, sha256 of the bytes) for its manifest record."""
        table = vectors_table(ids, vectors, dtype=self.dtype, calibration=self.calibration, stored=stored,
                              dim=self.dim)
        for name, column in (extra or {}).items():  # e.g. content_hash of incremental runs
            table = table.append_column(name, column)
        return self.layout.store.write_table(with_description(table, self.description), self.path_for(unit_id))
