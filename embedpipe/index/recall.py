"""Measured quality: exact neighbours of the hold-out queries, recall of a built index, tuning.

The hold-out queries are corpus vectors (they stay in the index). Each query's own row is left
out of both the exact and the approximate neighbour lists, so recall measures finding *other*
rows, as for a new query. Exact neighbours are computed part by part (``ExactNeighbours``, on
the workers for sharded builds) and merged: nobody holds all vectors at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCORE_SIGN = {"inner_product": 1.0, "l2": -1.0}  # scores: higher is better for both metrics


@dataclass
class Neighbours:
    """Top ``width`` neighbours per query: ids [Q, width] (-1: none) and scores (higher is better)."""

    ids: np.ndarray
    scores: np.ndarray

    @classmethod
    def empty(cls, queries: int, width: int) -> "Neighbours":
        return cls(np.full((queries, width), -1, np.int64), np.full((queries, width), -np.inf, np.float32))

    def merge(self, other: "Neighbours") -> "Neighbours":
        """Keep the best ``width`` of both; ties go to the smaller id, so merge order never matters."""
        width = self.ids.shape[1]
        ids = np.concatenate([self.ids, other.ids], axis=1)
        scores = np.concatenate([self.scores, other.scores], axis=1)
        order = np.lexsort((np.where(ids < 0, np.iinfo(np.int64).max, ids), -scores), axis=1)[:, :width]
        return Neighbours(np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1))


class ExactNeighbours:
    """Built once per build with the hold-out queries; called per part with its vectors and index ids."""

    def __init__(self, queries: np.ndarray, *, width: int, metric: str):
        self.queries, self.width, self.metric = queries, width, metric

    def __call__(self, vectors: np.ndarray, index_ids: np.ndarray) -> Neighbours:
        import faiss

        k = min(self.width, len(vectors))
        out = Neighbours.empty(len(self.queries), self.width)
        if k == 0 or len(self.queries) == 0:
            return out
        fmetric = faiss.METRIC_INNER_PRODUCT if self.metric == "inner_product" else faiss.METRIC_L2
        dist, idx = faiss.knn(self.queries, vectors, k, metric=fmetric)
        part = Neighbours(index_ids[idx], (SCORE_SIGN[self.metric] * dist).astype(np.float32))
        return out.merge(Neighbours(np.pad(part.ids, ((0, 0), (0, self.width - k)), constant_values=-1),
                                    np.pad(part.scores, ((0, 0), (0, self.width - k)), constant_values=-np.inf)))


def without_self(ids: np.ndarray, query_ids: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` ids of each row that are not the query's own id (and not -1)."""
    out = np.full((len(ids), k), -1, np.int64)
    for q, (row, own) in enumerate(zip(ids, query_ids)):
        kept = row[(row != own) & (row >= 0)][:k]
        out[q, : len(kept)] = kept
    return out


def recall(found: np.ndarray, exact: np.ndarray, query_ids: np.ndarray, *, k: int, at: int) -> float:
    """k-recall@at: the share of each query's ``k`` exact neighbours found in its first ``at`` results."""
    f, e = without_self(found, query_ids, at), without_self(exact, query_ids, k)
    hits = sum(len(set(fr[fr >= 0]) & set(er[er >= 0])) for fr, er in zip(f, e))
    total = int((e >= 0).sum())
    return hits / total if total else 1.0


@dataclass
class Measured:
    params: dict
    recall_at_10: float
    recall_at_1: float


@dataclass
class Tuning:
    chosen: Measured
    reached: bool
    curve: list[Measured] = field(default_factory=list)


def measure(index, queries: np.ndarray, query_ids: np.ndarray, exact: Neighbours, *, k: int) -> Measured:
    """Search the hold-out queries (k+1: the query itself may come back) and score 10-recall@10, 1-recall@1."""
    _, found = index.search(queries, k + 1)
    return Measured({}, round(recall(found, exact.ids, query_ids, k=k, at=k), 4),
                    round(recall(found, exact.ids, query_ids, k=1, at=1), 4))


def tune(index, *, steps: list[dict], queries: np.ndarray, query_ids: np.ndarray, exact: Neighbours,
         k: int, target: float) -> Tuning:
    """The first of ``steps`` (search parameters, cheapest first) whose recall@k reaches ``target``;
    else the best step tried. The chosen parameters are left set on ``index``."""
    import faiss

    space = faiss.ParameterSpace()
    curve: list[Measured] = []
    for params in steps or [{}]:
        for name, value in params.items():
            space.set_index_parameter(index, name, value)
        m = measure(index, queries, query_ids, exact, k=k)
        m.params = dict(params)
        curve.append(m)
        if m.recall_at_10 >= target:
            return Tuning(m, True, curve)
        if len(curve) >= 3 and curve[-1].recall_at_10 <= curve[-3].recall_at_10:
            break  # flat: searching more does not help (a compression limit)
    best = max(curve, key=lambda c: (c.recall_at_10, -curve.index(c)))
    for name, value in best.params.items():
        space.set_index_parameter(index, name, value)
    return Tuning(best, False, curve)
