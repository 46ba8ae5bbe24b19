"""``embedpipe.embed``: texts, a DataFrame, an Arrow table or a ``datasets.Dataset`` to vectors, in process.

The same engine as a job's workers (``runtime.Encoder``: tokenizer, packer, packed model, head)
built from the same job schema, so the vectors equal the CLI's for the same rows; no Ray starts.
For inputs that fit in memory: the rows go through in chunks of ``CHUNK_ROWS`` and the vectors of
all of them come back as one array. Larger corpora: write them to files and run a ``Job``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from embedpipe.api.options import job_for_options
from embedpipe.io.quantize import Calibration
from embedpipe.io.rows import screen_rows
from embedpipe.io.writer import document_means, vector_column
from embedpipe.text.chunking import Chunks, concat_chunks
from embedpipe.units import InputError

log = logging.getLogger(__name__)

CHUNK_ROWS = 10_000  # rows tokenized and packed together: the default input.unit_rows, as a worker sees them


def embed(inputs: str | Sequence[str] | Any, *, model: str, text_column: str = "text",
          add_column: str | None = None, progress: bool = False,
          calibration: Calibration | str | os.PathLike | None = None, **options: Any) -> Any:
    """Embed ``inputs`` with ``model``, in this process.

    inputs: a string (returns one vector ``[D]``), a sequence of strings, or a table with a
        ``text_column``: ``pandas.DataFrame``, ``pyarrow.Table`` or ``datasets.Dataset``.
    model: ``model.path`` of a job: a model folder or a hub name served offline.
    add_column: for a table, return the table with the vectors added as this column (Arrow and
        datasets: fixed-size lists of float32; pandas: one numpy array per row) instead of the array.
    options: the job file's ``model.*`` fields (``max_seq_len=128``, ``dtype="bfloat16"``,
        ``pooling``, ``normalize``, ``prompt``, ``prompt_name``, ...), ``output.dim`` and ``output.dtype``
        (as ``dim`` and ``output_dtype``: float32, float16, int8, uint8, binary, ubinary), ``on_bad_row`` (``error``, the default, or
        ``embed_empty``: a null or empty text is embedded as ``""``), ``batching.*`` and ``runtime.*``
        (``device="cuda"``), checked by the same schema as a job file: errors name the option.

    calibration: int8/uint8 ranges: a ``Calibration``, or a job's output folder (or its
        ``quantization.json``), so that queries quantize exactly as that job's index did. Without it the
        ranges are fitted on a seeded sample of ``calibration_rows`` of these inputs' own vectors (as
        sentence-transformers' ``quantize_embeddings`` does without calibration embeddings).

    Returns ``np.ndarray [N, W]``, one row per input row, in input order: float32 (or float16, int8,
    uint8 with W = D; binary/ubinary packed bits, W = D/8, as ``output.dtype`` says).

    Long documents: ``chunking=`` takes the job file's ``input.chunking`` fields as a mapping
    (``{"mode": "split", "max_tokens": 256, "overlap": 32}``; ``mode: late`` for long-context models), or the
    mode alone (``chunking="split"``). It then returns a ``ChunkVectors``: the vectors of every chunk [C, W],
    documents in input order and chunks in text order, with each chunk's input ``row``, ``chunk`` number and
    ``start``/``end`` character offsets (``.to_arrow()``: a table of them), as a chunked job writes its rows.
    With ``document_vectors="mean"`` it returns one vector per input row again (``[N, D]``, ``add_column``
    allowed): each row's normalised mean of its chunks, as a job's ``document_vectors/``.
    """
    from tqdm.auto import tqdm

    job = job_for_options(model, options)
    encoder = _encoder(job)
    parts = [np.empty((0, encoder.dim), dtype=np.float32)]
    chunked: list[tuple[Chunks, int]] = []  # with chunking: each slice's chunks and its first row
    rows = 0
    with tqdm(total=_row_count(inputs), unit="rows", disable=not progress, desc="embed") as bar:
        for texts in _text_chunks(inputs, text_column=text_column, on_bad_row=job.input.on_bad_row):
            if encoder.chunker is None:
                parts.append(encoder.embed(texts))  # [n, D]
            else:
                chunks, vectors = encoder.embed_chunks(texts)  # [c, D], documents in order, chunks in text order
                parts.append(vectors)
                chunked.append((chunks, rows))
            rows += len(texts)
            bar.update(len(texts))
    out = np.concatenate(parts) if len(parts) > 2 else parts[-1]
    if job.output.dtype != "float32":
        out = _quantize(out, job.output, calibration)
    if encoder.chunker is not None:
        chunks = concat_chunks([c for c, _ in chunked], offsets=[first for _, first in chunked])
        if job.output.document_vectors == "none":
            if add_column is not None:
                raise TypeError("embed(): add_column needs one vector per row, and chunking gives one per chunk: "
                                "pass document_vectors='mean' (each row's mean of its chunks), or drop add_column")
            return ChunkVectors(vectors=out, row=chunks.doc, chunk=chunks.chunk, start=chunks.start, end=chunks.end)
        out = document_means(out, doc=chunks.doc, documents=rows)  # as a job's document_vectors/ (float16: of the
        if job.output.dtype != "float32":  # chunks' stored values, and stored as float16 again)
            out = _quantize(out, job.output, None)
    if isinstance(inputs, str):
        return out[0]
    return out if add_column is None else _with_column(inputs, add_column, out)


@dataclass(frozen=True)
class ChunkVectors:
    """What ``embed`` returns with ``chunking`` (and ``document_vectors`` none): one row per chunk, documents in
    input order and chunks in text order, as a chunked job's rows; ``text[start:end]`` is a chunk's text."""

    vectors: np.ndarray  # [C, W] as output_dtype says (float32 [C, D] by default)
    row: np.ndarray  # [C] int64: the input row (document) of each chunk
    chunk: np.ndarray  # [C] int32: 0-based within its document
    start: np.ndarray  # [C] int64: character offset of the chunk's text in its document
    end: np.ndarray  # [C] int64: one past its last character

    def __len__(self) -> int:
        return int(self.row.shape[0])

    def to_arrow(self, *, column: str = "embedding") -> pa.Table:
        """The chunks as a table: row, chunk, start, end and the vectors (a fixed-size list column)."""
        return pa.table({"row": self.row, "chunk": self.chunk, "start": self.start, "end": self.end,
                         column: vector_column(self.vectors)})


def _quantize(vectors: np.ndarray, output, calibration) -> np.ndarray:
    """Float vectors [N, D] to ``output.dtype``'s stored values [N, W]."""
    from embedpipe.io.quantize import fit_calibration, quantize, stored_type

    if stored_type(output.dtype).calibrated:
        if calibration is None:
            if not len(vectors):
                raise ValueError(f"embed(): output_dtype={output.dtype!r} needs calibration ranges and there are "
                                 f"no inputs to fit them on: pass calibration=")
            rng = np.random.default_rng(output.calibration_seed)
            pick = np.sort(rng.choice(len(vectors), size=min(output.calibration_rows, len(vectors)), replace=False))
            calibration = fit_calibration(vectors[pick], precision=output.dtype, seed=output.calibration_seed,
                                          input_rows=len(vectors))
        else:
            calibration = _load_calibration(calibration, output.dtype)
    return quantize(vectors, dtype=output.dtype, calibration=calibration)


