"""The worker actor: builds its pipeline once, then processes work units one at a time.

model: the driver's shipped copy, materialized in this node's cache (embedpipe/cluster/modelship.py) ->
read (pyarrow; the unit's input format) -> screen rows -> tokenize -> pack -> encode -> pool -> write (Parquet part)
-> manifest record (last: from then on the unit is done, whatever happens to this process).
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field

from embedpipe.cluster.modelship import ShippedModel, job_on_node
from embedpipe.config import JobSpec
from embedpipe.units import Unit


@dataclass(frozen=True)
class Incremental:
    """What an incremental run's workers need: the hash salt and the previous version's vectors."""

    salt: bytes  # fingerprint of the model and vector settings: part of every content hash
    previous: str | None  # the current version's vectors/ folder; None on the first run
    previous_parts: tuple[str, ...] = ()  # its parts that its manifest records intact (only these are read)


@dataclass
class UnitResult:
    unit_id: str
    worker: int
    counters: dict  # Counters.to_dict()
    peak_rss_mb: float  # this worker process's peak resident memory so far
    started: float = 0.0  # time.time() when the worker took the unit (the report's per-worker timeline)
    finished: float = 0.0  # time.time() when its part was recorded
    device: dict = field(default_factory=dict)  # DeviceInfo.to_dict(): the device and its measured peak
    node: str = ""  # the Ray node it ran on: "<node ip>/<node id, 8 hex digits>" (scheduler.node_label)


class EmbedWorker:
    """Plain class; the driver wraps it with ``ray.remote`` and its resources."""

    def __init__(self, job: JobSpec, *, model: ShippedModel, index: int, threads: int,
                 incremental: Incremental | None = None, calibration=None):
        """``model``: the run's model in the object store; this worker loads it from its node's cache,
        never from ``model.path``. ``calibration``: the run's int8/uint8 ranges
        (embedpipe.io.quantize.Calibration), the same on every worker, replacements included: the
        driver fits them before any worker starts."""
        logging.basicConfig(level=logging.WARNING)
        from embedpipe.io.fs import use_job_storage

        use_job_storage(job)  # the job's storage_options reach every worker on every node
        job = job_on_node(job, model)  # model.path: this node's cached copy, fetched once per node
        self.node = node_name()
        from embedpipe.io.manifest import Manifest
        from embedpipe.io.formats import UnitReader
        from embedpipe.io.writer import ParquetPartWriter
        from embedpipe.runtime import Encoder

        self.index = index
        self.reader = UnitReader(text_column=job.input.text_column, id_column=job.input.id_column,
                                 on_bad_row=job.input.on_bad_row)
        self.encoder = Encoder.from_job(job, threads=threads)
        self.writer = ParquetPartWriter(output_path=job.output.path, dtype=job.output.dtype, calibration=calibration,
                                        dim=self.encoder.dim)
        self.manifest = Manifest(job.output.path)
        self.document_vectors = job.output.document_vectors == "mean" and self.encoder.chunker is not None
        self.incremental = incremental
        self.previous = None
        if incremental is not None and incremental.previous:
            from embedpipe.io.reuse import PreviousVectors

            self.previous = PreviousVectors(incremental.previous, parts=incremental.previous_parts)
        from embedpipe.report.device import describe_device

        # the device and its peak FLOP/s in the model's dtype: a short matmul probe, once per machine
        self.device = describe_device(self.encoder.device, dtypes=(job.model.dtype,)).to_dict()

    def process(self, unit: Unit) -> UnitResult:
        from embedpipe.io.layout import atomic_write_table
        from embedpipe.report.counters import Counters

        started = time.time()
        counters = Counters()
        with counters.time("read"):
            rows = self.reader(unit)
        extra, ids, doc = None, rows.ids, None
        if self.encoder.chunker is not None:
            ids, vectors, extra, doc = self._embed_chunks(rows, counters)
        elif self.incremental is None:
            vectors = self.encoder.embed(rows.texts, counters)
        else:
            vectors, extra = self._embed_incremental(rows, counters)
        counters.skipped_rows, counters.bad_rows = rows.skipped.num_rows, rows.bad
        documents = []
        with counters.time("write"):
            part = self.writer.write(unit.id, ids, vectors, extra, stored=self.incremental is not None)
            if self.document_vectors:  # the normalised mean of each document's chunk vectors
                documents.append(self.writer.write_documents(unit.id, rows.ids, doc, vectors))
            if rows.skipped.num_rows:
                atomic_write_table(rows.skipped, self.manifest.skipped_path(unit.id))
        # last, with the unit's complete counters: from now on the unit is done
        self.manifest.record(unit.id, parts=[part], document_parts=documents, file=unit.file,
                             row_groups=list(unit.row_groups), counters=counters.to_dict())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return UnitResult(unit_id=unit.id, worker=self.index, counters=counters.to_dict(), peak_rss_mb=round(peak, 1),
                          started=started, finished=time.time(), device=self.device, node=self.node)

    def _embed_incremental(self, rows, counters):
        """Encode only rows whose content changed; take the others' vectors from the previous version."""
        import numpy as np

        from embedpipe.io.reuse import content_hashes

        with counters.time("reuse"):
            hashes = content_hashes(rows.texts, salt=self.incremental.salt)
            reuse = np.zeros(len(rows.texts), dtype=bool)
            if self.previous is not None:
                reuse, reused, counters.previous_ids = self.previous.lookup(rows.ids, hashes)
        fresh = np.flatnonzero(~reuse)
        encoded = self.writer.store(self.encoder.embed([rows.texts[i] for i in fresh], counters))  # [F, W]
        vectors = np.empty((len(rows.texts), encoded.shape[1]), dtype=encoded.dtype)  # stored values, [N, W]
        vectors[fresh] = encoded
        if reuse.any():
            vectors[reuse] = reused  # stored values of the same dtype, dim and calibration (they are in the salt)
            counters.rows += int(reuse.sum())
            counters.reused_rows = int(reuse.sum())
        return vectors, {"content_hash": hashes}


    def _embed_chunks(self, rows, counters):
        """input.chunking: one row per chunk, (id, chunk) in document then text order; an incremental run hashes
        each whole document and reuses all chunks of an unchanged one (the previous version's rows).
        Returns the chunk rows' ids, vectors, extra columns and documents (row index of each chunk)."""
        import numpy as np
        import pyarrow as pa

        from embedpipe.io.reuse import content_hashes, stored_rows

        fresh = np.arange(len(rows.texts))
        hashes, reused = None, None
        if self.incremental is not None:
            with counters.time("reuse"):
                hashes = content_hashes(rows.texts, salt=self.incremental.salt)  # [N] per document
                if self.previous is not None:
                    reuse, reused, counters.previous_ids = self.previous.lookup_chunks(rows.ids, hashes)
                    fresh = np.flatnonzero(~reuse)
        chunks, vectors = self.encoder.embed_chunks([rows.texts[i] for i in fresh], counters)
        doc = fresh[chunks.doc]  # [C] the document (row) of each fresh chunk
        columns = {"chunk": chunks.chunk, "start": chunks.start, "end": chunks.end}
        if self.incremental is not None:
            vectors = self.writer.store(vectors)  # stored values [C, W], like the reused ones
        if reused is not None and reused.num_rows:
            position = {key: i for i, key in enumerate(rows.ids.to_pylist())}
            old_doc = np.fromiter((position[k] for k in reused["id"].to_pylist()), np.int64, count=reused.num_rows)
            doc = np.concatenate([doc, old_doc])
            for name in columns:
                columns[name] = np.concatenate([columns[name], reused[name].to_numpy().astype(columns[name].dtype)])
            vectors = np.concatenate([vectors, stored_rows(reused).astype(vectors.dtype, copy=False)])
            reused_docs = np.unique(old_doc)
            counters.rows += reused.num_rows
            counters.reused_rows = reused.num_rows
            counters.add_documents(np.bincount(old_doc)[reused_docs])
        order = np.lexsort((columns["chunk"], doc))  # documents in input order, chunks in text order
        extra = {"chunk": pa.array(columns["chunk"][order], pa.int32()),
                 "start": pa.array(columns["start"][order], pa.int64()),
                 "end": pa.array(columns["end"][order], pa.int64())}
        if hashes is not None:
            extra["content_hash"] = hashes.take(pa.array(doc[order]))
        return rows.ids.take(pa.array(doc[order])), vectors[order], extra, doc[order]


def node_name() -> str:
    """This process's Ray node as the report names it (scheduler.node_label); "" outside Ray."""
    import ray

    from embedpipe.cluster.scheduler import node_label

    if not ray.is_initialized():
        return ""
    return node_label(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())
