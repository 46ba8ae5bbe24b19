"""One counters object per worker (and per unit): rows, tokens and seconds per stage."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator

STAGES = ("read", "tokenize", "pack", "encode", "write")


@dataclass
class Counters:
    rows: int = 0
    tokens: int = 0  # real tokens, no padding
    padded_tokens: int = 0  # tokens the encoder computed, padding included
    truncated_rows: int = 0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - start

    def merge(self, other: "Counters") -> "Counters":
        self.rows += other.rows
        self.tokens += other.tokens
        self.padded_tokens += other.padded_tokens
        self.truncated_rows += other.truncated_rows
        for stage, seconds in other.stages.items():
            self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Counters":
        return cls(**{**data, "stages": dict(data["stages"])})
