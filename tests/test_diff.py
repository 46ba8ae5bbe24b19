"""The incremental night's diff (embedpipe/io/diff.py, embedpipe/cluster/diff.py): linear in the rows.

The previous version's parts live on a real fsspec store (the in-memory one, under a protocol of its own
that counts every file opened), so the test sees each read the diff and the per-unit lookups make."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from typer.testing import CliRunner

from embedpipe.io.diff import bucket_of, diff_locally, unit_key
from embedpipe.io.formats import UnitReader
from embedpipe.io.reuse import PreviousVectors, content_hashes
from embedpipe.units import plan_units
from tests.conftest import write_job

SALT = b"s" * 32
WIDTH = 4


class CountingMemory(MemoryFileSystem):
    """fsspec's in-memory store under ``countmem://``, counting the files opened for reading."""

    protocol = ("countmem",)
    opened: Counter = Counter()

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            CountingMemory.opened[self._strip_protocol(path)] += 1
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def counting_store():
    fsspec.register_implementation("countmem", CountingMemory, clobber=True)
    CountingMemory.opened.clear()
    yield "countmem://diff"
    CountingMemory.store.clear()
    CountingMemory.clear_instance_cache()


def _ids(kind: str, n: int, rng) -> list:
    if kind == "uuid":
        return [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n)]
    if kind == "int":
        return rng.permutation(10 * n)[:n].tolist()
    return [rng.bytes(16) for _ in range(n)]  # content-hash ids


def _write_previous(store: str, ids: list, texts: list[str], *, rows_per_part: int) -> tuple[tuple[str, ...], dict]:
    """Parts as an incremental run writes them (id, embedding, content_hash); vectors = row number."""
    hashes = content_hashes(texts, salt=SALT)
    parts = []
    for start in range(0, len(ids), rows_per_part):
        end = min(start + rows_per_part, len(ids))
        flat = pa.array(np.repeat(np.arange(start, end, dtype=np.float32), WIDTH))
        table = pa.table({"id": pa.array(ids[start:end]), "embedding": pa.FixedSizeListArray.from_arrays(flat, WIDTH),
                          "content_hash": hashes[start:end]})
        parts.append(f"{store}/vectors/part-{start:05d}.parquet")
        with fsspec.open(parts[-1], "wb") as f:
            pq.write_table(table, f, row_group_size=8)  # moved rows are read by their row groups
    return tuple(parts), {p: i for i, p in enumerate(parts)}


@pytest.mark.parametrize("kind", ["uuid", "int", "binary"])
def test_the_diff_and_lookups_read_each_previous_part_a_bounded_number_of_times(tmp_path, counting_store, kind):
    """20 units, 20 previous parts, ids in random order, 4 % of the rows moved to other units: the night reads
    each previous part a few times (its ids in the diff, its own unit's lookup, a unit a row moved to), never
    once per unit (the per-unit scan opened every part 20 times and more); and every row is found where it is."""
    rng = np.random.default_rng(1)
    n, per = 400, 20
    ids, texts = _ids(kind, n, rng), [f"text {i}" for i in range(n)]
    parts, by_path = _write_previous(counting_store, ids, texts, rows_per_part=per)

    # tonight: the same file's units; rows 0..7 swap units with rows 200..207; row 399 is replaced by a new id
    order = list(range(n))
    order[0:8], order[200:208] = order[200:208], order[0:8]
    new_ids = [ids[i] for i in order[:-1]] + _ids(kind, 1, rng)
    new_texts = [texts[i] for i in order[:-1]] + ["brand new"]
    new_texts[3] = "changed"  # row 203 of before, now in unit 0: found by the join, but its text changed
    data = tmp_path / "night.parquet"
    pq.write_table(pa.table({"id": pa.array(new_ids), "text": new_texts}), data, row_group_size=per)
    units = plan_units([str(data)], unit_rows=per)
    previous = {unit_key(str(data), u.id): by_path[p] for u, p in zip(units, parts)}  # night 1 read the same file
    reader = UnitReader(text_column="text", id_column="id")

    diff = diff_locally(units, parts=parts, previous=previous, id_column="id", reader=reader, buckets=4)
    assert diff.stats.looked_up == n and diff.stats.joined == 16 and diff.stats.same_unit == n - 17
    assert diff.stats.parts_read == len(parts)
    lookup = PreviousVectors(f"{counting_store}/vectors", parts=parts)
    reused_rows = 0
    for unit in units:
        rows = reader(unit)
        reuse, vectors, present = lookup.lookup_unit(rows.ids, content_hashes(rows.texts, salt=SALT),
                                                     same_part=diff.same_part.get(unit.id),
                                                     moved=diff.moved.get(unit.id))
        start = int(unit.id.split("-")[1]) * per
        expected = np.array([order[start + k] for k in range(len(rows.texts))], dtype=np.float32)
        keep = np.array([not (start + k == 3 or start + k == n - 1) for k in range(len(rows.texts))])
        np.testing.assert_array_equal(reuse, keep)
        np.testing.assert_array_equal(vectors[:, 0], expected[keep])
        assert present == len(rows.texts) - (unit is units[-1])
        reused_rows += int(reuse.sum())
    assert reused_rows == n - 2
    opened = Counter({p: CountingMemory.opened[CountingMemory._strip_protocol(p)] for p in parts})
    # pyarrow opens a file once or twice per read (footer, then pages); a per-unit scan: >= 20 per part
    assert max(opened.values()) <= 6, opened
    assert sum(opened.values()) <= 4 * len(parts) + 8, opened


