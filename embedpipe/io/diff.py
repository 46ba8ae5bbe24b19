"""The incremental diff of a night: where in the previous version each of tonight's ids was, in linear time.

Two steps, whatever order the ids come in (auto-increment keys, UUIDs, content hashes):

1. Same unit. Each of tonight's units is compared with the previous version's part of the same unit (the same
   input file and first row group or row: rows rarely move between files from one night to the next). Both
   id columns are read and matched with one hash set (``pc.is_in``).
2. Join. The ids left over on either side (tonight: new rows and rows that moved; before: deleted rows, rows
   that moved, and every row of a previous part that no unit of tonight claims) are hash-partitioned by id
   into ``buckets`` and joined bucket by bucket (Arrow's hash join): a row that moved to another unit or
   file is found in its bucket, never by scanning every part.

``map_units``, ``map_parts`` and ``join_bucket`` are the tasks (plain functions of small arguments: Ray
runs them on the cluster, ``embedpipe/cluster/diff.py``; ``diff_locally`` runs them on threads). Each
previous part's ids are read once here; a worker then reads its unit's previous part (id, content_hash,
embedding) and, for moved rows only, the few parts they came from (``embedpipe/io/reuse.py``). The
content hash is compared by the worker, which hashes its rows' texts anyway.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedpipe.io import fs
from embedpipe.ranges import within
from embedpipe.report.memory import peak_rss_mb
from embedpipe.units import Unit

MAP_UNITS = 32  # units per map task: (map tasks x buckets) Ray objects stay under ~40k at 10^4 units
ROWS_PER_BUCKET = 1_000_000  # input rows per join bucket: at a few % leftovers, tens of thousands of ids each
MAX_BUCKETS = 64


@dataclass(frozen=True)
class UnitTask:
    """One of tonight's units and the index of the previous part of the same unit (-1: none)."""

    unit: Unit
    index: int  # the unit's position in the night's list (the join's key for it)
    same_part: int


@dataclass
class DiffStats:
    looked_up: int = 0  # tonight's non-null ids looked up
    same_unit: int = 0  # found in the previous part of the same unit
    joined: int = 0  # found by the join (moved between units or files)
    parts_read: int = 0  # previous parts whose ids were read (each once)
    seconds: float = 0.0
    buckets: int = 0
    peak_rss_mb: float = 0.0  # the largest peak resident memory of a process that ran a map task

    def add(self, other: "DiffStats") -> None:
        self.looked_up += other.looked_up
        self.same_unit += other.same_unit
        self.joined += other.joined
        self.parts_read += other.parts_read
        self.peak_rss_mb = max(self.peak_rss_mb, other.peak_rss_mb)

    def to_dict(self) -> dict:
        return {"method": "same unit, then a hash-partitioned join of ids", "seconds": round(self.seconds, 3),
                "looked_up": self.looked_up, "same_unit": self.same_unit, "joined": self.joined,
                "new": self.looked_up - self.same_unit - self.joined, "parts_read": self.parts_read,
                "buckets": self.buckets, "task_peak_rss_mb": round(self.peak_rss_mb, 1)}


@dataclass
class NightDiff:
    """What the workers need: per unit id, its same-unit previous part and the rows found elsewhere."""

    parts: tuple[str, ...]  # the previous version's intact parts (indexes below point here)
    same_part: dict[str, int] = field(default_factory=dict)  # unit id -> part index (absent: none)
    moved: dict[str, object] = field(default_factory=dict)  # unit id -> pa.Table(id, part) or a Ray ref to one
    stats: DiffStats = field(default_factory=DiffStats)


def unit_key(file: str, unit_id: str) -> tuple[str, str]:
    """The same unit on two nights: the same input file and the same first row group or row (the unit id's
    second half): a file added before it in the listing changes its index, not this key."""
    return str(file), unit_id.split("-", 1)[-1]


def unit_tasks(units: list[Unit], previous: dict[tuple[str, str], int]) -> list[UnitTask]:
    """``previous``: ``unit_key`` -> part index of the previous version's units. A part is claimed by one
    unit at most (its leftovers then go to the join once)."""
    tasks, claimed = [], set()
    for i, u in enumerate(units):
        part = previous.get(unit_key(u.file, u.id), -1)
        part = -1 if part in claimed else part
        claimed.add(part)
        tasks.append(UnitTask(unit=u, index=i, same_part=part))
    return tasks


