"""The worker actor: builds its pipeline once, then processes work units one at a time.

read (pyarrow) -> tokenize -> pack -> encode -> pool -> write (Parquet part)
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from embedpipe.config import JobSpec
from embedpipe.units import Unit


@dataclass
class UnitResult:
    unit_id: str
    part: str
    worker: int
    counters: dict  # Counters.to_dict()


class EmbedWorker:
    """Plain class; the driver wraps it with ``ray.remote`` and its resources."""

    def __init__(self, job: JobSpec, *, index: int, threads: int):
        logging.basicConfig(level=logging.WARNING)
        from embedpipe.io.reader import ParquetReader
        from embedpipe.io.writer import ParquetPartWriter
        from embedpipe.runtime import Encoder, EncoderSettings

        self.index = index
        self.reader = ParquetReader(text_column=job.input.text_column, id_column=job.input.id_column)
        self.encoder = Encoder(EncoderSettings.from_job(job, threads=threads))
        self.writer = ParquetPartWriter(output_path=job.output.path)

    def info(self) -> dict:
        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(),
                "device": self.encoder.device, "dim": self.encoder.dim}

    def process(self, unit: Unit) -> UnitResult:
        from embedpipe.report.counters import Counters

        counters = Counters()
        with counters.time("read"):
            rows = self.reader(unit)
        vectors = self.encoder.embed(rows.texts, counters)
        with counters.time("write"):
            part = self.writer(unit.id, rows.ids, vectors)
        return UnitResult(unit_id=unit.id, part=part, worker=self.index, counters=counters.to_dict())
