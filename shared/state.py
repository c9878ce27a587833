"""Shard state: a frozen value, changed only by pure transition functions.

A shard's state lives in sequence-numbered state objects on the object store. Every change
follows one shape (as pyiceberg's table updates do)::

    load head -> validate preconditions -> apply a pure update -> write data objects
              -> conditionally write state n+1 (If-None-Match: *)

This module holds the value types and the pure updates; :mod:`shared.shard` performs the I/O.

Invariants (checked by :func:`check_invariants`, kept by every transition):

- ``since <= upper`` as frontiers; both only move forward.
- ``since`` is the meet of the reader holds (never regressing); with no holds it stays.
- Batches are ordered by ``lower``, contiguous ranges never overlap, and every batch's
  ``upper <= shard upper``.
- Recent append tokens are unique; a token names exactly one committed append.
- A dropped shard has ``since = upper = {}`` and no batches, readers or writers.

The state codec is plain JSON; golden fixtures in ``tests/fixtures/state/`` guard it. Format
:data:`STATE_FORMAT_VERSION` (1) is written while the shard has one row schema; a shard whose
schema was altered is written in format :data:`SCHEMA_HISTORY_FORMAT_VERSION` (2), which adds
``schema_versions`` (every version with the first upper from which it holds). A reader of
format 1 only refuses a format-2 state (FormatError) rather than read old parts with a newer
schema it does not know how to resolve. Both formats decode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from shared.errors import (
    FormatError,
    InvalidUsageError,
    ReaderExpiredError,
    ShardDroppedError,
    UpperMismatchError,
)
from shared.frontier import Frontier

STATE_FORMAT_VERSION = 1
#: The format of a state whose shard has more than one row schema version.
SCHEMA_HISTORY_FORMAT_VERSION = 2
#: How many committed append tokens a state remembers, for retries of indeterminate appends.
RECENT_TOKENS = 256
#: Fan-out of the tiered merge policy: FANOUT batches of one level merge into one.
FANOUT = 4


@dataclass(frozen=True, slots=True)
class Part:
    """One write-once Parquet data object. ``errors``: how many of its ``rows`` are error rows
    (``_error`` set), written to the state only when there are any."""

    key: str
    rows: int
    bytes: int
    errors: int = 0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "rows": self.rows, "bytes": self.bytes}
        if self.errors:
            d["errors"] = self.errors
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Part:
        return Part(key=str(d["key"]), rows=int(d["rows"]), bytes=int(d["bytes"]), errors=int(d.get("errors", 0)))


@dataclass(frozen=True, slots=True)
class BatchMeta:
    """A batch of updates with times in ``[lower, upper)``, advanced to ``since``.

    ``weight`` is what the merge policy sizes batches by (rows, at least 1).
    """

    id: str
    lower: Frontier
    upper: Frontier
    since: Frontier
    parts: tuple[Part, ...]
    rows: int

    def __post_init__(self) -> None:
        if not self.lower.less_equal(self.upper):
            raise InvalidUsageError(
                f"expected batch lower <= upper, found {self.lower!r} > {self.upper!r}"
            )

    @property
    def weight(self) -> int:
        return max(self.rows, 1)

    def level(self) -> int:
        w, lvl = self.weight, 0
        while w >= FANOUT:
            w //= FANOUT
            lvl += 1
        return lvl

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "since": self.since.to_json(),
            "parts": [p.to_json() for p in self.parts],
            "rows": self.rows,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> BatchMeta:
        return BatchMeta(
            id=str(d["id"]),
            lower=Frontier.from_json(d["lower"]),
            upper=Frontier.from_json(d["upper"]),
            since=Frontier.from_json(d["since"]),
            parts=tuple(Part.from_json(p) for p in d["parts"]),
            rows=int(d["rows"]),
        )


LEASED = "leased"
CRITICAL = "critical"


@dataclass(frozen=True, slots=True)
class ReaderHold:
    """A reader's hold on since. Leased holds expire at ``expires_ms`` unless renewed;
    critical holds (the controller's) never expire and must be released explicitly."""

    id: str
    kind: str
    since: Frontier
    lease_ms: int
    expires_ms: int | None

    def __post_init__(self) -> None:
        if self.kind not in (LEASED, CRITICAL):
            raise InvalidUsageError(f"expected reader kind 'leased' or 'critical', found {self.kind!r}")

    def expired(self, now_ms: int) -> bool:
        return self.expires_ms is not None and now_ms >= self.expires_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "since": self.since.to_json(),
            "lease_ms": self.lease_ms,
            "expires_ms": self.expires_ms,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ReaderHold:
        return ReaderHold(
            id=str(d["id"]),
            kind=str(d["kind"]),
            since=Frontier.from_json(d["since"]),
            lease_ms=int(d["lease_ms"]),
            expires_ms=None if d["expires_ms"] is None else int(d["expires_ms"]),
        )


@dataclass(frozen=True, slots=True)
class AppendRecord:
    """A committed append, remembered so that a retry with the same token is recognised."""

    token: str
    expected_upper: Frontier
    new_upper: Frontier
    seqno: int

    def to_json(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "expected_upper": self.expected_upper.to_json(),
            "new_upper": self.new_upper.to_json(),
            "seqno": self.seqno,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> AppendRecord:
        return AppendRecord(
            token=str(d["token"]),
            expected_upper=Frontier.from_json(d["expected_upper"]),
            new_upper=Frontier.from_json(d["new_upper"]),
            seqno=int(d["seqno"]),
        )


@dataclass(frozen=True, slots=True)
class RetiredPart:
    """A data object no longer referenced by the head (replaced by compaction), kept until a
    grace period has passed so that readers of older states can finish."""

    key: str
    retired_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "retired_ms": self.retired_ms}

    @staticmethod
    def from_json(d: dict[str, Any]) -> RetiredPart:
        return RetiredPart(key=str(d["key"]), retired_ms=int(d["retired_ms"]))


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """A version of the shard's row schema and the first upper from which it holds: the shard's
    upper when the version was added (updates at times from there on may be written with it;
    parts of any version are read as the current one, see :mod:`shared.schema_evolution`)."""

    schema: dict[str, Any]
    from_upper: Frontier

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "from_upper": self.from_upper.to_json()}

    @staticmethod
    def from_json(d: dict[str, Any]) -> SchemaVersion:
        return SchemaVersion(schema=dict(d["schema"]), from_upper=Frontier.from_json(d["from_upper"]))