def unclaimed_parts(tasks: list[UnitTask], parts: tuple[str, ...]) -> list[int]:
    claimed = {t.same_part for t in tasks}
    return [i for i in range(len(parts)) if i not in claimed]


def bucket_count(rows: int) -> int:
    return int(min(MAX_BUCKETS, max(1, rows // ROWS_PER_BUCKET)))


def map_units(tasks: list[UnitTask], *, parts: tuple[str, ...], id_column: str, reader,
              buckets: int) -> tuple[DiffStats, list[pa.Table]]:
    """Match each unit with its same-unit part; the leftovers of both sides, one table per bucket
    (``id``, ``unit``: tonight's unit index or -1, ``part``: the previous part index or -1)."""
    stats, pieces = DiffStats(), []
    for task in tasks:
        tonight = _valid(reader.columns(task.unit, [id_column]).column(0))
        stats.looked_up += len(tonight)
        if task.same_part < 0:
            pieces.append(_side(tonight, unit=task.index))
            continue
        before = read_part_ids(parts[task.same_part])
        stats.parts_read += 1
        found = pc.is_in(tonight, value_set=before["id"])
        stats.same_unit += pc.sum(found).as_py() or 0
        pieces.append(_side(pc.filter(tonight, pc.invert(found)), unit=task.index))
        gone = pc.invert(pc.is_in(before["id"], value_set=tonight))
        pieces.append(_side(pc.filter(before["id"], gone), part=task.same_part, row=pc.filter(before["row"], gone)))
    return _peak(stats), _partition(pieces, buckets)


def map_parts(indexes: list[int], *, parts: tuple[str, ...], buckets: int) -> tuple[DiffStats, list[pa.Table]]:
    """Previous parts no unit of tonight claims: all their ids go to the join."""
    pieces = [_side(t["id"], part=i, row=t["row"]) for i in indexes for t in [read_part_ids(parts[i])]]
    return _peak(DiffStats(parts_read=len(indexes))), _partition(pieces, buckets)


def join_bucket(*pieces: pa.Table) -> pa.Table:
    """One bucket: tonight's leftover ids joined with the previous leftovers; (unit, id, part, row) of each
    match (``row``: its position in that part)."""
    table = pa.concat_tables([p for p in pieces if p.num_rows]) if any(p.num_rows for p in pieces) else None
    if table is None:
        return _empty()
    tonight = table.filter(pc.field("unit") >= 0).select(["id", "unit"])
    before = table.filter(pc.field("part") >= 0).select(["id", "part", "row"])
    if not tonight.num_rows or not before.num_rows:
        return _empty(table.schema.field("id").type)
    return tonight.join(before, keys="id", join_type="inner").select(["unit", "id", "part", "row"])


def group_moved(matches: list[pa.Table], units: list[Unit]) -> dict[str, pa.Table]:
    """The join's matches, one small (id, part, row) table per unit that has any."""
    matches = [m for m in matches if m.num_rows]
    if not matches:
        return {}
    table = pa.concat_tables(matches).sort_by("unit")
    unit = table["unit"].to_numpy()
    starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]])
    ends = np.r_[starts[1:], len(unit)]
    return {units[int(unit[s])].id: table.slice(s, e - s).select(["id", "part", "row"])
            for s, e in zip(starts, ends)}


def diff_locally(units: list[Unit], *, parts: tuple[str, ...], previous: dict[tuple[str, str], int],
                 id_column: str, reader, threads: int = 8, buckets: int | None = None) -> NightDiff:
    """The same tasks on threads in this process (no Ray: tests, and a run without a cluster)."""
    tasks = unit_tasks(units, previous)
    buckets = buckets or bucket_count(sum(u.num_rows for u in units))
    with ThreadPoolExecutor(threads) as pool:
        maps = [pool.submit(map_units, tasks[i:i + MAP_UNITS], parts=parts, id_column=id_column, reader=reader,
                            buckets=buckets) for i in range(0, len(tasks), MAP_UNITS)]
        rest = unclaimed_parts(tasks, parts)
        maps += [pool.submit(map_parts, rest[i:i + MAP_UNITS], parts=parts, buckets=buckets)
                 for i in range(0, len(rest), MAP_UNITS)]
        results = [m.result() for m in maps]
        joins = [pool.submit(join_bucket, *(r[1][b] for r in results)) for b in range(buckets)]
        matches = [j.result() for j in joins]
    return night_diff(units, tasks, parts=parts, stats=[r[0] for r in results], matches=matches, buckets=buckets)


