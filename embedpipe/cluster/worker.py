"""The worker actor: builds its pipeline once, then encodes work units one at a time, reading the next ahead.

The actor is not threaded (Ray's ``max_concurrency`` 1): its calls run on the process's main thread, one at a
time, in the order the driver made them. Each call names the unit the driver holds for this worker next
(``ahead``); one plain thread of the worker reads and tokenizes that unit while the call encodes its own
(``ReadAhead``). Ray's threaded actors (``max_concurrency`` > 1, or concurrency groups) encoded 10-25 % slower on
two CPU threads, the same calls and the same CPU-seconds (docs/performance.md, issue 17).

model: the driver's shipped copy, materialized in this node's cache (embedpipe/cluster/modelship.py) ->
read (pyarrow; the unit's input format) -> screen rows -> tokenize -> pack -> encode -> pool -> write (Parquet part)
-> manifest record (last: from then on the unit is done, whatever happens to this process).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from embedpipe.cluster.codeid import CodeId, check_same_code
from embedpipe.cluster.modelship import ShippedModel, job_on_node
from embedpipe.cluster.nodes import node_name
from embedpipe.cluster.sampled import SamplePiece, documents_within
from embedpipe.config import JobSpec
from embedpipe.report.counters import Counters
from embedpipe.report.memory import peak_rss_mb
from embedpipe.units import Unit

if TYPE_CHECKING:
    import numpy as np

READ_AHEAD = 1  # units a worker reads and tokenizes while it encodes one (ReadAhead holds one): the driver holds it


@dataclass(frozen=True)
class Incremental:
    """What an incremental run's workers need: the hash salt and the previous version's vectors."""

    salt: bytes  # fingerprint of the model and vector settings: part of every content hash
    previous: str | None  # the current version's vectors/ folder; None on the first run
    previous_parts: tuple[str, ...] = ()  # its parts that its manifest records intact (only these are read)
    previous_units: dict = field(default_factory=dict)  # driver: unit key -> part index (io/diff.py unit_key)
    same_part: dict = field(default_factory=dict)  # the night's diff: unit id -> its previous part's index
    moved: dict = field(default_factory=dict)  # the night's diff: unit id -> (id, part) of rows found elsewhere


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker is given once the run's planning is done (``EmbedWorker.configure``): its workers may have
    started before it, beside the id scan (cluster/early.py)."""

    output_path: str  # the run's output folder (a versioned output's: the version's own)
    incremental: Incremental | None = None
    calibration: Any = None  # the run's int8/uint8 ranges (io.quantize.Calibration), the same on every worker
    description: Any = None  # the output's record (io.describe.OutputDescription), in every part's schema metadata
    sampled: Any = None  # int8/uint8: the calibration sample's vectors (cluster/sampled.py), for the rows it holds


@dataclass
class UnitResult:
    unit_id: str
    worker: int
    counters: dict  # Counters.to_dict()
    peak_rss_mb: float  # this worker process's peak resident memory so far
    started: float = 0.0  # time.time() when the worker took the unit (the report's per-worker timeline)
    finished: float = 0.0  # time.time() when its part was recorded
    device: dict = field(default_factory=dict)  # DeviceInfo.to_dict(): the device and its measured peak
    node: str = ""  # the Ray node it ran on: "<node ip>/<node id, 8 hex digits>" (cluster/nodes.py)


