"""The read path of a shard: snapshots, the updates between two times, and listening.

Every read takes one shape:

1. a state (the head, refreshed) whose since and upper admit the time asked
   (:func:`wait_readable`: dropped, below since and not yet readable are typed errors);
2. the batches of that state visible at the time asked, and their parts;
3. the parts fetched and decoded concurrently, each read as the schema the caller sees
   (:func:`read_parts`, :func:`shared.shard_format.conform_part`);
4. rows filtered on ``_time``, then consolidated (:func:`shared.shard_merge.consolidate`; the
   read API's snapshot in row order: :func:`shared.shard_sort.consolidate_in_row_order`).

The functions are handed the shard handle as a :class:`ShardHandle`: what they need of
:class:`shared.shard.Shard` (its head, its schema views, its store), which calls them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from shared.errors import (
    NotReadableYetError,
    SchemaMismatchError,
    ShardDroppedError,
    SinceViolationError,
)
from shared.frontier import MAX_TIME, Frontier
from shared.objectstore import ObjectStore
from shared.shard_format import (
    ERROR,
    SCHEMA_META_KEY,
    TIME,
    SchemaView,
    conform_part,
    decode_part,
    plain_schema,
    schema_view,
)
from shared.shard_merge import consolidate
from shared.shard_sort import consolidate_in_row_order, sorted_by_row
from shared.state import ShardState


class ShardHandle(Protocol):
    """What the read path needs of a shard handle (:class:`shared.shard.Shard` is one)."""

    shard_id: str
    store: ObjectStore

    @property
    def io_threads(self) -> int: ...

    def refresh(self) -> ShardState: ...

    def head(self, *, max_age_s: float | None = None) -> ShardState: ...

    def view(self, schema: dict[str, Any] | None = None) -> SchemaView: ...


@dataclass(frozen=True, slots=True)
class ListenEvent:
    """Updates with times in ``[lower, upper)`` (consolidated), then progress to ``upper``."""

    lower: Frontier
    upper: Frontier
    updates: pa.Table


def read_parts(
    store: ObjectStore, keys: Sequence[str], view: SchemaView, *, threads: int, dictionaries: bool = False
) -> pa.Table:
    """The rows of the data objects ``keys`` in ``view``'s part schema, whatever version they
    were written in (not consolidated), fetched and decoded on up to ``threads`` threads.

    ``dictionaries`` (a merge's read, :func:`shared.shard_merge.merge_table` takes it as it
    is): the string and binary columns that Parquet stored with a dictionary stay
    dictionary-encoded (:func:`shared.shard_format.decode_part`), and the table's
    :func:`plain_schema` is the part schema. A part written in another version is read as
    usual, and a column that some part stored without a dictionary is cast to its plain type
    in every part."""
    if not keys:
        return view.part_schema.empty_table()

    def one(k: str) -> pa.Table:
        t = decode_part(store.get(k), dictionaries=dictionaries)
        plain = plain_schema(t.schema)
        if plain is not t.schema:
            if plain.equals(view.part_schema):
                return t
            t = t.cast(plain)
        return conform_part(t, view)

    if len(keys) == 1:
        return one(keys[0])
    with ThreadPoolExecutor(max_workers=min(threads, len(keys))) as ex:
        tables = list(ex.map(one, keys))
    if dictionaries and any(not t.schema.equals(tables[0].schema) for t in tables[1:]):
        # A column dictionary-encoded in one part and not in another: plain in every part.
        plain = {f.name for t in tables for f in t.schema if not pa.types.is_dictionary(f.type)}
        tables = [_decoded(t, plain) for t in tables]
    return pa.concat_tables(tables)


def _decoded(table: pa.Table, names: set[str]) -> pa.Table:
    """``table`` with its dictionary-encoded columns among ``names`` as their value type."""
    fields = [f.with_type(f.type.value_type) if f.name in names and pa.types.is_dictionary(f.type) else f
              for f in table.schema]
    schema = pa.schema(fields, metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)


def read_parts_as_written(
    store: ObjectStore, keys: Sequence[str], state: ShardState, shard_id: str, *, threads: int
) -> list[tuple[dict[str, Any], pa.Table]]:
    """Each data object's rows in the schema version it was written in: ``(that version's
    Avro schema, its table in that version's part schema)``, in the order of ``keys``. A part
    names its version in its metadata; one without it was written under the first. The
    version is looked up in ``state``; a part of a version it does not hold is a
    SchemaMismatchError."""
    versions = {schema_view(v.schema).fingerprint: v.schema for v in state.versions}
    first = state.versions[0].schema

    def one(k: str) -> tuple[dict[str, Any], pa.Table]:
        t = decode_part(store.get(k))
        fp = (t.schema.metadata or {}).get(SCHEMA_META_KEY)
        schema = first if fp is None else versions.get(fp.decode())
        if schema is None:
            raise SchemaMismatchError(
                f"expected a part written in a schema version of {shard_id!r}, found "
                f"{k!r} written in an unknown one ({fp!r})",
                shard_id=shard_id,
            )
        return schema, conform_part(t, schema_view(schema))

    if len(keys) <= 1:
        return [one(k) for k in keys]
    with ThreadPoolExecutor(max_workers=min(threads, len(keys))) as ex:
        return list(ex.map(one, keys))


def wait_readable(shard: ShardHandle, as_of: int, timeout_s: float, *, head: ShardState | None = None) -> ShardState:
    """The head once ``since <= as_of < upper``: polls (every 20 ms) up to ``timeout_s`` for
    the upper to pass ``as_of``, then NotReadableYetError. A dropped shard is a
    ShardDroppedError, ``as_of`` below since a SinceViolationError. ``head``: a head the
    caller has just refreshed, looked at first instead of refreshing again."""
    deadline = time.monotonic() + timeout_s
    state = head if head is not None else shard.refresh()
    while True:
        if state.dropped:
            raise ShardDroppedError(f"expected a live shard, found {shard.shard_id!r} dropped")
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(
                f"expected as_of >= since {state.since!r}, found {as_of}",
                shard_id=shard.shard_id,
                as_of=as_of,
                since=state.since,
            )
        if state.upper.is_empty() or as_of < (state.upper.time or 0):
            return state
        if time.monotonic() >= deadline:
            raise NotReadableYetError(
                f"expected as_of < upper {state.upper!r}, found {as_of} (waited {timeout_s}s)",
                shard_id=shard.shard_id,
                as_of=as_of,
                upper=state.upper,
            )
        time.sleep(0.02)
        state = shard.refresh()


def snapshot(
    shard: ShardHandle, as_of: int, *, timeout_s: float = 0.0, in_row_order: bool = False, head: ShardState | None = None
) -> pa.Table:
    """Consolidated contents at ``as_of`` (row columns, ``_error``, ``_diff``) in the schema of
    the state read. ``in_row_order`` (the read API's snapshot): sorted by row, where Arrow can
    order the row columns' types (:func:`shared.shard_sort.consolidate_in_row_order`, which
    sorts first and consolidates the neighbours; else consolidated by hash, then sorted as
    :func:`shared.shard_sort.sorted_by_row` can); else in the order of the groups' first rows.
    ``head``: as :func:`wait_readable`'s."""
    state = wait_readable(shard, as_of, timeout_s, head=head)
    # Times only ever advance (to since <= as_of), so a batch whose lower is beyond
    # as_of holds nothing visible at as_of.
    visible = [b for b in state.batches if b.lower.beyond(as_of)]
    view = shard.view(state.schema)
    table = read_parts(shard.store, [p.key for b in visible for p in b.parts], view, threads=shard.io_threads)
    # A batch's times are below its upper: when every upper is at most as_of + 1, every
    # time is at or before as_of and the filter has nothing to drop (at the last time, every
    # upper is: as_of + 1 is no time, the empty frontier stands for it).
    after = Frontier.at(as_of + 1) if as_of < MAX_TIME else Frontier.empty()
    if table.num_rows and not all(b.upper.less_equal(after) for b in visible):
        table = table.filter(pc.less_equal(table[TIME], pa.scalar(as_of, pa.uint64())))
    if in_row_order:
        ordered = consolidate_in_row_order(table, view.row_columns, threads=_threads())
        if ordered is not None:
            return ordered
        return sorted_by_row(consolidate(table, [*view.row_columns, ERROR]), view.row_columns)
    return consolidate(table, [*view.row_columns, ERROR])


