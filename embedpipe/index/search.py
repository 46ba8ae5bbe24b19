"""Open a built index and search it with text: ``open_index(output_path).search(texts, k=10)``.

Queries are encoded in this process (no Ray) with the settings the output records in its ``embedpipe.json``
(the resolved model folder, pooling, normalisation, max_seq_len and dimension: embedpipe/io/describe.py; for an
output written before there was one, the job's own settings read back from ``index.json``), with the model's
query prompt when it has one; results are the input's own ids, best first. Imports are lazy: opening loads
FAISS and the id map, the first query loads the model (a BERT-family float32 model in numpy, without torch:
embedpipe/index/query.py; any other with torch); texts are read through the input's format
reader (embedpipe/io/formats.py) only when asked for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedpipe.errors import BadJob
from embedpipe.index.ids import IdLookup
from embedpipe.index.local_copy import local_copy
from embedpipe.io.describe import OutputDescription, read_description
from embedpipe.io.layout import IndexLayout, OutputLayout
from embedpipe.io.store import store_for, tree_path

log = logging.getLogger(__name__)


QUERY_ENCODERS = ("auto", "torch")


class IndexNotFound(BadJob, FileNotFoundError):
    pass


def _job_from_dict(raw: dict):
    """The job the index was built with, rebuilt without validation (its input may be gone)."""
    from embedpipe.config import REDACTED, SECTIONS, JobSpec

    sections = {}
    for name, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in (raw.get(name) or {}).items() if k in names}
        if "storage_options" in values:  # the secrets were never written: they come from the environment
            values["storage_options"] = {k: v for k, v in values["storage_options"].items() if v != REDACTED}
        try:
            sections[name] = cls(**values)
        except TypeError:  # a section whose required fields this version does not find
            sections[name] = None
    return JobSpec(**{k: v for k, v in sections.items() if v is not None})


@dataclass(frozen=True)
class ChunkHit:
    """A hit of a chunked index (input.chunking): the document's id, which chunk, where it is, its text."""

    id: object
    score: float
    chunk: int
    start: int  # character offsets of the chunk in its document's text
    end: int
    text: str | None = None  # the chunk's text, when the job's input is still readable


