"""Consolidation and merges of a shard's updates: pure numpy and Arrow, no I/O.

:func:`consolidate` sums ``_diff`` over equal rows and drops zero sums; :func:`merge_table` is
the rows of a merge (times advanced to a since, then consolidated) and :func:`merged_batch`
the batch that replaces the run it merged. The controller's process (``Shard.merge_here`` in
:mod:`shared.shard`) and Spark's executors (services/controller/spark_jobs.py) merge with them
alike.

How it consolidates, and why (issue 31). One 64-bit hash per row, from integers equal iff
the values are (floats by their bits, strings by Arrow's dictionary codes, or by Parquet's own
dictionaries when the merge read them so, lists, maps and structs by the codes of their
elements); each row's first row of equal hash found with a hash table built by numpy scatters
(:func:`_first_rows`: no sort); every other row checked against that first row column by
column (so the result is exact whatever the hash does: a collision is consolidated apart);
the diffs summed into the first rows, and those whose sum is not zero taken once
(:func:`_consolidate_hashed`). On 1M rows in 20 parts (id, name, amount; 30 % retractions,
430k rows out) :func:`merge_table` costs 71-90 ms of CPU on this machine (medians of six
runs of 12 merges, load 2), where the bucketed sort of the hashes before it cost 153-184 in the
same runs, and the sort on every key column before that (kept as the reference in
tests/shared/test_shard_merge_equivalence.py) 0.35-0.49 s. The alternatives weighed:

- Arrow's hash aggregation (``Table.group_by``) on the key columns: 0.22 CPU-s, and it
  cannot group lists or maps, nor floats by their bits without a view first; on the one
  64-bit hash column, 64 ms (and Arrow's ``dictionary_encode`` of it 56), against about 20
  for :func:`_first_rows`;
- a native engine as a dependency (DuckDB or Polars; DataFusion not measured): on the same
  Arrow table in memory DuckDB 2.0.1 took 0.24 CPU-s and Polars 2.1.0 0.19-0.22 (their
  conversions included; Polars' ``group_by`` of the one hash column alone 100 ms), more than
  this. Either would need floats viewed as integers first (both group ``0.0`` with ``-0.0``
  and every NaN with every other), floats inside lists, maps and records rewritten the same
  way, and the part schema restored after the round trip (Polars has no map type); and either
  brings a second thread pool and allocator into the controller and every Spark worker;
- a sort of the hashes (the implementation before this one: a radix pass, then 256 buckets
  sorted in cache): 40-45 ms for 1M keys, where numpy's ``np.sort`` takes 52;
- streaming the parts through the merge: no group is final before the last part is read, so
  only the decode and the hashing could overlap the rest; not done.

Where the time goes, and what the code does about it: the first round of the hash table (a
``np.minimum.at`` into about 2 slots per row, two random gathers: 13 ms of the 20); the check
of the rows that are not first (random gathers, by ranges on the threads); fresh temporaries
(a new 8 MB array costs 2,048 page faults once the allocator has handed its pages back: the
first large consolidation in a process lets glibc keep them, :func:`keep_freed_memory`; the
threads write into arrays allocated by the caller, ``np.take`` into them with ``mode="clip"``,
without which numpy buffers the output; the hash table stays on one thread: its first round
split over two cost 5-10 ms more CPU and 1,500 more faults per merge, for no less wall time);
and strings, which the merge reads as Parquet's dictionaries
(:func:`shared.shard_format.decode_part`): no string is decoded, hashed or compared before the
rows kept are chosen (1M strings of 1,000 values: 20.6 ms to decode as strings and 14.5 to
dictionary-encode, against 6.2 to decode as a dictionary and 4 to map its codes). The hash, the
check and the final take are cut into ranges shared by a few threads (numpy's gathers and
ufuncs, and Arrow's kernels, release the GIL).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shared.frontier import Frontier
from shared.shard_format import DIFF, ERROR, TIME, plain_schema
from shared.state import BatchMeta, Part

# A merge writes its result as parts of at most this many rows, encoded in parallel.
MERGE_ROWS_PER_PART = 256 * 1024


def consolidate(table: pa.Table, keys: Sequence[str], *, threads: int | None = None) -> pa.Table:
    """Sum ``_diff`` over equal ``keys`` and drop zero sums.

    Rows are equal when their values are bitwise equal (floats compare by their bits, so
    ``0.0`` and ``-0.0`` stay apart and equal NaNs consolidate; null equals null), as their
    encoded bytes are; lists, maps and structs compare by their elements the same way. Each
    sum stands in the first row of its group, and the groups keep the order of those rows
    (an input with no equal rows comes back as it was, less its zero diffs).

    Vectorised with numpy over one 64-bit hash per row (:func:`_consolidate_hashed`, on up
    to ``threads`` threads; default: up to 4, no more than the cores); a key type it does not
    know (none that a row schema maps to) takes Arrow's hash aggregation, then a Python
    fallback.
    """
    return _consolidate(table, keys, _threads(threads), plain=False)


def _consolidate(table: pa.Table, keys: Sequence[str], threads: int, *, plain: bool) -> pa.Table:
    """:func:`consolidate`; ``plain``: dictionary-encoded key columns come out as their value
    type (materialised only for the rows kept, on the threads)."""
    if table.num_rows == 0:
        out = table.select([*keys, DIFF])
        return out.cast(plain_schema(out.schema)) if plain else out
    try:
        out = _consolidate_hashed(table, keys, threads, plain=plain)
    except _Unsupported:
        try:
            out = table.group_by(list(keys), use_threads=False).aggregate([(DIFF, "sum")])
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            out = _consolidate_py(table, keys)
        else:
            out = out.rename_columns([*keys, DIFF])
        out = out.select([*keys, DIFF])
    # The input's fields (nullability included: a sum may report its column nullable).
    fields = pa.schema([table.schema.field(n) for n in out.column_names])
    out = out.cast(plain_schema(fields) if plain else fields)
    diffs = out[DIFF]
    if diffs.null_count == 0 and pc.all(pc.not_equal(diffs, 0)).as_py():
        return out
    return out.filter(pc.not_equal(diffs, 0))


def merge_table(
    table: pa.Table, since: Frontier, row_columns: Sequence[str], schema: pa.Schema, *, threads: int | None = None
) -> pa.Table:
    """The rows of a merge: times advanced to ``since``, updates of equal ``(row, _error,
    _time)`` consolidated, zero sums dropped, in the part ``schema``. Pure: the controller's
    process and Spark's executors (services/controller/spark_jobs.py) merge with it alike.
    ``table`` is in the part schema, its strings possibly dictionary-encoded (a merge's read:
    :func:`shared.shard_read.read_parts` with ``dictionaries``), which come out plain.
    ``threads``: those of the consolidation (default: up to 4, no more than the cores)."""
    if since.time is not None and table.num_rows:
        table = table.set_column(table.schema.get_field_index(TIME), TIME, _advanced(table[TIME], since.time))
    table = _consolidate(table, [*row_columns, ERROR, TIME], _threads(threads), plain=True).select(schema.names)
    return table if table.schema == schema else table.cast(schema)


def _advanced(times: pa.ChunkedArray, since: int) -> pa.Array | pa.ChunkedArray:
    """``times`` advanced to ``since``: every time below it becomes it. A merge below since
    (the controller's) has no time above it: one value, written without a comparison."""
    if times.type == pa.uint64() and not times.null_count:
        top = pc.max(times).as_py()
        if top is not None and top <= since:
            return pa.array(np.full(len(times), since, dtype=np.uint64))
    return pc.max_element_wise(times, pa.scalar(since, pa.uint64()))


def merged_batch(run: Sequence[BatchMeta], since: Frontier, parts: Sequence[Part]) -> BatchMeta | None:
    """The batch that replaces ``run`` (None when every update cancelled): it covers the run's
    ``[lower, upper)``, its since is the shard's (or the run's last when the shard is closed)."""
    rows = sum(p.rows for p in parts)
    if rows == 0:
        return None
    return BatchMeta(
        id=uuid.uuid4().hex,
        lower=run[0].lower,
        upper=run[-1].upper,
        since=since if not since.is_empty() else run[-1].since,
        parts=tuple(parts),
        rows=rows,
    )


class _Unsupported(Exception):
    """A key column of a type :func:`_row_values` does not know."""


# Multipliers of the row hash (odd, fixed): splitmix64's.
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_UINT = {8: pa.uint8(), 16: pa.uint16(), 32: pa.uint32(), 64: pa.uint64()}

#: A column's values as integers equal iff the values are: ``(values, valid)``, ``valid``
#: None when every value is valid or nulls already have a value of their own.
_Values = tuple[np.ndarray, "np.ndarray | None"]


def _consolidate_hashed(
    table: pa.Table, keys: Sequence[str], threads: int, *, plain: bool = False
) -> pa.Table:
    """Consolidation over one 64-bit hash per row, exact whatever the hash does.

    1. each key column becomes integers equal iff its values are (:func:`_row_values`:
       fixed-width values by their bits, others by a dense code of Arrow's dictionary
       encoding, lists, maps and structs by the codes of their elements; a dictionary-encoded
       column by its codes, :func:`_dictionary_codes`); a row's hash mixes them
       (:func:`_row_hash`); a column of one value is left out;
    2. each row's representative: the first row of equal hash (:func:`_first_rows`, a hash
       table built with numpy scatters, no sort);
    3. no row with an earlier one of equal hash: the input is already consolidated, returned
       as it is (no take of the rows);
    4. else the diffs are summed into the representatives, the rows that are not their own
       representative are checked against it column by column (a group whose rows differ is
       a hash collision, consolidated exactly apart: :func:`_consolidate_collided`), and the
       representatives whose sum is not zero are taken once, in input order, with their sums.

    The large temporaries are few: a fresh 8 MB array costs 2,048 page faults when the
    allocator has handed its pages back (a quarter of the CPU of a merge of 1M rows once);
    the hash table lives in the hash's scratch array, and the threads' steps write into
    arrays allocated here (what a worker thread allocates comes from its own arena, fresh
    pages again).
    """
    n = table.num_rows
    if n >= _MAX_ROWS:
        raise _Unsupported(f"{n} rows (at most {_MAX_ROWS - 1} in one consolidation)")
    if n >= _PARALLEL_ROWS:
        keep_freed_memory()
    columns: list[_Values] = []
    # Key columns whose output is not a take of their rows: Parquet's dictionaries (the take of
    # their codes) and columns of one value (a take of their first row).
    built: dict[str, Callable[[np.ndarray], pa.Array]] = {}
    with ThreadPoolExecutor(max_workers=threads) if threads > 1 else _Inline() as ex:
        for k in keys:
            col = table[k]
            if pa.types.is_dictionary(col.type):
                coded, built[k] = _dictionary_codes(col, plain=plain)
            else:
                coded = _row_values(col, ex, threads)
            if coded is not None:
                columns.append(coded)
            elif k not in built:
                built[k] = _repeat_first(col)
        diffs = _diffs(table)
        h, scratch = _row_hash(columns, n, ex, threads)
    rep = _first_rows(h, scratch)
    del h, scratch
    rows = np.arange(n, dtype=np.int32)
    first = np.equal(rep, rows)
    if first.all():
        return table.select([*keys, DIFF])
    sums = np.zeros(n, dtype=np.int64)
    np.add.at(sums, rep, diffs)
    # Every row that is not its own representative against its representative, column by
    # column: a group whose rows differ (hash collision: about one pair of rows in 10^13 with
    # 1M rows) is consolidated exactly apart.
    later = np.flatnonzero(~first)
    their = rep[later]
    differs = np.zeros(len(later), dtype=bool)
    checked = [v for values, valid in columns for v in (values, valid) if v is not None]
    # By ranges on the threads, into arrays allocated here (a large array first touched by a
    # worker thread costs page faults again and again; "clip": numpy buffers a take into
    # ``out`` otherwise).
    got, want = np.empty(len(later), dtype=np.uint64), np.empty(len(later), dtype=np.uint64)

    def check(r: tuple[int, int]) -> None:
        a, b = r
        for v in checked:
            np.take(v, later[a:b], out=got[a:b], mode="clip")
            np.take(v, their[a:b], out=want[a:b], mode="clip")
            differs[a:b] |= got[a:b] != want[a:b]

    with _executor(threads, len(later)) as ex:
        list(ex.map(check, _ranges(len(later), threads)))
    chosen = first
    chosen &= sums != 0
    if differs.any():
        collided = np.zeros(n, dtype=bool)
        collided[their[differs]] = True
        members = np.flatnonzero(collided[rep])
        chosen &= ~collided
        extra_reps, extra_sums = _consolidate_collided(columns, diffs, members)
        chosen[extra_reps] = True
        sums[extra_reps] = extra_sums
    # The groups in the order of their first rows.
    idx = np.flatnonzero(chosen)
    rows_t = table.select([k for k in keys if k not in built])

    def take(r: tuple[int, int]) -> pa.Table:
        return rows_t.take(pa.array(idx[r[0]:r[1]]))

    # The taken rows by ranges, and each built column, side by side on the threads.
    tasks: list[Callable[[], Any]] = [
        *(functools.partial(take, r) for r in _ranges(len(idx), threads)),
        *(functools.partial(built[k], idx) for k in built),
    ]
    with _executor(threads, len(idx)) as ex:
        done = list(ex.map(lambda f: f(), tasks))
    taken = done[: len(tasks) - len(built)]
    out = pa.concat_tables(taken) if taken else rows_t.slice(0, 0)
    made = dict(zip(built, done[len(taken):], strict=True))
    out_columns = [made[k] if k in made else out[k] for k in keys]
    return pa.Table.from_arrays([*out_columns, pa.array(sums[idx], pa.int64())], names=[*keys, DIFF])


#: glibc's ``mallopt`` parameters (malloc.h) and the values :func:`keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Let this process's C heap keep the memory a large consolidation freed for the next
    one's arrays, instead of handing it back to the kernel: True when set (glibc only; left as it is when
    the process's environment already sets ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_``). Called by the first consolidation of ``_PARALLEL_ROWS`` rows
    or more in a process (a merge, a snapshot), and left on.

    Why: numpy takes its arrays from malloc. By default glibc serves a block of 128 KB or more
    with its own ``mmap`` and unmaps it when it is freed (the limit rises to the size of the
    largest block freed, up to 32 MB), and trims the heap once more than twice that is free at
    its top. A merge of 1M rows allocates tens of 8 MB temporaries and frees them by the end:
    the next merge got fresh pages again, about 5,000 page faults per merge of the bench's 1M
    rows (read, merge and write) and a fifth of its CPU. With blocks up to 32 MB from the heap
    and 64 MB kept free at its top (the bounds glibc's own adjustment can reach), the same
    merge took about 500 page faults: 110-118 -> 87-91 ms of wall time and 144-166 -> 118-125
    ms of CPU, the peak RSS unchanged (2026-11-28, bench_controller's 20 parts of issue 31's
    workload). The heap is trimmed once more than 64 MB is free at its top (then down to
    nothing free, as glibc trims): a larger merge gains less. The cost: an idle process may
    hold up to 64 MB it freed, once it has consolidated a large table."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, nor has macOS)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def _executor(threads: int, rows: int) -> Any:
    """A pool of ``threads`` threads for a step over ``rows`` rows (inline when small)."""
    return ThreadPoolExecutor(max_workers=threads) if threads > 1 and rows >= _PARALLEL_ROWS else _Inline()


#: Rows from which a consolidation shares its steps among threads.
_PARALLEL_ROWS = 1 << 15
#: Threads of a consolidation by default: numpy's gathers and ufuncs, and Arrow's kernels,
#: release the GIL.
_DEFAULT_THREADS = 4
#: A consolidation's rows are numbered in 32 bits (:func:`_first_rows`).
_MAX_ROWS = 1 << 31
#: The most bits of a slot of :func:`_first_rows`' table (tests lower it to force rounds).
_SLOT_BITS = 62
#: Multiplier of the slot of a row's hash after the first round (odd, fixed).
_SLOT_MUL = np.uint64(0xD6E8FEB86659FD93)


def _threads(threads: int | None) -> int:
    if threads is not None:
        return max(1, threads)
    return max(1, min(_DEFAULT_THREADS, os.cpu_count() or 1))


class _Inline:
    """A stand-in for a one-thread executor: ``map`` runs in the caller."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, f: Any, items: Any) -> Any:
        return map(f, items)


def _row_hash(columns: Sequence[_Values], n: int, ex: Any, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """One 64-bit hash per row of ``columns`` (splitmix64's mixing), equal for equal rows,
    computed by ranges of rows on the threads; and a scratch array as long."""
    h = np.zeros(n, dtype=np.uint64)
    tmp = np.empty(n, dtype=np.uint64)

    def mix(r: tuple[int, int]) -> None:
        a, b = r
        hr, tr = h[a:b], tmp[a:b]

        def xorshift(k: int) -> None:
            np.right_shift(hr, np.uint64(k), out=tr)
            np.bitwise_xor(hr, tr, out=hr)

        for values, valid in columns:
            hr ^= values[a:b]
            hr *= _M1
            xorshift(32)
            if valid is not None:
                hr ^= valid[a:b]
                hr *= _M1
        xorshift(30)
        hr *= _M2
        xorshift(27)
        hr *= _M3
        xorshift(31)

    list(ex.map(mix, _ranges(n, threads) if n >= _PARALLEL_ROWS else [(0, n)]))
    return h, tmp


def _ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into up to ``parts`` ranges of about equal length."""
    cuts = np.linspace(0, n, max(1, parts) + 1).astype(np.int64).tolist()
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if a < b]


def _first_rows(h: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Each row's representative (int32): the first row whose hash equals its own.

    A hash table in numpy, by rounds over the rows not yet placed (all of them at first):

    1. each row's slot: the top bits of its hash (after the first round: of its hash times an
       odd constant), in a table of about twice as many slots as rows, in ``scratch``;
    2. each slot holds the first of its rows (``np.minimum.at``): the winner;
    3. the rows whose hash equals their winner's are placed, the winner their
       representative (the first row of that hash: all its rows are in the round, in the same
       slot, and none before the winner);
    4. the others (rows of another hash in the same slot) go to the next round.

    Every round places at least the winners, and rows of equal hash always together. On 1M
    rows of 715k hashes (a table of 2^20 slots): 256k rows left after the first round, 39k
    after the second, 7k after the third, none after 16; about 20 ms of CPU, where the sort of
    the hashes before it took 40-45. Single-threaded: its first round split over two threads
    (two half tables, then their least) cost 5-10 ms more CPU and 1,500 more page faults per
    merge of 1M rows for no less wall time; the rows split by hash, 30 ms more CPU."""
    n = len(h)
    table = scratch.view(np.int32)
    top = np.iinfo(np.int32).max
    pending: np.ndarray | None = None  # the rows of the round (None: all, in order)
    ph = h
    rep = np.empty(0, dtype=np.int32)
    while pending is None or len(pending):
        m = n if pending is None else len(pending)
        bits = min(_SLOT_BITS, max(1, (2 * m - 1).bit_length()), len(table).bit_length() - 1)
        slots = table[: 1 << bits]
        slots.fill(top)
        if pending is None:
            slot = (ph >> np.uint64(64 - bits)).view(np.int64)
            np.minimum.at(slots, slot, np.arange(n, dtype=np.int32))
        else:
            mixed = ph * _SLOT_MUL
            mixed >>= np.uint64(64 - bits)
            slot = mixed.view(np.int64)
            np.minimum.at(slots, slot, pending)
        winner = slots[slot]
        same = np.equal(h[winner], ph)
        if pending is None:
            rep = winner  # the rows of another hash are placed in a later round
            left = np.flatnonzero(~same).astype(np.int32)
        else:
            rep[pending[same]] = winner[same]
            left = pending[~same]
        if len(left) == 0:
            break
        ph = h[left]
        pending = left
    return rep


def _diffs(table: pa.Table) -> np.ndarray:
    col = table[DIFF]
    if col.null_count:
        raise _Unsupported("null diffs")
    return np.asarray(col.to_numpy(), dtype=np.int64)


def _repeat_first(
    col: pa.ChunkedArray | pa.Array, as_type: pa.DataType | None = None
) -> Callable[[np.ndarray], pa.Array]:
    """The output of a key column whose values are all equal: its first value, once per
    group (a take of one row, whatever the type; nulls when every value is null, of
    ``as_type`` when given). A take even of a null: a null record keeps the placeholders
    in its required fields (:func:`shared.shard_format.cast_rows`), where ``pa.nulls`` has none."""
    if col.null_count == len(col) and as_type is not None:
        return lambda idx: pa.nulls(len(idx), as_type)
    first = col.slice(0, 1).combine_chunks() if isinstance(col, pa.ChunkedArray) else col.slice(0, 1)
    return lambda idx: first.take(pa.array(np.zeros(len(idx), dtype=np.int32)))


def _dictionary_codes(
    col: pa.ChunkedArray | pa.Array, *, plain: bool = False
) -> tuple[_Values | None, Callable[[np.ndarray], pa.Array]]:
    """A dictionary-encoded column (a string read with Parquet's dictionary: no string is
    materialised) as dense codes equal iff the values are, without looking at its rows: the
    chunks' dictionaries (and one null) dictionary-encoded together, each row's code that of
    its chunk's dictionary entry (null rows the null's). Also the column's output for the
    groups' first rows: a dictionary array over the distinct values, or with ``plain`` those
    values (None as codes when every row holds the same value)."""
    if col.null_count == len(col):
        return None, _repeat_first(col, col.type.value_type if plain else None)
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    value_type = col.type.value_type
    dictionaries = [c.dictionary for c in chunks]
    encoded = pc.dictionary_encode(
        pa.concat_arrays([*dictionaries, pa.nulls(1, value_type)]),
        null_encoding="encode",
    )
    remap = np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    null_code = int(remap[-1])
    codes = np.empty(len(col), dtype=np.int64)
    at, offset = 0, 0
    for c, d in zip(chunks, dictionaries, strict=True):
        ind = c.indices
        m = len(ind)
        if ind.null_count:
            local = np.asarray(pc.fill_null(ind, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
            np.take(remap, local + offset, out=codes[at:at + m], mode="clip")
            codes[at:at + m][~np.asarray(ind.is_valid().to_numpy(zero_copy_only=False))] = null_code
        elif m:
            local = np.asarray(ind.to_numpy(), dtype=np.int64)
            np.take(remap, local + offset, out=codes[at:at + m], mode="clip")
        at += m
        offset += len(d)
    uniques = encoded.dictionary
    has_nulls = col.null_count > 0 or uniques.null_count > 0

    def output(idx: np.ndarray) -> pa.Array:
        taken = codes[idx]
        mask = np.equal(taken, null_code) if has_nulls else None
        out = pa.DictionaryArray.from_arrays(pa.array(taken.astype(np.int32), mask=mask), uniques)
        return out.cast(value_type) if plain else out

    if len(codes) == 0 or codes.min() == codes.max():
        return None, output
    return (codes.view(np.uint64), None), output


def _consolidate_collided(
    columns: Sequence[_Values], diffs: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The groups among ``rows`` (whose hashes collided), exactly: ``(first row of each
    group, its sum)``, zero sums left out. Python over a handful of rows."""
    diffs = diffs[rows]
    sums: dict[tuple[Any, ...], int] = {}
    firsts: dict[tuple[Any, ...], int] = {}
    for i, r in enumerate(rows.tolist()):
        key = tuple((int(v[r]), None if ok is None else bool(ok[r])) for v, ok in columns)
        sums[key] = sums.get(key, 0) + int(diffs[i])
        firsts.setdefault(key, r)
    kept = [k for k, s in sums.items() if s != 0]
    return (np.array([firsts[k] for k in kept], dtype=np.intp),
            np.array([sums[k] for k in kept], dtype=np.int64))


def _row_values(col: pa.ChunkedArray | pa.Array, ex: Any = None, threads: int = 1) -> _Values | None:
    """``col`` as ``(values, valid)`` (uint64, bool or None), equal iff its values are; None
    for a column whose values are all equal (nothing to tell rows apart). Strings and
    binaries are encoded by ranges of rows on the threads (:func:`_text_codes`)."""
    t = col.type
    varies = False  # known to hold two values or more
    if (pa.types.is_integer(t) or pa.types.is_temporal(t)) and not col.null_count and len(col):
        # A merge's times, all advanced to since, are one value: known without a copy.
        mm = pc.min_max(col)
        if mm["min"] == mm["max"]:
            return None
        varies = True
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    if text and threads > 1 and len(arr) >= _PARALLEL_ROWS and arr.null_count < len(arr):
        codes = _text_codes(arr, ex, threads)
        return None if codes.min() == codes.max() else (codes.view(np.uint64), None)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    t = arr.type
    if arr.null_count == len(arr):
        return None
    if pa.types.is_boolean(t):
        arr, t = arr.cast(pa.uint8()), pa.uint8()
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)) and t.bit_width <= 64:
        bits = arr.view(_UINT[t.bit_width])
        valid = None
        if bits.null_count:
            valid = bits.is_valid().to_numpy(zero_copy_only=False).astype(np.uint64)
            bits = pc.fill_null(bits, 0)
        values = np.asarray(bits.to_numpy(), dtype=np.uint64)
        if valid is None and not varies and values.min() == values.max():
            return None
        return values, valid
    codes = _codes(arr)
    if codes.min() == codes.max():
        return None
    return codes.view(np.uint64), None


