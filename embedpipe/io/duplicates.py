"""Ids seen more than once across an input, found in bounded memory (preflight's duplicate-id check).

    each unit's ids -> keys [n, 2] uint64 (``id_keys``) -> (key, unit, row) records, 24 B each, split by key into
    buckets -> per bucket: sort, the records of every key seen twice or more -> the later occurrences, input order
    -> text ids: each later occurrence confirmed against the ids themselves (``later(values=...)``)

One bucket holds at most ``BUCKET_ROWS`` ids; an input with more has its records spilled to one temporary file
per bucket while the units are read, and each bucket is then checked alone. Memory is O(BUCKET_ROWS) whatever
the corpus (~60 MB for the records of one bucket and its sort), disk 24 B per id for as long as the check runs.
Equal ids always share a key and a key always falls in one bucket, so a bucket's check is the input's for it.

An integer id is its own key, so equal keys are equal ids. A text or binary id's key is a 128-bit hash
(``_text_keys``, numpy over the Arrow buffers: ~20x the speed of one hashlib call per id); two different ids
that share a key are told apart by their values, read again for the keys seen twice only, so a collision can
never make a unique id a duplicate (and drop its row under keep_first).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

RECORD = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("unit", "<u4"), ("row", "<u4")])  # one id: 24 B
BUCKET_ROWS = 1_000_000  # ids checked at once: 24 MB of records, ~60 MB with the sort


def id_keys(ids: pa.Array) -> np.ndarray:
    """Two uint64 words per id: the value itself for integers, else 128 bits of a hash of its bytes (text and
    binary ids: ``_text_keys``; any other type: ``_repr_keys``).

    Each id is keyed by its value alone, so a null elsewhere in the unit changes no key; a null
    row gets a key too (callers leave it out)."""
    if pa.types.is_integer(ids.type):
        values = pc.fill_null(ids, 0).to_numpy().astype(np.int64).view(np.uint64)
        return np.stack([values, np.zeros_like(values)], axis=1)
    if ids.type in TEXT_OFFSETS:
        return _text_keys(ids)
    return _repr_keys(ids)


def _repr_keys(ids: pa.Array) -> np.ndarray:
    """[n, 2] uint64: 128 bits of blake2b of each id's repr, one hashlib call per id (the ids of other types)."""
    digests = b"".join(hashlib.blake2b(_id_bytes(v), digest_size=16).digest() for v in ids.to_pylist())
    return np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2)


def exact_keys(id_type: pa.DataType) -> bool:
    """True where equal keys are equal ids (integers); else a repeat is confirmed by value (``later(values=)``)."""
    return pa.types.is_integer(id_type)


def _id_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return b"b" + value
    return b"s" + repr(value).encode()


# the Arrow types hashed from their buffers, and the dtype of their offsets
TEXT_OFFSETS: dict[pa.DataType, type] = {pa.string(): np.int32, pa.binary(): np.int32,
                                         pa.large_string(): np.int64, pa.large_binary(): np.int64}
