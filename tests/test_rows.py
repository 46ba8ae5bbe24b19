import numpy as np
import pyarrow as pa
import pytest

from embedpipe.io.rows import screen_rows, valid_rows
from embedpipe.units import InputError

IDS = pa.array(["a", "b", "c", "d", "e"])


def _screen(column, policy, drop=()):
    mask = np.zeros(len(column), bool)
    mask[list(drop)] = True
    return screen_rows(IDS.slice(0, len(column)), column, policy=policy, drop=mask, where="f.parquet")


def test_each_bad_kind_under_skip_keeps_ids_with_their_texts():
    out = _screen(pa.array(["ok one", None, "", "  \n", "ok two"]), "skip")
    assert out.ids.to_pylist() == ["a", "e"] and out.texts == ["ok one", "ok two"]
    assert out.skipped.to_pylist() == [{"id": "b", "reason": "null"}, {"id": "c", "reason": "empty"},
                                       {"id": "d", "reason": "empty"}]
    assert out.bad == {"null": 1, "empty": 2}


def test_embed_empty_embeds_the_empty_string_in_place():
    out = _screen(pa.array(["ok", None, "x"]), "embed_empty")
    assert out.ids.to_pylist() == ["a", "b", "c"] and out.texts == ["ok", "", "x"]
    assert out.skipped.num_rows == 0 and out.bad == {"null": 1}


def test_error_names_the_row_and_the_policy():
    with pytest.raises(InputError, match=r"id 'b' has a bad text \(null\).*input.on_bad_row"):
        _screen(pa.array(["ok", None]), "error")


def test_binary_text_is_decoded_and_bad_bytes_are_flagged():
    out = _screen(pa.array([b"caf\xc3\xa9", b"\xff\xfe", None], pa.binary()), "skip")
    assert out.texts == ["café"] and [r["reason"] for r in out.skipped.to_pylist()] == ["undecodable", "null"]


def test_non_text_values_are_never_stringified():
    out = _screen(pa.array([1, 2, None]), "skip")
    assert out.ids.to_pylist() == [] and out.bad == {"not_text": 2, "null": 1}


def test_duplicates_are_skipped_whatever_the_policy():
    out = _screen(pa.array(["x", "y", None]), "embed_empty", drop=[1])
    assert out.ids.to_pylist() == ["a", "c"] and out.texts == ["x", ""]
    assert out.skipped.to_pylist() == [{"id": "b", "reason": "duplicate_id"}]


def test_valid_rows_is_pyarrows_mask_at_every_offset():
    """``valid_rows``: the rows holding a value, its own bits unpacked (not pyarrow's to_numpy, which imports
    pandas), for slices at every offset and length of arrays with nulls, chunked ones, all-null and empty ones."""
    rng = np.random.default_rng(0)
    values = pa.array([None if rng.random() < 0.3 else i for i in range(70)], pa.int64())
    for offset in range(0, 20):
        for length in (0, 1, 7, 8, 9, 17, 70 - offset):
            part = values.slice(offset, length)
            assert valid_rows(part).tolist() == [v is not None for v in part.to_pylist()], (offset, length)
    chunked = pa.chunked_array([values.slice(3, 10), values.slice(40, 9)])
    assert valid_rows(chunked).tolist() == [v is not None for v in chunked.to_pylist()]
    assert valid_rows(pa.array([None, None], pa.string())).tolist() == [False, False]
    assert valid_rows(pa.array(["a", "b"])).dtype == bool and valid_rows(pa.array([], pa.int64())).tolist() == []