def _threads() -> int:
    """Threads of a snapshot's CPU work (its take): up to 4, no more than the cores."""
    return max(1, min(4, os.cpu_count() or 1))


def updates_between(shard: ShardHandle, state: ShardState, lower: int, upper: Frontier) -> pa.Table:
    """Consolidated updates with ``lower <= time < upper`` as of ``state`` (with _time), in
    the current row schema. ``lower`` may be 2**64 (the time after the last one, from a read
    as of it): nothing is at or after it."""
    # In the newest schema this handle knows (the row columns its callers see), which is
    # never older than the parts of ``state``.
    head = shard.head(max_age_s=1e9)
    view = shard.view(state.schema if state.seqno > head.seqno else head.schema)
    if lower > MAX_TIME:
        return view.part_schema.empty_table()
    keys = [p.key for b in state.batches if not b.upper.less_equal(Frontier.at(lower)) for p in b.parts]
    table = read_parts(shard.store, keys, view, threads=shard.io_threads)
    if table.num_rows:
        mask = pc.greater_equal(table[TIME], pa.scalar(lower, pa.uint64()))
        if upper.time is not None:
            mask = pc.and_(mask, pc.less(table[TIME], pa.scalar(upper.time, pa.uint64())))
        table = table.filter(mask)
    return consolidate(table, [*view.row_columns, ERROR, TIME]).select(view.part_schema.names)


def listen(
    shard: ShardHandle,
    as_of: int,
    *,
    poll_s: float = 0.05,
    stop: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> Iterator[ListenEvent]:
    """Updates at times > ``as_of`` as the upper advances (after a snapshot at ``as_of``): one
    :class:`ListenEvent` per upper seen, polling the head every ``poll_s`` in between. Stops
    when ``stop()`` is true, at ``timeout_s`` without progress, or when the shard is dropped
    or closed; as of the last time (2**64 - 1), at once, with no event."""
    state = shard.refresh()
    if state.dropped:
        raise ShardDroppedError(f"expected a live shard, found {shard.shard_id!r} dropped")
    if not state.since.less_equal(Frontier.at(as_of)):
        raise SinceViolationError(f"expected as_of >= since {state.since!r}, found {as_of}")
    if as_of == MAX_TIME:
        return  # no time follows the last one: no update can come after it
    progress = as_of + 1
    last_progress = time.monotonic()
    while True:
        if stop is not None and stop():
            return
        state = shard.refresh()
        if state.dropped:
            return
        if state.upper.less_equal(Frontier.at(progress)):
            if timeout_s is not None and time.monotonic() - last_progress > timeout_s:
                return
            time.sleep(poll_s)
            continue
        updates = updates_between(shard, state, progress, state.upper)
        yield ListenEvent(Frontier.at(progress), state.upper, updates)
        if state.upper.is_empty():
            return
        assert state.upper.time is not None
        progress = state.upper.time
        last_progress = time.monotonic()
