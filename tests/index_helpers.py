"""Helpers for the index tests: recompute an index's recall from the vectors, independently of the build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from embedpipe.index.recall import Neighbours, recall
from embedpipe.index.search import open_index


def recompute_recall(index_dir: Path, index_ids: np.ndarray, vectors: np.ndarray):
    """(10-recall@10, 1-recall@1, stored exact neighbours, numpy's exact neighbours) of the built index
    searched with its stored parameters on its hold-out queries; ``vectors[i]`` has index id ``index_ids[i]``."""
    holdout = pq.read_table(Path(index_dir) / "holdout.parquet")
    stored = Neighbours(np.array(holdout["exact"].to_pylist()), np.array(holdout["exact_score"].to_pylist()))
    qids = np.array(holdout["index_id"].to_pylist())
    index_ids = np.asarray(index_ids, dtype=np.int64)
    position = {int(i): n for n, i in enumerate(index_ids)}
    queries = vectors[[position[int(i)] for i in qids]]
    scores = queries @ vectors.T  # [Q, N] inner products (the vectors are normalised)
    order = np.lexsort((np.broadcast_to(index_ids, scores.shape), -scores), axis=1)[:, : stored.ids.shape[1]]
    exact = Neighbours(index_ids[order], np.take_along_axis(scores, order, 1))
    _, found = open_index(index_dir).index.search(queries, 11)
    return (round(recall(found, exact, qids, k=10, at=10), 4), round(recall(found, exact, qids, k=1, at=1), 4),
            stored, exact)


def assert_same_neighbours(stored: Neighbours, exact: Neighbours) -> None:
    """The build's exact neighbours are numpy's: same scores, same ids but for near-ties."""
    np.testing.assert_allclose(stored.scores, exact.scores, atol=1e-5)
    assert (stored.ids == exact.ids).mean() > 0.99