class EmbedWorker:
    """Plain class; the driver wraps it with ``ray.remote`` and its resources (one call at a time: the read-ahead
    is this worker's own thread)."""

    def __init__(self, job: JobSpec, *, model: ShippedModel, index: int, threads: int, code: CodeId | None = None):
        """The worker's own start, which needs nothing of the run's planning: its model loaded and warmed up, its
        reader and device. ``configure`` then gives it the run's settings, before its first unit (the scheduler
        makes that call, as a new worker's ready call). ``model``: the run's model in the object store; this worker
        loads it from its node's cache, never from ``model.path``. ``code``: the driver's embedpipe
        (cluster/codeid.py): a worker running other code fails its first unit (None: not checked)."""
        logging.basicConfig(level=logging.WARNING)
        from embedpipe.io.fs import use_job_storage

        use_job_storage(job)  # the job's storage_options reach every worker on every node
        job = job_on_node(job, model)  # model.path: this node's cached copy, fetched once per node
        self.output_dtype = job.output.dtype
        self.node = node_name()
        from embedpipe.io.formats import UnitReader
        from embedpipe.runtime import Encoder

        self.index, self.threads = index, threads
        self.code = code
        self._ahead = ReadAhead()
        self.reader = UnitReader(text_column=job.input.text_column, id_column=job.input.id_column,
                                 on_bad_row=job.input.on_bad_row)
        self.encoder = Encoder.from_job(job, threads=threads)
        self.document_vectors = job.output.document_vectors == "mean" and self.encoder.chunker is not None
        self.setup: WorkerSetup | None = None  # configure's
        from embedpipe.report.device import describe_device

        # the device and its peak FLOP/s in the model's dtype: a short matmul probe, once per machine
        self.device = describe_device(self.encoder.device, dtypes=(job.model.dtype,),
                                      linears=self.encoder.linears).to_dict()

    def configure(self, setup: WorkerSetup) -> None:
        """The run's settings (``WorkerSetup``): where this worker writes, and what the run's planning decided.
        An error here is a failed start, as one of ``__init__``'s."""
        from embedpipe.io.manifest import Manifest
        from embedpipe.io.writer import ParquetPartWriter

        self.writer = ParquetPartWriter(output_path=setup.output_path, dtype=self.output_dtype,
                                        calibration=setup.calibration, dim=self.encoder.dim,
                                        description=setup.description)
        self.manifest = Manifest(setup.output_path)
        self.incremental = setup.incremental
        self.sampled = setup.sampled
        self.previous = None
        if setup.incremental is not None and setup.incremental.previous:
            from embedpipe.io.reuse import PreviousVectors

            self.previous = PreviousVectors(setup.incremental.previous, parts=setup.incremental.previous_parts)
        self.setup = setup

    def embed_sample(self, texts: list[str]) -> SamplePiece:
        """A piece of the run's int8/uint8 calibration sample embedded by this worker's encoder, before
        ``configure`` (its ranges come from this): float vectors [n, D], as a unit's are before they are stored,
        what each text cost, and the piece as a span of this worker's timeline (cluster/sampled.py). With
        ``input.chunking``, the vectors of chunks [C, D], as the parts store them, with their columns: all chunks
        of a subset of the texts that holds about as many chunks as there are texts (``documents_within``)."""
        # its ranges quantize every part: the driver's code, checked before anything is embedded
        check_same_code(self.code, who=f"the int8 calibration on worker {self.index}", node=self.node)
        import numpy as np

        from embedpipe.text.chunking import CHUNK_FIELDS, documents_of

        self._threads_here()
        counters, costs, started = Counters(), [], time.time()
        if self.encoder.chunker is not None:  # the ranges are of what the parts store: the documents' chunks
            with counters.time("tokenize"):  # each document's chunks, tokenized once: the embedded ones are taken
                docs, chunks = self.encoder.chunker(texts)
            embedded = documents_within(chunks.per_document_of(len(texts)), rows=len(texts))  # about as many chunks
            chunks, vectors = self.encoder.embed_chunks([texts[i] for i in embedded], counters, per_document=costs,
                                                        chunked=documents_of(docs, chunks, embedded))
            columns = {name: getattr(chunks, name) for name in CHUNK_FIELDS}  # [C] each
        else:
            vectors = self.encoder.embed(texts, counters, per_document=costs)  # [n, D]
            embedded, columns = np.arange(len(texts)), None
        counters.rows = 0  # the sample's rows are the units' (those the units take count there)
        return SamplePiece(vectors=vectors, size=len(texts), embedded=embedded, cost=costs[0], chunks=columns,
                           span=self._result("calibration", counters, started=started))

    def process(self, unit: Unit, ahead: Unit | None = None) -> UnitResult:
        """Encode and write ``unit``; read and tokenize ``ahead`` (the unit the driver gives this worker next)
        beside it. ``unit`` itself was read ahead by the previous call when that call named it; otherwise it
        is read here. A unit whose read failed fails in its own call, never in the one that read it ahead.
        Memory: two units (this one encoding, the next one tokenized)."""
        # before anything is read or written (this_code is cached): never retried
        check_same_code(self.code, who=f"worker {self.index}", node=self.node)
        if self.setup is None:
            raise RuntimeError(f"worker {self.index} was given {unit.label} before configure(): the run's scheduler "
                               "calls it first; this is embedpipe's bug, report it")
        try:
            taken = self._ahead.take(unit)  # (counters, _Ahead); None: it was not read ahead
            # not read ahead: read first, alone (the read-ahead is for the encode's time)
            counters, prepared = taken if taken is not None else self._read(unit)
        finally:  # a failed read still starts the next unit's
            if ahead is not None:
                self._ahead.start(ahead, self._read)
        return self._encode_and_write(unit, prepared, counters)

    def _read(self, unit: Unit) -> tuple[Counters, "_Ahead"]:
        """The read side of a unit: its rows, the texts to encode (incremental: the changed ones), tokenized;
        with the unit's counters."""
        counters = Counters()
        with counters.time("read"):
            rows = self.reader(unit)
        if self.encoder.chunker is not None:  # chunked: read ahead, chunked and encoded in its turn
            return counters, _Ahead(rows=rows, texts=rows.texts, windows=[])
        fresh, reuse = None, None
        texts = rows.texts
        if self.incremental is not None:
            fresh, reuse = self._reuse(unit.id, rows, counters)
            texts = [rows.texts[i] for i in fresh]
        sampled = self.sampled.take(texts) if self.sampled is not None else None
        if sampled is not None:  # the calibration embedded these rows already
            texts = sampled.others(texts)
        return counters, _Ahead(rows=rows, texts=texts, windows=self.encoder.prepare(texts, counters), fresh=fresh,
                                reuse=reuse, sampled=sampled)

    def _encode_and_write(self, unit: Unit, ahead: "_Ahead", counters: Counters) -> UnitResult:
        from embedpipe.io.layout import atomic_write_table

        started = time.time()  # the unit's turn: the report's timeline has no overlap within a worker
        self._threads_here()
        rows = ahead.rows
        extra, ids, doc = None, rows.ids, None
        if self.encoder.chunker is not None:
            ids, vectors, extra, doc = self._embed_chunks(unit.id, rows, counters)
        elif ahead.reuse is None:
            vectors = self._embed(ahead, counters)  # [N, D]
        else:
            vectors, extra = self._assemble(rows, ahead, self._embed(ahead, counters), counters)  # from [F, D]
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
                             row_groups=list(unit.row_groups), row_start=unit.row_start, num_rows=unit.num_rows,
                             counters=counters.to_dict())
        return self._result(unit.id, counters, started=started)

    def _result(self, unit_id: str, counters: Counters, *, started: float) -> UnitResult:
        """What the driver gets back for a unit, or a calibration piece, this worker finished now."""
        return UnitResult(unit_id=unit_id, worker=self.index, counters=counters.to_dict(),
                          peak_rss_mb=round(peak_rss_mb(), 1), started=started, finished=time.time(),
                          device=self.device, node=self.node)

    def _threads_here(self) -> None:
        """The worker's CPU threads for torch: intra-op threads are per calling thread, so set where it encodes."""
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)

    def _embed(self, ahead: "_Ahead", counters: Counters) -> np.ndarray:
        """The float vectors [T, D] of the unit's rows to encode (every row, or an incremental night's changed
        ones): encoded now, or the calibration sample's for the rows it holds (``ahead.sampled``)."""
        encoded = self.encoder.embed(ahead.texts, counters, prepared=ahead.windows)  # [T - K, D]
        if ahead.sampled is None:
            return encoded
        ahead.sampled.count(counters)
        return ahead.sampled.fill(encoded)

    def _reuse(self, unit_id: str, rows, counters):
        """Incremental: the rows to encode (content changed) and the previous version's answer for the others."""
        import numpy as np

        from embedpipe.io.reuse import content_hashes

        with counters.time("reuse"):
            hashes = content_hashes(rows.texts, salt=self.incremental.salt)
            reuse, reused = np.zeros(len(rows.texts), dtype=bool), None
            if self.previous is not None:
                reuse, reused, counters.previous_ids = self.previous.lookup_unit(
                    rows.ids, hashes, same_part=self.incremental.same_part.get(unit_id),
                    moved=_table(self.incremental.moved.get(unit_id)))
        return np.flatnonzero(~reuse), (reuse, reused, hashes)

    def _assemble(self, rows, ahead: "_Ahead", encoded, counters):
        """Stored vectors of every row: the fresh ones encoded now, the others taken from the previous version."""
        import numpy as np

        reuse, reused, hashes = ahead.reuse
        encoded = self.writer.store(encoded)  # [F, W]
        vectors = np.empty((len(rows.texts), encoded.shape[1]), dtype=encoded.dtype)  # stored values, [N, W]
        vectors[ahead.fresh] = encoded
        if reuse.any():
            vectors[reuse] = reused  # stored values of the same dtype, dim and calibration (they are in the salt)
            counters.rows += int(reuse.sum())
            counters.reused_rows = int(reuse.sum())
        return vectors, {"content_hash": hashes}

    def _embed_chunks(self, unit_id: str, rows, counters):
        """input.chunking: one row per chunk, (id, chunk) in document then text order; an incremental run hashes
        each whole document and reuses all chunks of an unchanged one (the previous version's rows, found through
        the night's diff: the unit's previous part and the rows it says moved, as for unchunked units).
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
                    reuse, reused, counters.previous_ids = self.previous.lookup_unit_chunks(
                        rows.ids, hashes, same_part=self.incremental.same_part.get(unit_id),
                        moved=_table(self.incremental.moved.get(unit_id)))
                    fresh = np.flatnonzero(~reuse)
        chunks, vectors = self._chunk_vectors([rows.texts[i] for i in fresh], counters)
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

    def _chunk_vectors(self, texts: list[str], counters: Counters):
        """input.chunking: the chunks of ``texts`` and their float vectors [C, D]: encoded now, or the calibration
        sample's for the documents it holds (their chunks then come last)."""
        taken = self.sampled.take(texts) if self.sampled is not None else None
        if taken is None:
            return self.encoder.embed_chunks(texts, counters)
        chunks, encoded = self.encoder.embed_chunks(taken.others(texts), counters)
        taken.count(counters)
        return taken.fill_chunks(chunks, encoded)