@dataclass(frozen=True, slots=True)
class ShardState:
    shard_id: str
    seqno: int
    schema: dict[str, Any]
    upper: Frontier
    since: Frontier
    batches: tuple[BatchMeta, ...] = ()
    readers: tuple[ReaderHold, ...] = ()
    recent: tuple[AppendRecord, ...] = ()
    retired: tuple[RetiredPart, ...] = ()
    dropped: bool = False
    appends: int = 0
    written_ms: int = 0
    #: Token of the change that wrote this state: lets a writer whose PUT had an unknown
    #: outcome recognise its own state object.
    change_token: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    #: Every row schema version, oldest first, the last one being ``schema``; empty while the
    #: shard has had only ``schema`` (format 1).
    schema_versions: tuple[SchemaVersion, ...] = ()

    # -- derived --
    @property
    def versions(self) -> tuple[SchemaVersion, ...]:
        """The row schema versions, oldest first; the last is the current ``schema``."""
        if self.schema_versions:
            return self.schema_versions
        return (SchemaVersion(self.schema, Frontier.minimum()),)

    def referenced_keys(self) -> set[str]:
        return {p.key for b in self.batches for p in b.parts}

    def keys_above(self, lower: Frontier) -> list[str]:
        """The data objects of every batch whose upper is beyond ``lower``, in order: what a
        reader whose contents reach ``lower`` reads to follow this state to its upper."""
        return [p.key for b in self.batches if not b.upper.less_equal(lower) for p in b.parts]

    def protected_keys(self) -> set[str]:
        """Keys GC must not delete: referenced ones and retired ones still in grace."""
        return self.referenced_keys() | {r.key for r in self.retired}

    def find_token(self, token: str) -> AppendRecord | None:
        for r in self.recent:
            if r.token == token:
                return r
        return None

    def reader(self, reader_id: str) -> ReaderHold | None:
        for r in self.readers:
            if r.id == reader_id:
                return r
        return None

    def total_rows(self) -> int:
        return sum(b.rows for b in self.batches)

    def total_errors(self) -> int:
        """Error rows held in the batches (rows the sink could not write as rows; after a
        compaction, as consolidated)."""
        return sum(p.errors for b in self.batches for p in b.parts)

    def total_bytes(self) -> int:
        return sum(p.bytes for b in self.batches for p in b.parts)

    # -- codec ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        history = len(self.schema_versions) > 1
        d: dict[str, Any] = {
            "format": SCHEMA_HISTORY_FORMAT_VERSION if history else STATE_FORMAT_VERSION,
            "shard_id": self.shard_id,
            "seqno": self.seqno,
            "schema": self.schema,
            "upper": self.upper.to_json(),
            "since": self.since.to_json(),
            "batches": [b.to_json() for b in self.batches],
            "readers": [r.to_json() for r in self.readers],
            "recent": [r.to_json() for r in self.recent],
            "retired": [r.to_json() for r in self.retired],
            "dropped": self.dropped,
            "appends": self.appends,
            "written_ms": self.written_ms,
            "change_token": self.change_token,
            "meta": self.meta,
        }
        if history:
            d["schema_versions"] = [v.to_json() for v in self.schema_versions]
        return d

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> ShardState:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"expected a JSON shard state object, found undecodable bytes: {e}") from e
        if not isinstance(d, dict):
            raise FormatError(f"expected a JSON object for a shard state, found {type(d).__name__}")
        version = d.get("format")
        if version not in (STATE_FORMAT_VERSION, SCHEMA_HISTORY_FORMAT_VERSION):
            raise FormatError(
                f"expected shard state format {STATE_FORMAT_VERSION} or "
                f"{SCHEMA_HISTORY_FORMAT_VERSION}, found {version!r}",
                expected=[STATE_FORMAT_VERSION, SCHEMA_HISTORY_FORMAT_VERSION],
                actual=version,
            )
        try:
            versions: tuple[SchemaVersion, ...] = ()
            if version == SCHEMA_HISTORY_FORMAT_VERSION:
                versions = tuple(SchemaVersion.from_json(v) for v in d["schema_versions"])
                if len(versions) < 2 or versions[-1].schema != d["schema"]:
                    raise FormatError(
                        "expected schema_versions of at least two versions ending with the "
                        f"current schema, found {len(versions)} version(s)"
                    )
            return ShardState(
                shard_id=str(d["shard_id"]),
                seqno=int(d["seqno"]),
                schema=dict(d["schema"]),
                upper=Frontier.from_json(d["upper"]),
                since=Frontier.from_json(d["since"]),
                batches=tuple(BatchMeta.from_json(b) for b in d["batches"]),
                readers=tuple(ReaderHold.from_json(r) for r in d["readers"]),
                recent=tuple(AppendRecord.from_json(r) for r in d["recent"]),
                retired=tuple(RetiredPart.from_json(r) for r in d["retired"]),
                dropped=bool(d["dropped"]),
                appends=int(d["appends"]),
                written_ms=int(d["written_ms"]),
                change_token=str(d.get("change_token", "")),
                meta=dict(d.get("meta") or {}),
                schema_versions=versions,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"expected a complete shard state object, found: {e}") from e


