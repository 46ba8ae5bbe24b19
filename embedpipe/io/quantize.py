"""Stored vector types: float32/float16 casts and sentence-transformers' quantize_embeddings.

    vectors [N, D] float32 -> stored [N, W] (W = D, or ceil(D / 8) packed bytes for the bit types)

int8/uint8 cut each dimension's calibrated [min, max] range into 256 buckets, exactly as
``sentence_transformers.quantize_embeddings(..., ranges=...)`` does (float32 arithmetic, floor,
clip). The ranges come from a sample of the run (``Calibration``) and must be the same for every
worker, so the driver fits them once and hands them out. binary/ubinary pack the bits ``x > 0``
(``np.packbits``); binary then subtracts 128 into int8. Pure numpy: no torch, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from embedpipe.io.layout import QUANTIZATION, OutputLayout
from embedpipe.io.store import store_for, tree_path

METADATA_KEY = b"embedpipe.quantization"  # Parquet schema metadata key of every part
RECORD = QUANTIZATION  # the same record, once per output folder (the layout's name)


@dataclass(frozen=True)
class Calibration:
    """Per-dimension ranges of an int8/uint8 run, and where they came from."""

    precision: str  # "int8" | "uint8"
    ranges: list[list[float]]  # [2][D]: per-dimension minimum, maximum (float32 values)
    rows: int  # rows the ranges were measured on
    seed: int  # seed of the uniform sample of rows
    input_rows: int  # rows of the whole input the sample was drawn from

    @property
    def ranges_array(self) -> np.ndarray:  # [2, D] float32
        return np.asarray(self.ranges, dtype=np.float32)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Calibration":
        return cls(**json.loads(text))


def fit_calibration(vectors: np.ndarray, *, precision: str, seed: int, input_rows: int) -> Calibration:
    """Per-dimension min/max of calibration vectors [n, D], as sentence-transformers computes them."""
    if vectors.ndim != 2 or vectors.shape[0] == 0:
        raise ValueError(f"calibration needs a non-empty [rows, dim] array, got shape {vectors.shape}")
    ranges = np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32)  # [2, D]
    return Calibration(precision=precision, ranges=ranges.tolist(), rows=int(vectors.shape[0]), seed=seed,
                       input_rows=input_rows)


def _scalar(vectors: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Bucket index 0..255 of each value: sentence-transformers' int8 arithmetic, float32 throughout."""
    starts = ranges[0, :]
    steps = (ranges[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    return np.clip(np.floor((vectors - starts) / steps), 0, 255)  # [N, D]


def _int8(vectors: np.ndarray, ranges: np.ndarray | None) -> np.ndarray:
    return (_scalar(vectors, _need(ranges)) - 128).astype(np.int8)


def _uint8(vectors: np.ndarray, ranges: np.ndarray | None) -> np.ndarray:
    return _scalar(vectors, _need(ranges)).astype(np.uint8)


def _need(ranges: np.ndarray | None) -> np.ndarray:
    if ranges is None:
        raise ValueError("int8/uint8 output needs calibration ranges (output.dtype int8/uint8 runs calibrate first)")
    return ranges.astype(np.float32, copy=False)


@dataclass(frozen=True)
class StoredType:
    arrow: pa.DataType  # element type of the fixed-size list column
    encode: Callable[[np.ndarray, np.ndarray | None], np.ndarray]  # ([N, D] float32, ranges) -> [N, W]
    width: Callable[[int], int]  # D -> W
    calibrated: bool = False  # needs Calibration ranges
    quantized: bool = True  # carries the quantization record (float32/float16 are plain casts)


OUTPUT_TYPES: dict[str, StoredType] = {
    "float32": StoredType(pa.float32(), lambda v, r: v.astype(np.float32, copy=False), lambda d: d, quantized=False),
    "float16": StoredType(pa.float16(), lambda v, r: v.astype(np.float16), lambda d: d, quantized=False),
    "int8": StoredType(pa.int8(), _int8, lambda d: d, calibrated=True),
    "uint8": StoredType(pa.uint8(), _uint8, lambda d: d, calibrated=True),
    "binary": StoredType(pa.int8(), lambda v, r: (np.packbits(v > 0, axis=-1) - 128).astype(np.int8), lambda d: -(-d // 8)),
    "ubinary": StoredType(pa.uint8(), lambda v, r: np.packbits(v > 0, axis=-1), lambda d: -(-d // 8)),
}


def stored_type(dtype: str) -> StoredType:
    if dtype not in OUTPUT_TYPES:
        raise ValueError(f"output.dtype {dtype!r} is not one of {', '.join(OUTPUT_TYPES)}")
    return OUTPUT_TYPES[dtype]


def quantize(vectors: np.ndarray, *, dtype: str, calibration: Calibration | None = None) -> np.ndarray:
    """[N, D] float32 -> [N, W] stored values of ``dtype``."""
    kind = stored_type(dtype)
    if kind.calibrated and (calibration is None or calibration.precision != dtype):
        got = "none" if calibration is None else f"one for {calibration.precision}"
        raise ValueError(f"output.dtype {dtype!r} needs a Calibration of that precision, got {got}")
    ranges = calibration.ranges_array if kind.calibrated else None
    return kind.encode(np.asarray(vectors, dtype=np.float32), ranges)


def quantization_record(*, dtype: str, dim: int, calibration: Calibration | None) -> dict:
    """What a reader needs to interpret the stored vectors; written to every part and quantization.json."""
    record = {"dtype": dtype, "dim": dim, "width": stored_type(dtype).width(dim)}
    if calibration is not None:
        record["calibration"] = asdict(calibration)
    return record


def read_record(path: str | Path | None) -> dict | None:
    """An output's quantization record: ``path`` is its folder or the ``quantization.json`` itself;
    None when there is none."""
    if path is None:
        return None
    path = tree_path(path)
    store = store_for(path)
    folder = Path(path).is_dir() if store.local else path.suffix != ".json"
    path = OutputLayout(path).quantization if folder else path
    return json.loads(store.read_bytes(path)) if store.exists(path) else None
