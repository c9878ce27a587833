"""The sink's pure core: the mint, write and append state machines.

The sink runs as three services joined by Kafka topics (``descs``, ``batches``,
``frontiers``). Timely gave the seeds two things for free that Kafka does not: ordering
between operators (a batch's data before the trigger that lets it be appended) and
completeness (the ``batches`` frontier says every worker has written). Here both are explicit
in the messages:

* a **description** (:class:`BatchDescription`) carries an identity: the minter's ``epoch``
  (a restarted minter takes a larger one) and a unique ``token``. Supersession is ordered by
  ``(lower, epoch)``: a greater lower always wins; at the same lower, the greater epoch wins;
* a **report** (:class:`BatchReport`) is sent by EVERY writer partition for every
  description it writes, including "nothing to write", and names the description by token;
* the appender appends a description only once it holds a report from each of the
  description's ``partition_count`` partitions, all carrying its token: batches written for
  another description (an old epoch's, with the same lower) are never appended under it.

These classes do no I/O. Each method absorbs one input and returns the decisions the
service's adapter must carry out (stage a batch, compare-and-append, delete staged parts,
publish an upper). The storage layer (``shared.shard``) is never imported: staged-batch
handles are opaque values here.

Invariants (from the seeds, kept by the classes below and tested in
``tests/test_sink_state.py``):

1. lowers minted by one :class:`MintState` are unique and strictly increasing; uppers are
   monotone; nothing is minted while read-only;
2. a writer writes a description only when it has read the shard's contents through exactly
   ``lower`` (``lower == persist frontier``) and the desired input through ``upper``; it
   writes each description at most once and skips outdated ones (``lower < persist
   frontier``); it never appends;
3. an appender holds at most one description (the greatest by ``(lower, epoch)``) and
   appends it only when complete; reports of other descriptions it owns are deleted, never
   appended; handles of a committed append are never deleted;
4. on an upper mismatch the appender adopts the shard's upper as its new lower (the
   self-correcting loop fixes the contents later); when the shard's upper is below a
   description's lower (a sink whose ``as_of`` is beyond the shard's upper) it asks for the
   upper to be bumped to that lower, the only write that is not a batch, and only ever for a
   description, so never in read-only mode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
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
from shared.desired import DesiredFrontierTracker, row_partition
from shared.errors import InvalidUsageError, SinkProtocolError
from shared.frontier import Frontier

FrontierLike = Union[Frontier, int, None]


def as_frontier(v: FrontierLike) -> Frontier:
    """An int is ``{t}``, None is the empty frontier."""
    if isinstance(v, Frontier):
        return v
    if v is None:
        return Frontier.empty()
    return Frontier.at(v)


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


# -- messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchDescription:
    """Write the updates in ``[lower, upper)`` and append them as one batch.

    Identity: ``token`` (unique), ordered by ``(lower, epoch)``. Field names follow
    ``schemas/batch_description.avsc``.
    """

    sink_id: str
    lower: Frontier
    upper: Frontier
    epoch: int
    token: str
    append_worker: int = 0
    partition_count: int = 1
    minted_at_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", as_frontier(self.lower))
        object.__setattr__(self, "upper", as_frontier(self.upper))
        if not self.sink_id:
            raise InvalidUsageError("expected a non-empty sink_id, found ''")
        if self.lower.is_empty():
            raise InvalidUsageError(f"expected a non-empty lower, found {self.lower}")
        if not self.lower.less_than(self.upper):
            raise InvalidUsageError(
                f"expected lower < upper in a batch description, found {self.lower} and "
                f"{self.upper}"
            )
        if self.epoch < 0 or self.append_worker < 0 or self.partition_count < 1:
            raise InvalidUsageError(
                "expected epoch >= 0, append_worker >= 0 and partition_count >= 1, found "
                f"{self.epoch}, {self.append_worker}, {self.partition_count}"
            )
        if not self.token:
            raise InvalidUsageError("expected a non-empty token, found ''")

    @property
    def lower_time(self) -> int:
        assert self.lower.time is not None
        return self.lower.time

    def order_key(self) -> tuple[int, int]:
        """Supersession order: a greater lower wins, then a greater epoch."""
        return (self.lower_time, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "epoch": self.epoch,
            "token": self.token,
            "append_worker": self.append_worker,
            "partition_count": self.partition_count,
            "minted_at_ms": self.minted_at_ms,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BatchDescription:
        try:
            return BatchDescription(
                sink_id=str(d["sink_id"]),
                lower=Frontier.from_json(d["lower"]),
                upper=Frontier.from_json(d["upper"]),
                epoch=int(d["epoch"]),
                token=str(d["token"]),
                append_worker=int(d.get("append_worker", 0)),
                partition_count=int(d.get("partition_count", 1)),
                minted_at_ms=int(d.get("minted_at_ms", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsageError(f"expected a batch description, found {d!r}: {e}") from e


@dataclass(frozen=True, slots=True)
class BatchReport:
    """Writer ``partition`` has written (staged, not appended) its part of a description.

    ``staged`` is the storage layer's handle of the staged data objects, or None when the
    partition had nothing to write. Field names follow ``schemas/written_batch.avsc``; the
    handle must compare equal to itself after a round trip (a re-delivered report is
    recognised by it).
    """

    sink_id: str
    desc_token: str
    epoch: int
    lower: Frontier
    upper: Frontier
    partition: int
    partition_count: int
    staged: Any = None
    rows: int = 0
    written_at_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", as_frontier(self.lower))
        object.__setattr__(self, "upper", as_frontier(self.upper))
        if not 0 <= self.partition < self.partition_count:
            raise InvalidUsageError(
                f"expected 0 <= partition < {self.partition_count}, found {self.partition}"
            )
        if self.lower.is_empty():
            raise InvalidUsageError(f"expected a non-empty lower, found {self.lower}")

    @staticmethod
    def for_description(
        desc: BatchDescription, partition: int, staged: Any = None, rows: int = 0, now_ms: int = 0
    ) -> BatchReport:
        return BatchReport(
            sink_id=desc.sink_id,
            desc_token=desc.token,
            epoch=desc.epoch,
            lower=desc.lower,
            upper=desc.upper,
            partition=partition,
            partition_count=desc.partition_count,
            staged=staged,
            rows=rows,
            written_at_ms=now_ms,
        )

    @property
    def empty(self) -> bool:
        return self.staged is None

    @property
    def lower_time(self) -> int:
        assert self.lower.time is not None
        return self.lower.time

    def order_key(self) -> tuple[int, int]:
        return (self.lower_time, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        """As ``schemas/written_batch.avsc`` names it (``staged`` is passed through as is)."""
        return {
            "sink_id": self.sink_id,
            "desc_token": self.desc_token,
            "epoch": self.epoch,
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "writer_partition": self.partition,
            "partition_count": self.partition_count,
            "staged_batch": self.staged,
            "rows": self.rows,
            "empty": self.staged is None,
            "written_at_ms": self.written_at_ms,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BatchReport:
        try:
            return BatchReport(
                sink_id=str(d["sink_id"]),
                desc_token=str(d["desc_token"]),
                epoch=int(d["epoch"]),
                lower=Frontier.from_json(d["lower"]),
                upper=Frontier.from_json(d["upper"]),
                partition=int(d["writer_partition"]),
                partition_count=int(d["partition_count"]),
                staged=d.get("staged_batch"),
                rows=int(d.get("rows", 0)),
                written_at_ms=int(d.get("written_at_ms", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsageError(f"expected a written-batch report, found {d!r}: {e}") from e


# -- mint -----------------------------------------------------------------------------------


class MintState:
    """The minter of one sink (one active instance per sink and replica).

    Inputs: the desired topic's progress (per partition), the shard's upper (read from the
    shard itself, or from ``frontiers``), and the read-only flag. Output: descriptions.

    Invariants: lowers are unique and strictly increasing (a description is minted only when
    the persist frontier moved beyond the last lower); uppers never regress (the desired
    frontier never does); nothing is minted while read-only. The persist frontier starts at
    ``as_of``, so the first lower is at least ``as_of``: no work is spent on earlier times.
    """

    def __init__(
        self,
        sink_id: str,
        epoch: int,
        partition_count: int,
        *,
        as_of: int = 0,
        read_only: bool = False,
        append_workers: int = 1,
        nonce: str = "",
    ) -> None:
        if append_workers < 1:
            raise InvalidUsageError(f"expected append_workers >= 1, found {append_workers}")
        if epoch < 0:
            raise InvalidUsageError(f"expected an epoch >= 0, found {epoch}")
        self.sink_id = sink_id
        self.epoch = epoch
        self.append_workers = append_workers
        self.nonce = nonce
        self.desired = DesiredFrontierTracker(partition_count)
        self.persist_frontier = Frontier.at(as_of)
        self.last_lower: Frontier | None = None
        self.read_only = read_only
        self.next_append_worker = 0
        self.minted = 0

    @property
    def desired_frontier(self) -> Frontier:
        return self.desired.frontier()

    def absorb_desired_progress(self, partition: int, frontier: FrontierLike) -> None:
        """A progress statement of one desired partition (regressions are ignored)."""
        self.desired.observe_progress(partition, as_frontier(frontier))

    def absorb_partition_count(self, partitions: int) -> None:
        """The desired topic has (at least) this many partitions now."""
        self.desired.grow(partitions)

    def absorb_shard_upper(self, upper: FrontierLike) -> None:
        """The shard's upper, as read from the shard (only its advances matter)."""
        self.persist_frontier = self.persist_frontier.join(as_frontier(upper))

    def allow_writes(self) -> None:
        """Leave read-only mode (one way)."""
        self.read_only = False

    def checkpoint(self) -> dict[str, Any]:
        """What a restarted minter must not re-read from the desired topic: every partition's
        latest progress. The epoch, the last lower and the read-only flag are not kept: a
        restart takes a new epoch (its first description supersedes any in flight) and reads
        the flag from the catalog."""
        return {"v": 1, "progress": self.desired.to_json()}

    def restore(self, data: dict[str, Any]) -> None:
        """Take the progress of :meth:`checkpoint` (a partition count that grew since is kept)."""
        if not isinstance(data, dict) or data.get("v") != 1:
            raise InvalidUsageError(f"expected a mint checkpoint of version 1, found {data!r}")
        restored = DesiredFrontierTracker.from_json(data["progress"])
        restored.grow(self.desired.partitions)
        self.desired = restored

    def persist_advanced(self) -> bool:
        """Whether the persist frontier moved since the last description (or none was minted):
        until it does, no description can be minted, whatever the desired frontier."""
        return self.last_lower is None or self.last_lower.less_than(self.persist_frontier)

    def maybe_mint(self, now_ms: int = 0) -> BatchDescription | None:
        """Mint ``[persist frontier, desired frontier)`` when writes are allowed, the desired
        frontier is ahead of the persist frontier, and the persist frontier advanced since
        the last description."""
        desired = self.desired.frontier()
        persist = self.persist_frontier
        desired_ahead = persist.less_than(desired)
        if self.read_only or not desired_ahead or not self.persist_advanced():
            return None
        assert persist.time is not None
        token = f"{self.sink_id}:{self.epoch}:{persist.time}"
        if self.nonce:
            token += f":{self.nonce}"
        desc = BatchDescription(
            sink_id=self.sink_id,
            lower=persist,
            upper=desired,
            epoch=self.epoch,
            token=token,
            append_worker=self.next_append_worker,
            partition_count=self.desired.partitions,
            minted_at_ms=now_ms,
        )
        self.next_append_worker = (self.next_append_worker + 1) % self.append_workers
        self.last_lower = persist
        self.minted += 1
        return desc


