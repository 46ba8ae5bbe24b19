"""Worker side of a sharded (IVF) build: add one unit's vectors to the trained index, write the shard.

A shard is the unit's inverted lists only (``faiss.write_InvertedLists``): the coarse quantizer and
the codebooks are the same for every shard, so they are not written once per unit. The worker also
returns the unit's exact neighbours of the hold-out queries, so the ground truth is computed where
the vectors already are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedpipe.index.ids import IdPlan
from embedpipe.io.layout import atomic_path, shard_path
from embedpipe.index.parts import Part, read_vectors
from embedpipe.index.recall import ExactNeighbours, Neighbours


@dataclass(frozen=True)
class ShardContext:
    """Shipped once per build to every worker (through the object store)."""

    trained: np.ndarray  # faiss.serialize_index of the trained, empty index (uint8)
    ids: IdPlan
    queries: np.ndarray  # [Q, D] float32 hold-out queries
    width: int  # exact neighbours kept per query (k + 1: the query itself is among them)
    metric: str
    shard_dir: str


@dataclass
class ShardResult:
    unit_id: str
    shard: str
    rows: int
    exact: Neighbours
    seconds: float


class ShardBuilder:
    """Built once per build on a worker (deserialises the trained index); called per unit."""

    def __init__(self, context: ShardContext):
        import faiss

        self.context = context
        self.index = faiss.deserialize_index(context.trained)
        self.ivf = faiss.extract_index_ivf(self.index)
        self.exact = ExactNeighbours(context.queries, width=context.width, metric=context.metric)
        Path(context.shard_dir).mkdir(parents=True, exist_ok=True)

    def __call__(self, part: Part) -> ShardResult:
        import faiss

        start = time.perf_counter()
        ids, vectors = read_vectors(part.path)
        index_ids = self.context.ids.index_ids(part.unit_id, ids)
        self.index.add_with_ids(vectors, index_ids)
        final = shard_path(self.context.shard_dir, part.unit_id)
        with atomic_path(final) as tmp:
            writer = faiss.FileIOWriter(str(tmp))
            faiss.write_InvertedLists(self.ivf.invlists, writer)
            del writer  # flushes and closes the file
        self.index.reset()  # empty lists again; quantizer and codebooks stay trained
        return ShardResult(part.unit_id, str(final), len(vectors), self.exact(vectors, index_ids),
                           time.perf_counter() - start)


class ShardWorker:
    """The Ray actor of a sharded build (no model: only the trained index); the driver's shard runner
    (embedpipe/cluster/shards.py) wraps it with ``ray.remote`` and runs it under the cluster
    Scheduler, so a dead worker's unit is retried."""

    def __init__(self, context: ShardContext):
        self.builder = ShardBuilder(context)

    def process(self, part: Part) -> ShardResult:
        return self.builder(part)
