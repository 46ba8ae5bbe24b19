"""Make the empty index for a spec and train it on the sample (the coarse k-means on GPUs when
faiss-gpu sees one)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from embedpipe.index.factory import IndexSpec

log = logging.getLogger(__name__)

METRICS = {"inner_product": "METRIC_INNER_PRODUCT", "l2": "METRIC_L2"}


def faiss_metric(metric: str) -> int:
    import faiss

    return getattr(faiss, METRICS[metric])


def empty_index(spec: IndexSpec, *, dim: int, metric: str):
    """Sharded (IVF) indexes carry ids in their lists; the others get an IndexIDMap2 around them."""
    import faiss

    factory = spec.factory if spec.sharded else f"IDMap2,{spec.factory}"
    return faiss.index_factory(dim, factory, faiss_metric(metric))


def train_index(spec: IndexSpec, sample: np.ndarray, *, dim: int, metric: str):
    """The trained, empty index. ``sample`` is a uniform sample of the corpus (any size for untrained kinds)."""
    import faiss

    index = empty_index(spec, dim=dim, metric=metric)
    if index.is_trained:
        return index
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if gpus and spec.nlist:  # untested here (no GPU): the coarse k-means runs on all GPUs
        ivf = faiss.extract_index_ivf(index)
        ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlat(ivf.d, faiss_metric(metric)))
        log.info("training %s: coarse k-means on %d GPU(s)", spec.factory, gpus)
    index.verbose = log.isEnabledFor(logging.DEBUG)  # FAISS's own progress lines with -vv
    with native_stderr():
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    return index


@contextmanager
def native_stderr() -> Iterator[None]:
    """FAISS's C++ writes to file descriptor 2 itself (k-means warnings such as "WARNING clustering 1000 points
    to 256 centroids", once per sub-quantizer and OPQ iteration): sent to /dev/null unless -v (embedpipe's
    loggers at INFO)."""
    if log.isEnabledFor(logging.INFO):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
