"""Screen a unit's rows before tokenizing: null, empty, non-text and undecodable texts, duplicate ids.

What happens to a bad row follows ``input.on_bad_row``; a duplicate id dropped by
``input.on_duplicate_id: keep_first`` is always skipped. Every skipped row keeps its own id in
``skipped.parquet`` with the reason, so no id ever shifts onto another row's vector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedpipe.units import InputError

REASONS = ("null", "empty", "not_text", "undecodable", "duplicate_id")
FIXES = {
    "null": "fill or remove the row",
    "empty": "fill or remove the row",
    "not_text": "point input.text_column at a text column",
    "undecodable": "re-encode the text as UTF-8",
}


@dataclass
class ScreenedRows:
    ids: pa.Array  # ids of the rows that get a vector, input order
    texts: list[str]  # their texts
    skipped: pa.Table  # id, reason: rows that get no vector
    bad: dict[str, int] = field(default_factory=dict)  # reason -> rows (whatever the policy did)


def skipped_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema([("id", id_type), ("reason", pa.string())])


def screen_rows(ids: pa.Array, column: pa.Array, *, policy: str, drop: np.ndarray, where: str) -> ScreenedRows:
    """Apply the bad-row policy; ``drop`` marks rows removed as duplicate ids (bool [N])."""
    texts, reasons = _decode(column)  # list[str | None], object [N] of reason or None
    reasons[drop] = "duplicate_id"
    bad = reasons != None  # noqa: E711 - elementwise on an object array
    counts = {r: int(n) for r, n in zip(*np.unique(reasons[bad].astype(str), return_counts=True))}
    policy_bad = bad & ~drop
    if policy == "error" and policy_bad.any():
        first = int(np.flatnonzero(policy_bad)[0])
        reason = reasons[first]
        raise InputError(f"{where}: row with id {ids[first].as_py()!r} has a bad text ({reason}): "
                         f"{FIXES[reason]}, or set input.on_bad_row to skip or embed_empty")
    if policy == "embed_empty":
        for i in np.flatnonzero(policy_bad):
            texts[i] = ""
        skip = drop
    else:  # skip (or error with nothing bad)
        skip = bad
    keep = ~skip
    keep_index = pa.array(np.flatnonzero(keep))
    skipped = pa.table({"id": ids.take(pa.array(np.flatnonzero(skip))),
                        "reason": pa.array(reasons[skip].astype(str).tolist(), pa.string())},
                       schema=skipped_schema(ids.type))
    return ScreenedRows(ids=ids.take(keep_index), texts=[texts[i] for i in np.flatnonzero(keep)],
                        skipped=skipped, bad=counts)


def _decode(column: pa.Array) -> tuple[list, np.ndarray]:
    """Texts (None where unusable) and the reason each unusable row is bad."""
    n = len(column)
    reasons = np.full(n, None, dtype=object)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    reasons[nulls] = "null"
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
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
        stripped = pc.utf8_length(pc.utf8_trim_whitespace(pa.array(texts, pa.string()))).to_numpy(zero_copy_only=False)
        empty = ok & (np.nan_to_num(stripped.astype(float), nan=1.0) == 0)
        reasons[empty] = "empty"
    return texts, reasons
