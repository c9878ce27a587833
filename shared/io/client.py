"""The Python read API: open a collection, read snapshots, iterate a subscribe.

::

    from shardsink import open_collection

    orders = open_collection("orders")           # settings from SHARDSINK_S3_* / AWS_* env vars
    orders.upper, orders.since                    # ints (None: the empty frontier)
    table = orders.snapshot(as_of=41)             # pyarrow.Table: row columns + _diff (count)
    df = orders.to_pandas(as_of=41)
    with orders.subscribe(as_of=41, up_to=100) as sub:
        for event in sub:                         # Change / ErrorRow / Progress(frontier)
            ...

Reads go to the shard on S3 directly (no controller, no Kafka): a snapshot reads the batches
the shard's current state names, and a subscribe registers a *leased reader hold* on the shard
so that its since (compaction, the controller's read policy) cannot pass the subscribe's
progress while it runs. The hold is moved forward as the subscribe progresses, renewed while
it waits, and released when the subscribe ends or is closed; a subscriber that stops iterating
for longer than ``lease_ms`` loses the hold (the next step then raises ReaderExpiredError, or
SinceViolationError if the since moved past it). The controller is not needed for reads; it
is only the writer of the catalog and of read policies.

Errors are the storage layer's (``shared.errors``): ``ShardNotFoundError`` (no such
collection), ``ShardDroppedError``, ``SinceViolationError`` (as_of below since),
``NotReadableYetError`` (as_of at or beyond the upper after ``timeout_s``),
``ReaderExpiredError``, ``ObjectStoreError``...

A subscribe yields the snapshot at ``as_of`` as changes at time ``as_of``, then every change
at times in ``(as_of, up_to)``, each step followed by ``Progress(frontier)`` (no more changes
at times below ``frontier``), like the controller's subscribe output. Changes come in time
order and, within one time, in row order (as snapshots do). It ends after
``Progress(up_to)``, or with ``Progress(None)`` when the collection is closed or dropped.
Error rows (updates the sink could not write as rows: ``_error`` set, naming the update, its
source offset and the reason) come in a subscribe as ``ErrorRow(time, diff, error)`` events,
after the changes of their time. Snapshots leave them out unless ``include_errors=True``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shared import shard_read
from shared.avro_arrow import arrow_to_rows
from shared.errors import InvalidUsageError, SinceViolationError
from shared.frontier import Frontier
from shared.shard import DIFF, ERROR, TIME, Shard
from shared.shard_sort import sorted_by_row as _sorted_by_row
from shared.state import LEASED, ShardState

__all__ = ["Change", "Collection", "ErrorRow", "Progress", "Subscription", "open_collection"]


@dataclass(frozen=True, slots=True)
class Change:
    """``row`` (a dict of the row schema) changed by ``diff`` at ``time``."""

    time: int
    diff: int
    row: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """An error row changed by ``diff`` at ``time``: an update the sink could not write as a
    row. ``error`` names the update, its source offset and the reason."""

    time: int
    diff: int
    error: str


@dataclass(frozen=True, slots=True)
class Progress:
    """No more changes at times below ``frontier``; None is the empty frontier (the end)."""

    frontier: int | None


def _store_of(settings: Any) -> Any:
    """An object store from settings: ServiceSettings-like (``.store()``), S3Settings, an
    ObjectStore, or None (S3 settings from the environment)."""
    from shared.io.s3 import S3ObjectStore, S3Settings

    if settings is None:
        return S3ObjectStore(S3Settings.from_env())
    if isinstance(settings, S3Settings):
        return S3ObjectStore(settings)
    if hasattr(settings, "store") and callable(settings.store):
        return settings.store()
    if hasattr(settings, "get") and hasattr(settings, "put"):
        return settings
    raise InvalidUsageError(
        f"expected ServiceSettings, S3Settings, an ObjectStore or None, found {type(settings).__name__}"
    )


def _latest(st: ShardState) -> int:
    """The latest readable time of a state: its upper - 1."""
    if st.upper.is_empty():
        return (1 << 64) - 1  # closed: every time is final, the largest one sees everything
    return max((st.upper.time or 0) - 1, 0)


def open_collection(collection_id: str, settings: Any = None) -> Collection:
    """A handle on a collection (its shard). Raises ShardNotFoundError if there is none.

    ``settings``: ``services.runtime.settings.ServiceSettings``, ``shared.io.s3.S3Settings``, an object
    store, or None for the environment (``SHARDSINK_S3_ENDPOINT``, ``SHARDSINK_S3_BUCKET``,
    ``SHARDSINK_S3_PREFIX``, ``AWS_ACCESS_KEY_ID[_FILE]``, ``AWS_SECRET_ACCESS_KEY[_FILE]``).
    """
    return Collection(Shard.open(_store_of(settings), collection_id))


class Collection:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.collection_id = shard.shard_id

    def __repr__(self) -> str:
        return f"Collection({self.collection_id!r})"

    @property
    def upper(self) -> int | None:
        """The current upper (refreshed): times below it are final. None: closed."""
        return self.shard.refresh().upper.time

    @property
    def since(self) -> int | None:
        """The current since (refreshed): reads at times below it are invalid. None: dropped."""
        return self.shard.refresh().since.time

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the row columns."""
        return self.shard.row_schema

    def snapshot(self, as_of: int | None = None, *, timeout_s: float = 0.0, include_errors: bool = False) -> pa.Table:
        """The contents at ``as_of`` (default: the latest readable time, upper - 1),
        consolidated: the row columns and ``_diff`` (the row's count), sorted by row (where
        Arrow can order the row columns' types)."""
        head = None
        if as_of is None:
            head = self.shard.refresh()  # the latest readable time, and the state read at it
            as_of = _latest(head)
        table = shard_read.snapshot(self.shard, int(as_of), timeout_s=timeout_s, in_row_order=True, head=head)
        if include_errors:
            return table
        if table[ERROR].null_count < table.num_rows:  # error rows to leave out (a filter copies every row)
            table = table.filter(pc.is_null(table[ERROR]))
        return table.select([*self.shard.row_columns, DIFF])

    def to_pandas(self, as_of: int | None = None, *, timeout_s: float = 0.0) -> Any:
        """:meth:`snapshot` as a pandas DataFrame."""
        return self.snapshot(as_of, timeout_s=timeout_s).to_pandas()

    def subscribe(
        self, as_of: int | None = None, up_to: int | None = None, *, lease_ms: int = 60_000, poll_s: float = 0.05,
        idle_timeout_s: float | None = None,
    ) -> Subscription:
        """Iterate the snapshot at ``as_of`` (default: the since) and the changes after it (see
        the module docstring). ``idle_timeout_s``: end the iteration (without a final
        progress) when the upper has not moved for that long."""
        return Subscription(self.shard, as_of, up_to, lease_ms=lease_ms, poll_s=poll_s, idle_timeout_s=idle_timeout_s)


