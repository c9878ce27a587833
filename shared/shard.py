"""Shards on an object store, with an S3-only compare-and-append.

Layout of a shard under ``shards/<shard_id>/``::

    state/00000000000000000042.json   sequence-numbered state objects (plain JSON, see
                                      shared.state); state n+1 is written with
                                      If-None-Match: *, so exactly one writer wins it
    data/<uuid>.parquet               write-once data objects (row columns + _time, _diff,
                                      _error); never overwritten
    hint                              the seqno of a recent state (a hint: probe forward)

Finding the head never LISTs the history: a handle caches the head it last saw, and a fresh
handle reads the hint, then probes forward (HEAD n+1, n+2, n+4, ... then a binary search).
Garbage collection keeps the hint at or above the lowest state it keeps.

Commit order of every state change (one numbered sequence, as quix-streams documents its
checkpoint):

1. load the head (cached, confirmed within half the grace period, else probed);
2. validate preconditions and apply the pure transition (shared.state) -> state n+1;
3. data objects of the change are already written (write-once, unreferenced until step 4);
4. PUT state n+1 with If-None-Match: *. 412/409: re-probe the head, go to 2. An unknown
   outcome (timeout): re-PUT the same bytes until the answer is known; a 412 then reads
   state n+1 and compares its change token with ours;
5. every 16 states, rewrite the hint.

Idempotency: ``compare_and_append(..., token=T)`` records T in the state. A retry of an append
that landed finds T (in the head's recent tokens) and returns success without applying twice.

Schema versions: the state records every row schema version with the first upper from which it
holds (:meth:`Shard.alter_schema`). A part is written in the schema its writer had (its Parquet
metadata names it: ``shardsink.schema``, the schema's fingerprint; a part without it was written
under the first version) and is read as the schema of the state being read
(:func:`conform_part`, :class:`shared.schema_evolution.Resolver`): snapshot, listen, read-back
and merges all see one schema, the current one, and a merge writes its parts in it.

Safety of GC: data objects that no state references are deleted only after ``grace_ms``;
staged batches older than ``grace_ms / 2`` are refused by append (StagedBatchExpiredError),
and a writer re-probes the head when its cache is older than ``grace_ms / 2``, so a deleted
state seqno is never written again.
"""

from __future__ import annotations

import io
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shared.avro_arrow import avro_to_arrow_schema, parse_row_schema, rows_to_arrow
from shared.schema_evolution import Resolver
from shared.errors import (
    InvalidUsageError,
    NotReadableYetError,
    SchemaMismatchError,
    ShardDroppedError,
    ShardExistsError,
    ShardNotFoundError,
    SinceViolationError,
    StagedBatchExpiredError,
    StorageError,
    UpperMismatchError,
)
from shared.frontier import Frontier
from shared.objectstore import ObjectStore, now_ms
from shared.versioned import AlreadyApplied, VersionedLog
from shared.state import (
    CRITICAL,
    LEASED,
    BatchMeta,
    Part,
    ShardState,
    apply_alter_schema,
    apply_append,
    apply_downgrade_since,
    apply_drop,
    apply_expire_reader,
    apply_forget_retired,
    apply_heartbeat,
    apply_merge,
    apply_register_reader,
    below_since,
    initial_state,
    plan_merge,
    plan_since_merge,
    validate_append_bounds,
    validate_times,
)

TIME = "_time"
DIFF = "_diff"
ERROR = "_error"
DATA_FORMAT_VERSION = "1"
#: Parquet metadata key of a part: the fingerprint (hex) of the row schema it was written in.
SCHEMA_META_KEY = b"shardsink.schema"
DEFAULT_GRACE_MS = 10 * 60 * 1000
# A merge writes its result as parts of at most this many rows, encoded in parallel.
MERGE_ROWS_PER_PART = 256 * 1024
_SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

Updates: TypeAlias = pa.Table | Sequence[tuple[Any, ...]]
#: Merges a run of batches of a shard with times advanced to a since (see ``Shard.merger``).
Merger: TypeAlias = "Callable[[Shard, Sequence[BatchMeta], Frontier, dict[str, Any] | None], BatchMeta | None]"
#: Deletes the shard's data objects that are neither protected nor younger than the cutoff,
#: and the expired ones; returns how many it deleted (see ``Shard.sweeper``).
Sweeper: TypeAlias = "Callable[[Shard, set[str], set[str], int], int]"


def validate_shard_id(shard_id: str) -> str:
    """Ids are single path segments: no '/', no '..', nothing that escapes the prefix."""
    if not isinstance(shard_id, str) or not _SHARD_ID.match(shard_id) or ".." in shard_id:
        raise InvalidUsageError(
            f"expected a shard id of letters, digits, '.', '_' or '-' (1-128 chars, no '..'), "
            f"found {shard_id!r}",
            shard_id=shard_id,
        )
    return shard_id


def part_schema(row_schema: pa.Schema) -> pa.Schema:
    """The Parquet schema of a data object: row columns (nullable: error rows have no row),
    then ``_time`` (uint64), ``_diff`` (int64), ``_error`` (string, null for ok rows)."""
    fields = [pa.field(f.name, f.type, nullable=True) for f in row_schema]
    fields += [
        pa.field(TIME, pa.uint64(), nullable=False),
        pa.field(DIFF, pa.int64(), nullable=False),
        pa.field(ERROR, pa.string(), nullable=True),
    ]
    return pa.schema(fields)


@dataclass(frozen=True, slots=True)
class SchemaView:
    """One row schema version and what the shard needs of it: its Arrow row and part schemas,
    its resolver (rows of earlier versions read as it) and its fingerprint (hex)."""

    schema: dict[str, Any]
    row_schema: pa.Schema
    part_schema: pa.Schema
    resolver: Resolver
    fingerprint: str

    @property
    def row_columns(self) -> list[str]:
        return list(self.row_schema.names)


def schema_view(schema: dict[str, Any]) -> SchemaView:
    """The (cached) view of a row schema."""
    return _schema_view(json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=64)