def _table(moved):
    """A unit's moved rows: the table itself (in process) or a Ray reference to it (the run's driver put it)."""
    import ray

    return ray.get(moved) if isinstance(moved, ray.ObjectRef) else moved


@dataclass
class _Ahead:
    """A unit read and tokenized, waiting for its turn to encode."""

    rows: Any  # ScreenedRows
    texts: list[str]  # what is encoded: every row's text, or (incremental) the changed rows', less the sampled
    windows: list  # Encoder.prepare(texts)
    fresh: Any = None  # incremental: [F] indices of the rows encoded
    reuse: tuple | None = None  # incremental: (reuse mask [N], their previous stored vectors, content hashes)
    sampled: Any = None  # cluster.sampled.Taken: the rows to encode that the calibration sample holds


class ReadAhead:
    """One unit read on a thread of its own while the caller encodes another: ``start(unit, read)`` runs
    ``read(unit)`` there; ``take(unit)`` waits for it and returns its result (raises its exception) when it was
    that unit, else None (the caller reads the unit itself). One read at a time: ``start`` follows ``take``."""

    def __init__(self) -> None:
        self._unit_id: str | None = None
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    def start(self, unit: Unit, read) -> None:
        self._join()
        self._unit_id, self._result, self._error = unit.id, None, None

        def run() -> None:
            try:
                self._result = read(unit)
            except BaseException as exc:  # noqa: BLE001 - raised by take(), in the unit's own call
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"read-ahead {unit.id}", daemon=True)
        self._thread.start()

    def take(self, unit: Unit) -> Any:
        self._join()
        mine, self._unit_id = self._unit_id == unit.id, None
        result, error, self._result, self._error = self._result, self._error, None, None
        if not mine:
            return None
        if error is not None:
            raise error
        return result

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
