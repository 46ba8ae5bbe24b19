"""Ranges laid end to end, in numpy: sequences in a packed batch, chunks of a document, bytes of an id, a sample.

``counts`` [N] are the ranges' lengths, laid end to end; these say where each range begins and which items it holds.
"""

from __future__ import annotations

import numpy as np


def bounds(counts: np.ndarray) -> np.ndarray:
    """[N + 1] int64: range i holds items bounds[i]:bounds[i + 1] (0, c0, c0 + c1, ...)."""
    edges = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=edges[1:])
    return edges


def within(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] int64: each item's place in its own range (0..c0-1, 0..c1-1, ...)."""
    edges = bounds(counts)
    return np.arange(edges[-1], dtype=np.int64) - np.repeat(edges[:-1], counts)


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] int64: range(starts[0], starts[0] + c0), then range(starts[1], ...), ... end to end."""
    return np.repeat(np.asarray(starts, dtype=np.int64), counts) + within(counts)