# -- transitions ----------------------------------------------------------------------------


def initial_state(
    shard_id: str, schema: dict[str, Any], since: Frontier, now_ms: int, token: str
) -> ShardState:
    """State 0: upper at ``since`` (nothing durable before it), no batches."""
    if since.is_empty():
        raise InvalidUsageError("expected a non-empty initial since, found {}")
    return ShardState(
        shard_id=shard_id,
        seqno=0,
        schema=schema,
        upper=since,
        since=since,
        written_ms=now_ms,
        change_token=token,
    )


def _next(state: ShardState, now_ms: int, token: str, **changes: Any) -> ShardState:
    return replace(state, seqno=state.seqno + 1, written_ms=now_ms, change_token=token, **changes)


def _live(state: ShardState) -> None:
    if state.dropped:
        raise ShardDroppedError(f"expected a live shard, found {state.shard_id!r} dropped", shard_id=state.shard_id)


def _expire(readers: tuple[ReaderHold, ...], now_ms: int) -> tuple[ReaderHold, ...]:
    return tuple(r for r in readers if not r.expired(now_ms))


def _since_of(current: Frontier, readers: tuple[ReaderHold, ...], upper: Frontier) -> Frontier:
    """since = the meet of the holds, never regressing, never beyond upper; unchanged with no
    holds. A hold beyond the upper is remembered: since follows it as the upper advances."""
    if not readers:
        return current
    m = readers[0].since
    for r in readers[1:]:
        m = m.meet(r.since)
    return current.join(m.meet(upper))