class Subscription:
    """An iterator of :class:`Change` and :class:`Progress` holding a leased reader hold;
    ``close()`` (or leaving a ``with`` block, or the end of the iteration) releases it."""

    def __init__(self, shard: Shard, as_of: int | None, up_to: int | None, *, lease_ms: int, poll_s: float,
                 idle_timeout_s: float | None) -> None:
        if lease_ms < 1000:
            raise InvalidUsageError(f"expected lease_ms >= 1000, found {lease_ms}")
        self.shard = shard
        self.reader_id = f"api-{uuid.uuid4().hex[:16]}"
        self.lease_ms = lease_ms
        self.poll_s = poll_s
        self.idle_timeout_s = idle_timeout_s
        self._closed = False
        st = shard.register_reader(self.reader_id, kind=LEASED, lease_ms=lease_ms)
        hold = st.reader(self.reader_id)
        assert hold is not None
        self.as_of = int(as_of) if as_of is not None else (hold.since.time or 0)
        if not hold.since.less_equal(Frontier.at(self.as_of)):
            self.close()
            raise SinceViolationError(
                f"expected as_of >= since {hold.since!r}, found {self.as_of}",
                shard_id=shard.shard_id, as_of=self.as_of, since=hold.since,
            )
        if up_to is not None and up_to <= self.as_of:
            self.close()
            raise InvalidUsageError(f"expected up_to > as_of {self.as_of}, found {up_to}")
        # Hold exactly at as_of: the snapshot is readable, compaction keeps later times apart.
        shard.downgrade_since(self.reader_id, self.as_of)
        self.up_to = up_to
        self._iter = self._run()

    def __iter__(self) -> Iterator[Change | ErrorRow | Progress]:
        return self

    def __next__(self) -> Change | ErrorRow | Progress:
        return next(self._iter)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End the iteration and release the reader hold (idempotent)."""
        it = getattr(self, "_iter", None)
        if it is not None:
            it.close()
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            st = self.shard.refresh()
            if not st.dropped and st.reader(self.reader_id) is not None:
                self.shard.expire_reader(self.reader_id)
        except Exception:  # noqa: BLE001 - an unreleased lease expires by itself
            pass

    def _changes(self, table: pa.Table, at: int | None) -> list[Change | ErrorRow]:
        if table.num_rows == 0:
            return []
        is_ok = pc.is_null(table[ERROR])
        ok = _sorted_by_row(table.filter(is_ok), self.shard.row_columns)
        # the one Arrow -> Avro mapping: maps as dicts, uuids and nanosecond times as decoded
        rows = arrow_to_rows(ok.select(self.shard.row_columns), self.shard.head(max_age_s=1e9).schema)
        diffs = ok[DIFF].to_pylist()
        times = [at] * ok.num_rows if at is not None else ok[TIME].to_pylist()
        out: list[Change | ErrorRow] = [Change(int(t), int(d), r) for t, d, r in zip(times, diffs, rows, strict=True)]
        if ok.num_rows < table.num_rows:  # error rows after the changes of their time, by reason
            bad = table.filter(pc.invert(is_ok)).sort_by([(ERROR, "ascending")])
            bad_times = [at] * bad.num_rows if at is not None else bad[TIME].to_pylist()
            out += [ErrorRow(int(t), int(d), str(e)) for t, d, e in
                    zip(bad_times, bad[DIFF].to_pylist(), bad[ERROR].to_pylist(), strict=True)]
        out.sort(key=lambda c: c.time)  # stable: within one time, in row order
        return out

    def _run(self) -> Iterator[Change | ErrorRow | Progress]:
        try:
            yield from self._steps()
        finally:
            self._release()

    def _steps(self) -> Iterator[Change | ErrorRow | Progress]:
        up_to = Frontier.empty() if self.up_to is None else Frontier.at(self.up_to)
        progress: int | None = None  # None: the snapshot is not emitted yet
        last_renew = last_move = time.monotonic()
        while True:
            st = self.shard.refresh()
            if st.dropped:
                yield Progress(None)
                return
            target = st.upper.meet(up_to)
            lower = self.as_of if progress is None else progress
            now = time.monotonic()
            if not Frontier.at(lower).less_than(target):  # nothing new (the first step needs as_of < upper)
                if self.idle_timeout_s is not None and now - last_move > self.idle_timeout_s:
                    return
                if now - last_renew > self.lease_ms / 3000.0:
                    self.shard.heartbeat(self.reader_id)
                    last_renew = now
                time.sleep(self.poll_s)
                continue
            out: list[Change | ErrorRow] = []
            if progress is None:
                out += self._changes(self.shard.snapshot(self.as_of), self.as_of)
                start = self.as_of + 1
            else:
                start = progress
            if target.is_empty() or start < (target.time or 0):
                out += self._changes(self.shard.updates_between(st, start, target), None)
            if not target.is_empty() and target != up_to:
                # The step is read: keep since at progress - 1 (changes at times >= progress
                # stay apart from the earlier ones), released before the step is handed out.
                assert target.time is not None
                self.shard.downgrade_since(self.reader_id, target.time - 1)
            last_renew = last_move = time.monotonic()
            yield from out
            if target.is_empty():
                yield Progress(None)
                return
            assert target.time is not None
            yield Progress(target.time)
            progress = target.time
            if target == up_to:
                return
