"""Ids seen more than once across an input, found in bounded memory (preflight's duplicate-id check).

    each unit's ids -> keys [n, 2] uint64 (``id_keys``) -> (key, unit, row) records, 24 B each, split by key into
    buckets -> per bucket: sort, every record after the first of its key -> the later occurrences, input order

One bucket holds at most ``BUCKET_ROWS`` ids; an input with more has its records spilled to one temporary file
per bucket while the units are read, and each bucket is then checked alone. Memory is O(BUCKET_ROWS) whatever
the corpus (~60 MB for the records of one bucket and its sort), disk 24 B per id for as long as the check runs.
Equal ids always share a key and a key always falls in one bucket, so a bucket's check is the input's for it.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

RECORD = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("unit", "<u4"), ("row", "<u4")])  # one id: 24 B
BUCKET_ROWS = 1_000_000  # ids checked at once: 24 MB of records, ~60 MB with the sort


def id_keys(ids: pa.Array) -> np.ndarray:
    """Two uint64 words per id: the value itself for integers, else 128 bits of blake2b of its text.

    Each id is keyed by its value alone, so a null elsewhere in the unit changes no key; a null
    row gets a key too (callers leave it out)."""
    if pa.types.is_integer(ids.type):
        values = pc.fill_null(ids, 0).to_numpy().astype(np.int64).view(np.uint64)
        return np.stack([values, np.zeros_like(values)], axis=1)
    digests = b"".join(hashlib.blake2b(_id_bytes(v), digest_size=16).digest() for v in ids.to_pylist())
    return np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2)


def _id_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return b"b" + value
    return b"s" + repr(value).encode()


class IdOccurrences:
    """Every id of an input as (key, unit, row), added unit by unit in input order; ``later()`` gives the second
    and later occurrences. ``rows``: the input's rows (planned), which decides the buckets."""

    def __init__(self, *, rows: int, bucket_rows: int | None = None):
        self.buckets = max(1, -(-rows // max(bucket_rows or BUCKET_ROWS, 1)))
        self._held: list[np.ndarray] = []  # one bucket: the records in memory
        self._dir = tempfile.TemporaryDirectory(prefix="embedpipe-ids-") if self.buckets > 1 else None
        self._files = [open(Path(self._dir.name) / f"bucket-{b:04d}", "wb") for b in range(self.buckets)] \
            if self._dir else []

    def add(self, keys: np.ndarray, *, unit: int, rows: np.ndarray) -> None:
        """``keys`` [n, 2] of one unit's ids at ``rows`` (their positions in the unit)."""
        records = np.empty(len(keys), dtype=RECORD)
        records["k0"], records["k1"], records["unit"], records["row"] = keys[:, 0], keys[:, 1], unit, rows
        if not self._files:
            self._held.append(records)
            return
        which = records["k0"] % np.uint64(self.buckets)  # integer ids: by value; text ids: by their hash
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(self.buckets + 1))
        for b in np.flatnonzero(np.diff(cuts)):
            self._files[b].write(records[order[cuts[b]:cuts[b + 1]]].tobytes())

    def later(self) -> np.ndarray:
        """[D, 2] (unit, row) of every occurrence after an id's first, in input order."""
        found = [_later(records) for records in self._bucket_records()]
        found = [f for f in found if len(f)]
        if not found:
            return np.zeros((0, 2), dtype=np.int64)
        later = np.concatenate(found)
        later = later[np.lexsort((later["row"], later["unit"]))]
        return np.stack([later["unit"].astype(np.int64), later["row"].astype(np.int64)], axis=1)

    def _bucket_records(self):
        if not self._files:
            yield np.concatenate(self._held) if self._held else np.zeros(0, dtype=RECORD)
            return
        for f in self._files:
            f.close()
        for f in self._files:
            yield np.fromfile(f.name, dtype=RECORD)

    def close(self) -> None:
        for f in self._files:
            f.close()
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> "IdOccurrences":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _later(records: np.ndarray) -> np.ndarray:
    """The records of one bucket that repeat an earlier record's key (earlier: lower unit, then row)."""
    order = np.lexsort((records["row"], records["unit"], records["k1"], records["k0"]))
    k0, k1 = records["k0"][order], records["k1"][order]
    repeat = np.zeros(len(order), dtype=bool)
    repeat[1:] = (k0[1:] == k0[:-1]) & (k1[1:] == k1[:-1])
    return records[order[repeat]]
