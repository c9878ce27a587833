"""An appender's state machine: collect reports, append complete descriptions.

An appender reads :class:`~shared.sink_messages.BatchDescription` values from ``descs`` and
:class:`~shared.sink_messages.BatchReport` values from ``batches`` (the messages and the
protocol they carry are in :mod:`shared.sink_messages`), and decides (:class:`AppendAction`)
when to compare-and-append a description's staged batches to the shard, which staged parts to
delete, and which upper to publish on ``frontiers``.

:class:`AppendState` does no I/O. Each method absorbs one input and returns the decisions the
service's adapter must carry out (bump the upper, compare-and-append, delete staged parts,
publish an upper); the adapter answers with :class:`AppendOutcome`. The storage layer
(``shared.shard``) is never imported: staged-batch handles are opaque values here.

Invariants (from the seeds, kept by the class below and tested in
``tests/shared/test_sink_state.py``; numbered as the sink's, see :mod:`shared.sink_messages`):

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

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Union

from shared.errors import InvalidUsageError, SinkProtocolError
from shared.frontier import Frontier
from shared.sink_messages import BatchDescription, BatchReport, FrontierLike, as_frontier


# -- actions and outcomes -------------------------------------------------------------------


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


# -- state ----------------------------------------------------------------------------------

#: Descriptions an appender remembers (seen, and appended with their handles' digests). The
#: state is checkpointed with every micro-batch of its query (every sink's, in a shared
#: query), so the window is its size. It is safe at any size: the window of appended
#: descriptions always covers that of the descriptions seen (an appended description was seen
#: first, and every append is of a description seen), and a report whose description is no
#: longer remembered is neither appended nor deleted (its parts are left to the collector of
#: unreferenced objects). A report comes that late only from a writer more than this many
#: appends of its sink behind.
REMEMBER = 256



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

    def __init__(self, sink_id: str, worker: int = 0, *, remember: int = REMEMBER) -> None:
        self.sink_id = sink_id
        self.worker = worker
        self.lower = Frontier.minimum()
        self._at = _AtLower()
        # Reports for descriptions not seen yet, by token.
        self._pending: dict[str, dict[int, BatchReport]] = {}
        self._pending_extras: dict[str, list[Any]] = {}
        # Descriptions seen, by token -> (order key, mine?), bounded.
        self._seen: OrderedDict[str, tuple[tuple[int, int], bool]] = OrderedDict()
        # Appended descriptions, by token -> digests of the staged handles the append committed
        # (a later report of the same description carries other handles: those are deleted).
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
                _digest(r.staged) for r in self._at.reports.values() if r.staged is not None
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
    def restore(data: dict[str, Any], *, remember: int = REMEMBER) -> AppendState:
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
        # The newest ``remember`` (a checkpoint of a larger window, or of whole handles, is cut
        # down and digested).
        s._seen = OrderedDict((t, ((int(k[0]), int(k[1])), bool(mine))) for t, k, mine in data["seen"][-remember:])
        s._appended = OrderedDict((t, tuple(_digest(x) for x in h)) for t, h in data["appended"][-remember:])
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
            staged = [s for s in staged if s is None or _digest(s) not in committed]
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


def _digest(handle: Any) -> str:
    """A short digest of a staged handle (an opaque value: the append state keeps digests of
    the handles it committed, not the handles); a digest is its own digest."""
    if isinstance(handle, str) and handle.startswith(_DIGEST):
        return handle
    raw = json.dumps(handle, sort_keys=True, default=repr).encode()
    return _DIGEST + hashlib.blake2b(raw, digest_size=12).hexdigest()


_DIGEST = "b2:"


def _delete(staged: list[Any], reason: str) -> list[AppendAction]:
    handles = tuple(s for s in staged if s is not None)
    return [DeleteStaged(handles, reason)] if handles else []