def validate_append_bounds(expected_upper: Frontier, new_upper: Frontier) -> None:
    if expected_upper.is_empty():
        raise InvalidUsageError("expected a non-empty expected_upper, found {} (the shard is closed)")
    if not expected_upper.less_equal(new_upper):
        raise InvalidUsageError(
            f"expected expected_upper <= new_upper, found {expected_upper!r} > {new_upper!r}",
            expected_upper=expected_upper,
            new_upper=new_upper,
        )


def validate_times(min_time: int | None, max_time: int | None, lower: Frontier, upper: Frontier) -> None:
    """Every update's time must satisfy ``lower <= time < upper``."""
    if min_time is None or max_time is None:
        return
    if not lower.less_equal(Frontier.at(min_time)):
        raise InvalidUsageError(
            f"expected every update time >= {lower!r}, found {min_time}", time=min_time, lower=lower
        )
    if upper.beyond(max_time):
        raise InvalidUsageError(
            f"expected every update time < {upper!r}, found {max_time}", time=max_time, upper=upper
        )


def apply_append(
    state: ShardState,
    batch: BatchMeta | None,
    expected_upper: Frontier,
    new_upper: Frontier,
    token: str,
    now_ms: int,
) -> ShardState:
    """compare_and_append as a pure function.

    Raises UpperMismatchError (carrying ``current``) unless ``state.upper == expected_upper``.
    ``batch`` is None for an append with no updates (it only advances the upper).
    """
    _live(state)
    validate_append_bounds(expected_upper, new_upper)
    if state.upper != expected_upper:
        raise UpperMismatchError(
            f"expected shard upper {expected_upper!r}, found {state.upper!r}",
            shard_id=state.shard_id,
            expected=expected_upper,
            current=state.upper,
        )
    batches = state.batches
    if batch is not None and batch.rows > 0:
        if batch.lower != expected_upper or batch.upper != new_upper:
            raise InvalidUsageError(
                f"expected batch bounds [{expected_upper!r}, {new_upper!r}), found "
                f"[{batch.lower!r}, {batch.upper!r})"
            )
        batches = batches + (batch,)
    record = AppendRecord(token, expected_upper, new_upper, state.seqno + 1)
    recent = (state.recent + (record,))[-RECENT_TOKENS:]
    readers = _expire(state.readers, now_ms)
    return _next(
        state,
        now_ms,
        token,
        upper=new_upper,
        batches=batches,
        recent=recent,
        readers=readers,
        since=_since_of(state.since, readers, new_upper),
        appends=state.appends + 1,
    )


def apply_register_reader(
    state: ShardState, reader_id: str, kind: str, lease_ms: int, now_ms: int, token: str
) -> ShardState:
    """A new hold at the current since (holds can never regress since)."""
    _live(state)
    readers = _expire(state.readers, now_ms)
    existing = next((r for r in readers if r.id == reader_id), None)
    if existing is not None:
        hold = replace(existing, expires_ms=None if kind == CRITICAL else now_ms + lease_ms, lease_ms=lease_ms)
    else:
        hold = ReaderHold(
            id=reader_id,
            kind=kind,
            since=state.since,
            lease_ms=lease_ms,
            expires_ms=None if kind == CRITICAL else now_ms + lease_ms,
        )
    readers = tuple(r for r in readers if r.id != reader_id) + (hold,)
    return _next(state, now_ms, token, readers=readers, since=_since_of(state.since, readers, state.upper))


