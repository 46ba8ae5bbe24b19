"""Planning reads the input files' footers in parallel, each once (embedpipe/units.py read_footers).

The files live on a real fsspec store (the in-memory one, under a protocol of its own) that takes 30 ms to
open a file, as an object store's first GET does, and records how many opens were in flight at once."""

from __future__ import annotations

import threading
import time
from collections import Counter

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from embedpipe.config import InputConfig
from embedpipe.io.formats import plan_input
from embedpipe.units import InputError


class SlowMemory(MemoryFileSystem):
    protocol = ("slowmem",)
    opened: Counter = Counter()
    in_flight, most = 0, 0
    lock = threading.Lock()

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        with SlowMemory.lock:
            SlowMemory.opened[path] += 1
            SlowMemory.in_flight += 1
            SlowMemory.most = max(SlowMemory.most, SlowMemory.in_flight)
        time.sleep(0.03)
        with SlowMemory.lock:
            SlowMemory.in_flight -= 1
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def slow_store():
    fsspec.register_implementation("slowmem", SlowMemory, clobber=True)
    SlowMemory.opened.clear()
    SlowMemory.most = 0
    yield "slowmem://footers"
    SlowMemory.store.clear()
    SlowMemory.clear_instance_cache()


def _files(root: str, count: int) -> None:
    for f in range(count):
        table = pa.table({"id": list(range(f * 30, f * 30 + 30)), "text": [f"row {i}" for i in range(30)]})
        with fsspec.open(f"{root}/in/part-{f:03d}.parquet", "wb") as out:
            pq.write_table(table, out, row_group_size=10)


def test_planning_reads_every_footer_once_and_in_parallel(slow_store):
    _files(slow_store, 40)
    plan = plan_input(InputConfig(path=f"{slow_store}/in", unit_rows=20))
    assert len(plan.units) == 80 and sum(u.num_rows for u in plan.units) == 1200
    assert set(SlowMemory.opened.values()) == {1}  # one read per footer (was two: columns, then row groups)
    assert SlowMemory.most > 4  # in flight together (was one at a time)


def test_a_bad_file_fails_planning_naming_the_first_in_listing_order(slow_store):
    _files(slow_store, 6)
    for name in ("part-002.parquet", "part-004.parquet"):
        with fsspec.open(f"{slow_store}/in/{name}", "wb") as out:
            out.write(b"not parquet")
    with pytest.raises(InputError, match="part-002.parquet"):
        plan_input(InputConfig(path=f"{slow_store}/in", unit_rows=20))


def test_the_duplicate_id_check_reads_the_units_ids_in_parallel(slow_store):
    from embedpipe.io.formats import UnitReader
    from embedpipe.preflight import _resolve_duplicates

    _files(slow_store, 24)
    plan = plan_input(InputConfig(path=f"{slow_store}/in", unit_rows=30))
    SlowMemory.most = 0
    units, dropped = _resolve_duplicates(plan.units, reader=UnitReader(text_column="text", id_column="id"),
                                         id_column="id", policy="error")
    assert dropped == 0 and units == plan.units
    assert SlowMemory.most > 4  # was one unit at a time
