"""A writer partition's state machine: the correction buffer and when to write it.

A writer partition absorbs desired updates (from the desired topic) and the shard's contents
read back (negated), holds the latest :class:`~shared.sink_messages.BatchDescription` from
``descs``, and decides (:class:`WriteDecision`) when to stage its part of a description and
report it on ``batches`` with a :class:`~shared.sink_messages.BatchReport` (the messages and
the protocol they carry are in :mod:`shared.sink_messages`).

:class:`WriteState` does no I/O. Each method absorbs one input and returns the decision the
service's adapter must carry out (stage a batch, publish a report). The storage layer
(``shared.shard``) is never imported: staged-batch handles are opaque values here.

Invariant (from the seeds, kept by the class below and tested in
``tests/shared/test_sink_state.py``; numbered as the sink's, see :mod:`shared.sink_messages`):

2. a writer writes a description only when it has read the shard's contents through exactly
   ``lower`` (``lower == persist frontier``) and the desired input through ``upper``; it
   writes each description at most once and skips outdated ones (``lower < persist
   frontier``); it never appends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from shared.correction import (
    ConsolidatedUpdates,
    Correction,
    DiffsLike,
    Keys,
    TimesLike,
    as_diffs,
    as_times,
    sort_consolidate,
)
from shared.desired import row_partition
from shared.errors import InvalidUsageError, SinkProtocolError
from shared.frontier import Frontier
from shared.sink_messages import BatchDescription, BatchReport, FrontierLike, as_frontier


# -- error rows -----------------------------------------------------------------------------

_ERROR_PREFIX = "partition "


def error_key(partition: int, message: str) -> str:
    """The error collection's key for an error raised by writer ``partition``.

    The writer that inserts an error into its buffer must also receive the error's read-back
    (so the two cancel); the partition prefix lets the read-back be routed by
    :func:`error_partition` instead of by a hash of the text."""
    return f"{_ERROR_PREFIX}{partition}: {message}"


def error_partition(error: str, partitions: int) -> int:
    """The writer partition of an error row read back from the shard."""
    if error.startswith(_ERROR_PREFIX):
        head = error[len(_ERROR_PREFIX) :].split(":", 1)[0]
        if head.isdigit():
            return int(head) % partitions
    return row_partition(error.encode(), partitions)


# -- decisions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Idle:
    """No description is held."""


@dataclass(frozen=True, slots=True)
class Wait:
    """The held description is not ready yet (``reason`` says which input is behind)."""

    desc: BatchDescription
    reason: str


@dataclass(frozen=True, slots=True)
class Skip:
    """The description is outdated (its lower is below the persist frontier): dropped."""

    desc: BatchDescription
    reason: str


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage ``updates`` (rows) and ``errors`` (error collection) as data objects for
    ``desc``, then publish :meth:`report` with the handle. Never append."""

    desc: BatchDescription
    partition: int
    updates: ConsolidatedUpdates
    errors: ConsolidatedUpdates

    def report(self, staged: Any, now_ms: int = 0) -> BatchReport:
        return BatchReport.for_description(
            self.desc, self.partition, staged, len(self.updates) + len(self.errors), now_ms
        )


@dataclass(frozen=True, slots=True)
class NothingToWrite:
    """Nothing to write for ``desc``: publish :meth:`report` (completeness is explicit)."""

    desc: BatchDescription
    partition: int

    def report(self, now_ms: int = 0) -> BatchReport:
        return BatchReport.for_description(self.desc, self.partition, None, 0, now_ms)


@dataclass(frozen=True, slots=True)
class Refuse:
    """The partition cannot prove it has seen the desired history behind the shard (the
    oldest input is gone and no checkpoint covers it): it writes nothing, so it never deletes
    a row only because the row's insert has aged out of the topic. The description stays
    held; an operator adopts the shard's contents as the baseline (``sink adopt``)."""

    desc: BatchDescription
    reason: str


WriteDecision = Union[Idle, Wait, Skip, Stage, NothingToWrite, Refuse]


# -- state ----------------------------------------------------------------------------------