def apply_heartbeat(state: ShardState, reader_id: str, now_ms: int, token: str) -> ShardState:
    _live(state)
    hold = state.reader(reader_id)
    if hold is None or hold.expired(now_ms):
        raise ReaderExpiredError(
            f"expected a live reader {reader_id!r} on {state.shard_id!r}, found it expired or unknown",
            reader_id=reader_id,
        )
    renewed = replace(hold, expires_ms=None if hold.kind == CRITICAL else now_ms + hold.lease_ms)
    readers = tuple(renewed if r.id == reader_id else r for r in _expire(state.readers, now_ms))
    return _next(state, now_ms, token, readers=readers, since=_since_of(state.since, readers, state.upper))


def apply_downgrade_since(
    state: ShardState, reader_id: str, new_since: Frontier, now_ms: int, token: str
) -> ShardState:
    """Move a reader's hold forward (never back; an earlier frontier is a no-op join)."""
    _live(state)
    hold = state.reader(reader_id)
    if hold is None or hold.expired(now_ms):
        raise ReaderExpiredError(
            f"expected a live reader {reader_id!r} on {state.shard_id!r}, found it expired or unknown",
            reader_id=reader_id,
        )
    moved = replace(
        hold,
        since=hold.since.join(new_since),
        expires_ms=None if hold.kind == CRITICAL else now_ms + hold.lease_ms,
    )
    readers = tuple(moved if r.id == reader_id else r for r in _expire(state.readers, now_ms))
    return _next(state, now_ms, token, readers=readers, since=_since_of(state.since, readers, state.upper))


def apply_expire_reader(state: ShardState, reader_id: str, now_ms: int, token: str) -> ShardState:
    """Release a hold. With no holds left, since stays where it is."""
    _live(state)
    readers = tuple(r for r in _expire(state.readers, now_ms) if r.id != reader_id)
    return _next(state, now_ms, token, readers=readers, since=_since_of(state.since, readers, state.upper))


def plan_merge(state: ShardState) -> tuple[int, int] | None:
    """The first run of FANOUT adjacent batches at the same level, as ``(start, end)``.

    This tiered policy keeps at most ``FANOUT - 1`` batches per level, so the batch count is
    at most ``(FANOUT - 1) * log_FANOUT(rows) + 1``: logarithmic in the number of appends.
    """
    bs = state.batches
    i = 0
    while i < len(bs):
        j = i
        while j + 1 < len(bs) and bs[j + 1].level() == bs[i].level():
            j += 1
        if j - i + 1 >= FANOUT:
            return (i, i + FANOUT)
        i = j + 1
    return None


def below_since(state: ShardState) -> int:
    """How many batches lie at or below since (batches are in time order, so they are the
    first ones): those whose upper is at or below it."""
    n = 0
    while n < len(state.batches) and state.batches[n].upper.less_equal(state.since):
        n += 1
    return n


#: A since move merges batches below since only into runs where no batch outweighs the others
#: together more than this many times (:func:`plan_since_merge`).
SINCE_MERGE_RATIO = FANOUT


def plan_since_merge(state: ShardState, ratio: int = SINCE_MERGE_RATIO) -> tuple[int, int] | None:
    """The run of batches at or below since that a since move merges, as ``(start, end)``:
    the longest run ending at the newest such batch in which the heaviest batch weighs at most
    ``ratio`` times the rest together; None when no run of two or more is that balanced.

    In a balanced run every row moves into a batch at least ``1 + 1/ratio`` times the one it
    was in, so however often since moves a row is rewritten at most ``log_{1+1/ratio}(rows)``
    times. Merging every batch below since at every move (:meth:`Shard.compact_below_since`,
    the explicit full collapse) rewrites the whole history each time: with since trailing the
    upper, quadratic in the number of appends. A batch left out keeps its own since; readers
    advance times to the as-of they read at, so its contents are the same."""
    if state.since.is_empty():
        return None
    bs = state.batches
    end = below_since(state)
    best = None
    total = heaviest = 0
    for start in range(end - 1, -1, -1):
        w = bs[start].weight
        total += w
        heaviest = max(heaviest, w)
        if end - start >= 2 and heaviest <= ratio * (total - heaviest):
            best = (start, end)
    return best


