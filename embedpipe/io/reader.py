"""Read one work unit's ids and texts from Parquet (only the two columns, only its row groups)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedpipe.units import InputError, Unit


@dataclass
class UnitRows:
    ids: pa.Array  # the input ids, type kept
    texts: list[str]


def check_columns(file: str, *, text_column: str, id_column: str) -> pq.ParquetFile:
    """Open ``file`` and check it has both columns; the error names the file and the field to fix."""
    try:
        pf = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"cannot read Parquet file {file!r} ({exc}): replace or remove the file") from exc
    names = pf.schema_arrow.names
    for column, field in ((text_column, "input.text_column"), (id_column, "input.id_column")):
        if column not in names:
            raise InputError(f"{file}: no column {column!r} (columns: {', '.join(names)}): "
                             f"set {field} to the right column")
    return pf


class ParquetReader:
    """Built once per worker; called per unit."""

    def __init__(self, *, text_column: str, id_column: str):
        self.text_column, self.id_column = text_column, id_column

    def __call__(self, unit: Unit) -> UnitRows:
        pf = check_columns(unit.file, text_column=self.text_column, id_column=self.id_column)
        table = pf.read_row_groups(list(unit.row_groups), columns=[self.id_column, self.text_column])
        ids = table.column(self.id_column).combine_chunks()
        text = table.column(self.text_column).combine_chunks()
        if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
            raise InputError(f"{unit.file}: column {self.text_column!r} holds {text.type}, not text: "
                             f"set input.text_column to a string column")
        if text.null_count:
            first = pc.index(pc.is_null(text), True).as_py()
            raise InputError(f"{unit.file}: row with id {ids[first].as_py()!r} has no text (null): "
                             f"fix the row or remove it from the input")
        return UnitRows(ids=ids, texts=text.to_pylist())
