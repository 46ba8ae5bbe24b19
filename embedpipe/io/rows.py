"""Screen a unit's rows before tokenizing: null ids; null, empty, non-text and undecodable texts; duplicate ids.

What happens to a bad row follows ``input.on_bad_row``; a duplicate id dropped by
``input.on_duplicate_id: keep_first`` is always skipped. Every skipped row keeps its own id in
``skipped.parquet`` with the reason, so no id ever shifts onto another row's vector.

A null id (``null_id``) is a bad row of its own, whatever its text: a vector without an id is
useless, so the row is skipped under ``skip`` and ``embed_empty`` alike (listed in
``skipped.parquet`` with a null id) and stops the run naming its row under ``error``. A null id
is never a duplicate of another null id.

Text is a string, large string, string view or binary (decoded as UTF-8) column, or a dictionary
of one of those; a union (a JSONL text field holding JSON values of several types) is text in its
string rows and ``not_text`` in the others. Any other type (numbers, lists, structs) is
``not_text`` in every row: its string form is never embedded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedpipe.units import InputError

REASONS = ("null_id", "null", "empty", "not_text", "undecodable", "duplicate_id")
FIXES = {
    "null": "fill or remove the row",
    "empty": "fill or remove the row",
    "not_text": "point input.text_column at a text column",
    "undecodable": "re-encode the text as UTF-8",
}
_VIEWS = {name: large for name, large in (("is_string_view", pa.large_string()), ("is_binary_view", pa.large_binary()))
          if hasattr(pa.types, name)}  # pyarrow >= 16: decoded through the large type
_TEXT_CHECKS = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary,
                *(getattr(pa.types, name) for name in _VIEWS))


@dataclass
class ScreenedRows:
    ids: pa.Array  # ids of the rows that get a vector, input order
    texts: list[str]  # their texts
    skipped: pa.Table  # id, reason: rows that get no vector
    bad: dict[str, int] = field(default_factory=dict)  # reason -> rows (whatever the policy did)


def skipped_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema([("id", id_type), ("reason", pa.string())])


def is_text_type(tp: pa.DataType) -> bool:
    """A column type the screen reads as text (a dictionary of text included)."""
    if pa.types.is_dictionary(tp):
        return is_text_type(tp.value_type)
    return any(check(tp) for check in _TEXT_CHECKS)


def null_id_error(where: str, row: int) -> InputError:
    """The one message for a row without an id under ``on_bad_row: error`` (preflight and the screen)."""
    return InputError(f"{where}: row {row} has a null id: give every row an id (or remove the row), or set "
                      f"input.on_bad_row to skip to skip rows without one (listed in skipped.parquet)")


def valid_rows(values: pa.Array) -> np.ndarray:
    """[N] bool: the rows holding a value. pyarrow's ``to_numpy`` of a mask imports pandas (about 0.2 s of CPU in
    a process that had no use for it: the driver's id scan ran it before Ray's start); without a null this is
    all True, and a mask's bits are unpacked here."""
    if values.null_count == 0:
        return np.ones(len(values), dtype=bool)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    mask = values.is_valid()  # a BooleanArray without nulls: its data bits, from its offset
    bits = np.frombuffer(mask.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, count=mask.offset + len(mask), bitorder="little")[mask.offset:].astype(bool)


