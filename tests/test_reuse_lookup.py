"""The incremental lookup: the id range added to the filter prunes row groups and changes no answer."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedpipe.io.reuse import PreviousVectors, _id_filter, content_hashes


def _previous(folder, ids, texts, *, rows_per_part=50):
    folder.mkdir()
    hashes = content_hashes(texts, salt=b"s" * 32)
    vectors = np.arange(len(ids) * 4, dtype=np.float32).reshape(-1, 4)
    for start in range(0, len(ids), rows_per_part):
        part = slice(start, start + rows_per_part)
        flat = pa.array(vectors[part].reshape(-1))
        pq.write_table(pa.table({"id": ids[part], "embedding": pa.FixedSizeListArray.from_arrays(flat, 4),
                                 "content_hash": hashes[part]}), folder / f"part-{start:05d}.parquet")
    return vectors


def test_lookup_answers_are_unchanged_for_ordered_and_shuffled_ids(tmp_path):
    rng = np.random.default_rng(0)
    texts = [f"text {i}" for i in range(400)]
    for name, ids in (("ordered", list(range(400))), ("shuffled", rng.permutation(400).tolist()),
                      ("strings", [f"doc-{i:04d}" for i in range(400)])):
        vectors = _previous(tmp_path / name, pa.array(ids), texts)
        previous = PreviousVectors(tmp_path / name)
        pick = [5, 60, 61, 399, 200]
        ask_ids = pa.array([ids[i] for i in pick] + ([10_000] if name != "strings" else ["new"]))
        ask_texts = [texts[i] for i in pick[:-1]] + ["changed", "brand new"]
        reuse, reused, present = previous.lookup(ask_ids, content_hashes(ask_texts, salt=b"s" * 32))
        assert reuse.tolist() == [True, True, True, True, False, False], name
        assert present == 5  # the new id was not there before
        np.testing.assert_array_equal(reused, vectors[pick[:4]])


def test_the_filter_carries_the_id_range():
    text = str(_id_filter(pa.array([7, 3, 9])))
    assert ">= 3" in text and "<= 9" in text and "is_in" in text
    assert "is_in" in str(_id_filter(pa.array([None], pa.int64())))


def _chunked_part(path, docs: dict, *, salt=b"s" * 32) -> pa.Table:
    """A chunked part: one row per (document, chunk), every row carrying its document's content hash."""
    ids, chunks, texts, vectors = [], [], [], []
    for doc, (text, n) in docs.items():
        for c in range(n):
            ids.append(doc), chunks.append(c), texts.append(text), vectors.append([doc, c, 0.5, 1.0])
    flat = pa.array(np.asarray(vectors, np.float32).reshape(-1))
    table = pa.table({"id": pa.array(ids, pa.int64()), "chunk": pa.array(chunks, pa.int32()),
                      "start": pa.array(chunks, pa.int64()), "end": pa.array([c + 1 for c in chunks], pa.int64()),
                      "embedding": pa.FixedSizeListArray.from_arrays(flat, 4),
                      "content_hash": content_hashes(texts, salt=salt)})
    pq.write_table(table, path, row_group_size=2)
    return table


def test_chunked_lookup_reads_only_the_units_part_and_the_moved_rows(tmp_path):
    """A chunked unit's lookup from the night's diff (same part read whole, moved rows by row group): every chunk
    of an unchanged document comes back, a changed one's none, and no other part is opened (one is gone here)."""
    folder = tmp_path / "vectors"
    folder.mkdir()
    _chunked_part(folder / "part-0.parquet", {1: ("one", 3), 2: ("two", 2), 3: ("three", 1)})
    _chunked_part(folder / "part-1.parquet", {10: ("ten", 2)})
    _chunked_part(folder / "part-2.parquet", {20: ("twenty", 2), 21: ("twenty-one", 3)})
    parts = tuple(str(folder / f"part-{i}.parquet") for i in range(3))
    previous = PreviousVectors(folder, parts=parts)
    (folder / "part-1.parquet").unlink()  # never read: neither this unit's part nor one its rows moved from
    ids = pa.array([1, 2, 21, 99], pa.int64())  # 21 moved here from part 2; 99 is new
    hashes = content_hashes(["one", "two (revised)", "twenty-one", "new"], salt=b"s" * 32)
    moved = pa.table({"id": pa.array([21, 21, 21], pa.int64()), "part": pa.array([2, 2, 2], pa.int32()),
                      "row": pa.array([2, 3, 4], pa.int32())})
    reuse, reused, present = previous.lookup_unit_chunks(ids, hashes, same_part=0, moved=moved)
    assert reuse.tolist() == [True, False, True, False]
    assert present == 3 + 2 + 3  # the chunk rows of documents 1, 2 and 21 (3 is not asked for)
    rows = sorted(zip(reused["id"].to_pylist(), reused["chunk"].to_pylist()))
    assert rows == [(1, 0), (1, 1), (1, 2), (21, 0), (21, 1), (21, 2)]
    assert "content_hash" not in reused.column_names
    got = {(i, c): v for i, c, v in zip(reused["id"].to_pylist(), reused["chunk"].to_pylist(),
                                        reused["embedding"].to_pylist())}
    assert got[(21, 2)] == [21.0, 2.0, 0.5, 1.0] and got[(1, 0)] == [1.0, 0.0, 0.5, 1.0]
    nothing = previous.lookup_unit_chunks(pa.array([5], pa.int64()), content_hashes(["x"], salt=b"s" * 32),
                                          same_part=None, moved=None)
    assert nothing[0].tolist() == [False] and nothing[1] is None and nothing[2] == 0
