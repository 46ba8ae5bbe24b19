"""Read one work unit's ids and texts from Parquet (only the two columns, only its row groups).

``screen_unit`` is the one bad-row screening every input format's reader ends with
(``embedpipe/io/formats.py``); each reader's ``columns(unit, names)`` gives the raw rows, and
fails naming the unit and both counts when they are not exactly the rows planning counted.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedpipe.io import fs
from embedpipe.io.rows import ScreenedRows, screen_rows
from embedpipe.units import InputError, Unit


def check_columns(file: str, *, text_column: str, id_column: str) -> pq.ParquetFile:
    """Open ``file`` and check it has both columns; the error names the file and the field to fix."""
    try:
        pf = pq.ParquetFile(fs.arrow_source(file))
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"cannot read Parquet file {file!r} ({exc}): replace or remove the file") from exc
    check_schema(file, pf.schema_arrow, text_column=text_column, id_column=id_column)
    return pf


def check_schema(file: str, schema: pa.Schema, *, text_column: str, id_column: str) -> None:
    """``file``'s schema has both columns; the error names the file and the field to fix."""
    names = schema.names
    for column, field in ((text_column, "input.text_column"), (id_column, "input.id_column")):
        if column not in names:
            raise InputError(f"{file}: no column {column!r} (columns: {', '.join(names)}): "
                             f"set {field} to the right column")


class ScreeningReader:
    """Built once per worker; called per unit: the unit's rows, screened by the bad-row policy.

    Each input format says only how to read a unit's columns (``read``); ``columns`` checks that
    it gave exactly the rows planning counted, so no unit writes a short (or long) part."""

    def __init__(self, *, text_column: str, id_column: str, on_bad_row: str = "error"):
        self.text_column, self.id_column, self.on_bad_row = text_column, id_column, on_bad_row

    def __call__(self, unit: Unit) -> ScreenedRows:
        return screen_unit(self.columns(unit, [self.id_column, self.text_column]), unit, text_column=self.text_column,
                           id_column=self.id_column, on_bad_row=self.on_bad_row)

    def columns(self, unit: Unit, names: list[str]) -> pa.Table:
        """The unit's rows, these columns only, unscreened (preflight reads the ids this way)."""
        table = self.read(unit, list(dict.fromkeys(names)))
        if table.num_rows != unit.num_rows:
            raise InputError(f"{unit.label}: read {table.num_rows} rows where planning counted {unit.num_rows}: "
                             f"the input changed after the job was planned; run the job again on a settled copy")
        return table

    def read(self, unit: Unit, names: list[str]) -> pa.Table:
        """The unit's rows, these (distinct) columns only."""
        raise NotImplementedError


class ParquetReader(ScreeningReader):
    """Parquet: the unit's row groups; of a row range inside one row group, only its rows."""

    def read(self, unit: Unit, names: list[str]) -> pa.Table:
        with check_columns(unit.file, text_column=self.text_column, id_column=self.id_column) as pf:
            try:
                table = pf.read_row_groups(list(unit.row_groups), columns=names)
            except Exception as exc:  # a corrupt page shows only when read
                raise InputError(f"{unit.label}: cannot read ({exc}): replace or remove the file") from exc
            meta = pf.metadata
        if not unit.in_row_group:
            return table  # whole row groups (a changed file shows as a changed row count)
        offset = unit.row_start - sum(meta.row_group(rg).num_rows for rg in range(unit.row_groups[0]))
        return table.slice(offset, unit.num_rows)  # a row range inside the row group


def screen_unit(table: pa.Table, unit: Unit, *, text_column: str, id_column: str, on_bad_row: str) -> ScreenedRows:
    """A unit's rows (any input format) through the bad-row policy, minus its duplicate-id rows."""
    ids = table.column(id_column).combine_chunks()
    drop = np.zeros(len(ids), dtype=bool)
    drop[list(unit.drop_rows)] = True
    return screen_rows(ids, table.column(text_column).combine_chunks(), policy=on_bad_row,
                       drop=drop, where=f"{unit.file} ({unit.label})", row_start=unit.row_start)
