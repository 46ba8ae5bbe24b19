"""The worker actor: builds its pipeline once, then processes work units one at a time.

read (pyarrow) -> screen rows -> tokenize -> pack -> encode -> pool -> write (Parquet part)
-> manifest record (last: from then on the unit is done, whatever happens to this process).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
from dataclasses import dataclass

from embedpipe.config import JobSpec
from embedpipe.units import Unit


@dataclass
class UnitResult:
    unit_id: str
    worker: int
    counters: dict  # Counters.to_dict()
    peak_rss_mb: float  # this worker process's peak resident memory so far


class EmbedWorker:
    """Plain class; the driver wraps it with ``ray.remote`` and its resources."""

    def __init__(self, job: JobSpec, *, index: int, threads: int):
        logging.basicConfig(level=logging.WARNING)
        from embedpipe.io.manifest import Manifest
        from embedpipe.io.reader import ParquetReader
        from embedpipe.io.writer import ParquetPartWriter
        from embedpipe.runtime import Encoder, EncoderSettings

        self.index = index
        self.reader = ParquetReader(text_column=job.input.text_column, id_column=job.input.id_column,
                                    on_bad_row=job.input.on_bad_row)
        self.encoder = Encoder(EncoderSettings.from_job(job, threads=threads))
        self.writer = ParquetPartWriter(output_path=job.output.path)
        self.manifest = Manifest(job.output.path)

    def info(self) -> dict:
        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(),
                "device": self.encoder.device, "dim": self.encoder.dim}

    def process(self, unit: Unit) -> UnitResult:
        from embedpipe.io.writer import write_table_atomic
        from embedpipe.report.counters import Counters

        counters = Counters()
        with counters.time("read"):
            rows = self.reader(unit)
        vectors = self.encoder.embed(rows.texts, counters)
        counters.skipped_rows, counters.bad_rows = rows.skipped.num_rows, rows.bad
        with counters.time("write"):
            part = self.writer(unit.id, rows.ids, vectors)
            if rows.skipped.num_rows:
                write_table_atomic(rows.skipped, self.manifest.skipped_path(unit.id))
            self.manifest.record(unit.id, parts=[part], file=unit.file, row_groups=list(unit.row_groups),
                                 counters=counters.to_dict())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return UnitResult(unit_id=unit.id, worker=self.index, counters=counters.to_dict(), peak_rss_mb=round(peak, 1))