def apply_merge(
    state: ShardState, replaced_ids: tuple[str, ...], merged: BatchMeta | None, now_ms: int, token: str
) -> ShardState:
    """Swap a contiguous run of batches for their merge (None when everything cancelled).

    Preconditions (checked on the *current* head, so concurrent appends do not conflict):
    the replaced batches are still present and contiguous, and the merge covers exactly
    their range.
    """
    _live(state)
    ids = [b.id for b in state.batches]
    try:
        start = ids.index(replaced_ids[0])
    except ValueError:
        raise InvalidUsageError(
            f"expected batch {replaced_ids[0]!r} in the shard, found it replaced already"
        ) from None
    end = start + len(replaced_ids)
    if tuple(ids[start:end]) != replaced_ids:
        raise InvalidUsageError(
            f"expected contiguous batches {replaced_ids!r}, found {tuple(ids[start:end])!r}"
        )
    old = state.batches[start:end]
    if merged is not None and (merged.lower != old[0].lower or merged.upper != old[-1].upper):
        raise InvalidUsageError(
            f"expected the merge to cover [{old[0].lower!r}, {old[-1].upper!r}), found "
            f"[{merged.lower!r}, {merged.upper!r})"
        )
    new_batches = state.batches[:start] + ((merged,) if merged is not None else ()) + state.batches[end:]
    retired = state.retired + tuple(RetiredPart(p.key, now_ms) for b in old for p in b.parts)
    return _next(state, now_ms, token, batches=new_batches, retired=retired)


def apply_alter_schema(state: ShardState, schema: dict[str, Any], now_ms: int, token: str) -> ShardState:
    """A new row schema version, holding from the current upper on.

    Precondition: rows of every earlier version can be read as ``schema``
    (:func:`shared.schema_evolution.check_evolution`: IncompatibleSchemaError naming the field
    and the rule otherwise; the state is unchanged). The current schema again is a no-op (the
    state itself)."""
    from shared.schema_evolution import check_evolution

    _live(state)
    new = check_evolution([v.schema for v in state.versions], schema)
    if new == state.schema:
        return state
    versions = state.versions + (SchemaVersion(new, state.upper),)
    return _next(state, now_ms, token, schema=new, schema_versions=versions)


def apply_forget_retired(state: ShardState, keys: set[str], now_ms: int, token: str) -> ShardState:
    return _next(state, now_ms, token, retired=tuple(r for r in state.retired if r.key not in keys))


def apply_drop(state: ShardState, now_ms: int, token: str) -> ShardState:
    """since and upper to the empty frontier; every part retired."""
    if state.dropped:
        return state
    retired = state.retired + tuple(RetiredPart(p.key, now_ms) for b in state.batches for p in b.parts)
    return _next(
        state,
        now_ms,
        token,
        upper=Frontier.empty(),
        since=Frontier.empty(),
        batches=(),
        readers=(),
        retired=retired,
        dropped=True,
    )


def check_invariants(state: ShardState) -> None:
    """Raise AssertionError-like InvalidUsageError if ``state`` breaks an invariant."""
    if not state.since.less_equal(state.upper):
        raise InvalidUsageError(f"expected since <= upper, found {state.since!r} > {state.upper!r}")
    prev: Frontier | None = None
    for b in state.batches:
        if prev is not None and not prev.less_equal(b.lower):
            raise InvalidUsageError(f"expected ordered batches, found {b.lower!r} after {prev!r}")
        if not b.upper.less_equal(state.upper):
            raise InvalidUsageError(f"expected batch upper <= shard upper, found {b.upper!r}")
        prev = b.upper
    tokens = [r.token for r in state.recent]
    if len(tokens) != len(set(tokens)):
        raise InvalidUsageError("expected unique append tokens in the recent list")
    if state.dropped and (state.batches or not state.upper.is_empty() or not state.since.is_empty()):
        raise InvalidUsageError("expected a dropped shard to be empty and closed")
