"""Shards on an object store, with an S3-only compare-and-append.

This module holds the handle (:class:`Shard`: its head, its commits, staging, compaction, reader
holds, GC). Beside it, each imported by it and none importing it:

* :mod:`shared.shard_format`: the Parquet part format (``_time``, ``_diff``, ``_error``, the
  metadata), schema views, updates as tables of the part schema;
* :mod:`shared.shard_merge`: consolidation and the merge of a run of batches (pure Arrow);
* :mod:`shared.shard_read`: the read path (snapshot, updates between two times, listen).

Names callers use (``TIME``, ``consolidate``, ``merge_table``, ...) are importable here too.

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
(:func:`shared.shard_format.conform_part`, :class:`shared.schema_evolution.Resolver`): snapshot,
listen, read-back and merges all see one schema, the current one, and a merge writes its parts
in it.

Safety of GC: data objects that no state references are deleted only after ``grace_ms``;
staged batches older than ``grace_ms / 2`` are refused by append (StagedBatchExpiredError),
and a writer re-probes the head when its cache is older than ``grace_ms / 2``, so a deleted
state seqno is never written again.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc

from shared import shard_read
from shared.avro_arrow import parse_row_schema
from shared.avro_columns import ColumnCodec
from shared.errors import (
    InvalidUsageError,
    SchemaMismatchError,
    ShardDroppedError,
    ShardExistsError,
    ShardNotFoundError,
    StagedBatchExpiredError,
    StorageError,
    UpperMismatchError,
)
from shared.frontier import Frontier
from shared.objectstore import ObjectStore, now_ms
from shared.shard_format import (
    DATA_FORMAT_VERSION,
    DIFF,
    ERROR,
    SCHEMA_META_KEY,
    TIME,
    SchemaView,
    Updates,
    conform_part,
    decode_part,
    dictionary_columns,
    encode_part,
    part_schema,
    schema_view,
    updates_to_table,
)
from shared.shard_merge import MERGE_ROWS_PER_PART, consolidate, merge_table, merged_batch
from shared.shard_read import ListenEvent
from shared.sink_messages import as_frontier
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

#: The shard's API: its own names, and those of the modules beside it that its callers use.
__all__ = [
    "Shard", "StagedBatch", "GcReport", "ListenEvent", "Merger", "Sweeper", "Updates",
    "DEFAULT_GRACE_MS", "validate_shard_id",
    # shared.shard_format
    "DATA_FORMAT_VERSION", "DIFF", "ERROR", "SCHEMA_META_KEY", "TIME", "SchemaView",
    "conform_part", "decode_part", "dictionary_columns", "part_schema", "schema_view",
    # shared.shard_merge
    "MERGE_ROWS_PER_PART", "consolidate", "merge_table", "merged_batch",
]

DEFAULT_GRACE_MS = 10 * 60 * 1000
_SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

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
        return {"shard_id": self.shard_id, "parts": [p.to_json() for p in self.parts], "rows": self.rows,
                "min_time": self.min_time, "max_time": self.max_time, "created_ms": self.created_ms}

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
class GcReport:
    data_deleted: int
    states_deleted: int
    retired_forgotten: int


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
    def refresh(self, *, enough: Callable[[ShardState], bool] | None = None, start_at: int | None = None) -> ShardState:
        """Find the head: from the cached seqno or the hint, probe forward (``enough`` and
        ``start_at``: as :meth:`shared.versioned.VersionedLog.refresh`)."""
        try:
            return self._log.refresh(enough=enough, start_at=start_at)
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

    def cached(self) -> ShardState | None:
        """The head this handle read last (None: none yet), without a round trip."""
        return self._log.cached()

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
        return updates_to_table(updates, self.view(schema))

    # -- data objects ----------------------------------------------------------------------
    def _write_part(
        self, table: pa.Table, tag: str | None = None, *, view: SchemaView | None = None,
        dictionary: Sequence[str] | None = None,
    ) -> Part:
        """Write one data object (:func:`shared.shard_format.encode_part`). ``dictionary``: its
        columns worth a dictionary, when the caller knows them (:func:`dictionary_columns` of
        the table it was sliced from)."""
        data = encode_part(
            table, shard_id=self.shard_id, schema_fingerprint=(view or self.view()).fingerprint,
            dictionary=dictionary,
        )
        key = self._data_key(tag)
        self.store.put(key, data, if_absent=True)
        errors = table.num_rows - table[ERROR].null_count if ERROR in table.column_names else 0
        return Part(key=key, rows=table.num_rows, bytes=len(data), errors=errors)

    def _read_parts(
        self, keys: Sequence[str], view: SchemaView | None = None, *, dictionaries: bool = False
    ) -> pa.Table:
        return shard_read.read_parts(self.store, keys, view or self.view(), threads=self._io_threads,
                                     dictionaries=dictionaries)

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
        return shard_read.read_parts_as_written(self.store, keys, st, self.shard_id, threads=self._io_threads)

    def stage(
        self,
        updates: Updates,
        *,
        max_rows_per_part: int = 1_000_000,
        tag: str | None = None,
        schema: dict[str, Any] | None = None,
        consolidated: bool = False,
    ) -> StagedBatch:
        """Write updates as data objects without appending them (consolidated first, unless
        ``consolidated``: no two with the same row, error and time, no zero diff).

        ``tag`` (letters, digits, ``-``) is appended to the objects' names: the write service
        names its writer partition there, so a reader can route a part without reading it.
        ``schema``: the row schema version the updates are in (default: the current one); the
        parts record it."""
        view = self.view(schema)
        table = self.to_table(updates, schema=view.schema)
        table = (table if consolidated else consolidate(table, [*view.row_columns, ERROR, TIME])).select(view.part_schema.names)
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
        expected = as_frontier(expected_upper)
        new = as_frontier(new_upper)
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
        expected = as_frontier(expected_upper)
        new = as_frontier(new_upper)
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
    @property
    def io_threads(self) -> int:
        """How many data objects this handle reads (or a merge encodes) at once."""
        return self._io_threads

    def _wait_readable(self, as_of: int, timeout_s: float) -> ShardState:
        """The head once ``since <= as_of < upper`` (:func:`shared.shard_read.wait_readable`)."""
        return shard_read.wait_readable(self, as_of, timeout_s)

    def snapshot(self, as_of: int, *, timeout_s: float = 0.0) -> pa.Table:
        """Consolidated contents at ``as_of``: row columns, ``_error``, ``_diff``.

        Valid iff ``since <= as_of < upper``. Below since: SinceViolationError. At or beyond
        upper: waits up to ``timeout_s`` for the upper to pass, then NotReadableYetError.
        """
        return shard_read.snapshot(self, as_of, timeout_s=timeout_s)

    def updates_between(self, state: ShardState, lower: int, upper: Frontier) -> pa.Table:
        """Consolidated updates with ``lower <= time < upper`` as of ``state`` (with _time), in
        the current row schema."""
        return shard_read.updates_between(self, state, lower, upper)

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
        return shard_read.listen(self, as_of, poll_s=poll_s, stop=stop, timeout_s=timeout_s)

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
        f = as_frontier(new_since)
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
        # Strings stay in Parquet's dictionaries until the merge has chosen its rows.
        keys = [p.key for b in run for p in b.parts]
        table = merge_table(self._read_parts(keys, view, dictionaries=True), since, view.row_columns, view.part_schema)
        if table.num_rows == 0:
            return None
        return merged_batch(run, since, self.write_parts(table, view=view))

    def write_parts(
        self, table: pa.Table, *, rows_per_part: int | None = None, view: SchemaView | None = None
    ) -> tuple[Part, ...]:
        """Write ``table`` as the fewest equal parts of at most ``rows_per_part`` rows (default
        ``MERGE_ROWS_PER_PART``), encoded concurrently (Parquet encoding releases the GIL)."""
        n, most = table.num_rows, rows_per_part or MERGE_ROWS_PER_PART
        rows_per_part = max(1, -(-n // max(1, -(-n // most))))  # ceil(n / ceil(n / most))
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