def test_buckets_are_stable_and_spread():
    rng = np.random.default_rng(0)
    ids = pa.array([str(uuid.UUID(bytes=rng.bytes(16))) for _ in range(4000)])
    a, b = bucket_of(ids, 8), bucket_of(ids.slice(1000), 8)
    np.testing.assert_array_equal(a[1000:], b)  # a sliced array hashes its own bytes
    assert np.bincount(a, minlength=8).min() > 350
    ints = bucket_of(pa.array(np.arange(4000)), 8)
    assert np.bincount(ints, minlength=8).min() > 350


MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.mark.slow
def test_shuffled_uuid_night_reencodes_exactly_the_changed_and_added_rows(tmp_path, quickstart_table, ray_session):
    """Random UUID ids, and night 2 shuffles every row to another place: only the changed and added rows are
    encoded, the vectors equal a full recompute, and the report says where the diff found the rows."""
    from embedpipe.cli import app
    from embedpipe.runtime import Encoder
    from embedpipe.versions import CURRENT

    rng = np.random.default_rng(7)
    texts = quickstart_table.slice(0, 240)["text"].to_pylist()
    ids = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in texts]
    data, root = tmp_path / "in", tmp_path / "index"
    data.mkdir()

    def write_night(rows: dict) -> None:
        keys = list(rows)
        for f, chunk in enumerate(np.array_split(np.arange(len(keys)), 2)):
            pq.write_table(pa.table({"id": [keys[i] for i in chunk], "text": [rows[keys[i]] for i in chunk]}),
                           data / f"part-{f}.parquet", row_group_size=30)

    write_night(dict(zip(ids, texts)))
    job = write_job(tmp_path / "nightly.yaml", input={"path": str(data), "unit_rows": 60},
                    model={"path": MODEL}, batching={"max_tokens": 2048},
                    output={"path": str(root), "versioned": True, "incremental": True}, cluster={"workers": 1})
    first = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert first.exit_code == 0, first.output

    order = rng.permutation(240)
    changed, deleted = set(order[:20].tolist()), set(order[20:30].tolist())
    night2 = {ids[i]: texts[i] + " (revised)" if i in changed else texts[i] for i in range(240) if i not in deleted}
    night2.update({str(uuid.UUID(bytes=rng.bytes(16), version=4)): t
                   for t in quickstart_table.slice(240, 10)["text"].to_pylist()})
    shuffled = list(night2)
    rng.shuffle(shuffled)
    write_night({k: night2[k] for k in shuffled})
    second = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert second.exit_code == 0, second.output

    version = (root / CURRENT).read_text().strip()
    report = json.loads((root / "versions" / version / "report.json").read_text())
    inc = report["incremental"]
    assert (inc["reused"], inc["encoded"], inc["dropped"]) == (210, 30, 10)
    diff = inc["diff"]
    assert diff["looked_up"] == 240 and diff["same_unit"] + diff["joined"] == 230 and diff["new"] == 10
    assert diff["joined"] > diff["same_unit"]  # shuffled: most rows moved to another unit
    table = pq.read_table(Path(root / "versions" / version / "vectors"))
    got = dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)))
    assert set(got) == set(night2)
    full = Encoder.from_options(MODEL).embed(list(night2.values()))  # a full recompute of the same corpus
    np.testing.assert_allclose(np.stack([got[k] for k in night2]), full, atol=2e-6)
