"""Helpers for the index tests: recompute an index's recall from the vectors, independently of the build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from embedpipe.index.recall import recall
from embedpipe.index.search import open_index


def recompute_recall(index_dir: Path, index_ids: np.ndarray, vectors: np.ndarray):
    """(10-recall@10, 1-recall@1, the stored exact neighbours, numpy's exact neighbours) for the built
    index, its stored search parameters and its hold-out queries; ``vectors[i]`` has index id ``index_ids[i]``."""
    holdout = pq.read_table(Path(index_dir) / "holdout.parquet")
    qids = np.array(holdout["index_id"].to_pylist())
    position = {int(i): n for n, i in enumerate(index_ids)}
    queries = vectors[[position[int(i)] for i in qids]]
    scores = queries @ vectors.T
    exact = np.asarray(index_ids)[np.argsort(-scores, axis=1, kind="stable")[:, :11]]
    _, found = open_index(index_dir).index.search(queries, 11)
    return (round(recall(found, exact, qids, k=10, at=10), 4), round(recall(found, exact, qids, k=1, at=1), 4),
            np.array(holdout["exact"].to_pylist()), exact)