# -- write ----------------------------------------------------------------------------------


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

        def part(name: str) -> ConsolidatedUpdates:
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


# -- append ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnsureUpperAtLeast:
    """Bump the shard's upper to ``lower`` if it is below (an empty compare-and-append from
    the current upper, retried while the upper stays below), then call
    :meth:`AppendState.absorb_shard_upper` with the upper found."""

    desc: BatchDescription
    lower: Frontier


@dataclass(frozen=True, slots=True)
class ReadyToAppend:
    """``compare_and_append`` all ``staged`` handles as one batch ``[lower, upper)`` with
    idempotency token ``desc.token``; then call :meth:`AppendState.on_append_result`."""

    desc: BatchDescription
    staged: tuple[Any, ...]
    reports: tuple[BatchReport, ...]


@dataclass(frozen=True, slots=True)
class DeleteStaged:
    """Delete staged handles that will never be appended under this appender. The storage
    call must refuse to delete parts a committed batch references (after an appender restart
    a re-delivered report may belong to a description appended before the crash)."""

    staged: tuple[Any, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class PublishUpper:
    """Publish the shard's new upper on ``frontiers`` (each advance once)."""

    sink_id: str
    upper: Frontier
    desc_token: str | None = None


AppendAction = Union[EnsureUpperAtLeast, ReadyToAppend, DeleteStaged, PublishUpper]


@dataclass(frozen=True, slots=True)
class Committed:
    """compare_and_append succeeded (or recognised the token as already committed)."""

    upper: Frontier


@dataclass(frozen=True, slots=True)
class UpperMismatch:
    """compare_and_append failed: the shard's upper is ``current``, not the lower."""

    current: Frontier


AppendOutcome = Union[Committed, UpperMismatch]


@dataclass(slots=True)
class _AtLower:
    """What the appender knows of the descriptions at its current lower."""

    desc: BatchDescription | None = None  # the winning description at lower, any owner
    reports: dict[int, BatchReport] = field(default_factory=dict)  # for desc, if mine


class AppendState:
    """Appender ``worker`` of one sink: collects reports and appends complete descriptions.

    ``lower`` is the greatest lower seen (from descriptions and the shard's upper); only the
    winning description at ``lower`` (greatest epoch) can be appended, and only by its
    ``append_worker``. Reports whose description has not arrived yet are kept aside until it
    does (Kafka gives no order across the ``descs`` and ``batches`` topics).

    Calls must not interleave with an append in flight: after :class:`ReadyToAppend`, call
    :meth:`on_append_result` before absorbing anything else.
    """

    def __init__(self, sink_id: str, worker: int = 0, *, remember: int = 4096) -> None:
        self.sink_id = sink_id
        self.worker = worker
        self.lower = Frontier.minimum()
        self._at = _AtLower()
        # Reports for descriptions not seen yet, by token.
        self._pending: dict[str, dict[int, BatchReport]] = {}
        self._pending_extras: dict[str, list[Any]] = {}
        # Descriptions seen, by token -> (order key, mine?), bounded.
        self._seen: OrderedDict[str, tuple[tuple[int, int], bool]] = OrderedDict()
        # Appended descriptions, by token -> the staged handles the append committed (a later
        # report of the same description carries other handles: those are deleted).
        self._appended: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
        self._remember = remember
        self.known_upper: Frontier | None = None
        self.published: Frontier | None = None
        self.in_flight: BatchDescription | None = None
        self.appends = 0
        self.mismatches = 0

    # -- inputs -----------------------------------------------------------------------------
    def absorb_description(self, desc: BatchDescription) -> list[AppendAction]:
        """A description from ``descs``."""
        self._check_not_in_flight()
        if desc.sink_id != self.sink_id:
            return []
        mine = desc.append_worker == self.worker
        known = self._seen.get(desc.token)
        if known is not None and known[0] != desc.order_key():
            raise SinkProtocolError(
                f"expected token {desc.token!r} to name one description, found two",
                token=desc.token,
            )
        self._remember_desc(desc.token, desc.order_key(), mine)
        actions: list[AppendAction] = []
        if desc.lower.less_than(self.lower):
            return self._reject_pending(desc.token, mine, "outdated description")
        if self.lower.less_than(desc.lower):
            actions += self._advance_lower(desc.lower, "a description with a greater lower")
        current = self._at.desc
        if current is not None:
            if current.token == desc.token:
                return actions + self._maybe_append()  # a re-delivery
            if current.epoch == desc.epoch:
                raise SinkProtocolError(
                    f"expected one description per lower and epoch, found {current.token!r} "
                    f"and {desc.token!r}",
                    lower=desc.lower,
                    epoch=desc.epoch,
                )
            if desc.epoch < current.epoch:
                return actions + self._reject_pending(desc.token, mine, "superseded by epoch")
            # A restarted minter's description with the same lower: it supersedes.
            actions += self._drop_current("superseded by a newer epoch")
        self._at = _AtLower(desc=desc)
        pending = self._pending.pop(desc.token, {})
        extras = self._pending_extras.pop(desc.token, [])
        if not mine:
            return actions
        for report in sorted(pending.values(), key=lambda r: r.partition):
            actions += self._record(report)
        actions += _delete(extras, "duplicate report for a partition")
        if self.known_upper is None or self.known_upper.less_than(desc.lower):
            # Appending waits for the adapter's answer (absorb_shard_upper).
            return actions + [EnsureUpperAtLeast(desc, desc.lower)]
        return actions + self._maybe_append()

    def absorb_report(self, report: BatchReport) -> list[AppendAction]:
        """A written-batch report from ``batches``."""
        self._check_not_in_flight()
        if report.sink_id != self.sink_id:
            return []
        known = self._seen.get(report.desc_token)
        if report.lower.less_than(self.lower):
            return self._reject(report, known, "report for an outdated lower")
        current = self._at.desc
        if current is not None and current.token == report.desc_token:
            if current.append_worker != self.worker:
                return []
            return self._record(report) + self._maybe_append()
        if known is not None:
            # Its description was seen and lost (superseded at this lower).
            return self._reject(report, known, "report for a superseded description")
        self._pending.setdefault(report.desc_token, {})
        return self._add_pending(report)

    def absorb_shard_upper(self, upper: FrontierLike) -> list[AppendAction]:
        """The shard's upper as observed (after a bump, from ``frontiers``, from a read).
        An upper beyond ``lower`` makes the held description unappendable: adopt it."""
        self._check_not_in_flight()
        u = as_frontier(upper)
        actions = self._learn_upper(u, None)
        if self.lower.less_than(u):
            actions += self._advance_lower(u, "the shard's upper moved past the lower")
        return actions + self._maybe_append()

    def maybe_append(self) -> list[AppendAction]:
        self._check_not_in_flight()
        return self._maybe_append()

    def on_append_result(
        self, desc: BatchDescription, outcome: AppendOutcome
    ) -> list[AppendAction]:
        """The outcome of the compare-and-append of :class:`ReadyToAppend`."""
        if self.in_flight is None or self.in_flight.token != desc.token:
            raise SinkProtocolError(
                f"expected the result of the append in flight, found one for {desc.token!r}",
                token=desc.token,
            )
        self.in_flight = None
        if isinstance(outcome, Committed):
            self.appends += 1
            self._appended[desc.token] = tuple(
                r.staged for r in self._at.reports.values() if r.staged is not None
            )
            while len(self._appended) > self._remember:
                self._appended.popitem(last=False)
            # The handles now belong to the shard: forget them, never delete them.
            self._at = _AtLower()
            actions = self._learn_upper(outcome.upper, desc.token)
            if self.lower.less_than(outcome.upper):
                actions += self._advance_lower(outcome.upper, "appended")
            return actions
        self.mismatches += 1
        current = outcome.current
        if current.less_than(desc.lower):
            # The seeds' rule: bring the upper to the first lower, then try again.
            return [EnsureUpperAtLeast(desc, desc.lower)]
        # Another writer got there first: adopt its upper; the loop corrects contents later.
        actions = self._learn_upper(current, None)
        if self.lower.less_than(current):
            actions += self._advance_lower(current, "upper mismatch")
        else:
            actions += self._drop_current("upper mismatch")
        return actions

    # -- checkpoint -------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """Everything a restarted appender needs instead of re-reading ``descs`` and
        ``batches`` from their start (JSON-able; staged handles are passed through as is).
        Taken between appends only."""
        self._check_not_in_flight()

        def frontier(f: Frontier | None) -> Any:
            return None if f is None else {"t": f.to_json()}

        return {
            "v": 1,
            "sink_id": self.sink_id,
            "worker": self.worker,
            "lower": self.lower.to_json(),
            "at": {
                "desc": None if self._at.desc is None else self._at.desc.to_dict(),
                "reports": [r.to_dict() for r in self._at.reports.values()],
            },
            "pending": {t: [r.to_dict() for r in rs.values()] for t, rs in self._pending.items()},
            "pending_extras": {t: list(x) for t, x in self._pending_extras.items()},
            "seen": [[t, list(k), mine] for t, (k, mine) in self._seen.items()],
            "appended": [[t, list(h)] for t, h in self._appended.items()],
            "known_upper": frontier(self.known_upper),
            "published": frontier(self.published),
            "appends": self.appends,
            "mismatches": self.mismatches,
        }

    @staticmethod
    def restore(data: dict[str, Any], *, remember: int = 4096) -> AppendState:
        """The inverse of :meth:`checkpoint`."""
        if not isinstance(data, dict) or data.get("v") != 1:
            raise InvalidUsageError(f"expected an append checkpoint of version 1, found {data!r}")

        def frontier(v: Any) -> Frontier | None:
            return None if v is None else Frontier.from_json(v["t"])

        s = AppendState(str(data["sink_id"]), int(data["worker"]), remember=remember)
        s.lower = Frontier.from_json(data["lower"])
        at = data["at"]
        s._at = _AtLower(
            desc=None if at["desc"] is None else BatchDescription.from_dict(at["desc"]),
            reports={r.partition: r for r in map(BatchReport.from_dict, at["reports"])},
        )
        s._pending = {
            t: {r.partition: r for r in map(BatchReport.from_dict, rs)}
            for t, rs in data["pending"].items()
        }
        s._pending_extras = {t: list(x) for t, x in data["pending_extras"].items()}
        s._seen = OrderedDict((t, ((int(k[0]), int(k[1])), bool(mine))) for t, k, mine in data["seen"])
        s._appended = OrderedDict((t, tuple(h)) for t, h in data["appended"])
        s.known_upper = frontier(data["known_upper"])
        s.published = frontier(data["published"])
        s.appends = int(data["appends"])
        s.mismatches = int(data["mismatches"])
        return s

    # -- internals --------------------------------------------------------------------------
    def _maybe_append(self) -> list[AppendAction]:
        at = self._at
        d = at.desc
        if self.in_flight is not None or d is None or d.append_worker != self.worker:
            return []
        if len(at.reports) < d.partition_count:
            return []
        if self.known_upper is None or self.known_upper.less_than(d.lower):
            return []  # an EnsureUpperAtLeast is out: wait for absorb_shard_upper
        if d.lower.less_than(self.known_upper):
            return self._advance_lower(self.known_upper, "the shard's upper moved past")
        reports = tuple(at.reports[p] for p in range(d.partition_count))
        staged = tuple(r.staged for r in reports if r.staged is not None)
        self.in_flight = d
        return [ReadyToAppend(d, staged, reports)]

    def _record(self, report: BatchReport) -> list[AppendAction]:
        d = self._at.desc
        assert d is not None and d.token == report.desc_token
        if report.partition_count != d.partition_count or report.lower != d.lower:
            raise SinkProtocolError(
                f"expected a report matching description {d.token!r} ({d.partition_count} "
                f"partitions, lower {d.lower}), found {report.partition_count} partitions, "
                f"lower {report.lower}",
                token=d.token,
            )
        have = self._at.reports.get(report.partition)
        if have is None:
            self._at.reports[report.partition] = report
            return []
        if have.staged == report.staged:
            return []  # a re-delivery of the same report
        # A second write of the same partition (a restarted writer): keep the first.
        return _delete([report.staged], "duplicate report for a partition")

    def _add_pending(self, report: BatchReport) -> list[AppendAction]:
        slot = self._pending[report.desc_token]
        have = slot.get(report.partition)
        if have is None:
            slot[report.partition] = report
            return []
        if have.staged != report.staged and report.staged is not None:
            # A second write of one partition; the owner is unknown until the description
            # arrives: the extra is deleted then if the description is mine.
            self._pending_extras.setdefault(report.desc_token, []).append(report.staged)
        return []

    def _reject(
        self, report: BatchReport, known: tuple[tuple[int, int], bool] | None, reason: str
    ) -> list[AppendAction]:
        if known is None or not known[1]:
            return []  # not mine, or owner unknown: its appender (or GC) cleans it up
        return self._delete_unappended(report.desc_token, [report.staged], reason)

    def _reject_pending(self, token: str, mine: bool, reason: str) -> list[AppendAction]:
        pending = self._pending.pop(token, {})
        extras = self._pending_extras.pop(token, [])
        if not mine:
            return []
        return self._delete_unappended(token, [r.staged for r in pending.values()] + extras, reason)

    def _delete_unappended(self, token: str, staged: list[Any], reason: str) -> list[AppendAction]:
        """Delete ``staged`` handles of description ``token``, except those its committed
        append holds: a restarted writer's second report of an appended description names
        other data objects, never appended, which must not be left behind."""
        committed = self._appended.get(token)
        if committed is not None:
            staged = [s for s in staged if s not in committed]
        return _delete(staged, reason)

    def _drop_current(self, reason: str) -> list[AppendAction]:
        at, self._at = self._at, _AtLower()
        if at.desc is None or at.desc.append_worker != self.worker:
            return []
        if at.desc.token in self._appended:
            return []
        return _delete([r.staged for r in at.reports.values()], reason)

    def _advance_lower(self, new: Frontier, reason: str) -> list[AppendAction]:
        """Move to a greater lower: the held description and its reports are dead; pending
        reports below the new lower are dropped (deleted if their description was mine)."""
        assert self.lower.less_than(new)
        self.lower = new
        actions = self._drop_current(reason)
        for token in list(self._pending):
            slot = self._pending[token]
            any_report = next(iter(slot.values()))
            if any_report.lower.less_than(new):
                del self._pending[token]
                extras = self._pending_extras.pop(token, [])
                known = self._seen.get(token)
                if known is not None and known[1]:
                    actions += self._delete_unappended(
                        token, [r.staged for r in slot.values()] + extras, reason
                    )
        return actions

    def _learn_upper(self, upper: Frontier, token: str | None) -> list[AppendAction]:
        if self.known_upper is None or self.known_upper.less_than(upper):
            self.known_upper = upper
        if self.published is None or self.published.less_than(upper):
            self.published = upper
            return [PublishUpper(self.sink_id, upper, token)]
        return []

    def _remember_desc(self, token: str, key: tuple[int, int], mine: bool) -> None:
        self._seen[token] = (key, mine)
        self._seen.move_to_end(token)
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)

    def _check_not_in_flight(self) -> None:
        if self.in_flight is not None:
            raise SinkProtocolError(
                f"expected no append in flight, found {self.in_flight.token!r}: call "
                "on_append_result first",
                token=self.in_flight.token,
            )


def _delete(staged: list[Any], reason: str) -> list[AppendAction]:
    handles = tuple(s for s in staged if s is not None)
    return [DeleteStaged(handles, reason)] if handles else []


def _binary(keys: Keys) -> pa.Array:
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if isinstance(keys, pa.Array):
        return keys if pa.types.is_binary(keys.type) else keys.cast(pa.binary())
    return pa.array(list(keys), type=pa.binary())


def _diffs(diffs: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(np.broadcast_to(np.asarray(diffs, dtype=np.int64), (n,)))