def _schema_view(key: str) -> SchemaView:
    from shared.codec import fingerprint

    schema = json.loads(key)
    rows = avro_to_arrow_schema(schema)
    return SchemaView(schema, rows, part_schema(rows), Resolver.of(schema), fingerprint(schema).hex())


def decode_part(data: bytes) -> pa.Table:
    """A data object's Parquet bytes as a table (schema metadata kept).

    Through :class:`pyarrow.parquet.ParquetFile` rather than :func:`pyarrow.parquet.read_table`,
    whose dataset machinery costs more than the decoding of a part of 50k rows (20 parts of
    50k rows, 8.2 MB, on 8 threads: 102 -> 57 ms of CPU, 56 -> 29 ms of wall time)."""
    return pq.ParquetFile(pa.BufferReader(data)).read()


def conform_part(table: pa.Table, view: SchemaView) -> pa.Table:
    """A part's table (written in any accepted version of the schema) as a table of
    ``view``'s part schema: row columns resolved (added columns take their default, promoted
    types are cast, removed columns dropped; error rows keep null rows), then ``_time``,
    ``_diff``, ``_error``. A part written in ``view``'s schema costs a comparison."""
    target = view.part_schema
    if table.schema.equals(target):
        return table
    if view.resolver.is_current(table.schema):
        return table.select(target.names).cast(target)
    errors = None
    if ERROR in table.column_names and table[ERROR].null_count < table.num_rows:
        errors = table[ERROR].is_valid().combine_chunks()
    rows = view.resolver.resolve(table, null_where=errors)
    for name in (TIME, DIFF, ERROR):
        col = table[name] if name in table.column_names else pa.nulls(table.num_rows, target.field(name).type)
        rows = rows.append_column(name, col)
    return rows.cast(target)