class WriteState:
    """One writer partition: the correction buffer ``desired - persist`` and its frontiers.

    * ``desired_frontier``: this partition's progress (updates below it are complete);
    * ``persist_frontier``: the shard's contents at times below it have been absorbed
      (negated): the snapshot at start, then each appended batch, contiguously.

    Buffered times are advanced to the persist frontier (the sink only writes at or beyond
    it). Consolidation is eager in every mode, read-only included: it is driven by inserts.
    """

    def __init__(
        self,
        sink_id: str,
        partition: int,
        partition_count: int,
        *,
        correction: Correction | None = None,
        errors: Correction | None = None,
    ) -> None:
        if not 0 <= partition < partition_count:
            raise InvalidUsageError(
                f"expected 0 <= partition < {partition_count}, found {partition}"
            )
        self.sink_id = sink_id
        self.partition = partition
        self.partition_count = partition_count
        self.correction = correction if correction is not None else Correction()
        self.errors = errors if errors is not None else Correction()
        self.desired_frontier = Frontier.minimum()
        self.persist_frontier = Frontier.minimum()
        self.description: BatchDescription | None = None
        # (lower, epoch) of the last description written or skipped: re-deliveries of it or
        # of anything older are ignored, so each description is written at most once.
        self._handled: tuple[int, int] | None = None
        self._snapshot_upper: Frontier | None = None
        self._snapshot_done = False
        self.contract_violations = 0
        self.decode_errors = 0
        self.written = 0
        # Retention safety: how much the buffer absorbed (a gap in the input after anything
        # was absorbed cannot be proven harmless), the adopted baseline, and why this
        # partition refuses to write (None: it does not).
        self.absorbed_desired = 0
        self.absorbed_persist = 0
        self.adopted: Frontier | None = None
        self.dropped_below_baseline = 0
        self.unproven: str | None = None
        # Batches this partition staged and may see appended: part key -> staged id, and
        # staged id -> (description upper, updates, errors). Its own parts are read back from
        # here, not from the object store.
        self._staged_parts: dict[str, str] = {}
        self._staged: dict[str, tuple[Frontier, ConsolidatedUpdates, ConsolidatedUpdates]] = {}
        #: The fingerprint of the row schema the buffered keys are encoded in (a key is the
        #: row's canonical single-object encoding); None when not known (an older checkpoint).
        self.key_schema: bytes | None = None

    # -- desired input ----------------------------------------------------------------------
    def absorb_desired_progress(self, frontier: FrontierLike) -> None:
        """This partition's progress statement (regressions are ignored)."""
        self.desired_frontier = self.desired_frontier.join(as_frontier(frontier))

    def absorb_desired_updates(
        self, keys: Keys, times: TimesLike, diffs: DiffsLike = 1, *, describe: Callable[[int], str] | None = None
    ) -> int:
        """Insert desired updates. Updates below this partition's progress break the
        contract: each goes to the error collection at its time instead, its error naming
        the update by ``describe(i)`` (``i`` indexes the given updates: where it came from and
        its row) when given. Returns the number of violations."""
        k = _binary(keys)
        n = len(k)
        if n == 0:
            return 0
        t = as_times(times, n)
        d = as_diffs(diffs, n)
        if self.adopted is not None and self.adopted.time is not None:
            keep = t >= np.uint64(self.adopted.time)
            if not keep.all():
                # Below the adopted baseline: the shard's contents there are the desired ones.
                idx = np.flatnonzero(keep)
                self.dropped_below_baseline += n - len(idx)
                k, t, d = k.take(pa.array(idx, type=pa.int64())), t[idx], d[idx]
                n = len(k)
                if n == 0:
                    return 0
        self.absorbed_desired += n
        f = self.desired_frontier
        if f.time is None:
            bad = np.ones(n, dtype=bool)
        else:
            bad = t < np.uint64(f.time)
        if not bad.any():
            self.correction.insert(k, t, d)
            return 0
        good = np.flatnonzero(~bad)
        if len(good):
            self.correction.insert(k.take(pa.array(good)), t[good], d[good])
        bad_idx = np.flatnonzero(bad)
        fmsg = "{}" if f.is_empty() else f"{{{f.time}}}"
        messages = [
            error_key(
                self.partition,
                f"expected an update at a time beyond the partition's progress {fmsg}, "
                f"found one at time {int(t[i])}" + (f" ({describe(i)})" if describe is not None else ""),
            )
            for i in bad_idx.tolist()
        ]
        self.errors.insert([m.encode() for m in messages], t[bad_idx], 1)
        self.contract_violations += len(bad_idx)
        return len(bad_idx)

    def absorb_desired_error(self, message: str, time: int, diff: int = 1) -> None:
        """A desired message that could not be decoded (or does not match the schema): an
        error row at its time, so a reader sees an error rather than missing data."""
        self.errors.insert([error_key(self.partition, message).encode()], [time], [diff])
        self.decode_errors += 1

    # -- persist read-back ------------------------------------------------------------------
    def begin_persist_snapshot(self, upper: FrontierLike) -> None:
        """The shard's snapshot (contents below ``upper``) is about to be absorbed. Buffered
        times advance to ``upper`` now so the snapshot cancels desired updates as it arrives,
        but nothing is written until :meth:`end_persist_snapshot`."""
        if self._snapshot_done or self._snapshot_upper is not None:
            raise SinkProtocolError(
                "expected one shard snapshot per writer, found a second one",
                partition=self.partition,
            )
        u = as_frontier(upper)
        self._snapshot_upper = u
        self.correction.advance_since(u)
        self.errors.advance_since(u)

    def absorb_persist_snapshot_part(
        self,
        keys: Keys,
        times: TimesLike,
        diffs: npt.ArrayLike = 1,
        *,
        error_keys: Keys = (),
        error_times: TimesLike = (),
        error_diffs: npt.ArrayLike = (),
    ) -> None:
        """Part of the shard's snapshot (rows of this partition), negated."""
        if self._snapshot_upper is None:
            raise SinkProtocolError(
                "expected begin_persist_snapshot before snapshot parts, found none",
                partition=self.partition,
            )
        self._insert_negated(keys, times, diffs, error_keys, error_times, error_diffs)

    def end_persist_snapshot(self) -> None:
        if self._snapshot_upper is None:
            raise SinkProtocolError(
                "expected begin_persist_snapshot before end_persist_snapshot, found none",
                partition=self.partition,
            )
        upper, self._snapshot_upper = self._snapshot_upper, None
        self._snapshot_done = True
        self.advance_persist_frontier(upper)

    def absorb_persist_snapshot(
        self,
        upper: FrontierLike,
        keys: Keys,
        times: TimesLike,
        diffs: npt.ArrayLike = 1,
        **errors: Any,
    ) -> None:
        """The whole snapshot at once (begin, one part, end)."""
        self.begin_persist_snapshot(upper)
        self.absorb_persist_snapshot_part(keys, times, diffs, **errors)
        self.end_persist_snapshot()

    def absorb_persist_batch(
        self,
        lower: FrontierLike,
        upper: FrontierLike,
        keys: Keys = (),
        times: TimesLike = (),
        diffs: npt.ArrayLike = (),
        *,
        error_keys: Keys = (),
        error_times: TimesLike = (),
        error_diffs: npt.ArrayLike = (),
    ) -> bool:
        """An appended batch ``[lower, upper)`` read back from the shard (rows of this
        partition), negated; the persist frontier moves to ``upper``.

        Idempotent: a batch at or below the persist frontier was absorbed already (a
        re-delivery) and is ignored (returns False). A batch that starts beyond the persist
        frontier would leave a gap: :class:`SinkProtocolError`."""
        lo, up = as_frontier(lower), as_frontier(upper)
        if self._snapshot_upper is not None:
            raise SinkProtocolError(
                "expected the snapshot to end before read-back batches, found a batch",
                partition=self.partition,
            )
        if up.less_equal(self.persist_frontier):
            return False
        if lo != self.persist_frontier:
            raise SinkProtocolError(
                f"expected a read-back batch starting at the persist frontier "
                f"{self.persist_frontier}, found one at [{lo}, {up})",
                partition=self.partition,
                expected=self.persist_frontier,
                actual=lo,
            )
        self._insert_negated(keys, times, diffs, error_keys, error_times, error_diffs)
        self.advance_persist_frontier(up)
        return True

    def _insert_negated(
        self,
        keys: Keys,
        times: TimesLike,
        diffs: npt.ArrayLike,
        error_keys: Keys,
        error_times: TimesLike,
        error_diffs: npt.ArrayLike,
    ) -> None:
        k = _binary(keys)
        if len(k):
            self.correction.insert_negated(k, times, _diffs(diffs, len(k)))
            self.absorbed_persist += len(k)
        ek = _binary(error_keys)
        if len(ek):
            self.errors.insert_negated(ek, error_times, _diffs(error_diffs, len(ek)))

    def advance_persist_frontier(self, frontier: FrontierLike) -> None:
        """The shard's contents below ``frontier`` have all been absorbed. Buffered times
        advance to it; a held description whose lower is now below it is outdated."""
        f = as_frontier(frontier)
        if not self.persist_frontier.less_than(f):
            return
        self.persist_frontier = f
        self.correction.advance_since(f)
        self.errors.advance_since(f)
        for sid, (upper, _u, _e) in list(self._staged.items()):
            if upper.less_equal(f):
                self._forget_staged(sid)  # appended (and read back) or superseded
        d = self.description
        if d is not None and d.lower.less_than(f):
            self.description = None
            self._mark_handled(d)

    # -- history (retention safety) ---------------------------------------------------------
    def adopt_baseline(self, upper: FrontierLike) -> None:
        """Take the shard's contents below ``upper`` as the desired collection there (the
        operator's ``--adopt-shard``), instead of absorbing the shard's snapshot: nothing of
        the shard is negated, and desired updates at times below ``upper`` are dropped as
        already reflected. Corrections apply from ``upper`` on."""
        u = as_frontier(upper)
        self.begin_persist_snapshot(u)
        self.end_persist_snapshot()
        self.adopted = u

    def absorb_history_gap(self, lost_from: int, lost_to: int) -> None:
        """Offsets ``[lost_from, lost_to)`` of this partition's desired input are no longer
        available (retention), and no checkpoint covers them.

        Harmless only when the buffer has absorbed nothing yet, neither desired updates nor
        rows of the shard (a sink on an empty collection, or one whose baseline was adopted):
        then nothing the lost input held can be in the shard for this partition. Otherwise
        the partition cannot prove it saw the history behind the shard, and refuses to write
        (:class:`Refuse`) from now on."""
        if self.absorbed_desired == 0 and self.absorbed_persist == 0:
            return
        if self.unproven is None:
            self.unproven = (
                f"expected the desired input of partition {self.partition} to be complete since "
                f"the last checkpoint, found offsets [{lost_from}, {lost_to}) no longer "
                "available (topic retention): refusing to write, since a retraction might "
                "delete rows whose inserts aged out"
            )

    # -- own staged batches -----------------------------------------------------------------
    def remember_staged(
        self, desc: BatchDescription, part_keys: list[str], stage: Stage
    ) -> None:
        """This partition staged ``stage`` for ``desc`` as the objects ``part_keys``: when
        they come back appended, :meth:`take_staged` gives their rows without a read."""
        if not part_keys:
            return
        sid = part_keys[0]
        self._staged[sid] = (desc.upper, stage.updates, stage.errors)
        for k in part_keys:
            self._staged_parts[k] = sid

    def staged(self, part_key: str) -> bool:
        """Whether this partition staged the object ``part_key`` (and has not read it back)."""
        return part_key in self._staged_parts

    def take_staged(
        self, part_key: str
    ) -> tuple[ConsolidatedUpdates, ConsolidatedUpdates] | None:
        """The rows of an object this partition staged (once per staged batch: the batch's
        other objects then return empty updates), or None for an object it did not stage."""
        sid = self._staged_parts.get(part_key)
        if sid is None:
            return None
        upper, updates, errors = self._staged[sid]
        empty = ConsolidatedUpdates.empty()
        self._staged[sid] = (upper, empty, empty)  # its other objects: nothing more
        return updates, errors

    def _forget_staged(self, sid: str) -> None:
        self._staged.pop(sid, None)
        for k in [k for k, v in self._staged_parts.items() if v == sid]:
            del self._staged_parts[k]

    # -- row schema ---------------------------------------------------------------------------
    def rekey(self, key_schema: bytes, convert: Callable[[pa.Array], pa.Array]) -> int:
        """The collection's row schema changed: every buffered row key (the correction buffer
        and this partition's own staged batches) becomes ``convert(keys)``, the same rows'
        canonical keys under the new schema (fingerprint ``key_schema``), and is consolidated
        again, so that rows that now mean the same value meet (the new keys are what the
        shard's parts, read back as the new schema, and desired updates of any version give).
        Nothing is written because of it: only the keys' encoding changes. Error keys (texts)
        stay. Returns the number of keys converted."""
        n = self.correction.map_keys(convert)
        for sid, (upper, u, e) in list(self._staged.items()):
            if len(u):
                converted = convert(u.keys)
                if converted is not u.keys:
                    n += len(u)
                    u = sort_consolidate(converted, u.times, u.diffs)
            self._staged[sid] = (upper, u, e)
        self.key_schema = key_schema
        return n

    # -- checkpoint -------------------------------------------------------------------------
    def to_checkpoint(self) -> bytes:
        """The whole state as bytes (Arrow IPC: the buffers and staged batches as rows, the
        frontiers and counters as schema metadata); :meth:`from_checkpoint` inverts it. Which
        buffer a row belongs to (``which``) is a dictionary column: a staged batch's name is a
        data object's key, as long as a row's key, and written once, not per row."""
        import json

        names: list[str] = []
        parts: list[ConsolidatedUpdates] = []

        def add(which: str, u: ConsolidatedUpdates) -> None:
            if len(u):
                names.append(which)
                parts.append(u)

        add("c", self.correction.contents())
        add("e", self.errors.contents())
        staged_meta = {}
        for sid, (upper, u, e) in self._staged.items():
            staged_meta[sid] = {
                "upper": upper.to_json(),
                "parts": sorted(k for k, v in self._staged_parts.items() if v == sid),
            }
            add("su:" + sid, u)
            add("se:" + sid, e)
        meta = {
            "v": 1,
            "sink_id": self.sink_id,
            "partition": self.partition,
            "partition_count": self.partition_count,
            "desired_frontier": self.desired_frontier.to_json(),
            "persist_frontier": self.persist_frontier.to_json(),
            "correction_since": self.correction.since,
            "errors_since": self.errors.since,
            "description": None if self.description is None else self.description.to_dict(),
            "handled": None if self._handled is None else list(self._handled),
            "snapshot_done": self._snapshot_done,
            "counters": [
                self.contract_violations, self.decode_errors, self.written,
                self.absorbed_desired, self.absorbed_persist, self.dropped_below_baseline,
            ],
            "adopted": None if self.adopted is None else self.adopted.to_json(),
            "unproven": self.unproven,
            "staged": staged_meta,
            "key_schema": None if self.key_schema is None else self.key_schema.hex(),
        }
        which_type = pa.dictionary(pa.int32(), pa.string())
        schema = pa.schema(
            [("which", which_type), ("key", pa.binary()), ("time", pa.uint64()), ("diff", pa.int64())],
            metadata={b"shardsink.write_state": json.dumps(meta).encode()},
        )
        if parts:
            lengths = np.array([len(u) for u in parts], dtype=np.int64)
            which = pa.DictionaryArray.from_arrays(
                pa.array(np.repeat(np.arange(len(parts), dtype=np.int32), lengths)), pa.array(names, pa.string()))
            table = pa.Table.from_arrays(
                [
                    which,
                    pa.chunked_array([u.keys if u.keys.type == pa.binary() else u.keys.cast(pa.binary()) for u in parts],
                                    pa.binary()),
                    pa.array(np.concatenate([np.asarray(u.times, dtype=np.uint64) for u in parts])),
                    pa.array(np.concatenate([np.asarray(u.diffs, dtype=np.int64) for u in parts])),
                ],
                schema=schema,
            )
        else:
            table = schema.empty_table()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return bytes(sink.getvalue().to_pybytes())

    @staticmethod
    def from_checkpoint(data: bytes) -> WriteState:
        import json

        import pyarrow.compute as pc

        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
        raw = (table.schema.metadata or {}).get(b"shardsink.write_state")
        if raw is None:
            raise SinkProtocolError("expected a write state checkpoint, found no metadata")
        meta = json.loads(raw)
        if meta.get("v") != 1:
            raise SinkProtocolError(f"expected write state version 1, found {meta.get('v')!r}")
        ws = WriteState(str(meta["sink_id"]), int(meta["partition"]), int(meta["partition_count"]))
        which = table["which"]
        # The parts are written one after the other (``to_checkpoint``): each is a slice,
        # found from the dictionary's indices. A table in another order or of the earlier
        # format (``which`` a string per row) is filtered.
        spans: dict[str, tuple[int, int]] | None = None
        if pa.types.is_dictionary(which.type):
            arr = which.combine_chunks()  # a batch per buffer; their dictionaries unified
            idx, names = arr.indices.to_numpy(zero_copy_only=False), arr.dictionary.to_pylist()
            if len(set(names)) == len(names) and bool(np.all(idx[1:] >= idx[:-1])):
                codes = np.arange(len(names))
                lo, hi = np.searchsorted(idx, codes, "left"), np.searchsorted(idx, codes, "right")
                spans = {n: (int(a), int(b)) for n, a, b in zip(names, lo, hi, strict=True)}

        def part(name: str) -> ConsolidatedUpdates:
            if spans is not None:
                a, b = spans.get(name, (0, 0))
                t = table.slice(a, b - a)
            else:
                t = table.filter(pc.equal(which, name))
            if t.num_rows == 0:
                return ConsolidatedUpdates.empty()
            return ConsolidatedUpdates(
                t["key"].combine_chunks(),
                t["time"].to_numpy().astype(np.uint64),
                t["diff"].to_numpy().astype(np.int64),
            )

        ws.correction.restore(part("c"), int(meta["correction_since"]))
        ws.errors.restore(part("e"), int(meta["errors_since"]))
        ws.desired_frontier = Frontier.from_json(meta["desired_frontier"])
        ws.persist_frontier = Frontier.from_json(meta["persist_frontier"])
        d = meta.get("description")
        ws.description = None if d is None else BatchDescription.from_dict(d)
        h = meta.get("handled")
        ws._handled = None if h is None else (int(h[0]), int(h[1]))
        ws._snapshot_done = bool(meta["snapshot_done"])
        (
            ws.contract_violations, ws.decode_errors, ws.written,
            ws.absorbed_desired, ws.absorbed_persist, ws.dropped_below_baseline,
        ) = (int(x) for x in meta["counters"])
        a = meta.get("adopted")
        ws.adopted = None if a is None else Frontier.from_json(a)
        ws.unproven = meta.get("unproven")
        ks = meta.get("key_schema")
        ws.key_schema = None if ks is None else bytes.fromhex(ks)
        for sid, sm in meta.get("staged", {}).items():
            ws._staged[sid] = (Frontier.from_json(sm["upper"]), part("su:" + sid), part("se:" + sid))
            for k in sm["parts"]:
                ws._staged_parts[k] = sid
        return ws

    # -- descriptions -----------------------------------------------------------------------
    def absorb_description(self, desc: BatchDescription) -> bool:
        """Hold ``desc`` if it is newer than everything held or handled and not outdated.
        Returns whether it is now held."""
        if desc.sink_id != self.sink_id:
            return False
        if desc.partition_count != self.partition_count:
            raise SinkProtocolError(
                f"expected descriptions for {self.partition_count} partitions, found one for "
                f"{desc.partition_count}",
                partition=self.partition,
                expected=self.partition_count,
                actual=desc.partition_count,
            )
        key = desc.order_key()
        if self._handled is not None and key <= self._handled:
            return False  # written or skipped already (a re-delivery), or older still
        held = self.description
        if held is not None and key <= held.order_key():
            return False
        if desc.lower.less_than(self.persist_frontier):
            self._mark_handled(desc)
            return False  # outdated: the shard moved past its lower
        self.description = desc
        return True

    def maybe_write(self, desc: BatchDescription | None = None) -> WriteDecision:
        """Decide what to do with the held description (absorbing ``desc`` first if given).

        Writes only when ``lower == persist frontier`` (every shard update before lower has
        been negated) and ``upper <= desired frontier`` (every desired update before upper
        has been inserted); then the description is consumed: it is written once."""
        if desc is not None:
            self.absorb_description(desc)
            held = self.description
            if held is None or held.token != desc.token:
                if desc.lower.less_than(self.persist_frontier):
                    return Skip(
                        desc, f"lower {desc.lower} < persist frontier {self.persist_frontier}"
                    )
        d = self.description
        if d is None:
            return Idle()
        if d.lower.less_than(self.persist_frontier):
            self.description = None
            self._mark_handled(d)
            return Skip(d, f"lower {d.lower} < persist frontier {self.persist_frontier}")
        if self._snapshot_upper is not None or not self._snapshot_done:
            return Wait(d, "the shard snapshot has not been absorbed")
        if self.unproven is not None:
            return Refuse(d, self.unproven)
        if self.persist_frontier.less_than(d.lower):
            return Wait(d, f"persist frontier {self.persist_frontier} < lower {d.lower}")
        if not d.upper.less_equal(self.desired_frontier):
            return Wait(d, f"desired frontier {self.desired_frontier} < upper {d.upper}")
        updates = self.correction.updates_before(d.upper)
        errors = self.errors.updates_before(d.upper)
        self.description = None
        self._mark_handled(d)
        self.written += 1
        if updates.is_empty() and errors.is_empty():
            return NothingToWrite(d, self.partition)
        return Stage(d, self.partition, updates, errors)

    def _mark_handled(self, desc: BatchDescription) -> None:
        key = desc.order_key()
        if self._handled is None or key > self._handled:
            self._handled = key


def _binary(keys: Keys) -> pa.Array:
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if isinstance(keys, pa.Array):
        return keys if pa.types.is_binary(keys.type) else keys.cast(pa.binary())
    return pa.array(list(keys), type=pa.binary())


def _diffs(diffs: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(np.broadcast_to(np.asarray(diffs, dtype=np.int64), (n,)))