# xxHash64's primes: lane a runs its round, lane b another round on other primes; both end in its avalanche
_P1, _P2, _P3, _P4, _P5 = (np.uint64(p) for p in (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                                  0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _avalanche(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    return h ^ (h >> np.uint64(32))


def _text_keys(ids: pa.Array) -> np.ndarray:
    """[n, 2] uint64: a 128-bit hash of each id's bytes (two 64-bit lanes over its 8-byte words, then its length).

    Vectorised over the ids: the ids are taken longest first, so word j is read for the first ``count[j]``
    of them only, and the work is proportional to the input's bytes whatever the spread of lengths."""
    n = len(ids)
    buffers = ids.buffers()  # [validity, offsets, data]
    offsets = np.frombuffer(buffers[1], dtype=TEXT_OFFSETS[ids.type])[ids.offset:ids.offset + n + 1].astype(np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    padded = np.zeros(len(data) + 8, dtype=np.uint8)  # every id's last word can be read whole
    padded[:len(data)] = data
    words = np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))  # a word at each byte
    start, length = offsets[:-1], offsets[1:] - offsets[:-1]
    n_words = (length + 7) // 8
    order = np.argsort(-n_words, kind="stable")  # longest first
    start, length, n_words = start[order], length[order], n_words[order]
    count = np.searchsorted(-n_words, -np.arange(int(n_words[0]) if n else 0), side="left")  # ids with > j words
    a = np.full(n, 0x61C8864E7A143579, dtype=np.uint64)
    b = np.full(n, 0x3C6EF372FE94F82B, dtype=np.uint64)
    for j, c in enumerate(count.tolist()):
        w = words[start[:c] + 8 * j]  # [c] the ids' word j, little-endian
        left = length[:c] - 8 * j  # bytes of the id from word j on
        short = left < 8  # the last word: only its own bytes count
        w[short] &= (np.uint64(1) << (np.uint64(8) * left[short].astype(np.uint64))) - np.uint64(1)
        a[:c] = _rotl(a[:c] + w * _P2, 31) * _P1
        b[:c] = _rotl(b[:c] ^ (w * _P4), 27) * _P3 + _P5
    n_bytes = length.astype(np.uint64)
    keys = np.empty((n, 2), dtype=np.uint64)
    keys[order, 0] = _avalanche(a ^ (n_bytes * _P5))
    keys[order, 1] = _avalanche(b + n_bytes * _P1 + a)
    return keys


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
        which = which.astype(np.uint16 if self.buckets <= 1 << 16 else np.uint32)  # a radix sort below 2^16
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(self.buckets + 1))
        for b in np.flatnonzero(np.diff(cuts)):
            self._files[b].write(records[order[cuts[b]:cuts[b + 1]]].tobytes())

    def later(self, *, values: Callable[[int], pa.Array] | None = None) -> np.ndarray:
        """[D, 2] (unit, row) of every occurrence after an id's first, in input order.

        ``values``: a unit's ids by its index, where the keys are hashes (``exact_keys`` False): the records of
        every key seen twice are then told apart by their ids, so only equal ids repeat. None: keys are ids."""
        shared = [_shared_keys(records, first=index) for index, records in enumerate(self._bucket_records())]
        shared = [s for s in shared if len(s)]
        if not shared:
            return np.zeros((0, 2), dtype=np.int64)
        shared = np.concatenate(shared)
        shared = shared[np.lexsort((shared["row"], shared["unit"]))]  # input order
        if values is None:
            later = shared[~shared["first"]]
        else:
            later = shared[_repeated_values(shared, values)]
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


# a record whose key another record shares: ``group`` numbers its key (unique across buckets), ``first`` marks
# the key's earliest record in input order
SHARED = np.dtype([("group", "<u8"), ("unit", "<u4"), ("row", "<u4"), ("first", "?")])


def _shared_keys(records: np.ndarray, *, first: int) -> np.ndarray:
    """The records of one bucket (``first``: its index, which makes its groups' numbers its own) whose key is
    seen twice or more, as ``SHARED``. The bucket's records are in input order, and stay so within a key.

    The bucket's first words are sorted alone (a plain value sort, several times a lexsort of the records): only
    the records whose first word repeats (the duplicates, and the rare first-word collision) are grouped by key."""
    k0 = records["k0"]
    ordered = np.sort(k0)  # [n]
    twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])  # [m] first words held by two records or more
    if not len(twice):
        return np.zeros(0, dtype=SHARED)
    at = np.searchsorted(twice, k0).clip(max=len(twice) - 1)
    candidates = records[twice[at] == k0]  # [c] in input order
    order = np.lexsort((candidates["k1"], candidates["k0"]))  # [c] by key, stable: input order within a key
    c0, c1 = candidates["k0"][order], candidates["k1"][order]
    starts = np.ones(len(order), dtype=bool)  # [c] the first record of each key
    starts[1:] = (c0[1:] != c0[:-1]) | (c1[1:] != c1[:-1])
    group = np.cumsum(starts) - 1  # [c] the key's number in this bucket
    keep = np.bincount(group)[group] > 1  # a first-word collision alone is no shared key
    shared = np.empty(int(keep.sum()), dtype=SHARED)
    shared["group"] = (group[keep].astype(np.uint64) << np.uint64(20)) | np.uint64(first)  # < 2^20 buckets
    shared["unit"], shared["row"] = candidates["unit"][order[keep]], candidates["row"][order[keep]]
    shared["first"] = starts[keep]
    return shared


def _repeated_values(shared: np.ndarray, values: Callable[[int], pa.Array]) -> np.ndarray:
    """[M] bool: the records, in input order, whose id an earlier record of the same key holds. Each unit with
    such a record is read once, in input order; the ids held are one per key (one set of them on a collision)."""
    seen: dict[int, set] = {}
    repeated = np.zeros(len(shared), dtype=bool)
    cuts = np.flatnonzero(np.diff(shared["unit"].astype(np.int64))) + 1
    for span in np.split(np.arange(len(shared)), cuts):
        unit = int(shared["unit"][span[0]])
        ids = values(unit).take(pa.array(shared["row"][span].astype(np.int64))).to_pylist()
        for i, group, value in zip(span.tolist(), shared["group"][span].tolist(), ids):
            held = seen.setdefault(group, set())
            if value in held:
                repeated[i] = True
            else:
                held.add(value)
    return repeated