def _text_codes(arr: pa.Array, ex: Any, threads: int) -> np.ndarray:
    """:func:`_codes` of a string or binary array, by ranges of rows on the threads: each
    range dictionary-encoded on its own, then its codes mapped onto one dictionary (the first
    range's, extended by the values the others add). 1M strings of 1,000 values on 2 threads:
    12-14 ms of wall time against 19-20 in one."""
    ranges = _ranges(len(arr), threads)
    encoded = list(ex.map(lambda r: pc.dictionary_encode(arr.slice(r[0], r[1] - r[0]), null_encoding="encode"), ranges))
    dictionary = encoded[0].dictionary
    mappings: list[np.ndarray | None] = [None]
    for enc in encoded[1:]:
        own = enc.dictionary
        found = pc.index_in(own, value_set=dictionary, skip_nulls=False)
        mapping = np.asarray(found.to_numpy(zero_copy_only=False), dtype=np.float64)
        new = np.isnan(mapping)
        mapping[new] = len(dictionary) + np.arange(int(new.sum()))
        if new.any():
            dictionary = pa.concat_arrays([dictionary, own.filter(pa.array(new))])
        mappings.append(mapping.astype(np.int64))
    out = np.empty(len(arr), dtype=np.int64)

    def place(j: int) -> None:
        lo, hi = ranges[j]
        idx = encoded[j].indices.to_numpy(zero_copy_only=False)
        m = mappings[j]
        out[lo:hi] = idx if m is None else m[idx]

    list(ex.map(place, range(len(ranges))))
    return out