def night_diff(units: list[Unit], tasks: list[UnitTask], *, parts: tuple[str, ...], stats: list[DiffStats],
               matches: list[pa.Table], buckets: int) -> NightDiff:
    total = DiffStats(buckets=buckets)
    for s in stats:
        total.add(s)
    total.joined = sum(m.num_rows for m in matches)
    return NightDiff(parts=parts, same_part={t.unit.id: t.same_part for t in tasks if t.same_part >= 0},
                     moved=group_moved(matches, units), stats=total)


def read_part_ids(path: str) -> pa.Table:
    """A previous part's ids and their rows in the part (one read of one column)."""
    ids = pq.read_table(fs.arrow_source(path), columns=["id"]).column(0).combine_chunks()
    rows = pa.array(np.arange(len(ids), dtype=np.int32))
    if ids.null_count:
        rows, ids = pc.filter(rows, ids.is_valid()), pc.drop_null(ids)
    return pa.table({"id": ids, "row": rows})


def bucket_of(ids: pa.Array, buckets: int) -> np.ndarray:
    """A stable bucket per id, the same in every process: integers by value, anything else by its bytes."""
    if buckets == 1:
        return np.zeros(len(ids), np.int64)
    return (_hash64(ids) % np.uint64(buckets)).astype(np.int64)


def _hash64(ids: pa.Array) -> np.ndarray:
    """[N] uint64: splitmix64 of the integer, or of a polynomial hash of the id's bytes (vectorized)."""
    if pa.types.is_integer(ids.type):
        h = ids.cast(pa.int64()).to_numpy().view(np.uint64).copy()
    else:
        b = ids.cast(pa.large_binary())
        offsets = np.frombuffer(b.buffers()[1], dtype=np.int64)[b.offset:b.offset + len(b) + 1]
        data = np.frombuffer(b.buffers()[2], dtype=np.uint8) if b.buffers()[2] is not None else np.zeros(0, np.uint8)
        rel, data = offsets - offsets[0], data[offsets[0]:offsets[-1]].astype(np.uint64)
        lengths = np.diff(rel)
        position = within(lengths)  # [bytes] each byte's place in its id
        powers = np.cumprod(np.full(int(lengths.max(initial=0)) + 1, 0x100000001B3, np.uint64))  # FNV prime^k
        h = lengths.astype(np.uint64)
        nonempty = lengths > 0
        if nonempty.any():
            h[nonempty] += np.add.reduceat(data * powers[position], rel[:-1][nonempty])
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _peak(stats: DiffStats) -> DiffStats:
    stats.peak_rss_mb = peak_rss_mb()
    return stats


def _valid(ids: pa.ChunkedArray | pa.Array) -> pa.Array:
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    return pc.drop_null(ids) if ids.null_count else ids


def _side(ids: pa.Array, *, unit: int = -1, part: int = -1, row: pa.Array | None = None) -> pa.Table:
    n = len(ids)
    return pa.table({"id": ids, "unit": pa.array(np.full(n, unit, np.int32)),
                     "part": pa.array(np.full(n, part, np.int32)),
                     "row": row if row is not None else pa.array(np.full(n, -1, np.int32))})


def _partition(pieces: list[pa.Table], buckets: int) -> list[pa.Table]:
    """The pieces' rows split by ``bucket_of(id)``: ``buckets`` tables (some empty)."""
    pieces = [p for p in pieces if p.num_rows]
    if not pieces:
        return [_empty() for _ in range(buckets)]
    table = pa.concat_tables(pieces)
    which = bucket_of(table["id"].combine_chunks(), buckets)
    order = np.argsort(which, kind="stable")
    cuts = np.searchsorted(which[order], np.arange(buckets + 1))
    table = table.take(pa.array(order))
    return [table.slice(cuts[b], cuts[b + 1] - cuts[b]) for b in range(buckets)]


def _empty(id_type: pa.DataType = pa.null()) -> pa.Table:
    return pa.table({"id": pa.array([], id_type), **{c: pa.array([], pa.int32()) for c in ("unit", "part", "row")}})