@dataclass(frozen=True, slots=True)
class StagedBatch:
    """Data objects written for a later append: a small handle that can cross Kafka."""

    shard_id: str
    parts: tuple[Part, ...]
    rows: int
    min_time: int | None
    max_time: int | None
    created_ms: int

    def to_json(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "parts": [p.to_json() for p in self.parts],
            "rows": self.rows,
            "min_time": self.min_time,
            "max_time": self.max_time,
            "created_ms": self.created_ms,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> StagedBatch:
        try:
            return StagedBatch(
                shard_id=str(d["shard_id"]),
                parts=tuple(Part.from_json(p) for p in d["parts"]),
                rows=int(d["rows"]),
                min_time=None if d["min_time"] is None else int(d["min_time"]),
                max_time=None if d["max_time"] is None else int(d["max_time"]),
                created_ms=int(d["created_ms"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsageError(f"expected a staged batch handle, found {d!r}: {e}") from e


@dataclass(frozen=True, slots=True)
class ListenEvent:
    """Updates with times in ``[lower, upper)`` (consolidated), then progress to ``upper``."""

    lower: Frontier
    upper: Frontier
    updates: pa.Table


@dataclass(frozen=True, slots=True)
class GcReport:
    data_deleted: int
    states_deleted: int
    retired_forgotten: int


def consolidate(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Sum ``_diff`` over equal ``keys`` and drop zero sums.

    Vectorised with Arrow: sort on the keys, mark rows equal to their predecessor, sum the
    diffs of each run of equal rows (:func:`_consolidate_sorted`). Key types Arrow cannot sort
    or compare (lists, maps, structs) take Arrow's hash aggregation, then a Python fallback.
    Rows are equal when their values are bitwise equal (floats compare by their bits, so
    ``0.0`` and ``-0.0`` stay apart and equal NaNs consolidate), as their encoded bytes are.
    """
    if table.num_rows == 0:
        return table.select([*keys, DIFF])
    out = _consolidate_sorted(table, keys)
    if out is None:
        try:
            out = table.group_by(list(keys), use_threads=True).aggregate([(DIFF, "sum")])
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            out = _consolidate_py(table, keys)
        else:
            out = out.rename_columns([*keys, DIFF])
        out = out.select([*keys, DIFF])
    # The input's fields (nullability included: a sum or a sort may report its column nullable).
    out = out.cast(pa.schema([table.schema.field(n) for n in out.column_names]))
    diffs = out[DIFF]
    if diffs.null_count == 0 and pc.all(pc.not_equal(diffs, 0)).as_py():
        return out
    return out.filter(pc.not_equal(diffs, 0))


#: Rows of a column sampled to decide whether its Parquet chunks use a dictionary.
_DICTIONARY_SAMPLE = 4096


def _even_sample(col: pa.ChunkedArray, k: int) -> pa.ChunkedArray:
    """Up to ``k`` values of ``col`` at evenly spaced rows, taken chunk by chunk: a take on a
    chunked array concatenates its chunks first (a merge's table is one chunk per part read,
    and that copy of every column cost more than the rest of the sampling)."""
    n = len(col)
    if n <= k:
        return col
    idx = np.linspace(0, n - 1, k).astype(np.int64)
    offsets = np.cumsum([0, *(len(c) for c in col.chunks)])
    which = np.searchsorted(offsets, idx, side="right") - 1
    chunks = [col.chunk(int(c)).take(pa.array(idx[which == c] - offsets[c])) for c in np.unique(which)]
    return pa.chunked_array(chunks, type=col.type)


def dictionary_columns(table: pa.Table) -> list[str]:
    """The Parquet leaf columns of ``table`` worth a dictionary: those of a flat column whose
    values repeat (at most half as many distinct values as rows in an even sample of up to
    4096 rows), and every leaf of a nested column (Parquet's default).

    Parquet's writer tries a dictionary on every column and falls back to plain encoding once
    the dictionary page outgrows its limit; on a column of mostly distinct values (ids,
    amounts) that attempt costs about as much as the rest of the encoding, makes the part
    larger and its decoding slower (measured on 1M rows of (long id, string of 1,000 values,
    double): encoding 0.117 -> 0.060 CPU-s, 10.3 -> 8.2 MB)."""
    out: list[str] = []
    nested = [f.name for f in table.schema if pa.types.is_nested(f.type)]
    if nested:
        out += [c for c in _leaf_paths(table.schema) if c.split(".", 1)[0] in nested]
    for f in table.schema:
        if pa.types.is_nested(f.type) or pa.types.is_boolean(f.type):
            continue
        col = _even_sample(table[f.name], _DICTIONARY_SAMPLE)
        try:
            repeats = len(col) == 0 or pc.count_distinct(col, mode="all").as_py() * 2 <= len(col)
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            repeats = True  # a type Arrow cannot count: Parquet's default
        if repeats:
            out.append(f.name)
    return out


_LEAF_PATHS: dict[pa.Schema, list[str]] = {}


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """Parquet leaf column paths of an Arrow schema (``s.a``, ``l.list.element``, ...)."""
    paths = _LEAF_PATHS.get(schema)
    if paths is None:
        buf = io.BytesIO()
        pq.write_table(schema.empty_table(), buf)
        meta = pq.read_metadata(io.BytesIO(buf.getvalue()))
        paths = _LEAF_PATHS[schema] = [meta.schema.column(i).path for i in range(len(meta.schema))]
    return paths


def merge_table(table: pa.Table, since: Frontier, row_columns: Sequence[str], schema: pa.Schema) -> pa.Table:
    """The rows of a merge: times advanced to ``since``, updates of equal ``(row, _error,
    _time)`` consolidated, zero sums dropped, in the part ``schema``. Pure: the controller's
    process and Spark's executors (services/controller/spark_jobs.py) merge with it alike."""
    if since.time is not None and table.num_rows:
        advanced = pc.max_element_wise(table[TIME], pa.scalar(since.time, pa.uint64()))
        table = table.set_column(table.schema.get_field_index(TIME), TIME, advanced)
    table = consolidate(table, [*row_columns, ERROR, TIME]).select(schema.names)
    return table if table.schema == schema else table.cast(schema)


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


def _bitwise(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Floats viewed as integers of their width: equal bits sort together and compare equal."""
    t = col.type
    if pa.types.is_floating(t):
        it = {16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[t.bit_width]
        return pa.chunked_array([c.view(it) for c in col.chunks], type=it)
    return col


def _most_distinct_first(keys: pa.Table) -> list[str]:
    """The columns of ``keys``, those with the most distinct values (in an even sample of up
    to 4096 rows) first; ties keep their order.

    Equal rows are equal in every key whatever the order the sort takes them in, but the sort
    is much cheaper when its first key settles most comparisons: 1M rows of (string of 1,000
    values, unique long, double, ...) sort in 128 ms of CPU with the string first, 17 ms with
    the long first."""
    if keys.num_columns < 2 or keys.num_rows < 2:
        return list(keys.column_names)
    distinct: dict[str, int] = {}
    for name in keys.column_names:
        col = _even_sample(keys[name], _DICTIONARY_SAMPLE)
        try:
            distinct[name] = pc.count_distinct(col, mode="all").as_py()
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            distinct[name] = 0  # a type Arrow cannot count: last
    return sorted(keys.column_names, key=lambda c: -distinct[c])


def _consolidate_sorted(table: pa.Table, keys: Sequence[str]) -> pa.Table | None:
    """Sort-based consolidation; None when a key type cannot be sorted or compared.

    1. sort the keys (floats by their bits, nulls last; the most distinct key first, see
       :func:`_most_distinct_first`): equal rows become adjacent;
    2. ``same[i]``: sorted row ``i + 1`` equals row ``i`` in every key (null equals null),
       built key by key;
    3. no equal neighbours (after any key): the input is already consolidated, returned
       unsorted (no take of the rows);
    4. else each run of equal rows starts where ``same`` is false: ``np.add.reduceat`` sums
       its diffs and the run's first row stands for it.
    """
    names = [f"k{i}" for i in range(len(keys))]
    try:
        sk = pa.table([_bitwise(table[k]) for k in keys], names=names)
        names = _most_distinct_first(sk)
        idx = pc.sort_indices(sk, [(n, "ascending") for n in names])
        n = table.num_rows
        same: pa.Array | None = None
        for name in names if n > 1 else []:
            # Column by column, stopping once no neighbours are equal so far: a unique
            # leading column (an id) settles it without touching the others.
            c = sk[name].combine_chunks().take(idx)
            a, b = c.slice(1), c.slice(0, n - 1)
            eq = pc.equal(a, b)
            if eq.null_count:
                eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
            same = eq if same is None else pc.and_(same, eq)
            if not pc.any(same).as_py():
                return table.select([*keys, DIFF])
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
        return None
    if same is None:
        return table.select([*keys, DIFF])
    starts = np.flatnonzero(np.concatenate([[True], ~same.to_numpy(zero_copy_only=False)]))
    order = idx.to_numpy()
    diffs = table[DIFF].to_numpy()[order]
    sums = np.add.reduceat(diffs, starts)
    firsts = pa.array(order[starts])
    out = table.select(list(keys)).take(firsts)
    return out.append_column(DIFF, pa.array(sums, pa.int64()))


def _consolidate_py(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Fallback for key types Arrow's hash aggregation does not support (lists, maps)."""
    import json

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


class Shard:
    """A handle on one shard. Thread-safe; several handles (threads, processes) may race."""

    def __init__(
        self,
        store: ObjectStore,
        shard_id: str,
        *,
        root: str = "shards",
        grace_ms: int = DEFAULT_GRACE_MS,
        auto_compact: bool = False,
        clock: Callable[[], int] = now_ms,
        io_threads: int = 8,
        merger: Merger | None = None,
        sweeper: Sweeper | None = None,
    ) -> None:
        self.store = store
        self.shard_id = validate_shard_id(shard_id)
        self.prefix = f"{root}/{shard_id}/"
        self.grace_ms = grace_ms
        self.auto_compact = auto_compact
        self.clock = clock
        self._log: VersionedLog[ShardState] = VersionedLog(
            store,
            self.prefix,
            ShardState.decode,
            max_cache_age_s=grace_ms / 2000.0,
            name=f"shard {shard_id}",
        )
        self._io_threads = io_threads
        #: Who merges a run of batches (default: :meth:`merge_here`); the controller hands
        #: large runs to Spark's executors (services/controller/spark_jobs.py). Either way the
        #: merged batch is swapped in here, by one conditional state write.
        self.merger = merger
        #: Who deletes unreferenced data objects in :meth:`gc` (default: list and delete here).
        self.sweeper = sweeper

    # -- keys ------------------------------------------------------------------------------
    def state_key(self, seqno: int) -> str:
        return self._log.state_key(seqno)

    def _data_key(self, tag: str | None = None) -> str:
        suffix = f"-{tag}" if tag else ""
        return f"{self.prefix}data/{uuid.uuid4().hex}{suffix}.parquet"

    @property
    def hint_key(self) -> str:
        return self._log.hint_key

    # -- create / open ---------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        store: ObjectStore,
        shard_id: str,
        schema: dict[str, Any] | str,
        *,
        since: Frontier | int = 0,
        **kw: Any,
    ) -> Shard:
        """Create the shard (state 0), or open it if it exists with the same schema (or one of
        its versions: the shard's schema may have been altered since)."""
        shard = cls(store, shard_id, **kw)
        parsed = parse_row_schema(schema)
        since_f = since if isinstance(since, Frontier) else Frontier.at(since)
        state = initial_state(shard_id, parsed, since_f, shard.clock(), uuid.uuid4().hex)
        if not shard._log.put_initial(state):
            existing = shard.refresh()
            if all(v.schema != parsed for v in existing.versions):
                raise ShardExistsError(
                    f"expected shard {shard_id!r} to have the given schema, found another",
                    shard_id=shard_id,
                ) from None
            return shard
        return shard

    @classmethod
    def open(cls, store: ObjectStore, shard_id: str, **kw: Any) -> Shard:
        shard = cls(store, shard_id, **kw)
        shard.refresh()
        return shard

    # -- head discovery (see shared.versioned) ----------------------------------------------
    def refresh(self) -> ShardState:
        """Find the head: from the cached seqno or the hint, probe forward."""
        try:
            return self._log.refresh()
        except ShardNotFoundError:
            raise ShardNotFoundError(
                f"expected a shard at {self.prefix!r}, found none", shard_id=self.shard_id
            ) from None

    def head(self, *, max_age_s: float | None = None) -> ShardState:
        """The cached head if confirmed within half the grace period, else a refreshed one."""
        if max_age_s is None and self._log.cached() is not None:
            return self._log.head()
        if self._log.cached() is not None:
            return self._log.head(max_age_s=max_age_s)
        return self.refresh()

    @property
    def state(self) -> ShardState:
        return self.refresh()

    def upper(self) -> Frontier:
        return self.refresh().upper

    def since(self) -> Frontier:
        return self.refresh().since

    # -- schema ----------------------------------------------------------------------------
    def view(self, schema: dict[str, Any] | None = None) -> SchemaView:
        """The view of ``schema`` (default: the current schema of the cached head)."""
        return schema_view(self.head(max_age_s=1e9).schema if schema is None else schema)

    @property
    def row_schema(self) -> pa.Schema:
        """The Arrow row schema of the current version (as of the cached head)."""
        return self.view().row_schema

    @property
    def part_schema(self) -> pa.Schema:
        return self.view().part_schema

    @property
    def row_columns(self) -> list[str]:
        return self.view().row_columns

    def alter_schema(self, schema: dict[str, Any] | str) -> ShardState:
        """Make ``schema`` the current row schema, holding from the current upper on.

        Refused with :class:`~shared.errors.IncompatibleSchemaError` (field, rule) unless rows
        of every earlier version can be read as it (:mod:`shared.schema_evolution`); the shard
        is then unchanged. The current schema again is a no-op. Nothing else changes: parts
        stay as they are and are read as the new schema."""
        parsed = parse_row_schema(schema)
        token = uuid.uuid4().hex
        return self._commit(lambda h: apply_alter_schema(h, parsed, self.clock(), token), token)

    def to_table(self, updates: Updates, *, schema: dict[str, Any] | None = None) -> pa.Table:
        """Updates as a table in the part schema (of ``schema``, default the current one).

        Accepts an Arrow table with the row columns, ``_time`` and ``_diff`` (``_error``
        optional), or a sequence of ``(row_dict, time, diff)`` / ``(None, time, diff, error)``.
        """
        view = self.view(schema)
        target = view.part_schema
        if isinstance(updates, pa.Table):
            table = updates
        else:
            rows, times, diffs, errors = [], [], [], []
            for u in updates:
                if len(u) not in (3, 4):
                    raise InvalidUsageError(f"expected (row, time, diff[, error]), found {u!r}")
                row, t, d = u[0], u[1], u[2]
                err = u[3] if len(u) == 4 else None
                rows.append(row)
                times.append(t)
                diffs.append(d)
                errors.append(err)
            ok_rows = [r for r in rows if r is not None]
            if ok_rows:
                body = rows_to_arrow(ok_rows, view.schema)
                if len(ok_rows) != len(rows):
                    # Interleave null rows for the error entries.
                    idx, taken = [], 0
                    for r in rows:
                        idx.append(taken if r is not None else None)
                        taken += r is not None
                    body = body.take(pa.array(idx, type=pa.int64()))
            else:
                body = pa.table({f.name: pa.nulls(len(rows), f.type) for f in view.row_schema})
            try:
                table = body.append_column(TIME, pa.array(times, pa.uint64()))
            except (pa.ArrowInvalid, OverflowError, TypeError) as e:
                raise InvalidUsageError(f"expected times in [0, 2**64), found: {e}") from e
            table = table.append_column(DIFF, pa.array(diffs, pa.int64()))
            table = table.append_column(ERROR, pa.array(errors, pa.string()))
        if ERROR not in table.column_names:
            table = table.append_column(ERROR, pa.nulls(table.num_rows, pa.string()))
        missing = [n for n in target.names if n not in table.column_names]
        if missing:
            raise SchemaMismatchError(
                f"expected columns {target.names}, found {table.column_names} (missing {missing})"
            )
        table = table.select(target.names)
        try:
            return table.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise SchemaMismatchError(f"expected updates castable to {target}, found: {e}") from e

    # -- data objects ----------------------------------------------------------------------
    def _write_part(
        self, table: pa.Table, tag: str | None = None, *, view: SchemaView | None = None,
        dictionary: Sequence[str] | None = None,
    ) -> Part:
        """Write one data object. ``dictionary``: its columns worth a dictionary, when the
        caller knows them (:func:`dictionary_columns` of the table it was sliced from)."""
        buf = io.BytesIO()
        meta = {
            b"shardsink.format": DATA_FORMAT_VERSION.encode(),
            b"shardsink.shard": self.shard_id.encode(),
            SCHEMA_META_KEY: (view or self.view()).fingerprint.encode(),
        }
        pq.write_table(
            table.replace_schema_metadata(meta), buf, compression="snappy",
            use_dictionary=list(dictionary_columns(table) if dictionary is None else dictionary),
            write_statistics=[TIME],
        )
        data = buf.getvalue()
        key = self._data_key(tag)
        self.store.put(key, data, if_absent=True)
        errors = table.num_rows - table[ERROR].null_count if ERROR in table.column_names else 0
        return Part(key=key, rows=table.num_rows, bytes=len(data), errors=errors)

    def _read_parts(self, keys: Sequence[str], view: SchemaView | None = None) -> pa.Table:
        view = view or self.view()
        if not keys:
            return view.part_schema.empty_table()

        def one(k: str) -> pa.Table:
            return conform_part(decode_part(self.store.get(k)), view)

        if len(keys) == 1:
            return one(keys[0])
        with ThreadPoolExecutor(max_workers=min(self._io_threads, len(keys))) as ex:
            tables = list(ex.map(one, keys))
        return pa.concat_tables(tables)

    def read_parts(self, keys: Sequence[str], *, schema: dict[str, Any] | None = None) -> pa.Table:
        """The rows of the given data objects in the part schema of ``schema`` (default: the
        current one), whatever version they were written in (not consolidated)."""
        return self._read_parts(keys, self.view(schema))

    def read_parts_as_written(
        self, keys: Sequence[str], state: ShardState | None = None
    ) -> list[tuple[dict[str, Any], pa.Table]]:
        """Each data object's rows in the schema version it was written in: ``(that version's
        Avro schema, its table in that version's part schema)``, in the order of ``keys``. A
        part names its version in its metadata; one without it was written under the first.
        The version is looked up in ``state`` (default: the cached head)."""
        st = state or self.head(max_age_s=1e9)
        versions = {schema_view(v.schema).fingerprint: v.schema for v in st.versions}
        first = st.versions[0].schema

        def one(k: str) -> tuple[dict[str, Any], pa.Table]:
            t = decode_part(self.store.get(k))
            fp = (t.schema.metadata or {}).get(SCHEMA_META_KEY)
            schema = first if fp is None else versions.get(fp.decode())
            if schema is None:
                raise SchemaMismatchError(
                    f"expected a part written in a schema version of {self.shard_id!r}, found "
                    f"{k!r} written in an unknown one ({fp!r})",
                    shard_id=self.shard_id,
                )
            return schema, conform_part(t, schema_view(schema))

        if len(keys) <= 1:
            return [one(k) for k in keys]
        with ThreadPoolExecutor(max_workers=min(self._io_threads, len(keys))) as ex:
            return list(ex.map(one, keys))

    def stage(
        self,
        updates: Updates,
        *,
        max_rows_per_part: int = 1_000_000,
        tag: str | None = None,
        schema: dict[str, Any] | None = None,
    ) -> StagedBatch:
        """Write updates as data objects without appending them (consolidated first).

        ``tag`` (letters, digits, ``-``) is appended to the objects' names: the write service
        names its writer partition there, so a reader can route a part without reading it.
        ``schema``: the row schema version the updates are in (default: the current one); the
        parts record it."""
        view = self.view(schema)
        table = self.to_table(updates, schema=view.schema)
        table = consolidate(table, [*view.row_columns, ERROR, TIME])
        table = table.select(view.part_schema.names)
        parts: list[Part] = []
        for off in range(0, table.num_rows, max_rows_per_part):
            parts.append(self._write_part(table.slice(off, max_rows_per_part), tag, view=view))
        if table.num_rows:
            mm = pc.min_max(table[TIME])
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
        else:
            lo = hi = None
        return StagedBatch(self.shard_id, tuple(parts), table.num_rows, lo, hi, self.clock())

    def staged_from_keys(self, keys: Sequence[str]) -> StagedBatch:
        """The handle of data objects another process staged for this shard (a client's
        all-or-nothing append), checked before anything references them: each key is an
        object under this shard's ``data/`` that no state references yet, in the part schema,
        with rows and no error rows, and every row a value of the shard's schema. Its age is
        the oldest object's, as the store dates it, so the append's age check guards them
        against GC like any staged batch. InvalidUsageError, SchemaMismatchError or
        EncodeError name the first object that fails."""
        from shared.avro_columns import ColumnCodec

        prefix = f"{self.prefix}data/"
        if not keys:
            raise InvalidUsageError("expected at least one staged data object, found none", shard_id=self.shard_id)
        if len(set(keys)) != len(keys):
            raise InvalidUsageError(f"expected distinct staged data objects, found {sorted(keys)}", shard_id=self.shard_id)
        protected = self.refresh().protected_keys()
        for k in keys:
            name = k[len(prefix):] if k.startswith(prefix) else ""
            if not name.endswith(".parquet") or "/" in name or ".." in name:
                raise InvalidUsageError(f"expected staged data objects under {prefix!r}, found {k!r}", shard_id=self.shard_id)
            if k in protected:
                raise InvalidUsageError(f"expected staged data objects no batch holds yet, found {k!r} in the shard",
                                        shard_id=self.shard_id)
        target = self.part_schema
        columns = ColumnCodec(self.head(max_age_s=1e9).schema)
        parts: list[Part] = []
        lo: int | None = None
        hi: int | None = None
        created: int | None = None
        for k in keys:
            info = next((i for i in self.store.list(k) if i.key == k), None)
            if info is None:
                raise InvalidUsageError(f"expected the staged data object {k!r}, found none (never staged, or "
                                        "collected after the grace period)", shard_id=self.shard_id)
            data = self.store.get(k)
            try:
                table = decode_part(data)
            except (pa.ArrowInvalid, OSError) as e:
                raise InvalidUsageError(f"expected a Parquet data object at {k!r}, found: {e}", shard_id=self.shard_id) from None
            if not table.schema.remove_metadata().equals(target):
                raise SchemaMismatchError(f"expected the part schema {target} in {k!r}, found {table.schema.remove_metadata()}",
                                          shard_id=self.shard_id)
            if table.num_rows == 0 or table[ERROR].null_count != table.num_rows:
                raise InvalidUsageError(f"expected rows and no error rows in {k!r}, found {table.num_rows} rows, "
                                        f"{table.num_rows - table[ERROR].null_count} of them error rows", shard_id=self.shard_id)
            columns.encode(table.select(self.row_columns))  # EncodeError: a value the schema cannot hold
            mm = pc.min_max(table[TIME])
            lo = mm["min"].as_py() if lo is None else min(lo, mm["min"].as_py())
            hi = mm["max"].as_py() if hi is None else max(hi, mm["max"].as_py())
            created = info.last_modified_ms if created is None else min(created, info.last_modified_ms)
            parts.append(Part(key=k, rows=table.num_rows, bytes=len(data)))
        assert created is not None
        return StagedBatch(self.shard_id, tuple(parts), sum(p.rows for p in parts), lo, hi, created)

    def delete_staged(self, staged: StagedBatch | Sequence[StagedBatch]) -> int:
        """Delete staged data objects that the head does not reference. Returns the count."""
        batches = [staged] if isinstance(staged, StagedBatch) else list(staged)
        protected = self.refresh().protected_keys()
        keys = [p.key for b in batches for p in b.parts if p.key not in protected]
        if keys:
            self.store.delete_many(keys)
        return len(keys)

    def _commit(
        self,
        transition: Callable[[ShardState], ShardState],
        token: str,
        *,
        before_put: Callable[[], None] | None = None,
    ) -> ShardState:
        if self._log.cached() is None:
            self.refresh()
        return self._log.commit(
            transition, token, before_put=before_put, on_mismatch=(UpperMismatchError,)
        )

    # -- compare_and_append ----------------------------------------------------------------
    def compare_and_append(
        self,
        updates: Updates | None,
        expected_upper: Frontier | int,
        new_upper: Frontier | int,
        token: str | None = None,
    ) -> ShardState:
        """Append ``updates`` iff the shard's upper equals ``expected_upper``.

        Every update's time must satisfy ``expected_upper <= time < new_upper``
        (InvalidUsageError otherwise, nothing written). On a mismatch raises
        UpperMismatchError with ``.current``. ``token`` makes retries idempotent.
        """
        expected = _frontier(expected_upper)
        new = _frontier(new_upper)
        validate_append_bounds(expected, new)
        staged: list[StagedBatch] = []
        table = None if updates is None else self.to_table(updates)
        if table is not None and table.num_rows:
            mm = pc.min_max(table[TIME])
            validate_times(mm["min"].as_py(), mm["max"].as_py(), expected, new)
            staged.append(self.stage(table))
        try:
            return self.compare_and_append_staged(staged, expected, new, token)
        except (UpperMismatchError, InvalidUsageError, ShardDroppedError):
            # Best-effort cleanup: the caller must see the refusal it has to act on (with the
            # current upper), not a failure of the cleanup; gc() reclaims what is left.
            try:
                self.delete_staged(staged)
            except StorageError:
                pass
            raise

    def compare_and_append_staged(
        self,
        staged: Sequence[StagedBatch],
        expected_upper: Frontier | int,
        new_upper: Frontier | int,
        token: str | None = None,
    ) -> ShardState:
        """Append staged batches (possibly from several writers) as one logical batch."""
        expected = _frontier(expected_upper)
        new = _frontier(new_upper)
        validate_append_bounds(expected, new)
        token = token or uuid.uuid4().hex
        for s in staged:
            if s.shard_id != self.shard_id:
                raise InvalidUsageError(
                    f"expected staged batches of {self.shard_id!r}, found one of {s.shard_id!r}"
                )
            validate_times(s.min_time, s.max_time, expected, new)
        parts = tuple(p for s in staged for p in s.parts)
        rows = sum(s.rows for s in staged)
        batch = (
            BatchMeta(id=token, lower=expected, upper=new, since=expected, parts=parts, rows=rows)
            if rows
            else None
        )

        def check_age() -> None:
            now = self.clock()
            for s in staged:
                if now - s.created_ms > self.grace_ms // 2:
                    raise StagedBatchExpiredError(
                        f"expected a staged batch younger than {self.grace_ms // 2} ms, found one "
                        f"{now - s.created_ms} ms old",
                        shard_id=self.shard_id,
                    )

        def transition(head: ShardState) -> ShardState:
            if head.find_token(token) is not None:
                raise AlreadyApplied(head)
            return apply_append(head, batch, expected, new, token, self.clock())

        check_age()
        result = self._commit(transition, token, before_put=check_age)
        if self.auto_compact:
            # The append has committed: compaction is best effort from here on. Any storage
            # failure of it (a refused PUT, a timeout) must not reach the caller, who would
            # take it for a failed append; a merge that did not commit leaves only an
            # unreferenced data object for gc().
            try:
                self.compact(max_merges=4)
            except StorageError:
                pass
        return result

    # -- reads -----------------------------------------------------------------------------
    def _wait_readable(self, as_of: int, timeout_s: float) -> ShardState:
        deadline = time.monotonic() + timeout_s
        state = self.refresh()
        while True:
            if state.dropped:
                raise ShardDroppedError(f"expected a live shard, found {self.shard_id!r} dropped")
            if not state.since.less_equal(Frontier.at(as_of)):
                raise SinceViolationError(
                    f"expected as_of >= since {state.since!r}, found {as_of}",
                    shard_id=self.shard_id,
                    as_of=as_of,
                    since=state.since,
                )
            if state.upper.is_empty() or as_of < (state.upper.time or 0):
                return state
            if time.monotonic() >= deadline:
                raise NotReadableYetError(
                    f"expected as_of < upper {state.upper!r}, found {as_of} (waited {timeout_s}s)",
                    shard_id=self.shard_id,
                    as_of=as_of,
                    upper=state.upper,
                )
            time.sleep(0.02)
            state = self.refresh()

    def snapshot(self, as_of: int, *, timeout_s: float = 0.0) -> pa.Table:
        """Consolidated contents at ``as_of``: row columns, ``_error``, ``_diff``.

        Valid iff ``since <= as_of < upper``. Below since: SinceViolationError. At or beyond
        upper: waits up to ``timeout_s`` for the upper to pass, then NotReadableYetError.
        """
        state = self._wait_readable(as_of, timeout_s)
        # Times only ever advance (to since <= as_of), so a batch whose lower is beyond
        # as_of holds nothing visible at as_of.
        visible = [b for b in state.batches if b.lower.beyond(as_of)]
        view = self.view(state.schema)
        table = self._read_parts([p.key for b in visible for p in b.parts], view)
        # A batch's times are below its upper: when every upper is at most as_of + 1, every
        # time is at or before as_of and the filter has nothing to drop.
        if table.num_rows and not all(b.upper.less_equal(Frontier.at(as_of + 1)) for b in visible):
            table = table.filter(pc.less_equal(table[TIME], pa.scalar(as_of, pa.uint64())))
        return consolidate(table, [*view.row_columns, ERROR])

    def updates_between(self, state: ShardState, lower: int, upper: Frontier) -> pa.Table:
        """Consolidated updates with ``lower <= time < upper`` as of ``state`` (with _time), in
        the current row schema."""
        keys = [p.key for b in state.batches if not b.upper.less_equal(Frontier.at(lower)) for p in b.parts]
        # In the newest schema this handle knows (the row columns its callers see), which is
        # never older than the parts of ``state``.
        head = self.head(max_age_s=1e9)
        view = self.view(state.schema if state.seqno > head.seqno else head.schema)
        table = self._read_parts(keys, view)
        if table.num_rows:
            mask = pc.greater_equal(table[TIME], pa.scalar(lower, pa.uint64()))
            if upper.time is not None:
                mask = pc.and_(mask, pc.less(table[TIME], pa.scalar(upper.time, pa.uint64())))
            table = table.filter(mask)
        return consolidate(table, [*view.row_columns, ERROR, TIME]).select(view.part_schema.names)

    def listen(
        self,
        as_of: int,
        *,
        poll_s: float = 0.05,
        stop: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[ListenEvent]:
        """Updates at times > ``as_of`` as the upper advances (after a snapshot at ``as_of``).

        The caller should hold since at or below ``as_of`` (a reader handle) while listening.
        Stops when ``stop()`` is true, at ``timeout_s`` without progress, or when the shard is
        dropped or closed.
        """
        state = self.refresh()
        if state.dropped:
            raise ShardDroppedError(f"expected a live shard, found {self.shard_id!r} dropped")
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(f"expected as_of >= since {state.since!r}, found {as_of}")
        progress = as_of + 1
        last_progress = time.monotonic()
        while True:
            if stop is not None and stop():
                return
            state = self.refresh()
            if state.dropped:
                return
            if state.upper.less_equal(Frontier.at(progress)):
                if timeout_s is not None and time.monotonic() - last_progress > timeout_s:
                    return
                time.sleep(poll_s)
                continue
            updates = self.updates_between(state, progress, state.upper)
            yield ListenEvent(Frontier.at(progress), state.upper, updates)
            if state.upper.is_empty():
                return
            assert state.upper.time is not None
            progress = state.upper.time
            last_progress = time.monotonic()

    # -- reader holds ----------------------------------------------------------------------
    def register_reader(self, reader_id: str, *, kind: str = LEASED, lease_ms: int = 60_000) -> ShardState:
        if kind not in (LEASED, CRITICAL):
            raise InvalidUsageError(f"expected reader kind 'leased' or 'critical', found {kind!r}")
        token = uuid.uuid4().hex
        return self._commit(
            lambda h: apply_register_reader(h, reader_id, kind, lease_ms, self.clock(), token), token
        )

    def heartbeat(self, reader_id: str) -> ShardState:
        token = uuid.uuid4().hex
        return self._commit(lambda h: apply_heartbeat(h, reader_id, self.clock(), token), token)

    def downgrade_since(self, reader_id: str, new_since: Frontier | int) -> ShardState:
        f = _frontier(new_since)
        token = uuid.uuid4().hex

        def transition(h: ShardState) -> ShardState:
            hold = h.reader(reader_id)
            if hold is not None and f.less_equal(hold.since) and not hold.expired(self.clock()) and hold.kind == CRITICAL:
                return h
            return apply_downgrade_since(h, reader_id, f, self.clock(), token)

        return self._commit(transition, token)

    def expire_reader(self, reader_id: str) -> ShardState:
        token = uuid.uuid4().hex

        def transition(h: ShardState) -> ShardState:
            if h.reader(reader_id) is None:
                return h
            return apply_expire_reader(h, reader_id, self.clock(), token)

        return self._commit(transition, token)

    # -- compaction ------------------------------------------------------------------------
    def _merge_run(
        self, run: Sequence[BatchMeta], since: Frontier, schema: dict[str, Any] | None = None
    ) -> BatchMeta | None:
        """The merge of ``run``, written in ``schema`` (the head's: parts of earlier versions
        are read as it), by :attr:`merger` or here."""
        if self.merger is not None:
            return self.merger(self, run, since, schema)
        return self.merge_here(run, since, schema)

    def merge_here(
        self, run: Sequence[BatchMeta], since: Frontier, schema: dict[str, Any] | None = None
    ) -> BatchMeta | None:
        """Merge ``run`` in this process (:func:`merge_table`), in ``schema`` (default: the
        current one), writing the merged parts; the caller commits the result (or deletes its
        parts)."""
        view = self.view(schema)
        table = merge_table(self._read_parts([p.key for b in run for p in b.parts], view), since,
                            view.row_columns, view.part_schema)
        if table.num_rows == 0:
            return None
        return merged_batch(run, since, self.write_parts(table, view=view))

    def write_parts(
        self, table: pa.Table, *, rows_per_part: int | None = None, view: SchemaView | None = None
    ) -> tuple[Part, ...]:
        """Write ``table`` as parts of at most ``rows_per_part`` rows (default
        ``MERGE_ROWS_PER_PART``), encoded concurrently (Parquet encoding releases the GIL,
        so a large merge uses every core)."""
        rows_per_part = rows_per_part or MERGE_ROWS_PER_PART
        slices = [table.slice(off, rows_per_part) for off in range(0, table.num_rows, rows_per_part)]
        if len(slices) == 1:
            return (self._write_part(slices[0], view=view),)
        # One sample of the whole table decides the dictionaries of every part.
        dictionary = dictionary_columns(table)
        with ThreadPoolExecutor(max_workers=min(self._io_threads, len(slices))) as ex:
            return tuple(ex.map(lambda t: self._write_part(t, view=view, dictionary=dictionary), slices))

    def _apply_merge_of(self, run: Sequence[BatchMeta], merged: BatchMeta | None) -> bool:
        token = uuid.uuid4().hex
        ids = tuple(b.id for b in run)
        try:
            self._commit(lambda h: apply_merge(h, ids, merged, self.clock(), token), token)
            return True
        except (InvalidUsageError, ShardDroppedError):
            if merged is not None:
                self.store.delete_many([p.key for p in merged.parts])
            return False

    def compact(self, *, max_merges: int | None = None) -> int:
        """Merge batches by the tiered policy (times advanced to since, consolidated).

        Returns the number of merges committed. Safe to run concurrently with appends and
        other compactors: a merge commits only if its batches are all still there.
        """
        done = 0
        while max_merges is None or done < max_merges:
            head = self.head()
            plan = plan_merge(head)
            if plan is None:
                return done
            if self._merge_at_since(head, head.batches[plan[0] : plan[1]]):
                done += 1
            else:
                self.refresh()
        return done

    def compact_below_since(self) -> bool:
        """Merge every batch whose upper is at or below since into one, with times advanced
        to since: history before since collapses to its consolidated contents. A full
        collapse, asked for explicitly: it rewrites all history below since, so a since move
        merges with :meth:`compact_since_moved` instead."""
        head = self.refresh()
        if head.since.is_empty():
            return False
        run = head.batches[: below_since(head)]
        if not run or (len(run) == 1 and run[0].since == head.since):
            return False
        return self._merge_at_since(head, run)

    def compact_since_moved(self) -> bool:
        """The merge a since move asks for (the controller's): the balanced run of batches
        below since (:func:`shared.state.plan_since_merge`), times advanced to since. Each row
        is rewritten a logarithmic number of times however often since moves, where
        :meth:`compact_below_since` rewrites all history below since each time."""
        head = self.refresh()
        plan = plan_since_merge(head)
        if plan is None:
            return False
        return self._merge_at_since(head, head.batches[plan[0] : plan[1]])

    def _merge_at_since(self, head: ShardState, run: Sequence[BatchMeta]) -> bool:
        """Merge ``run`` (batches of ``head``) at ``head``'s since and swap it in; False when
        its batches were gone meanwhile."""
        return self._apply_merge_of(run, self._merge_run(run, head.since, head.schema))

    # -- drop and garbage collection -------------------------------------------------------
    def drop(self) -> ShardState:
        """since and upper go to the empty frontier; data is reclaimed by :meth:`gc`."""
        token = uuid.uuid4().hex
        return self._commit(lambda h: h if h.dropped else apply_drop(h, self.clock(), token), token)

    def gc(self, *, grace_ms: int | None = None) -> GcReport:
        """Delete unreferenced data objects and old state objects older than the grace period.

        Never deletes: a part referenced by the head, a part retired less than ``grace_ms``
        ago, a data object younger than ``grace_ms`` (it may be staged for an append), the
        head state, or any state younger than ``grace_ms``.
        """
        grace = self.grace_ms if grace_ms is None else grace_ms
        head = self.refresh()
        now = self.clock()
        cutoff = now - grace
        # 1. retired parts past their grace: delete, then forget them in the state.
        expired = {r.key for r in head.retired if r.retired_ms <= cutoff}
        # 2. unreferenced data objects (failed appends, cancelled stages) older than grace.
        protected = head.protected_keys() - expired
        sweep = self.sweeper or Shard.sweep_here
        n_deleted = sweep(self, protected, expired, cutoff)
        forgotten = 0
        if expired:
            token = uuid.uuid4().hex
            head = self._commit(
                lambda h: apply_forget_retired(h, expired, self.clock(), token)
                if any(r.key in expired for r in h.retired)
                else h,
                token,
            )
            forgotten = len(expired)
        # 3. old state objects: the hint moves to the head first, then states below it go.
        n_states = self._log.collect_states(head.seqno, cutoff)
        if head.dropped:
            # A dropped shard keeps only its tombstone (the head state); opening it finds the
            # tombstone by listing the (now one-object) state prefix.
            self.store.delete(self.hint_key)
        return GcReport(data_deleted=n_deleted, states_deleted=n_states, retired_forgotten=forgotten)

    def sweep_here(self, protected: set[str], expired: set[str], cutoff_ms: int) -> int:
        """List ``data/`` and delete what is not protected and not younger than the cutoff,
        and the ``expired`` parts; returns how many objects were deleted."""
        doomed = {
            info.key
            for info in self.store.list(f"{self.prefix}data/")
            if info.key not in protected and info.last_modified_ms <= cutoff_ms
        } | expired
        if doomed:
            self.store.delete_many(sorted(doomed))
        return len(doomed)

    def list_objects(self) -> list[str]:
        return [i.key for i in self.store.list(self.prefix)]


def _frontier(v: Frontier | int) -> Frontier:
    if isinstance(v, Frontier):
        return v
    return Frontier.at(v)
