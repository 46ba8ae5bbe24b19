"""Incremental runs: reuse the current version's vector for a row whose content is unchanged.

Each row's content hash covers its text and everything else that decides its vector (the
model fingerprint and the vector settings, prompt included: the ``salt``). It is stored with
the vectors (column ``content_hash``), and a row of the next run whose id and hash match the
previous version takes that vector instead of being encoded again.

Lookup cost in a run: ``lookup_unit`` (``lookup_unit_chunks`` for a chunked output, whose chunk rows carry
their document's hash) with the night's diff (``embedpipe/io/diff.py``): the previous part of the same unit,
read whole, and for rows that moved only the row groups they came from: linear in the rows whatever the ids'
order. ``lookup`` (no diff: any ids against the whole version) scans the previous
version's ``id`` and ``content_hash`` columns where their Parquet statistics overlap the ids' range, then
reads the part files that hold matches: a few row groups for ids in order, every part for UUIDs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from embedpipe.io.fs import arrow_filesystem
from embedpipe.io.rows import valid_rows
from embedpipe.ranges import bounds

HASH_BYTES = 16


def content_hashes(texts: list[str], *, salt: bytes) -> pa.Array:
    """fixed_size_binary(16): blake2b of the vector settings' fingerprint and the row's text."""
    digests = [hashlib.blake2b(t.encode(), digest_size=HASH_BYTES, key=salt[:64]).digest() for t in texts]
    return pa.array(digests, pa.binary(HASH_BYTES))


class PreviousVectors:
    """The current version's vectors (a ``vectors/`` folder with ``content_hash``), looked up per unit."""

    def __init__(self, vectors_dir: str | Path, *, parts: tuple[str, ...] | list[str] = ()):
        """``parts``: the part files the previous version's manifest records intact; an orphan or a torn part
        in the folder is never read (an empty list: the folder's parts, for a folder without a manifest)."""
        self.filesystem, files = arrow_filesystem(list(parts) if parts else [str(vectors_dir)])  # None: local
        self.files = files if parts else []  # parts[i] within self.filesystem (the diff's part indexes)
        self.dataset = ds.dataset(files if parts else files[0], format="parquet", filesystem=self.filesystem)
        if "content_hash" not in self.dataset.schema.names:
            raise ValueError(f"{vectors_dir} has no content_hash column: it was not written by an incremental "
                             f"run; run once more without output.incremental to start one")

    def lookup(self, ids: pa.Array, hashes: pa.Array) -> tuple[np.ndarray, np.ndarray, int]:
        """(reuse mask [N], stored vectors of the reused rows in order [R, W], ids present before).

        The vectors keep their stored type (float32, float16, int8, uint8): the salt covers output.dtype
        and output.dim, so a reused row always has the type and width of the run's fresh rows."""
        reuse, files, previous = self._match(ids, hashes)
        if not reuse.any():
            return reuse, np.zeros((0, 0), np.float32), previous
        reused_ids = [i for i, r in zip(ids.to_pylist(), reuse) if r]
        by_id: dict = {}
        for file in files:
            part = pq.read_table(file, columns=["id", "embedding"], filters=[("id", "in", reused_ids)],
                                 filesystem=self.filesystem)
            by_id.update(zip(part["id"].to_pylist(), stored_rows(part)))
        return reuse, np.stack([by_id[i] for i in reused_ids]), previous

    def _match(self, ids: pa.Array, hashes: pa.Array) -> tuple[np.ndarray, list[str], int]:
        """(reuse mask [N]: the id is there with the same hash, the part files holding them, ids present before)."""
        found = self.dataset.to_table(columns=["id", "content_hash", "__filename"], filter=_id_filter(ids))
        reuse, at, present = _same_hash(ids, hashes, found)
        files = found["__filename"].take(pc.filter(at, pa.array(reuse))).to_pylist()
        return reuse, sorted(set(files)), int(present.sum())

    def lookup_unit(self, ids: pa.Array, hashes: pa.Array, *, same_part: int | None,
                    moved: pa.Table | None) -> tuple[np.ndarray, np.ndarray, int]:
        """``lookup``'s answer for one unit from the night's diff: ``same_part`` (the index of the previous part
        of the same unit, read whole) and ``moved`` (id, part index, row in it: rows found in other parts,
        of which only the row groups holding them are read). No other part is opened."""
        return _match_found(ids, hashes, self._found(same_part, moved, columns=["id", "content_hash", "embedding"]))

    def lookup_unit_chunks(self, ids: pa.Array, hashes: pa.Array, *, same_part: int | None,
                           moved: pa.Table | None) -> tuple[np.ndarray, pa.Table | None, int]:
        """Chunked outputs (input.chunking), from the night's diff as ``lookup_unit``: ``hashes`` are the documents'
        (the whole text, which every chunk row of a document carries). (reuse mask [N] over the documents, every
        chunk row of the reused documents (id, chunk, start, end, embedding; any order), chunk rows of the
        documents present before): an unchanged document reuses all of its chunks, a changed one none."""
        found = [t for t in self._found(same_part, moved, columns=CHUNK_COLUMNS) if t.num_rows]
        if not found:
            return np.zeros(len(ids), dtype=bool), None, 0
        table = pa.concat_tables(found).filter(pc.is_in(pc.field("id"), value_set=ids))  # chunk rows of these ids
        reuse, _, _ = _same_hash(ids, hashes, table)
        reused = table.filter(pc.is_in(pc.field("id"), value_set=ids.filter(pa.array(reuse))))
        return reuse, (reused.drop_columns(["content_hash"]) if reused.num_rows else None), table.num_rows

    def _found(self, same_part: int | None, moved: pa.Table | None, *, columns: list[str]) -> list[pa.Table]:
        """The unit's previous part (read whole) and the rows found elsewhere (only their row groups)."""
        found = []
        if same_part is not None:
            found.append(pq.read_table(self.files[same_part], columns=columns, filesystem=self.filesystem))
        if moved is not None and moved.num_rows:
            for part in np.unique(moved["part"].to_numpy()):
                rows = pc.filter(moved["row"], pc.equal(moved["part"], int(part))).to_numpy()
                found.append(self._rows(int(part), rows, columns=columns))
        return found

    def _rows(self, part: int, rows: np.ndarray, *, columns: list[str]) -> pa.Table:
        """These rows of one part (positions in it): only the row groups that hold them are read."""
        source = self.files[part] if self.filesystem is None else self.filesystem.open_input_file(self.files[part])
        with pq.ParquetFile(source) as pf:
            sizes = np.array([pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)])
            starts = bounds(sizes)  # [G + 1]
            group_of = np.searchsorted(starts, rows, side="right") - 1  # [R] the row group holding each row
            groups = np.unique(group_of)
            table = pf.read_row_groups(groups.tolist(), columns=columns)
        offsets = bounds(sizes[groups])  # where each read group starts in table
        local = offsets[np.searchsorted(groups, group_of)] + rows - starts[group_of]
        return table.take(pa.array(local))


