"""Consolidation in row order: a snapshot as the read API hands it out. Pure Arrow and numpy.

The read API's snapshot (``shared.io.client``, ``Collection.snapshot``) is consolidated and
sorted by row. Done as two steps, the consolidation (:func:`shared.shard_merge.consolidate`:
a 64-bit hash of every row, a hash table, a check of every later row of a hash) and then a
sort of its result, the hash is mostly wasted work: once the rows are sorted, equal rows are
neighbours, and comparing each row with the one before it finds them. So
:func:`consolidate_in_row_order`:

1. takes rows whose first row column is an integer, time or float column without nulls and
   strictly increases as they are: in row order already, no two equal (appends of increasing
   keys read so), a check of one column;
2. consolidates by hash first when some ``_diff`` is negative: retracted rows are in the
   input twice or more, and Arrow's sort pays for every tie (1.3M rows of which 300k
   retracted: the sort then the comparison cost a fifth to a third more CPU than the hash
   then the sort of the 700k rows left); the rows left are distinct, only their order is to
   find;
3. sorts on the row columns in order (as the sort before did: ascending, nulls last), then
   the bits of each floating-point column, then ``_error`` when there are error rows. Arrow
   orders ``0.0`` and ``-0.0`` as equal and NaNs of any payload together, but they are
   different rows (floats are equal by their bits, as :func:`shared.shard_merge.consolidate`
   has them); rows Arrow orders as equal differ in nothing but such floats (and ``_error``),
   so the keys after the row columns make every group of equal rows one run of neighbours,
   and the order is the row columns' as Arrow sorts them;
4. compares each row with the one before it in that order, column by column (fixed-width
   values by their bits, strings and binaries by their bytes, null equal to null), each
   column only at the positions the columns before found equal (the first column gathered
   in order once, the others at those positions only);
5. sums the runs of equal rows (``np.add.reduceat``) and takes their first rows where the sum
   is not zero, in that order, by columns on threads; no take at all when the order is the
   rows' own and no two are equal.

On the bench's snapshot of 1M rows (4 parts of 250k inserts, ``id`` increasing), the hash
consolidation then the sort cost 0.13-0.18 CPU-s; step 1 is under a millisecond. On the same
rows shuffled, Arrow's sort on four keys is about 0.12 CPU-s and its take 0.065: the hash
(0.09-0.14) is what is saved.

Types Arrow cannot order (lists, maps, records) give None: the caller consolidates by hash
and leaves the order as it is, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shared.shard_format import DIFF, ERROR
from shared.shard_merge import consolidate

_UINT = {8: pa.uint8(), 16: pa.uint16(), 32: pa.uint32(), 64: pa.uint64()}
_INT = {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}
#: Rows from which the take of the sorted rows runs column by column on threads.
_PARALLEL_ROWS = 1 << 16


def consolidate_in_row_order(table: pa.Table, row_columns: Sequence[str], *, threads: int = 1) -> pa.Table | None:
    """``table`` (the part schema) consolidated on ``(row columns, _error)`` and sorted by
    row: the row columns, ``_error`` and ``_diff`` (the sum), zero sums dropped; equal
    to :func:`shared.shard_merge.consolidate` on those keys up to the order of the rows.

    Order: by the row columns as Arrow sorts them (ascending, nulls last); rows it orders
    as equal (``0.0`` and ``-0.0``, NaNs) by their floats' bits, error rows by ``_error``. None when
    a row column's type cannot be ordered (lists, maps, records) or a ``_diff`` is null.
    ``threads``: those of the take of the rows kept."""
    keys = [*row_columns, ERROR]
    n = table.num_rows
    if not row_columns or any(not _orderable(table.schema.field(c).type) for c in row_columns):
        return None
    rows = table.select([*keys, DIFF]).replace_schema_metadata(None)  # contents, not a part: no part metadata
    if n == 0:
        return rows
    if rows[DIFF].null_count:
        return None
    if _strictly_increasing(table[row_columns[0]]):
        # In row order already, and the first column alone tells every row apart (no nulls:
        # no error row either).
        return _without_zero_sums(rows)
    errors = table[ERROR].null_count < n
    distinct = False
    if pc.min(rows[DIFF]).as_py() < 0:
        # Retractions (step 2 of the module docstring): by hash first, then only the order.
        rows = consolidate(rows, keys, threads=threads)
        distinct = True
    order = _sort_indices(rows, row_columns, errors)
    if order is None:
        return None
    later = np.empty(0, np.int64) if distinct else _equal_to_previous(rows, order, keys if errors else list(row_columns))
    if not len(later):
        # No two rows equal: the rows in that order, less their zero diffs.
        return _without_zero_sums(rows if _is_identity(order) else _take(rows, pa.array(order), threads))
    first = np.ones(rows.num_rows, dtype=bool)
    first[later] = False
    starts = np.flatnonzero(first)
    sums = np.add.reduceat(_numpy(rows[DIFF])[order], starts)
    kept = sums != 0
    out = _take(rows.select(keys), pa.array(order[starts[kept]]), threads)
    return out.append_column(rows.schema.field(DIFF), pa.array(sums[kept], pa.int64()))


def sorted_by_row(table: pa.Table, row_columns: Sequence[str]) -> pa.Table:
    """``table`` in row order (column by column, nulls last); as it is when Arrow cannot order
    a row column's type (lists, maps, records)."""
    if table.num_rows < 2:
        return table
    try:
        return table.sort_by([(c, "ascending") for c in row_columns])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        return table


