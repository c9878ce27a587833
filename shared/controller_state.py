"""The controller's pure state: read capabilities, reported frontiers, the command log and
subscribe progress. No I/O: the rooms of ``services/controller/`` perform the effects.

Invariants kept here (from the reference storage and compute controllers):

- A collection's *implied capability* (from its read policy) only moves forward: a policy
  change or an upper advance that would move it back leaves it where it is.
- since = the meet of the implied capability and every hold (pending peeks at their as-of,
  running subscribes at their frontier, live sinks at the last readable time), never beyond
  the upper, never backwards (the shard's reader hold only moves forward).
- Uppers are reported when they advance, once per advance, never backwards.
- The command log maps a command id to its response (bounded, oldest evicted first); a
  replayed id is answered from the log and not applied again.
- A subscribe's progress only moves forward; ``emitting`` records an output range whose
  messages may be partly on the topic (its intent is durable before its first message).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.errors import wire_kind
from shared.frontier import Frontier
from shared.read_policy import ReadPolicy

#: The catalog ``extra`` section owned by the controller.
SECTION = "controller"


# -- read capabilities ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Capabilities:
    """One collection's read capabilities as the controller sees them."""

    implied: Frontier
    holds: tuple[tuple[str, Frontier], ...] = ()

    def advance_implied(self, policy: ReadPolicy, upper: Frontier) -> Capabilities:
        """The policy's frontier for ``upper``, if it is not behind the current one."""
        new = policy.implied(upper)
        if self.implied.less_equal(new):
            return Capabilities(new, self.holds)
        return self

    def with_holds(self, holds: dict[str, Frontier]) -> Capabilities:
        return Capabilities(self.implied, tuple(sorted(holds.items(), key=lambda kv: kv[0])))

    def since(self, upper: Frontier) -> Frontier:
        """The meet of the implied capability and the holds, clamped to the upper."""
        out = self.implied
        for _, h in self.holds:
            out = out.meet(h)
        return out.meet(upper) if not upper.is_empty() else out


def sink_hold(upper: Frontier) -> Frontier:
    """A live sink reads its collection back at ``upper - 1`` (hydration): hold there."""
    return upper.step_back() if upper.time is not None else Frontier.minimum()


def collection_holds(
    collection_id: str,
    peeks: Iterable[tuple[str, str, int]],
    subs: Mapping[str, Mapping[str, Any]],
    sink_ids: Iterable[str],
    upper: Frontier,
) -> dict[str, Frontier]:
    """The holds on one collection's since, by holder name.

    ``peeks``: ``(command_id, collection_id, as_of)`` of waiting peeks; ``subs``: the
    subscribes of the controller section (finished ones hold nothing); ``sink_ids``: the
    live sinks writing this collection. Names are ``peek:<id>``, ``subscribe:<id>``,
    ``sink:<id>``.
    """
    holds: dict[str, Frontier] = {}
    for command_id, cid, as_of in peeks:
        if cid == collection_id:
            holds[f"peek:{command_id}"] = Frontier.at(as_of)
    for sid, sub in subs.items():
        if sub["collection_id"] == collection_id and sub.get("state") != "done":
            holds[f"subscribe:{sid}"] = subscribe_hold(sub)
    for sink_id in sink_ids:
        holds[f"sink:{sink_id}"] = sink_hold(upper)
    return holds


def is_readable(as_of: int, upper: Frontier) -> bool:
    """A snapshot as of ``as_of`` can be answered now: ``as_of < upper`` (or the upper is closed)."""
    return upper.is_empty() or as_of < (upper.time or 0)


# -- frontier reporting ----------------------------------------------------------------------------


def should_report(reported: Frontier | None, upper: Frontier) -> bool:
    """Report ``upper`` iff nothing was reported yet or it is strictly beyond the last report."""
    return reported is None or reported.less_than(upper)


def upper_reports(
    reported: Mapping[str, int | None], uppers: Mapping[str, Frontier], dropped: Iterable[str]
) -> dict[str, int | None]:
    """The upper reports due: ``collection_id -> upper`` (JSON: ``None`` is the empty frontier).

    A live collection is reported when its upper advanced past the last report (or was never
    reported); a dropped collection once, as the empty frontier, if it was ever reported.
    """
    changes: dict[str, int | None] = {}
    for cid, upper in uppers.items():
        prev = Frontier.from_json(reported[cid]) if cid in reported else None
        if should_report(prev, upper):
            changes[cid] = upper.to_json()
    for cid in dropped:
        if cid in reported and reported[cid] is not None:
            changes[cid] = None
    return changes


def record_reports(reported: dict[str, int | None], changes: Mapping[str, int | None]) -> None:
    """Record sent reports in ``reported``, never moving one backwards (a concurrent commit
    may have recorded a later one)."""
    for cid, up in changes.items():
        prev = reported.get(cid, -1)
        if cid not in reported or (prev is not None and (up is None or up > prev)):
            reported[cid] = up


