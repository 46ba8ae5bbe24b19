"""Models shipped to every node: the driver puts the model's files in Ray's object store once, and each
worker materializes them in its node's model cache, then loads from there.

    driver:  RunPlan.model.dir -> model_files (what the fingerprint hashes) -> ray.put, one object per
             CHUNK_BYTES of each file -> ShippedModel (content hash, file list, object refs)
    worker:  ShippedModel -> node cache $EMBEDPIPE_CACHE_DIR/models/<sha256>/ (embedpipe/models/cache.py):
             a hit loads at once; a miss fetches the chunks from the object store, checks each file's
             sha256, renames the folder into place

So no node needs the model installed, and workers never read ``model.path``. The objects live while the
driver holds the ShippedModel (the whole run: replacement workers fetch from it too); each node fetches
at most once per model, a restarted worker on a node that has it fetches nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ray

from embedpipe.config import JobSpec
from embedpipe.models.cache import ModelFile, materialize

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # one object per 64 MiB of a file: the driver and a fetching node hold one chunk at a time


@dataclass(frozen=True)
class ShippedModel:
    """A model in the object store: what a worker needs to materialize it on its node."""

    sha256: str  # the model's content hash (the manifest's model_fingerprint): the node cache folder's name
    files: tuple[ModelFile, ...]
    chunks: tuple[tuple[Any, ...], ...]  # per file, its chunks' ObjectRefs in order

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def ship_model(model_dir: Path) -> ShippedModel:
    """Put the files of ``model_dir`` that a worker reads in the object store (Ray must be up)."""
    from embedpipe.io.manifest import HashCache, model_files, model_fingerprint

    started = time.perf_counter()
    hashes = HashCache()  # the fingerprint just hashed them: size, time and inode hits, no rehashing
    digest = model_fingerprint(model_dir, cache=hashes)
    files, chunks = [], []
    for path in model_files(model_dir):
        files.append(ModelFile(name=path.relative_to(model_dir).as_posix(), size=path.stat().st_size,
                               sha256=hashes.sha256(path)))
        chunks.append(tuple(ray.put(block) for block in _read_chunks(path)))
    shipped = ShippedModel(sha256=digest, files=tuple(files), chunks=tuple(chunks))
    log.info("model %s (%d files, %.1f MB) in the object store in %.2f s", digest[:12], len(files),
             shipped.size / 1e6, time.perf_counter() - started)
    return shipped


def open_model(shipped: ShippedModel) -> tuple[Path, bool]:
    """This node's folder of the model (fetched from the object store on a miss) and whether it was fetched."""
    started = time.perf_counter()

    def fetch(i: int) -> Iterator[bytes]:
        for ref in shipped.chunks[i]:
            yield ray.get(ref)  # one chunk at a time: released before the next is fetched

    folder, fetched = materialize(shipped.sha256, list(shipped.files), fetch)
    if fetched:
        log.info("model %s fetched into %s (%.1f MB) in %.2f s", shipped.sha256[:12], folder, shipped.size / 1e6,
                 time.perf_counter() - started)
    return folder, fetched


def job_on_node(job: JobSpec, shipped: ShippedModel | None) -> JobSpec:
    """The job as this node runs it: ``model.path`` is the node's cached copy (the job as is without one)."""
    if shipped is None:
        return job
    folder, _ = open_model(shipped)
    return job.replace(model={"path": str(folder)})


def _read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            yield block