def _load_calibration(calibration, dtype: str) -> Calibration:
    """A Calibration as given, or read from a job output folder / its quantization.json."""
    from embedpipe.io.quantize import read_record

    if not isinstance(calibration, Calibration):
        record = read_record(calibration)
        if record is None:
            raise FileNotFoundError(f"embed(): calibration={str(calibration)!r}: no quantization.json there; pass "
                                    f"the output folder of a job with output.dtype {dtype!r}, or a Calibration")
        if "calibration" not in record:
            raise ValueError(f"embed(): {calibration} records output.dtype {record.get('dtype')!r}, which has no "
                             f"calibration ranges: pass the output of an int8/uint8 job")
        calibration = Calibration(**record["calibration"])
    if calibration.precision != dtype:
        raise ValueError(f"embed(): the calibration is for {calibration.precision}, output_dtype is {dtype!r}: "
                         f"pass output_dtype={calibration.precision!r}")
    return calibration


_ENCODERS: OrderedDict[str, Any] = OrderedDict()  # the MAX_ENCODERS last used, oldest first
MAX_ENCODERS = 2


def _encoder(job):
    """One encoder per distinct settings, kept across calls (loading a model takes seconds)."""
    from embedpipe.runtime import Encoder

    key = repr((job.model, job.batching, job.runtime, job.output.dim, job.input.chunking))  # lists inside: no hash
    if key not in _ENCODERS:
        _ENCODERS[key] = Encoder.from_job(job)
        _warn_if_slower(_ENCODERS[key])
        while len(_ENCODERS) > MAX_ENCODERS:
            _ENCODERS.popitem(last=False)
    _ENCODERS.move_to_end(key)
    return _ENCODERS[key]


def _warn_if_slower(encoder) -> None:
    """The driver's warning, in process: a model.dtype whose matmul this device measured slower than float32 (bfloat16
    on a CPU with no native bfloat16) is logged once per encoder. float32 (CPU's auto) probes nothing."""
    from embedpipe.report.device import describe_device, slower_than_float32

    if encoder.dtype == "float32":
        return
    line = slower_than_float32(describe_device(encoder.device, dtypes=(encoder.dtype,)), encoder.dtype,
                               setting="embed(dtype=...)", subject="embed()", fix='dtype="float32" (or "auto")')
    if line:
        log.warning(line)


