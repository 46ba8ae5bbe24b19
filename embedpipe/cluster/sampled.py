"""The int8/uint8 calibration sample's float vectors, kept for its rows so that no row is embedded twice.

    workers: pieces of the sample -> SamplePiece (vectors, what each text embedded cost, the piece's span)
    driver:  the pieces -> SampleVectors.kept: only when the sample holds a large share of the input, within a byte
             bound -> every worker's WorkerSetup
    worker:  a unit's texts to encode -> take -> the texts the sample holds take its vectors, and their share of
             what embedding them cost (tokens, padding, stage seconds); the others are encoded

Same text, same vectors: the sample's texts were embedded by the run's own encoder, and batch invariance makes a
row's vector the same whichever batch held it (to fp32 rounding: tests/model_helpers.assert_batch_invariant).
Texts are matched as they are, so whatever the run's ``input.on_bad_row`` or an incremental night leaves to
encode finds its vectors. A text taken from the sample counts in its unit as if the unit had encoded it: its real
tokens, and its share (by tokens) of its piece's padded tokens and stage seconds; the pieces' own spans on the
workers' timelines carry their wall time (the report's scaling). With ``input.chunking`` a text is a document and
has the vectors of its chunks (rows), with their columns; a piece embeds only some of its documents
(``documents_within``), and only those are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from embedpipe.ranges import bounds, ranges
from embedpipe.report.counters import Counters, DocumentCost

KEEP_SHARE = 0.05  # kept when the sample holds at least this share of the input's rows (a row's lookup by its text
# costs ~0.2 µs, its tokenizing alone ~40: docs/performance.md, session 34) ...
KEEP_BYTES = 256 << 20  # ... and its vectors and texts fit in this many bytes (every worker holds a copy)


@dataclass
class SamplePiece:
    """One piece of the calibration sample embedded by one worker (``EmbedWorker.embed_sample``)."""

    vectors: np.ndarray  # [V, D] float32: the run's float vectors, before output.dtype (one per row: per chunk)
    size: int  # [n] the texts it was given
    embedded: np.ndarray  # [E] int64 those it embedded, in order (all of them; chunked: documents_within's)
    cost: DocumentCost  # [E] what embedding each cost; its ``chunks`` (1 when unchunked) add up to V
    chunks: dict[str, np.ndarray] | None  # chunked: text.chunking.CHUNK_FIELDS -> [V], "doc" into ``embedded``
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
    """The calibration sample's texts that were embedded, the run's float vectors for them, and what embedding
    each cost."""

    texts: list[str]  # [S] as the input's reader gives them (the prompt is the encoder's)
    vectors: np.ndarray  # [V, D] float32: text s has vectors[first[s]:first[s + 1]] (one; chunked: its chunks')
    first: np.ndarray  # [S + 1] int64
    tokens: np.ndarray  # [S] int64 real tokens
    tokens_squared: np.ndarray  # [S] int64
    truncated: np.ndarray  # [S] int64 rows cut at max_seq_len
    padded: np.ndarray  # [S] float64: its piece's computed tokens (padding included), shared out by tokens
    seconds: dict[str, np.ndarray]  # stage -> [S] float64: its piece's stage seconds, shared out by tokens
    chunks: dict[str, np.ndarray] | None  # chunked: CHUNK_FIELDS but "doc" -> [V] (a text's chunks: ``first``)

    @classmethod
    def kept(cls, texts: list[str], pieces: list[SamplePiece], *, input_rows: int) -> SampleVectors | None:
        """The sample (``texts``, cut in ``pieces`` in order) worth keeping for the units: what it embedded holds
        ``KEEP_SHARE`` of the input's ``input_rows`` (an unchunked input no larger than ``output.calibration_rows``
        is all in it) and fits in ``KEEP_BYTES``; else None."""
        if sum(p.size for p in pieces) != len(texts):
            raise ValueError(f"the calibration's pieces hold {sum(p.size for p in pieces)} texts, its sample "
                             f"{len(texts)}: this is embedpipe's bug, report it")
        starts = bounds(np.array([p.size for p in pieces], dtype=np.int64))
        held = [texts[start + i] for p, start in zip(pieces, starts.tolist()) for i in p.embedded.tolist()]
        if not held or len(held) < KEEP_SHARE * input_rows:
            return None
        size = sum(p.vectors.nbytes + sum(c.nbytes for c in (p.chunks or {}).values()) for p in pieces)
        if size + sum(len(t) for t in held) > KEEP_BYTES:  # characters: about the texts' bytes
            return None
        vectors = np.concatenate([p.vectors for p in pieces])
        shares = [p.cost.tokens / max(int(p.cost.tokens.sum()), 1) for p in pieces]  # each text's share of its piece
        counters = [Counters.from_dict(p.span.counters) for p in pieces]
        stages = sorted({stage for c in counters for stage, seconds in c.stages.items() if seconds})
        joined = lambda name: np.concatenate([getattr(p.cost, name) for p in pieces])  # noqa: E731
        chunks = None
        if pieces[0].chunks is not None:  # in the texts' order: a text's chunks are found through ``first``
            chunks = {name: np.concatenate([p.chunks[name] for p in pieces]) for name in pieces[0].chunks
                      if name != "doc"}
        return cls(texts=held, vectors=np.ascontiguousarray(vectors, dtype=np.float32),
                   first=bounds(joined("chunks")),
                   tokens=joined("tokens"), tokens_squared=joined("tokens_squared"), truncated=joined("truncated"),
                   padded=np.concatenate([s * c.padded_tokens for s, c in zip(shares, counters)]),
                   seconds={stage: np.concatenate([s * c.stages.get(stage, 0.0) for s, c in zip(shares, counters)])
                            for stage in stages},
                   chunks=chunks)

    @cached_property
    def _row_of(self) -> dict[str, int]:  # text -> its place in the sample, built once per worker
        return {text: row for row, text in enumerate(self.texts)}

    def take(self, texts: list[str]) -> Taken | None:
        """The texts of ``texts`` that the sample holds (None for none)."""
        row_of = self._row_of
        rows = np.fromiter((row_of.get(t, -1) for t in texts), dtype=np.int64, count=len(texts))  # [N]
        found = rows >= 0
        return Taken(found=found, rows=rows[found], sample=self) if found.any() else None


@dataclass(frozen=True)
class Taken:
    """The texts of a unit's texts to encode that the sample holds."""

    found: np.ndarray  # [N] bool over the texts to encode
    rows: np.ndarray  # [K] their places in the sample, in order
    sample: SampleVectors

    @cached_property
    def _counts(self) -> np.ndarray:  # [K] vectors of each text taken (1; chunked: its chunks), read up to 3 times
        first = self.sample.first
        return first[self.rows + 1] - first[self.rows]

    def _vectors(self) -> np.ndarray:  # [V'] the sample's vectors of the texts taken, in order
        return ranges(self.sample.first[self.rows], self._counts)

    def others(self, texts: list[str]) -> list[str]:
        """The texts (the ``texts`` this was taken from) that the sample does not hold: those left to encode."""
        return [text for text, found in zip(texts, self.found.tolist()) if not found]

    def fill(self, encoded: np.ndarray) -> np.ndarray:
        """[N, D] in order: the sample's vectors where found, ``encoded`` [N - K, D] (the other rows) elsewhere."""
        vectors = np.empty((len(self.found), self.sample.vectors.shape[1]), dtype=np.float32)
        vectors[self.found] = self.sample.vectors[self.sample.first[self.rows]]
        vectors[~self.found] = encoded
        return vectors

    def fill_chunks(self, chunks, encoded: np.ndarray):
        """Chunked: ``chunks`` (text.chunking.Chunks, "doc" into the texts not found) and their vectors [C, D],
        joined with the chunks and vectors of the texts found: (Chunks, "doc" into all N texts; [C + C', D]), the
        chunks in no particular order."""
        from embedpipe.text.chunking import CHUNK_FIELDS, Chunks

        index = self._vectors()  # [C']
        taken = {name: self.sample.chunks[name][index] for name in CHUNK_FIELDS if name != "doc"}
        taken["doc"] = np.repeat(np.flatnonzero(self.found), self._counts)
        mine = {name: getattr(chunks, name) for name in CHUNK_FIELDS}
        mine["doc"] = np.flatnonzero(~self.found)[chunks.doc]
        joined = Chunks(**{name: np.concatenate([mine[name], taken[name].astype(mine[name].dtype)])
                           for name in CHUNK_FIELDS})
        return joined, np.concatenate([encoded, self.sample.vectors[index]])

    def count(self, counters: Counters) -> None:
        """Add the texts to the unit's counters as if it had encoded them (and their rows as ``sampled_rows``)."""
        s, rows, counts = self.sample, self.rows, self._counts
        tokens = int(s.tokens[rows].sum())
        counters.rows += int(counts.sum())
        counters.sampled_rows += int(counts.sum())
        counters.tokens += tokens
        counters.sampled_tokens += tokens
        counters.tokens_squared += int(s.tokens_squared[rows].sum())
        counters.truncated_rows += int(s.truncated[rows].sum())
        counters.padded_tokens += int(round(float(s.padded[rows].sum())))
        for stage, seconds in s.seconds.items():
            counters.stages[stage] = counters.stages.get(stage, 0.0) + float(seconds[rows].sum())
        if s.chunks is not None:
            counters.add_documents(counts)
