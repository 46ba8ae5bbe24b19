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
TIE_SLACK = 10  # exact neighbours kept beyond k + 1, to recognise ties with the k-th
TIE_EPS = 1e-6
FLAT_CURVE = 0.002  # a sweep stops once two more steps gained less recall than this


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


def without_self(ids: np.ndarray, query_ids: np.ndarray, k: int, scores: np.ndarray | None = None):
    """The first ``k`` ids of each row that are not the query's own id (nor -1), with their scores."""
    out = np.full((len(ids), k), -1, np.int64)
    out_scores = np.full((len(ids), k), -np.inf, np.float32)
    for q, (row, own) in enumerate(zip(ids, query_ids)):
        keep = (row != own) & (row >= 0)
        kept = row[keep][:k]
        out[q, : len(kept)] = kept
        if scores is not None:
            out_scores[q, : len(kept)] = scores[q][keep][:k]
    return out, out_scores


def recall(found: np.ndarray, exact: Neighbours, query_ids: np.ndarray, *, k: int, at: int) -> float:
    """k-recall@at: the share of each query's ``k`` exact neighbours among its first ``at`` results.

    Ties count: a result whose exact score equals the k-th exact score (a duplicate vector, say) is
    as good as the neighbour it ties with, so an exact index scores 1.0 whatever order ties come in.
    ``exact`` is wider than k (TIE_SLACK extra columns) so that tied rows are known with their scores.
    """
    f, _ = without_self(found, query_ids, at)
    e, e_scores = without_self(exact.ids, query_ids, exact.ids.shape[1], exact.scores)
    hits = total = 0
    for fr, er, es in zip(f, e, e_scores):
        valid = int((er[:k] >= 0).sum())
        if not valid:
            continue
        threshold = es[valid - 1] - TIE_EPS
        good = set(er[:valid]) | set(er[(es >= threshold) & (er >= 0)])
        hits += min(valid, len(set(fr[fr >= 0]) & good))
        total += valid
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
    return Measured({}, round(recall(found, exact, query_ids, k=k, at=k), 4),
                    round(recall(found, exact, query_ids, k=1, at=1), 4))


def tune(index, *, sweeps: list[list[dict]], queries: np.ndarray, query_ids: np.ndarray, exact: Neighbours,
         k: int, target: float) -> Tuning:
    """The first search setting whose recall@k reaches ``target``; else the best one tried.

    ``sweeps``: lists of settings, each cheapest first (e.g. nprobe 1, 2, 4, ... at one refine
    k_factor); a sweep stops early once more searching stops helping (a compression limit).
    The chosen setting is left on ``index``."""
    import faiss

    space = faiss.ParameterSpace()
    curve: list[Measured] = []
    for steps in sweeps or [[{}]]:
        tried = []
        for params in steps:
            for name, value in params.items():
                space.set_index_parameter(index, name, value)
            m = measure(index, queries, query_ids, exact, k=k)
            m.params = dict(params)
            curve.append(m)
            tried.append(m.recall_at_10)
            if m.recall_at_10 >= target:
                return Tuning(m, True, curve)
            if len(tried) >= 3 and tried[-1] - tried[-3] < FLAT_CURVE:
                break
    best = max(curve, key=lambda c: (c.recall_at_10, -curve.index(c)))
    for name, value in best.params.items():
        space.set_index_parameter(index, name, value)
    return Tuning(best, False, curve)
