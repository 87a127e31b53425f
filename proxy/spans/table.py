"""Span rows into table ``requests``: one checked, columnar ``INSERT ... SELECT`` per batch.

A row is a :class:`~specproxy.record.SpanRecord`'s values in :data:`~specproxy.record.COLUMNS` order
(:data:`record_row` makes it). :class:`RequestsTable` turns a batch of rows into numpy columns and
inserts them in one statement (DuckDB scans a dict of arrays): ~100k rows per CPU-second, where
row-by-row ``executemany`` manages a few hundred.

Every column is checked before the insert, with whole-column passes that cost a few ns per value when
all is well: numeric columns convert with numpy (which takes 3.0 as 3 and refuses "many" or 2**64),
INTEGER columns are range-checked as int32, text columns are joined once (which refuses a non-string)
and checked for UTF-8. A value that does not fit is replaced as :func:`~specproxy.record.fitted` says
(NULL, or U+FFFD for what cannot be encoded) and the row's ``notes`` say so, so a batch does not fail
on a value; records made by the proxy were already fitted, types included
(:func:`~specproxy.record.fit_to_columns`), this catches the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from specproxy.record import COLUMNS, REQUIRED_FIELDS, encodes_as_utf8, fitted

record_row = attrgetter(*COLUMNS)
"""A record's row: its values in COLUMNS order, as one tuple (a C-level call, ~1 µs)."""

Row = tuple[Any, ...]
# A batch column: its values and, when some are null, the null mask.
Column = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]

_INDEX = {name: i for i, name in enumerate(COLUMNS)}
T_START_NS = _INDEX["t_start_ns"]
_NOTES = _INDEX["notes"]
_SLICE = 2048  # rows per C call when building a batch (a few ms of GIL at most)
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)

# DuckDB column type → numpy dtype of its batch column
_NUMPY_KIND: dict[str, Any] = {
    "INTEGER": np.int64,
    "BIGINT": np.int64,
    "DOUBLE": np.float64,
    "BOOLEAN": np.bool_,
}


