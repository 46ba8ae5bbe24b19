"""One counters object per worker (and per unit): rows, tokens and seconds per stage."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

import numpy as np

STAGES = ("read", "tokenize", "pack", "encode", "write")


@dataclass
class Counters:
    rows: int = 0  # rows that got a vector
    tokens: int = 0  # real tokens, no padding
    padded_tokens: int = 0  # tokens the encoder computed, padding included
    truncated_rows: int = 0
    skipped_rows: int = 0  # rows that got no vector (bad rows under on_bad_row: skip, duplicate ids)
    bad_rows: dict[str, int] = field(default_factory=dict)  # reason -> rows, whatever the policy did with them
    reused_rows: int = 0  # incremental: rows whose vector came from the previous version
    sampled_rows: int = 0  # int8/uint8: rows whose vector the calibration sample gave (embedded in the start-up)
    sampled_tokens: int = 0  # their real tokens (in ``tokens`` too: computed by the calibration's pieces)
    previous_ids: int = 0  # incremental: rows whose id was in the previous version (changed or not)
    tokens_squared: int = 0  # sum over rows of length^2: the attention term of model FLOPs (report/flops.py)
    documents: int = 0  # input.chunking: documents cut into chunks (each chunk is a row)
    chunks_max: int = field(default=0, metadata={"merge": max})  # input.chunking: most chunks of one document
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - start

    def merge(self, other: "Counters") -> "Counters":
        """Add ``other`` in place: numbers add, dicts add key by key."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.metadata.get("merge") is not None:
                setattr(self, f.name, f.metadata["merge"](mine, theirs))
            elif isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def add_documents(self, chunks_per_document) -> None:
        """input.chunking: the documents of a list and their chunk counts (an array [N])."""
        self.documents += len(chunks_per_document)
        if len(chunks_per_document):
            self.chunks_max = max(self.chunks_max, int(max(chunks_per_document)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Counters":
        known = {f.name for f in fields(cls)}
        return cls(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k in known})


@dataclass(frozen=True)
class DocumentCost:
    """What embedding each of a list of texts [N] cost, summed over its sequences (``Encoder.embed``: one each;
    ``Encoder.embed_chunks``: a document's chunks, or with late chunking its windows)."""

    tokens: np.ndarray  # [N] int64 real tokens of its sequences
    tokens_squared: np.ndarray  # [N] int64 sum of their squares
    truncated: np.ndarray  # [N] int64 of its sequences cut at max_seq_len
    chunks: np.ndarray  # [N] int64 its rows: 1, or a document's chunks

    @classmethod
    def of(cls, *, doc: np.ndarray, lengths: np.ndarray, truncated: np.ndarray, chunks: np.ndarray) -> "DocumentCost":
        """From every sequence embedded [S]: its document ``doc``, its real tokens, whether it was truncated; and
        each document's ``chunks`` [N]."""
        doc, lengths = np.asarray(doc, dtype=np.int64), np.asarray(lengths, dtype=np.int64)

        def total(values: np.ndarray) -> np.ndarray:  # [N] per document
            out = np.zeros(len(chunks), dtype=np.int64)
            np.add.at(out, doc, np.asarray(values, dtype=np.int64))
            return out

        return cls(tokens=total(lengths), tokens_squared=total(lengths ** 2), truncated=total(truncated),
                   chunks=np.asarray(chunks, dtype=np.int64))
