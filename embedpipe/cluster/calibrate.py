"""Quantized outputs: one int8/uint8 calibration for the whole run, and the record readers need.

    sample rows (seeded) -> embed them on the run's own workers -> per-dimension min/max
    -> every worker gets the same Calibration -> <output>/quantization.json

The calibration is fitted once and then kept: a resumed run reads it back from the output, and an
incremental run takes the current version's (reused vectors and fresh ones share one set of
ranges). The sample is a cluster sample, bounded in cost on any corpus size: units drawn uniformly
(at least one per SAMPLE_ROWS_PER_UNIT rows asked, and enough to hold the rows asked), read whole
through the input's reader (bad rows left out), then rows drawn uniformly among them.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable

import numpy as np

from embedpipe.config import InputConfig, JobSpec
from embedpipe.io.layout import OutputLayout, atomic_write_text
from embedpipe.io.quantize import Calibration, fit_calibration, quantization_record, read_record, stored_type
from embedpipe.units import Unit

log = logging.getLogger(__name__)

SAMPLE_ROWS_PER_UNIT = 1000  # rows asked per unit read: 10,000 rows -> 10 units

Embed = Callable[[list[str]], np.ndarray]  # texts -> the run's float vectors [n, D]


def sample_texts(cfg: InputConfig, units: list[Unit], *, rows: int, seed: int) -> list[str]:
    """Up to ``rows`` texts: units drawn uniformly (seeded), then rows uniformly among their good rows."""
    from embedpipe.io.formats import UnitReader

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(units))  # units in a seeded random order; take a prefix of it
    spread = max(1, math.ceil(rows / SAMPLE_ROWS_PER_UNIT))  # at least this many units ...
    held = np.cumsum([units[i].num_rows for i in order.tolist()])  # ... holding at least `rows` rows
    k = min(len(units), max(spread, int(np.searchsorted(held, rows)) + 1))
    chosen = np.sort(order[:k])
    # bad rows are left out of the sample whatever input.on_bad_row says: the ranges are of real texts
    reader = UnitReader(text_column=cfg.text_column, id_column=cfg.id_column, on_bad_row="skip")
    texts = [t for i in chosen.tolist() for t in reader(units[i]).texts]
    picks = np.sort(rng.choice(len(texts), size=min(rows, len(texts)), replace=False))
    return [texts[i] for i in picks.tolist()]


def prepare_quantization(job: JobSpec, units: list[Unit], output: Path, *, dim: int, previous: str | Path | None,
                         embed: Embed | None = None) -> Calibration | None:
    """The run's calibration (None for types that need none); writes ``<output>/quantization.json``.

    Order: this output's record (a resumed run), the previous version's (an incremental run), else
    fit one on a sample that ``embed`` turns into the run's float vectors (the run's workers, as they
    start: ``driver._embed_on_workers``; each checks the driver's code first, ``EmbedWorker.embed_sample``).
    ``dim``: the stored vectors' dimension, from the run's plan (``RunPlan.model.vector_dim``).
    ``embed``: None only where no calibration can need fitting (its absence then raises).
    """
    dtype = job.output.dtype
    if not stored_type(dtype).quantized:
        return None
    calibration = None
    if stored_type(dtype).calibrated:
        for source in (output, previous):
            record = read_record(source)
            if record and record.get("dtype") == dtype and "calibration" in record:
                calibration = Calibration(**record["calibration"])
                log.info("int8 calibration taken from %s", OutputLayout(source).quantization)
                break
        else:
            if embed is None:
                raise RuntimeError("prepare_quantization: a calibration to fit and no embed given; this is "
                                   "embedpipe's bug, report it")
            calibration = fit(job, units, embed=embed)
    record = quantization_record(dtype=dtype, dim=dim, calibration=calibration)
    atomic_write_text(OutputLayout(output).quantization, json.dumps(record, indent=2) + "\n")
    return calibration


def fit(job: JobSpec, units: list[Unit], *, embed: Embed) -> Calibration:
    """A calibration fitted on the job's seeded sample of ``units``, embedded by ``embed``."""
    o = job.output
    texts = sample_texts(job.input, units, rows=o.calibration_rows, seed=o.calibration_seed)
    if not texts:
        raise ValueError("output.dtype int8/uint8: the calibration sample found no text rows in the input")
    vectors = embed(texts)
    log.info("int8 calibration fitted on %d sampled rows", len(texts))
    return fit_calibration(vectors, precision=o.dtype, seed=o.calibration_seed,
                           input_rows=sum(u.num_rows for u in units))