# -- typed errors ------------------------------------------------------------------------------------


class CommandRejected(Exception):
    """A command the controller refuses; ``kind`` is the Error response kind."""

    def __init__(self, kind: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.fields = fields


def error_kind(e: BaseException) -> str:
    """The response ``Error.kind`` of an exception (see schemas/response.avsc): the kind a
    :class:`CommandRejected` names, else the one table's (:data:`shared.errors.ERROR_KINDS`,
    :func:`shared.errors.wire_kind`)."""
    if isinstance(e, CommandRejected):
        return e.kind
    return wire_kind(e)


# -- the durable section -------------------------------------------------------------------------


@dataclass
class ControllerSection:
    """The controller's part of the catalog ``extra`` (JSON-able; copied before changes).

    - ``offsets[partition]``: the next command offset to read; every command before it has
      been applied and answered (its response flushed).
    - ``log[command_id]``: ``{"o": "p:offset", "r": response (base64) | "k": S3 key}`` for
      answered commands, ``{"o": ..., "pending": command (base64)}`` for waiting peeks.
    - ``order``: command ids oldest first (eviction order).
    - ``reported[collection_id]``: the last reported upper (``null``: the empty frontier).
    - ``subs[subscribe_id]``: subscribe definitions and progress.
    - ``reclaim[collection_id]``: dropped collections whose storage is not yet reclaimed.
    """

    offsets: dict[str, int] = field(default_factory=dict)
    log: dict[str, dict[str, Any]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    reported: dict[str, int | None] = field(default_factory=dict)
    subs: dict[str, dict[str, Any]] = field(default_factory=dict)
    reclaim: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> ControllerSection:
        d = copy.deepcopy(extra.get(SECTION) or {})
        return ControllerSection(
            offsets={str(k): int(v) for k, v in (d.get("offsets") or {}).items()},
            log=dict(d.get("log") or {}),
            order=list(d.get("order") or []),
            reported=dict(d.get("reported") or {}),
            subs=dict(d.get("subs") or {}),
            reclaim={str(k): int(v) for k, v in (d.get("reclaim") or {}).items()},
        )

    def to_extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            **extra,
            SECTION: {
                "offsets": self.offsets,
                "log": self.log,
                "order": self.order,
                "reported": self.reported,
                "subs": self.subs,
                "reclaim": self.reclaim,
            },
        }

    # -- command log ------------------------------------------------------------------------
    def record(self, command_id: str, entry: dict[str, Any], max_entries: int) -> list[str]:
        """Log ``entry`` for ``command_id``; returns the evicted ids (oldest first)."""
        if command_id not in self.log:
            self.order.append(command_id)
        self.log[command_id] = entry
        evicted: list[str] = []
        while len(self.order) > max_entries:
            old = self.order.pop(0)
            if "pending" in self.log.get(old, {}):
                self.order.append(old)  # a waiting peek is never evicted
                if all("pending" in self.log.get(c, {}) for c in self.order):
                    break
                continue
            self.log.pop(old, None)
            evicted.append(old)
        return evicted


# -- subscribes ----------------------------------------------------------------------------------


def subscribe_step(sub: Mapping[str, Any], upper: Frontier) -> tuple[int | None, Frontier, bool] | None:
    """The next output range of a running subscribe, or None when there is nothing new.

    Returns ``(lower, new_frontier, with_snapshot)``: changes at times in ``[lower,
    new_frontier)`` (``lower`` None means: the snapshot at as_of, then changes after it), then
    a progress statement at ``new_frontier``. ``new_frontier`` never passes ``up_to``.
    """
    as_of = int(sub["as_of"])
    up_to = Frontier.empty() if sub.get("up_to") is None else Frontier.at(int(sub["up_to"]))
    target = upper.meet(up_to)
    progress = sub.get("progress")
    if progress is None:
        # The first step needs as_of readable: as_of < upper.
        if not Frontier.at(as_of).less_than(target):
            return None
        return (None, target, bool(sub.get("with_snapshot", True)))
    if not Frontier.at(int(progress)).less_than(target):
        return None
    return (int(progress), target, False)


def subscribe_hold(sub: Mapping[str, Any]) -> Frontier:
    """Where a running subscribe holds since: at as_of until it starts, then its progress."""
    p = sub.get("progress")
    return Frontier.at(int(sub["as_of"])) if p is None else Frontier.at(int(p))


def is_final_step(to: Frontier, up_to: int | None) -> bool:
    """A step to ``to`` is a subscribe's last: the collection closed or ``up_to`` reached."""
    return to.is_empty() or (up_to is not None and to == Frontier.at(int(up_to)))