class RequestsTable:
    """Writes batches of rows to ``requests`` on one DuckDB connection (used from one thread only)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        described = conn.execute("DESCRIBE requests").fetchall()
        types: dict[str, str] = {str(r[0]): str(r[1]) for r in described}
        missing = [name for name in COLUMNS if name not in types]
        if missing:
            raise ValueError(f"table requests lacks the columns {', '.join(missing)}")
        # t_start is made from t_start_ns in SQL (exact, whatever the session's time zone)
        self._plan = [(i, name, types[name]) for i, name in enumerate(COLUMNS) if name != "t_start"]

    def insert(self, rows: Sequence[Row]) -> None:
        """Insert ``rows`` in one statement; every value is made to fit first (the module docstring).
        Raises what DuckDB raises when the insert still fails (the store itself, or a bug)."""
        if not rows:
            return
        matrix = _object_matrix(rows, len(COLUMNS))
        notes: dict[int, list[str]] = {}
        columns: dict[str, Column] = {}
        for index, name, sql_type in self._plan:
            if index != _NOTES:
                columns[name] = _checked_column(matrix[:, index], name, sql_type, notes)
        if notes:
            note_column = matrix[:, _NOTES]
            for row, added in notes.items():
                old = note_column[row]
                note_column[row] = "; ".join([old, *added] if old else added)
        columns["notes"] = _checked_column(matrix[:, _NOTES], "notes", "VARCHAR", {})
        starts, nulls = columns["t_start_ns"]
        columns["_t_start_us"] = (starts // 1000, None)
        start_sql = epoch_us_to_timestamptz("_t_start_us")
        if nulls is not None:
            start_sql = f'CASE WHEN "t_start_ns__null" THEN NULL ELSE {start_sql} END'
        insert_columns(self._conn, "requests", columns, {"t_start": start_sql})


def _object_matrix(rows: Sequence[Row], width: int) -> np.ndarray[Any, Any]:
    """The rows as an (n, width) object matrix, built by C-level passes in slices (each holds the GIL,
    which the proxy's event loop shares). fromiter over the chained rows, unlike np.array(rows), never
    mistakes a value for a dimension."""
    if any(len(row) != width for row in rows):
        raise ValueError(f"span rows must have {width} values, in COLUMNS order")
    matrix = np.empty((len(rows), width), dtype=object)
    for k in range(0, len(rows), _SLICE):
        part = rows[k : k + _SLICE]
        flat = np.fromiter(chain.from_iterable(part), dtype=object, count=len(part) * width)
        matrix[k : k + len(part)] = flat.reshape(len(part), width)
    return matrix


def _checked_column(
    values: np.ndarray[Any, Any], name: str, sql_type: str, notes: dict[int, list[str]]
) -> Column:
    """One column of the batch as DuckDB will scan it, every value made to fit (changes noted per row)."""
    kind = _NUMPY_KIND.get(sql_type)
    if kind is None:  # text: DuckDB reads None in an object column as NULL
        if not _all_text(values):
            values = _fit_each(values, name, sql_type, notes)
        values = np.ascontiguousarray(values)
        if name in REQUIRED_FIELDS:
            values[values == None] = ""  # noqa: E711 (elementwise, not an identity test)
        return values, None
    nulls: np.ndarray[Any, Any] = values == None  # noqa: E711
    has_nulls = bool(nulls.any())
    if has_nulls:
        values = values.copy()
        values[nulls] = 0
    try:
        typed = values.astype(kind)
    except (OverflowError, ValueError, TypeError):  # beyond int64 or float64, text, another type
        return _checked_column(_fit_each(values, name, sql_type, notes, nulls), name, sql_type, notes)
    if sql_type == "INTEGER":  # int64 held it; INTEGER is int32
        low, high = _INT32
        outside = (typed < low) | (typed > high)
        if outside.any():
            for row in np.flatnonzero(outside):
                value, note = fitted(name, int(typed[row]))
                notes.setdefault(int(row), []).append(note or f"{name} is out of range for INTEGER")
            nulls = nulls | outside
            has_nulls = True
            typed[outside] = 0
    return typed, nulls if has_nulls else None


def _all_text(values: np.ndarray[Any, Any]) -> bool:
    """Whether every value of a column is None or a string that encodes as UTF-8: one join (which
    refuses a non-string) and one ASCII scan, C-level passes."""
    try:
        text = "".join(filter(None, values))
    except TypeError:
        return False
    return encodes_as_utf8(text)


def _fit_each(
    values: np.ndarray[Any, Any],
    name: str,
    sql_type: str,
    notes: dict[int, list[str]],
    nulls: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """The column with each value that does not fit replaced as :func:`fitted` says, and a note for
    each replacement. Values are screened inline first: a bad value costs its batch one Python pass
    over one column (~0.1 µs a value), not a call per value."""
    out = values.copy()
    if nulls is not None:
        out[nulls] = None
    for row in _suspects(out, sql_type):
        new, note = fitted(name, out[row])
        if note is not None:
            out[row] = new
            notes.setdefault(row, []).append(note)
    return out


def _suspects(values: np.ndarray[Any, Any], kind: str) -> list[int]:
    """Rows whose value may not fit a column of this kind (None always fits; NOT NULL is seen later)."""
    items = enumerate(values.tolist())
    if kind == "INTEGER":
        low, high = _INT32
        return [i for i, v in items if v is not None and not (type(v) is int and low <= v <= high)]
    if kind == "BIGINT":
        low, high = _INT64
        return [i for i, v in items if v is not None and not (type(v) is int and low <= v <= high)]
    if kind == "DOUBLE":
        return [i for i, v in items if v is not None and type(v) is not float]
    if kind == "BOOLEAN":
        return [i for i, v in items if v is not None and type(v) is not bool]
    return [i for i, v in items if v is not None and not (type(v) is str and v.isascii())]


def insert_columns(
    conn: Any, table: str, columns: Mapping[str, Column], extra_sql: Mapping[str, str] | None = None
) -> None:
    """``INSERT INTO table (...) SELECT ...`` from numpy columns in one statement.

    ``extra_sql`` maps a target column to an SQL expression over the batch (e.g. a timestamp built from
    an integer column); a column whose name starts with ``_`` is only scanned, for such expressions. A
    column whose mask is all-true becomes a plain NULL.
    """
    batch: dict[str, np.ndarray[Any, Any]] = {}
    targets: list[str] = []
    exprs: list[str] = []
    for name, (values, mask) in columns.items():
        if name.startswith("_"):  # a helper column that extra_sql reads, not a column of the table
            batch[name] = values
            continue
        targets.append(name)
        if mask is None:
            batch[name] = values
            exprs.append(f'"{name}"')
        else:
            batch[f"{name}__null"] = mask  # also readable by extra_sql
            if mask.all():
                exprs.append("NULL")
            else:
                batch[name] = values
                exprs.append(f'CASE WHEN "{name}__null" THEN NULL ELSE "{name}" END')
    for name, expr in (extra_sql or {}).items():
        targets.append(name)
        exprs.append(expr)
    if not batch:  # DuckDB needs at least one column to scan
        raise ValueError("insert_columns needs at least one non-null column")
    conn.register("_specproxy_batch", batch)
    try:
        conn.execute(
            f"INSERT INTO {table} ({', '.join(targets)}) SELECT {', '.join(exprs)} FROM _specproxy_batch"
        )
    finally:
        conn.unregister("_specproxy_batch")


def column_array(values: list[Any], sql_type: str) -> Column:
    """One column of plain values as a numpy array (typed where the SQL type allows) and its null mask."""
    kind = _NUMPY_KIND.get(sql_type)
    if kind is None:
        return np.array(values, dtype=object), None
    if None not in values:
        return np.array(values, dtype=kind), None
    mask = np.fromiter((v is None for v in values), dtype=np.bool_, count=len(values))
    filled: np.ndarray[Any, Any] = np.array([0 if v is None else v for v in values], dtype=kind)
    return filled, mask


def epoch_us_to_timestamptz(column: str) -> str:
    """SQL turning an epoch-microseconds column into TIMESTAMPTZ, whatever the session's time zone."""
    return f"timezone('UTC', make_timestamp(\"{column}\"))"