def _orderable(t: pa.DataType) -> bool:
    """Whether Arrow sorts ``t`` and step 3 compares it."""
    if pa.types.is_boolean(t) or pa.types.is_decimal(t) or pa.types.is_fixed_size_binary(t):
        return True
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return _fixed_width(t)


def _fixed_width(t: pa.DataType) -> bool:
    """Integers, floats and times of at most 64 bits (not intervals)."""
    if pa.types.is_interval(t):
        return False
    return bool((pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)) and t.bit_width <= 64)


def _strictly_increasing(col: pa.ChunkedArray) -> bool:
    """Whether ``col`` (integers, times or floats) has no null and strictly increases."""
    t = col.type
    if not _fixed_width(t) or col.null_count:
        return False
    last = None
    for chunk in col.chunks:
        if not len(chunk):
            continue
        # Times as the signed integers they are stored as (Arrow orders them so).
        v = _numpy(chunk if pa.types.is_integer(t) or pa.types.is_floating(t) else chunk.view(_INT[t.bit_width]))
        if v.dtype.kind == "f" and np.isnan(v).any():
            return False
        if (last is not None and not last < v[0]) or not np.all(v[1:] > v[:-1]):
            return False
        last = v[-1]
    return True


def _sort_indices(table: pa.Table, row_columns: Sequence[str], errors: bool) -> np.ndarray | None:
    """The order of step 1's keys (None when Arrow cannot sort them)."""
    arrays = [table[c] for c in row_columns]
    arrays += [_bits(col) for col in arrays if pa.types.is_floating(col.type)]
    if errors:
        arrays.append(table[ERROR])
    names = [f"k{i}" for i in range(len(arrays))]
    try:  # ascending, nulls last (Arrow's default)
        order = pc.sort_indices(pa.Table.from_arrays(arrays, names=names), [(k, "ascending") for k in names])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        return None
    return _numpy(order).astype(np.int64, copy=False)


def _bits(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A floating-point column's values as unsigned integers of their bits (nulls kept)."""
    t = _UINT[col.type.bit_width]
    return pa.chunked_array([c.view(t) for c in col.chunks], type=t)


def _is_identity(order: np.ndarray) -> bool:
    return bool(np.array_equal(order, np.arange(len(order), dtype=order.dtype)))


def _take(table: pa.Table, idx: pa.Array, threads: int) -> pa.Table:
    """``table.take(idx)``, its columns on up to ``threads`` threads (a take releases the GIL)."""
    if threads < 2 or len(idx) < _PARALLEL_ROWS or table.num_columns < 2:
        return table.take(idx)
    with ThreadPoolExecutor(max_workers=min(threads, table.num_columns)) as ex:
        columns = list(ex.map(lambda c: pc.take(c, idx), table.columns))
    return pa.Table.from_arrays(columns, schema=table.schema)


def _equal_to_previous(table: pa.Table, order: np.ndarray, keys: Sequence[str]) -> np.ndarray:
    """The positions ``i >= 1`` in ``order`` whose row equals the row at ``i - 1`` on every
    key (bitwise, null equal to null). Column by column, each compared only at the positions
    still equal on the columns before (at first all of them): the gathers shrink as the
    columns tell rows apart, and no column is gathered whole but the first."""
    at = np.arange(1, len(order), dtype=np.int64)
    for k in keys:
        if not len(at):
            break
        at = at[_equal_at(table[k], order, at)]
    return at


def _equal_at(col: pa.ChunkedArray, order: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each position ``i`` of ``at``: whether ``col[order[i]]`` equals ``col[order[i - 1]]``
    (fixed-width values by their bits, others by Arrow's equality: strings and binaries by
    their bytes, decimals of one scale by their value), null equal to null."""
    t = col.type
    if pa.types.is_boolean(t):
        col, t = col.cast(pa.uint8()), pa.uint8()
    this, prev = order[at], order[at - 1]
    valid = None if not col.null_count else _bools(col.is_valid())
    if _fixed_width(t):
        bits = col.combine_chunks().view(_UINT[t.bit_width])
        v = _numpy(pc.fill_null(bits, 0) if valid is not None else bits)
        eq = v[this] == v[prev]
    elif len(at) == len(order) - 1:
        # Every position: the column gathered once in order, each value against the one before.
        s = pc.take(col, pa.array(order))
        eq = _bools(pc.fill_null(pc.equal(s.slice(1), s.slice(0, len(s) - 1)), True))
    else:
        eq = _bools(pc.fill_null(pc.equal(pc.take(col, pa.array(this)), pc.take(col, pa.array(prev))), True))
    if valid is not None:
        # Values under nulls are zeros (fixed width) or compared as equal (others): a null
        # equals a null and nothing else.
        eq &= valid[this] == valid[prev]
    return np.asarray(eq, dtype=bool)


def _bools(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)


def _without_zero_sums(table: pa.Table) -> pa.Table:
    diffs = table[DIFF]
    if pc.all(pc.not_equal(diffs, 0)).as_py():
        return table
    return table.filter(pc.not_equal(diffs, 0))


def _numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(arr.to_numpy())