def screen_rows(ids: pa.Array, column: pa.Array, *, policy: str, drop: np.ndarray, where: str,
                row_start: int = 0) -> ScreenedRows:
    """Apply the bad-row policy; ``drop`` marks rows removed as duplicate ids (bool [N]); the rows are
    rows ``row_start..`` of ``where`` (for errors)."""
    texts, reasons = _decode(column)  # list[str | None], object [N] of reason or None
    reasons[drop] = "duplicate_id"
    null_id = ~valid_rows(ids)
    reasons[null_id] = "null_id"
    bad = reasons != None  # noqa: E711 - elementwise on an object array
    counts = {r: int(n) for r, n in zip(*np.unique(reasons[bad].astype(str), return_counts=True))}
    policy_bad = bad & ~drop
    if policy == "error" and policy_bad.any():
        first = int(np.flatnonzero(policy_bad)[0])
        reason = reasons[first]
        if reason == "null_id":
            raise null_id_error(where, row_start + first)
        raise InputError(f"{where}: row with id {ids[first].as_py()!r} has a bad text ({reason}): "
                         f"{FIXES[reason]}, or set input.on_bad_row to skip or embed_empty")
    if policy == "embed_empty":
        for i in np.flatnonzero(policy_bad):
            texts[i] = ""
        skip = drop | null_id  # a row without an id gets no vector
    else:  # skip (or error with nothing bad)
        skip = bad
    if not skip.any():  # the usual unit: nothing built through pa.array or pa.table (both import pandas)
        return ScreenedRows(ids=ids, texts=texts, skipped=pa.Table.from_batches([], schema=skipped_schema(ids.type)),
                            bad=counts)
    keep = ~skip
    keep_index = pa.array(np.flatnonzero(keep))
    skipped = pa.table({"id": ids.take(pa.array(np.flatnonzero(skip))),
                        "reason": pa.array(reasons[skip].astype(str).tolist(), pa.string())},
                       schema=skipped_schema(ids.type))
    return ScreenedRows(ids=ids.take(keep_index), texts=[texts[i] for i in np.flatnonzero(keep)],
                        skipped=skipped, bad=counts)


def _decode(column: pa.Array) -> tuple[list, np.ndarray]:
    """Texts (None where unusable) and the reason each unusable row is bad."""
    column = _plain(column)
    if pa.types.is_union(column.type):
        return _decode_union(column)
    n = len(column)
    reasons = np.full(n, None, dtype=object)
    nulls = ~valid_rows(column)
    reasons[nulls] = "null"
    text_column = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    if text_column:
        texts = column.to_pylist()
    elif pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        texts = []
        for i, raw in enumerate(column.to_pylist()):
            try:
                texts.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
                reasons[i] = "undecodable"
    else:  # numbers, lists, structs...: never embed their string form silently
        reasons[~nulls] = "not_text"
        return [None] * n, reasons
    ok = np.array([t is not None for t in texts], dtype=bool)
    if ok.any():
        decoded = column if text_column else pa.array(texts, pa.string())  # binary: the rows decoded
        stripped = pc.utf8_length(pc.utf8_trim_whitespace(decoded))  # [N] int32 or int64; null where no text
        reasons[ok & (_numbers(stripped) == 0)] = "empty"
    return texts, reasons


def _numbers(values: pa.Array) -> np.ndarray:
    """[N] the integers of an int32 or int64 array, read from its data buffer (a null row's slot holds any value:
    the caller masks it); pyarrow's to_numpy would import pandas."""
    dtype = {pa.int32(): np.int32, pa.int64(): np.int64}[values.type]
    return np.frombuffer(values.buffers()[1], dtype=dtype, count=values.offset + len(values))[values.offset:]


def _plain(column: pa.Array) -> pa.Array:
    """A dictionary decoded, a view cast to its large type: what ``_decode`` reads."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    for name, large in _VIEWS.items():
        if getattr(pa.types, name)(column.type):
            return column.cast(large)
    return column


def _decode_union(column: pa.UnionArray) -> tuple[list, np.ndarray]:
    """Rows of string members are decoded as text; rows of any other member are ``not_text``."""
    codes = column.type_codes.to_numpy(zero_copy_only=False)
    text_codes = [code for code, f in zip(column.type.type_codes, column.type)
                  if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    other = ~np.isin(codes, text_codes)
    values = column.to_pylist()
    texts, reasons = _decode(pa.array([None if o else v for v, o in zip(values, other)], pa.large_string()))
    reasons[other] = "not_text"
    return texts, reasons