class OpenedIndex:
    """A built index: FAISS index, id map and the encoder settings, opened once, searched many times."""

    def __init__(self, output_path: str | Path, *, query_prompt: str | None = None, threads: int | None = None,
                 query_encoder: str = "auto"):
        import faiss

        from embedpipe.versions import current_path

        root = tree_path(output_path)
        root = current_path(root) or root  # versioned outputs: the version CURRENT points at
        files = IndexLayout(root) if _is_file(IndexLayout(root).meta) else OutputLayout(root).index
        self.dir = files.dir
        if not _is_file(files.meta):
            raise IndexNotFound(f"no index at {self.dir}: run a job with output.format: faiss (or both) "
                                f"and pass its output.path")
        self.downloaded: tuple[str, ...] = ()  # object stores: the files this open fetched into the local cache
        if not files.store.local:  # FAISS reads local files: open a local copy, cached by the index's identity
            copy = local_copy(files)
            files, self.downloaded = copy.files, copy.downloaded
        self.local_dir = files.dir
        self.meta = json.loads(files.meta.read_text())
        self.index = faiss.read_index(str(files.faiss), faiss.IO_FLAG_ONDISK_SAME_DIR)
        space = faiss.ParameterSpace()
        for name, value in self.meta["search_params"].items():
            space.set_index_parameter(self.index, name, value)
        self.ids = IdLookup(files.ids, native=self.meta["ids"] == "native")
        self.job = _job_from_dict(self.meta["job"])
        # the output's own record (the index folder sits in the output): None for outputs older than embedpipe.json
        self.description: OutputDescription | None = _read_description(tree_path(self.dir).parent)
        recorded = self.description.query_prompt if self.description else self.meta.get("query_prompt", "")
        # what goes before each query: given, else the model's "query" prompt recorded at build time (the
        # job's own model.prompt is for the documents and is not used for queries)
        self.query_prompt: str = recorded if query_prompt is None else query_prompt
        self.text_problem: str | None = None  # why the last source_texts call found no texts, when it could not read
        self.threads = threads  # torch intra-op threads of the query encoder (None: torch's default)
        if query_encoder not in QUERY_ENCODERS:
            raise ValueError(f"query_encoder={query_encoder!r}: choose one of {QUERY_ENCODERS}")
        self.query_encoder = query_encoder  # auto: numpy where it applies (embedpipe/index/query.py); torch: always torch
        self._encoder = None

    @property
    def encoder(self):
        """The query encoder: numpy for a BERT-family float32 model (no torch: embedpipe/index/query.py), else the
        torch Encoder; built on the first query."""
        if self._encoder is None:
            model = self._query_model()
            self._encoder = self._numpy_encoder(model) or self._torch_encoder(model)
            log.debug("query encoder: %s", type(self._encoder).__name__)
        return self._encoder

    def _numpy_encoder(self, model):
        from embedpipe.index.query import numpy_query_encoder
        from embedpipe.models.resolve import resolve_model_path

        if self.description is None or self.query_encoder == "torch":
            return None
        model_dir = resolve_model_path(model.path, storage_options=model.storage_options)
        return numpy_query_encoder(model_dir=model_dir, description=self.description, prompt=self.query_prompt,
                                   dtype=model.dtype)

    def _torch_encoder(self, model):
        from embedpipe.runtime import Encoder

        job = self.job
        return Encoder(model=model, batching=job.batching,
                       output_dim=self.description.dim if self.description else job.output.dim,
                       runtime=dataclasses.replace(job.runtime, device="auto", attention="auto"), threads=self.threads)

    def _query_model(self):
        """The job's model section as the documents were encoded: every auto resolved from embedpipe.json."""
        model = dataclasses.replace(self.job.model, prompt=self.query_prompt, prompt_name=None)
        d = self.description
        if d is None:
            return model
        path = d.model.path if Path(d.model.path).is_dir() else d.model.name  # moved: resolve the name again
        return dataclasses.replace(model, path=path, normalize=d.normalized, pooling=d.pooling,
                                   max_seq_len=d.max_seq_len)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Query vectors [N, D]: the job's model settings and output.dim, with the query prompt."""
        return self.encoder.embed(list(texts))

    @property
    def chunked(self) -> bool:
        """The index is over chunks (input.chunking): hits are ``ChunkHit``s."""
        return self.ids.chunked

    def search(self, texts: str | list[str], k: int = 10, *, per_document: bool = False) -> list[list]:
        """For each query text, (input id, score) pairs, best first (inner product: higher is closer;
        L2: the squared distance, lower is closer). A chunked index gives ``ChunkHit``s (id, score, chunk,
        start, end, the chunk's text); ``per_document``: only the best chunk of each document, k documents."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        vectors = self.embed(texts)
        if not self.chunked:
            return self.search_vectors(vectors, k=k)
        return self.search_chunks(vectors, k=k, per_document=per_document)

    def search_chunks(self, vectors: np.ndarray, k: int = 10, *, per_document: bool = False) -> list[list[ChunkHit]]:
        """A chunked index's hits for query vectors; ``per_document`` collapses them to each document's best chunk
        (candidates widened until k documents are found or the index is exhausted)."""
        out = []
        for vector in np.atleast_2d(vectors):
            want = k
            while True:
                scores, index_ids = self.index.search(np.ascontiguousarray(vector[None], dtype=np.float32), want)
                keep = index_ids[0] >= 0
                hits = self._chunk_hits(index_ids[0][keep], scores[0][keep])
                if per_document:
                    hits = best_per_document(hits)
                if not per_document or len(hits) >= k or want >= self.index.ntotal:
                    break
                want = min(want * 4, self.index.ntotal)
            out.append(self._with_texts(hits[:k]))
        return out

    def _chunk_hits(self, index_ids: np.ndarray, scores: np.ndarray) -> list[ChunkHit]:
        return [ChunkHit(id=i, score=float(s), chunk=c, start=a, end=b)
                for i, s, (c, a, b) in zip(self.ids(index_ids), scores, self.ids.chunks(index_ids))]

    def _with_texts(self, hits: list[ChunkHit]) -> list[ChunkHit]:
        texts = self.source_texts(list({h.id for h in hits})) if hits else {}
        return [dataclasses.replace(h, text=texts[h.id][h.start:h.end]) if isinstance(texts.get(h.id), str) else h
                for h in hits]

    def search_vectors(self, vectors: np.ndarray, k: int = 10) -> list[list[tuple[object, float]]]:
        scores, index_ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)
        out = []
        for row_scores, row_ids in zip(scores, index_ids):
            keep = row_ids >= 0
            ids = self.ids(row_ids[keep])
            out.append([(i, float(s)) for i, s in zip(ids, row_scores[keep])])
        return out

    def source_texts(self, ids: list, *, warn: bool = True) -> dict:
        """id -> text for the given input ids, read from the job's input through its format's reader (Parquet,
        JSONL, CSV, HF datasets); {} when the input cannot be read, with ``text_problem`` set to the one line
        saying why (logged as a warning unless ``warn`` is False): texts are a convenience, never an error."""
        self.text_problem = None
        try:
            return self._read_texts(list(ids))
        except Exception as exc:  # any reader's or store's failure (gone, moved, unreachable, rewritten)
            self.text_problem = (f"texts not shown: the input {self.job.input.path} cannot be read "
                                 f"({' '.join(str(exc).split()) or type(exc).__name__})")
            if warn:
                log.warning(self.text_problem)
            return {}

    def _read_texts(self, ids: list) -> dict:
        """The units holding ``ids`` (found by the id columns of the output's parts), read with the input's reader."""
        from embedpipe.io import fs
        from embedpipe.io.formats import UnitReader, plan_input

        inp = self.job.input
        if not fs.storage_options(inp.path):  # the recorded options (secrets come from the environment)
            fs.use_storage_options(inp.path, inp.storage_options)
        wanted = set(ids)
        units = plan_input(inp).units
        holding = _units_holding(tree_path(self.dir).parent, wanted) or set()
        units = sorted(units, key=lambda u: u.id not in holding)  # the units whose parts hold the ids first
        reader = UnitReader(text_column=inp.text_column, id_column=inp.id_column)
        found: dict = {}
        for unit in units:
            table = reader.columns(unit, [inp.id_column, inp.text_column])
            for id_, text in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
                if id_ in wanted:
                    found[id_] = text
            if len(found) == len(wanted):
                break
        return found


def _units_holding(root, ids: set) -> set[str] | None:
    """The unit ids whose recorded parts hold any of ``ids`` (id columns only); None without readable parts.
    Reading stops once every id is found, so only those units are read while the input is as planned."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embedpipe.io.manifest import Manifest

    holding, missing = set(), set(ids)
    try:
        manifest = Manifest(root)
        for unit_id, record in manifest.done().items():
            for path in manifest.part_paths(record):
                column = pq.ParquetFile(manifest.store.arrow_source(path)).read(columns=["id"]).column(0)
                present = missing.intersection(column.to_pylist())  # not pa.array(...): it imports pandas (~0.3 s)
                if present:
                    holding.add(unit_id)
                    missing -= present
            if not missing:  # every id found: no later part holds one (an id is in one unit)
                break
    except (OSError, ValueError, TypeError, pa.ArrowException):  # the parts cannot say: every unit is read
        return None
    return holding or None


def _read_description(root) -> OutputDescription | None:
    try:
        return read_description(root)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable: search on with the job's settings
        log.warning("%s: embedpipe.json unreadable (%s): the job's settings are used", root, exc)
        return None


def best_per_document(hits: list[ChunkHit]) -> list[ChunkHit]:
    """The first (best) hit of each document, in hit order."""
    seen, out = set(), []
    for hit in hits:
        if hit.id not in seen:
            seen.add(hit.id)
            out.append(hit)
    return out


def _is_file(path) -> bool:
    """A file at ``path``: a local file (links followed) or an object."""
    return Path(path).is_file() if store_for(path).local else store_for(path).exists(path)


def open_index(output_path: str | Path, *, query_prompt: str | None = None,
               threads: int | None = None, query_encoder: str = "auto") -> OpenedIndex:
    """Open the index under ``<output_path>/index`` (or an index directory itself); ``output_path`` may be a URL
    (``s3://bucket/out``): the index files are then read from a local copy in the cache (embedpipe.index.local_copy).

    ``query_prompt``: put before every query (e.g. ``"query: "`` for E5 models); None: the model's
    own ``query`` prompt when its sentence-transformers config names one, else none. ``threads``: torch threads
    of the query encoder (None: torch's default, all cores; 1 answers a single query fastest on a busy machine).
    ``query_encoder``: "auto" encodes queries in numpy where the model allows (a BERT-family float32 model: no torch
    imported, embedpipe/index/query.py), else with torch; "torch" always with the torch encoder."""
    return OpenedIndex(output_path, query_prompt=query_prompt, threads=threads, query_encoder=query_encoder)
