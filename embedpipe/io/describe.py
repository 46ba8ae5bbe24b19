"""What an output is, said by the output itself: ``<output>/embedpipe.json``, and the same record in every part's
Parquet schema metadata (key ``b"embedpipe"``).

    {"format_version": 1, "embedpipe_version": "0.1.0",
     "model": {"name": "sentence-transformers/all-MiniLM-L6-v2", "path": "/.../all-MiniLM-L6-v2",
               "sha256": "<the model's files>", "weights": {"model.safetensors": "<sha256>"}},
     "dim": 384, "model_dim": 384, "dtype": "float32", "width": 384, "normalized": true, "metric": "cosine",
     "pooling": "mean", "max_seq_len": 256, "prompt": "", "query_prompt": "",
     "calibration": null, "chunking": null}

Every value is resolved (never "auto"): ``normalized`` is whether the stored vectors are unit-length, ``metric``
the comparison that implies (``cosine``: inner product of unit vectors, FAISS METRIC_INNER_PRODUCT; ``l2`` for
vectors of other lengths, as the index uses; ``hamming`` for the packed bits of binary/ubinary), ``dim`` the
float dimension of the stored vectors (output.dim for a Matryoshka truncation, ``model_dim`` the model's own),
``width`` the stored values per row (dim/8 bytes for the bit types). ``calibration``: int8/uint8's per-dimension
ranges (embedpipe/io/quantize.py). ``chunking``: null unless the run cut documents into chunks, then the chunking
settings that run used (set by ``OutputDescription.with_chunking``).

This module is the record's one owner: the driver builds it once (``RunPlan.describe``), workers put it in each
part, the driver writes embedpipe.json; ``open_index``, ``search``, ``report`` and incremental runs read it back
with ``read_description``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import pyarrow as pa

from embedpipe.io.layout import OutputLayout, atomic_write_text
from embedpipe.io.quantize import Calibration, stored_type
from embedpipe.io.store import TreePath, store_for, tree_path

METADATA_KEY = b"embedpipe"  # Parquet schema metadata key of every part
FORMAT_VERSION = 1


def embedpipe_version() -> str:
    """The installed package's version (importlib.metadata: io/ may not import the package's top module)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedpipe")
    except PackageNotFoundError:  # a source tree on sys.path without an installed distribution
        return "unknown"


def implied_metric(*, normalized: bool, dtype: str) -> str:
    """How vectors of this kind are compared: cosine (unit vectors: inner product), l2, or hamming (packed bits)."""
    if dtype in ("binary", "ubinary"):
        return "hamming"
    return "cosine" if normalized else "l2"


@dataclass(frozen=True)
class ModelRecord:
    name: str  # model.path as the job gave it (a hub name, a folder, a URL)
    path: str  # the folder it resolved to on the driver
    sha256: str  # over the names and contents of the model's files a worker reads (the manifest's model fingerprint)
    weights: dict[str, str] = field(default_factory=dict)  # weight file (relative name) -> its sha256


@dataclass(frozen=True)
class OutputDescription:
    model: ModelRecord
    dim: int  # float dimension of the stored vectors (output.dim, else the model's)
    model_dim: int  # the model's own dimension (after its Dense layers)
    dtype: str  # output.dtype: float32, float16, int8, uint8, binary, ubinary
    normalized: bool  # the vectors are L2-normalised (resolved: model.normalize or the model's Normalize module)
    pooling: str  # resolved: mean, cls, last, ...
    max_seq_len: int  # tokens per text, special tokens included (resolved)
    prompt: str  # the prefix put before every document ("" for none)
    query_prompt: str  # the model's query prompt, what `search` puts before a query ("" for none)
    calibration: dict | None = None  # int8/uint8: Calibration as a dict (ranges, rows, seed, input_rows)
    chunking: dict | None = None  # null unless documents were cut into chunks: that run's chunking settings
    embedpipe_version: str = field(default_factory=embedpipe_version)
    format_version: int = FORMAT_VERSION

    @property
    def metric(self) -> str:
        return implied_metric(normalized=self.normalized, dtype=self.dtype)

    @property
    def width(self) -> int:
        return stored_type(self.dtype).width(self.dim)

    def with_chunking(self, chunking: dict | None) -> "OutputDescription":
        """The record of a chunked run: ``chunking`` is the chunking settings it used (JSON values)."""
        return replace(self, chunking=chunking)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["metric"], body["width"] = self.metric, self.width
        order = ("format_version", "embedpipe_version", "model", "dim", "model_dim", "dtype", "width", "normalized",
                 "metric", "pooling", "max_seq_len", "prompt", "query_prompt", "calibration", "chunking")
        return {key: body[key] for key in order}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> "OutputDescription":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in body.items() if k in names}
        values["model"] = ModelRecord(**{k: v for k, v in body["model"].items()
                                         if k in {f.name for f in fields(ModelRecord)}})
        return cls(**values)

    @property
    def calibration_ranges(self) -> Calibration | None:
        return Calibration(**self.calibration) if self.calibration else None


def describe(*, model: ModelRecord, dim: int, model_dim: int, dtype: str, normalized: bool, pooling: str,
             max_seq_len: int, prompt: str, query_prompt: str, calibration: Calibration | None = None,
             chunking: dict | None = None) -> OutputDescription:
    """The record of a run's output, from the facts the run resolved once (RunPlan.describe hands them in)."""
    return OutputDescription(model=model, dim=dim, model_dim=model_dim, dtype=dtype, normalized=bool(normalized),
                             pooling=pooling, max_seq_len=int(max_seq_len), prompt=prompt, query_prompt=query_prompt,
                             calibration=asdict(calibration) if calibration is not None else None, chunking=chunking)


# -------------------------------------------------------------------- writing and reading it

def with_description(table: pa.Table, description: OutputDescription | None) -> pa.Table:
    """``table`` with the record in its schema metadata (kept beside any metadata already there)."""
    if description is None:
        return table
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = json.dumps(description.to_dict()).encode()
    return table.replace_schema_metadata(metadata)


def write_description(root: str | TreePath, description: OutputDescription) -> TreePath:
    """``<root>/embedpipe.json`` (one atomic write; one PUT on an object store)."""
    return atomic_write_text(OutputLayout(root).description, description.to_json())


def read_description(root: str | TreePath) -> OutputDescription | None:
    """The record of the output at ``root`` (its embedpipe.json); None for an output written before there was one."""
    path = OutputLayout(tree_path(root)).description
    store = store_for(path)
    if not store.exists(path):
        return None
    return OutputDescription.from_dict(json.loads(store.read_bytes(path)))


def part_description(schema: pa.Schema) -> OutputDescription | None:
    """The record in a part's Parquet schema metadata; None when the part carries none."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    return OutputDescription.from_dict(json.loads(raw)) if raw else None


def changes(old: OutputDescription, new: OutputDescription) -> list[str]:
    """What differs between two outputs' vectors, as ``name old -> new`` (the model by its files' hash)."""
    found = []
    if old.model.sha256 != new.model.sha256:
        found.append(f"model {old.model.name} ({old.model.sha256[:12]}) -> {new.model.name} ({new.model.sha256[:12]})")
    for name in ("dim", "dtype", "normalized", "pooling", "max_seq_len", "prompt", "chunking"):
        before, after = getattr(old, name), getattr(new, name)
        if before != after:
            found.append(f"{name} {before!r} -> {after!r}")
    return found
