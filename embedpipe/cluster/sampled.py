"""The int8/uint8 calibration sample's float vectors, kept for its rows so that no row is embedded twice.

    workers: pieces of the sample -> SamplePiece (vectors, each row's tokens, the piece's counters and times)
    driver:  the pieces -> SampleVectors.kept: only when the sample holds a large share of the input, within a byte
             bound -> every worker's WorkerSetup
    worker:  a unit's texts to encode -> take -> the rows the sample holds take its vectors, and their share of
             what embedding them cost (tokens, padding, stage seconds); the others are encoded

Same text, same vector: the sample's rows were embedded by the run's own encoder, and batch invariance makes a
row's vector the same whichever batch held it (to fp32 rounding: tests/model_helpers.assert_batch_invariant).
Rows are matched by their text, so whatever the run's ``input.on_bad_row`` or an incremental night leaves to
encode finds its vectors. A row taken from the sample counts in its unit as if the unit had encoded it: its real
tokens, and its share (by tokens) of its piece's padded tokens and stage seconds; the pieces' own spans on the
workers' timelines carry their wall time (the report's scaling). Chunked runs (``input.chunking``) keep nothing:
their rows are chunks, not texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from embedpipe.report.counters import Counters

KEEP_SHARE = 0.05  # kept when the sample holds at least this share of the input's rows (a row's lookup by its text
# costs ~0.2 µs, its tokenizing alone ~40: docs/performance.md, session 34) ...
KEEP_BYTES = 256 << 20  # ... and its vectors and texts fit in this many bytes (every worker holds a copy)


@dataclass
class SamplePiece:
    """One piece of the calibration sample embedded by one worker (``EmbedWorker.embed_sample``)."""

    vectors: np.ndarray  # [n, D] float32: the run's float vectors, before output.dtype ([C, D] chunks: chunked)
    tokens: np.ndarray | None  # [n] int64: each row's real tokens (None: chunked, never kept)
    truncated: np.ndarray | None  # [n] bool: the row was cut at max_seq_len (None: chunked)
    span: Any  # cluster.worker.UnitResult: the piece on its worker's timeline, with the counters of its embedding


def documents_within(chunks_per_document: np.ndarray, *, rows: int) -> np.ndarray:
    """A chunked run's piece of the sample: indices, in order, of a fixed-seed random subset of its documents whose
    chunks [N] add up to at most ``rows`` (at least one document; all of them when they fit). Its calibration then
    embeds about as many chunk vectors as ``output.calibration_rows`` asks rows, not every chunk of every sampled
    document; the subset depends on the piece alone, so any worker that takes it embeds the same chunks."""
    order = np.random.default_rng(0).permutation(len(chunks_per_document))
    held = np.cumsum(chunks_per_document[order])  # chunks of the first k documents of that order
    return np.sort(order[:max(1, int(np.searchsorted(held, rows, side="right")))])


@dataclass(frozen=True)
class SampleVectors:
    """The calibration sample's texts, the run's float vectors for them, and what embedding each row cost."""

    texts: list[str]  # [S] as the input's reader gives them (the prompt is the encoder's)
    vectors: np.ndarray  # [S, D] float32
    tokens: np.ndarray  # [S] int64 real tokens
    truncated: np.ndarray  # [S] bool
    padded: np.ndarray  # [S] float64: its piece's computed tokens (padding included), shared out by tokens
    seconds: dict[str, np.ndarray]  # stage -> [S] float64: its piece's stage seconds, shared out by tokens

    @classmethod
    def kept(cls, texts: list[str], pieces: list[SamplePiece], *, input_rows: int) -> SampleVectors | None:
        """The sample (``texts``, embedded in ``pieces`` in order) worth keeping for the units: it holds
        ``KEEP_SHARE`` of the input's ``input_rows`` (an input no larger than ``output.calibration_rows`` is all in
        it) and fits in ``KEEP_BYTES``; else None."""
        if not texts or len(texts) < KEEP_SHARE * input_rows:
            return None
        size = sum(p.vectors.nbytes for p in pieces) + sum(len(t) for t in texts)  # characters: about the texts' bytes
        if size > KEEP_BYTES:
            return None
        vectors = np.concatenate([p.vectors for p in pieces])
        shares = [p.tokens / max(int(p.tokens.sum()), 1) for p in pieces]  # each row's share of its piece
        counters = [Counters.from_dict(p.span.counters) for p in pieces]
        stages = sorted({stage for c in counters for stage, seconds in c.stages.items() if seconds})
        return cls(texts=list(texts), vectors=np.ascontiguousarray(vectors, dtype=np.float32),
                   tokens=np.concatenate([p.tokens for p in pieces]).astype(np.int64),
                   truncated=np.concatenate([p.truncated for p in pieces]).astype(bool),
                   padded=np.concatenate([s * c.padded_tokens for s, c in zip(shares, counters)]),
                   seconds={stage: np.concatenate([s * c.stages.get(stage, 0.0) for s, c in zip(shares, counters)])
                            for stage in stages})

    @cached_property
    def _row_of(self) -> dict[str, int]:  # text -> its row in the sample, built once per worker
        return {text: row for row, text in enumerate(self.texts)}

    def take(self, texts: list[str]) -> Taken | None:
        """The rows of ``texts`` that the sample holds (None for none)."""
        row_of = self._row_of
        rows = np.fromiter((row_of.get(t, -1) for t in texts), dtype=np.int64, count=len(texts))  # [N]
        found = rows >= 0
        return Taken(found=found, rows=rows[found], sample=self) if found.any() else None


@dataclass(frozen=True)
class Taken:
    """The rows of a unit's texts to encode that the sample holds."""

    found: np.ndarray  # [N] bool over the texts to encode
    rows: np.ndarray  # [K] their rows in the sample, in order
    sample: SampleVectors

    def fill(self, encoded: np.ndarray) -> np.ndarray:
        """[N, D] in order: the sample's vectors where found, ``encoded`` [N - K, D] (the other rows) elsewhere."""
        vectors = np.empty((len(self.found), self.sample.vectors.shape[1]), dtype=np.float32)
        vectors[self.found] = self.sample.vectors[self.rows]
        vectors[~self.found] = encoded
        return vectors

    def count(self, counters: Counters) -> None:
        """Add the rows to the unit's counters as if it had encoded them (and as ``sampled_rows``)."""
        s, rows = self.sample, self.rows
        tokens = s.tokens[rows]  # [K]
        counters.rows += len(rows)
        counters.sampled_rows += len(rows)
        counters.tokens += int(tokens.sum())
        counters.sampled_tokens += int(tokens.sum())
        counters.tokens_squared += int((tokens ** 2).sum())
        counters.truncated_rows += int(s.truncated[rows].sum())
        counters.padded_tokens += int(round(float(s.padded[rows].sum())))
        for stage, seconds in s.seconds.items():
            counters.stages[stage] = counters.stages.get(stage, 0.0) + float(seconds[rows].sum())
