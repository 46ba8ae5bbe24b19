"""The int8/uint8 calibration sample's float vectors, kept for its rows so that no row is embedded twice.

    driver: the sample's texts and vectors (cluster/calibrate.py, embedded by the run's workers)
            -> SampleVectors.kept: only when the sample holds a large share of the input, within a byte bound
            -> every worker's WorkerSetup
    worker: a unit's texts to encode -> lookup -> the rows the sample holds take its vectors; the others are encoded

Same text, same vector: the sample's rows were embedded by the run's own encoder, and batch invariance makes a
row's vector the same whichever batch held it (to fp32 rounding: tests/model_helpers.assert_batch_invariant).
The rows are matched by their text, so whatever the run's ``input.on_bad_row`` or an incremental night leaves
to encode finds its vectors. Chunked runs (``input.chunking``) keep nothing: their rows are chunks, not texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

KEEP_SHARE = 0.25  # kept when the sample holds at least this share of the input's rows ...
KEEP_BYTES = 256 << 20  # ... and its vectors and texts fit in this many bytes (every worker holds a copy)


@dataclass(frozen=True)
class SampleVectors:
    """The calibration sample's texts and the run's float vectors for them, looked up by text."""

    texts: list[str]  # [S] as the input's reader gives them (the prompt is the encoder's)
    vectors: np.ndarray  # [S, D] float32: the run's float vectors, before output.dtype

    @classmethod
    def kept(cls, texts: list[str], vectors: np.ndarray, *, input_rows: int) -> SampleVectors | None:
        """The sample worth keeping for the units: it holds ``KEEP_SHARE`` of the input's ``input_rows`` (an input
        no larger than ``output.calibration_rows`` is all in it) and fits in ``KEEP_BYTES``; else None."""
        size = vectors.nbytes + sum(len(t) for t in texts)  # characters: about the texts' bytes
        if not texts or len(texts) < KEEP_SHARE * input_rows or size > KEEP_BYTES:
            return None
        return cls(texts=list(texts), vectors=np.ascontiguousarray(vectors, dtype=np.float32))

    @cached_property
    def _row_of(self) -> dict[str, int]:  # text -> its row in the sample, built once per worker
        return {text: row for row, text in enumerate(self.texts)}

    def lookup(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """Which of ``texts`` the sample holds: a mask [N] bool and their vectors [K, D] in order; None for none."""
        row_of = self._row_of
        rows = np.fromiter((row_of.get(t, -1) for t in texts), dtype=np.int64, count=len(texts))  # [N]
        found = rows >= 0
        return (found, self.vectors[rows[found]]) if found.any() else None


def fill(found: np.ndarray, known: np.ndarray, encoded: np.ndarray) -> np.ndarray:
    """[N, D] in order: ``known`` [K, D] where ``found`` [N] is true, ``encoded`` [N - K, D] elsewhere."""
    vectors = np.empty((len(found), known.shape[1]), dtype=np.float32)
    vectors[found] = known
    vectors[~found] = encoded
    return vectors