# --------------------------------------------------------------------------- inputs

def _kind(inputs: Any) -> str:
    if isinstance(inputs, str):
        return "text"
    if isinstance(inputs, (pa.Table, pa.RecordBatch)):
        return "arrow"
    pd, hf = sys.modules.get("pandas"), sys.modules.get("datasets")  # never imported here just to check
    if pd is not None and isinstance(inputs, pd.DataFrame):
        return "pandas"
    if hf is not None and isinstance(inputs, hf.Dataset):
        return "datasets"
    if hf is not None and isinstance(inputs, (hf.DatasetDict, hf.IterableDataset)):
        raise TypeError("embed(): pass one split of the dataset (a datasets.Dataset, e.g. ds['train']); "
                        "for a large dataset save_to_disk it and run a Job with input.format: huggingface")
    if isinstance(inputs, (bytes, dict)) or not hasattr(inputs, "__len__"):
        raise TypeError(f"embed(): inputs is a {type(inputs).__name__}: pass a string, a list of strings, or a "
                        f"pandas.DataFrame, pyarrow.Table or datasets.Dataset with a text column")
    return "sequence"


def _row_count(inputs: Any) -> int:
    kind = _kind(inputs)
    return 1 if kind == "text" else len(inputs) if kind != "arrow" else inputs.num_rows


def _text_chunks(inputs: Any, *, text_column: str, on_bad_row: str) -> Iterator[list[str]]:
    """The texts, ``CHUNK_ROWS`` rows at a time, screened like a job's rows (``input.on_bad_row``)."""
    kind = _kind(inputs)
    if kind == "text":
        inputs, kind = [inputs], "sequence"
    if kind == "sequence":
        texts = list(inputs)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) and t is not None), None)
        if bad is not None:
            raise InputError(f"embed(): inputs[{bad}] is {texts[bad]!r}, not a string: pass strings only")
        columns = (pa.array(texts[s:s + CHUNK_ROWS], pa.string()) for s in range(0, len(texts), CHUNK_ROWS))
    else:
        columns = _table_columns(inputs, kind, text_column)
    start = 0
    for column in columns:
        yield _screen(column, start=start, on_bad_row=on_bad_row)
        start += len(column)


def _screen(column: pa.Array, *, start: int, on_bad_row: str) -> list[str]:
    """The job's bad-row screening; rows are named by their position in the input."""
    rows = pa.array(np.arange(start, start + len(column)))
    try:
        return screen_rows(rows, column, policy=on_bad_row, drop=np.zeros(len(column), dtype=bool), where="embed()").texts
    except InputError as exc:  # word it for embed(): rows by position, the option by its keyword
        message = str(exc).replace("row with id", "row").replace("set input.on_bad_row to skip or embed_empty",
                                                                 "pass on_bad_row='embed_empty'")
        raise InputError(message) from None


def _table_columns(inputs: Any, kind: str, text_column: str) -> Iterator[pa.Array]:
    _check_column(inputs, kind, text_column)
    if kind == "datasets":
        chunks = inputs.select_columns([text_column]).with_format("arrow").iter(batch_size=CHUNK_ROWS)
        columns = (chunk.column(text_column) for chunk in chunks)
    elif kind == "pandas":
        series = inputs[text_column]
        columns = (pa.array(series.iloc[s:s + CHUNK_ROWS], from_pandas=True) for s in range(0, len(series), CHUNK_ROWS))
    else:
        column = inputs.column(text_column)
        columns = (column.slice(s, CHUNK_ROWS) for s in range(0, len(column), CHUNK_ROWS))
    for column in columns:
        yield column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _check_column(inputs: Any, kind: str, text_column: str) -> None:
    names = list(inputs.column_names if kind in ("arrow", "datasets") else inputs.columns)
    if text_column not in names:
        raise InputError(f"embed(): no column {text_column!r} (columns: {', '.join(map(str, names))}): "
                         f"pass text_column= the column holding the texts")


def _with_column(inputs: Any, name: str, vectors: np.ndarray) -> Any:
    kind = _kind(inputs)
    if kind == "sequence":
        raise TypeError("embed(): add_column needs a table input (DataFrame, pyarrow.Table, datasets.Dataset)")
    if kind == "pandas":
        return inputs.assign(**{name: list(vectors)})
    column = vector_column(vectors)
    if kind == "datasets":
        return inputs.add_column(name, column)
    table = inputs if isinstance(inputs, pa.Table) else pa.Table.from_batches([inputs])
    return table.append_column(name, column)