def _codes(arr: pa.Array) -> np.ndarray:
    """A dense code (int64) per value of ``arr``, equal iff the values are (null its own
    code): Arrow's dictionary encoding, on the bits of fixed-width values; a list or map by
    the codes of its elements, a struct by the codes of its fields (each as the bytes of a
    binary value, itself encoded)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    t = arr.type
    if pa.types.is_boolean(t):
        arr, t = arr.cast(pa.uint8()), pa.uint8()
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)) and t.bit_width <= 64:
        arr = arr.view(_UINT[t.bit_width])
    elif pa.types.is_struct(t):
        fields = [_codes(f) for f in arr.flatten()] or [np.zeros(len(arr), np.int64)]
        blob = np.ascontiguousarray(np.stack(fields, axis=1), dtype="<i8")
        arr = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(8 * blob.shape[1]), len(arr), [_validity(arr), pa.py_buffer(blob)]
        )
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)
        lo, hi = int(offsets[0]), int(offsets[-1])
        elements = _codes(arr.values.slice(lo, hi - lo)).astype("<i8")
        arr = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), len(arr),
            [_validity(arr), pa.py_buffer((offsets - lo) * 8), pa.py_buffer(elements)],
        )
    try:
        encoded = pc.dictionary_encode(arr, null_encoding="encode")
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise _Unsupported(str(t)) from e
    return np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)


def _validity(arr: pa.Array) -> pa.Buffer | None:
    """A validity bitmap of ``arr`` starting at bit 0 (its own may start at its offset)."""
    if arr.null_count == 0:
        return None
    return pa.py_buffer(np.packbits(arr.is_valid().to_numpy(zero_copy_only=False), bitorder="little"))


def _consolidate_py(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Fallback for key types Arrow's hash aggregation does not support (lists, maps)."""
    sums: dict[str, int] = {}
    first: dict[str, dict[str, Any]] = {}
    cols = table.select(list(keys)).to_pylist()
    diffs = table[DIFF].to_pylist()
    for row, d in zip(cols, diffs, strict=True):
        k = json.dumps(row, sort_keys=True, default=repr)
        sums[k] = sums.get(k, 0) + d
        first.setdefault(k, row)
    rows = [{**first[k], DIFF: v} for k, v in sums.items()]
    schema = table.select([*keys, DIFF]).schema
    return pa.Table.from_pylist(rows, schema=schema)
