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