CHUNK_COLUMNS = ["id", "content_hash", "chunk", "start", "end", "embedding"]  # a chunked part's reusable columns


def stored_rows(part: pa.Table) -> np.ndarray:
    """A part's ``embedding`` column as its stored values [N, W]."""
    flat = part["embedding"].combine_chunks()
    return np.asarray(flat.values.to_numpy(zero_copy_only=False)).reshape(len(part), -1)


def _match_found(ids: pa.Array, hashes: pa.Array, found: list[pa.Table]) -> tuple[np.ndarray, np.ndarray, int]:
    """(reuse mask [N], the reused rows' stored vectors [R, W], ids present) of ``ids`` among ``found``'s rows."""
    found = [t for t in found if t.num_rows]
    if not found:
        return np.zeros(len(ids), dtype=bool), np.zeros((0, 0), np.float32), 0
    table = pa.concat_tables(found)
    reuse, at, present = _same_hash(ids, hashes, table)
    if not reuse.any():
        return reuse, np.zeros((0, 0), np.float32), int(present.sum())
    picked = table["embedding"].take(pc.filter(at, pa.array(reuse))).combine_chunks()  # [R] fixed-size lists
    width = picked.type.list_size
    vectors = np.asarray(picked.flatten().to_numpy(zero_copy_only=False)).reshape(len(picked), width)
    return reuse, vectors, int(present.sum())


def _same_hash(ids: pa.Array, hashes: pa.Array, table: pa.Table) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """(reuse mask [N]: the id is in ``table`` with the same content hash, the row of each id in ``table`` (its first;
    null where absent), present mask [N]). A chunked part's rows of one document all carry its hash: the first
    one answers for the document."""
    at = pc.index_in(ids, value_set=table["id"])  # [N] row of each id in table, null where absent
    present = valid_rows(at)
    reuse = np.zeros(len(ids), dtype=bool)
    same = pc.equal(table["content_hash"].take(pc.drop_null(at)), pc.filter(hashes, at.is_valid()))
    reuse[np.flatnonzero(present)] = same.to_numpy(zero_copy_only=False)
    return reuse, at, present


def _id_filter(ids: pa.Array) -> pc.Expression:
    """``id in ids``, and the range of ids for row-group pruning by statistics (same rows, fewer reads)."""
    wanted = pc.field("id").isin(ids)
    bounds = pc.min_max(ids)
    low, high = bounds["min"], bounds["max"]
    if not low.is_valid:  # no non-null id: the set alone
        return wanted
    return (pc.field("id") >= low) & (pc.field("id") <= high) & wanted
