"""The catalog: collections and sinks, on the object store, under the conditional-write
discipline of :mod:`shared.versioned` (no database).

Both the sink services (which read sink definitions and follow them at runtime) and the
controller (which owns the catalog's commands) use this module. Every change is a pure
transition on a frozen :class:`CatalogState`, committed as state ``n + 1`` with
``If-None-Match: *``.

Rules kept here:

- Ids are single path segments (``validate_shard_id``): nothing escapes its S3 prefix.
- Re-creating an id with the same definition is a no-op; with another, an error.
- Ids of dropped collections and sinks are never reused (tombstones stay in the catalog).
- ``controller_epoch`` fences controllers: a controller claims an epoch on start and every
  write it makes checks it; a second controller's claim fences the first out.
- A sink created on a collection that holds rows says what its desired topic holds:
  ``adopt_shard`` (the changes from the collection's upper on; the rows stay) or
  ``replace_contents`` (the whole truth; rows it does not hold are retracted). Without either
  the creation is refused (:class:`~shared.errors.SinkBaselineRequiredError`) and nothing is
  written; both at once is an :class:`~shared.errors.InvalidUsageError`. An empty collection
  needs neither.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any

from shared.errors import (
    FormatError,
    InvalidUsageError,
    ShardsinkError,
    SinkBaselineRequiredError,
    UnknownIdError,
)
from shared.objectstore import ObjectStore, now_ms
from shared.versioned import AlreadyApplied, VersionedLog

CATALOG_FORMAT_VERSION = 1


class CatalogError(ShardsinkError):
    """A catalog change was refused. ``kind`` is the typed error name used in responses."""

    kind = "catalog_error"


class UnknownCollectionError(CatalogError, UnknownIdError):
    kind = "unknown_collection"


class UnknownSinkError(CatalogError, UnknownIdError):
    kind = "unknown_sink"


class IdReuseError(CatalogError):
    kind = "id_reuse"


class CatalogNotFoundError(CatalogError):
    """No catalog at this bucket and prefix: a reading command never creates one."""

    kind = "catalog_not_found"


class FencedError(CatalogError):
    """Another controller claimed a newer epoch: this one must stop writing."""

    kind = "fenced"


def validate_id(kind: str, value: str) -> str:
    from shared.shard import validate_shard_id

    try:
        return validate_shard_id(value)
    except InvalidUsageError:
        raise InvalidUsageError(
            f"expected a {kind} id of letters, digits, '.', '_' or '-' (1-128 chars, no '..'), "
            f"found {value!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class CollectionDef:
    collection_id: str
    schema: dict[str, Any]
    since: int = 0
    read_policy: dict[str, Any] = field(default_factory=dict)
    dropped: bool = False

    def definition(self) -> dict[str, Any]:
        """What "the same definition" compares (the policy may be altered later)."""
        return {"schema": self.schema, "since": self.since}

    def to_json(self) -> dict[str, Any]:
        return {
            "collection_id": self.collection_id,
            "schema": self.schema,
            "since": self.since,
            "read_policy": self.read_policy,
            "dropped": self.dropped,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> CollectionDef:
        return CollectionDef(
            collection_id=str(d["collection_id"]),
            schema=dict(d["schema"]),
            since=int(d["since"]),
            read_policy=dict(d.get("read_policy") or {}),
            dropped=bool(d.get("dropped", False)),
        )


@dataclass(frozen=True, slots=True)
class SinkDef:
    """A sink: keep ``collection_id``'s shard equal to the collection on ``desired_topic``.

    ``epoch`` changes whenever the definition is (re)activated, so services can tell a
    re-created sink from the old one.
    """

    sink_id: str
    desired_topic: str
    collection_id: str
    as_of: int = 0
    read_only: bool = False
    dropped: bool = False
    epoch: int = 0
    #: The writer takes the shard's contents at its first start as the desired baseline
    #: (the operator's answer to lost desired history; see docs/operations.md, "Retention safety").
    adopt_shard: bool = False
    #: The creator said the desired topic is the whole truth: the writer corrects the shard's
    #: contents to it, retracting rows the topic does not hold (what a sink without
    #: ``adopt_shard`` does; recorded because a sink on a collection that held rows must say so).
    replace_contents: bool = False

    def __post_init__(self) -> None:
        check_baseline_flags(self.adopt_shard, self.replace_contents)

    def definition(self) -> dict[str, Any]:
        return {"desired_topic": self.desired_topic, "collection_id": self.collection_id, "as_of": self.as_of}

    def to_json(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "desired_topic": self.desired_topic,
            "collection_id": self.collection_id,
            "as_of": self.as_of,
            "read_only": self.read_only,
            "dropped": self.dropped,
            "epoch": self.epoch,
            "adopt_shard": self.adopt_shard,
            "replace_contents": self.replace_contents,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> SinkDef:
        return SinkDef(
            sink_id=str(d["sink_id"]),
            desired_topic=str(d["desired_topic"]),
            collection_id=str(d["collection_id"]),
            as_of=int(d.get("as_of", 0)),
            read_only=bool(d.get("read_only", False)),
            dropped=bool(d.get("dropped", False)),
            epoch=int(d.get("epoch", 0)),
            adopt_shard=bool(d.get("adopt_shard", False)),
            replace_contents=bool(d.get("replace_contents", False)),
        )


@dataclass(frozen=True, slots=True)
class CatalogState:
    seqno: int
    change_token: str = ""
    collections: dict[str, CollectionDef] = field(default_factory=dict)
    sinks: dict[str, SinkDef] = field(default_factory=dict)
    controller_epoch: int = 0
    written_ms: int = 0
    #: Free-form, versioned sections owned by the controller (command log, holds...).
    extra: dict[str, Any] = field(default_factory=dict)

    def live_sinks(self, collection_id: str | None = None) -> list[SinkDef]:
        """Live sinks by id; with ``collection_id``, those that write that collection."""
        return sorted(
            (s for s in self.sinks.values() if not s.dropped and collection_id in (None, s.collection_id)),
            key=lambda s: s.sink_id,
        )

    def live_collections(self) -> list[CollectionDef]:
        return sorted((c for c in self.collections.values() if not c.dropped), key=lambda c: c.collection_id)

    def collection(self, collection_id: str) -> CollectionDef:
        c = self.collections.get(collection_id)
        if c is None or c.dropped:
            raise UnknownCollectionError(
                f"expected a live collection {collection_id!r}, found "
                f"{'a dropped one' if c else 'none'}",
                collection_id=collection_id,
            )
        return c

    def sink(self, sink_id: str) -> SinkDef:
        s = self.sinks.get(sink_id)
        if s is None or s.dropped:
            raise UnknownSinkError(
                f"expected a live sink {sink_id!r}, found {'a dropped one' if s else 'none'}",
                sink_id=sink_id,
            )
        return s

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": CATALOG_FORMAT_VERSION,
                "seqno": self.seqno,
                "change_token": self.change_token,
                "collections": {k: v.to_json() for k, v in sorted(self.collections.items())},
                "sinks": {k: v.to_json() for k, v in sorted(self.sinks.items())},
                "controller_epoch": self.controller_epoch,
                "written_ms": self.written_ms,
                "extra": self.extra,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(data: bytes) -> CatalogState:
        try:
            d = json.loads(data)
            if d.get("format") != CATALOG_FORMAT_VERSION:
                raise FormatError(f"expected catalog format {CATALOG_FORMAT_VERSION}, found {d.get('format')!r}")
            return CatalogState(
                seqno=int(d["seqno"]),
                change_token=str(d.get("change_token", "")),
                collections={k: CollectionDef.from_json(v) for k, v in d["collections"].items()},
                sinks={k: SinkDef.from_json(v) for k, v in d["sinks"].items()},
                controller_epoch=int(d.get("controller_epoch", 0)),
                written_ms=int(d.get("written_ms", 0)),
                extra=dict(d.get("extra") or {}),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"expected a catalog state object, found: {e}") from e


def _next(state: CatalogState, token: str, **changes: Any) -> CatalogState:
    return replace(state, seqno=state.seqno + 1, change_token=token, written_ms=now_ms(), **changes)


class Catalog:
    """A handle on the catalog at ``<root>/``; thread-safe, many handles may race."""

    def __init__(
        self, store: ObjectStore, *, root: str = "catalog", max_cache_age_s: float = 1.0, create: bool = True
    ) -> None:
        """``create=False`` (readers) never writes: no catalog is CatalogNotFoundError."""
        self.store = store
        self.root = root
        self._log: VersionedLog[CatalogState] = VersionedLog(
            store, f"{root}/", CatalogState.decode, max_cache_age_s=max_cache_age_s, name="catalog"
        )
        self._ensure(create)

    def _ensure(self, create: bool = True) -> None:
        from shared.errors import ShardNotFoundError

        try:
            self._log.refresh()
        except ShardNotFoundError:
            if not create:
                raise CatalogNotFoundError(f"expected a catalog under {self.root + '/'!r}, found none") from None
            self._log.put_initial(CatalogState(seqno=0, change_token=uuid.uuid4().hex, written_ms=now_ms()))
            self._log.refresh()
        except ShardsinkError:
            if not create:
                raise
            self._log.put_initial(CatalogState(seqno=0, change_token=uuid.uuid4().hex, written_ms=now_ms()))
            self._log.refresh()

    def state(self, *, fresh: bool = True) -> CatalogState:
        return self._log.refresh() if fresh else self._log.head()

    def update(self, transition: Any, *, epoch: int | None = None) -> CatalogState:
        """Commit ``transition(state) -> state`` (may return the state itself: no-op).

        With ``epoch``, the write is fenced: it fails with FencedError if another controller
        claimed a newer epoch.
        """
        token = uuid.uuid4().hex

        def t(head: CatalogState) -> CatalogState:
            if epoch is not None and head.controller_epoch != epoch:
                raise FencedError(
                    f"expected controller epoch {epoch}, found {head.controller_epoch}",
                    expected=epoch,
                    actual=head.controller_epoch,
                )
            new = transition(head)
            if new is head:
                raise AlreadyApplied(head)
            return _next(head, token, **{
                k: getattr(new, k) for k in ("collections", "sinks", "controller_epoch", "extra")
            })

        return self._log.commit(t, token)

    def claim_controller_epoch(self) -> int:
        """Claim the next controller epoch (fencing out any older controller)."""
        state = self.update(lambda s: replace(s, controller_epoch=s.controller_epoch + 1))
        return state.controller_epoch

    # -- collections -----------------------------------------------------------------------
    def create_collection(self, c: CollectionDef, *, epoch: int | None = None) -> CatalogState:
        return self.update(create_collection_transition(c), epoch=epoch)

    def alter_collection(self, collection_id: str, read_policy: dict[str, Any], *, epoch: int | None = None) -> CatalogState:
        return self.update(alter_collection_transition(collection_id, read_policy), epoch=epoch)

    def alter_collection_schema(self, collection_id: str, schema: dict[str, Any], *, epoch: int | None = None) -> CatalogState:
        return self.update(alter_collection_schema_transition(collection_id, schema), epoch=epoch)

    def drop_collection(self, collection_id: str, *, epoch: int | None = None) -> CatalogState:
        return self.update(drop_collection_transition(collection_id), epoch=epoch)

    # -- sinks -----------------------------------------------------------------------------
    def create_sink(self, sink: SinkDef, *, epoch: int | None = None) -> CatalogState:
        """Refused (:class:`~shared.errors.SinkBaselineRequiredError`, nothing written) when the
        collection holds rows and ``sink`` says neither ``adopt_shard`` nor ``replace_contents``."""
        return self.update(create_sink_transition(sink, held=self.held_rows(sink.collection_id)), epoch=epoch)

    def held_rows(self, collection_id: str) -> HeldRows:
        """What the collection's shard holds, from its head state (no data is read); nothing
        for a collection without a live shard (the catalog's own check names that)."""
        from shared.shard import Shard

        try:
            state = Shard(self.store, collection_id).refresh()
        except (UnknownIdError, InvalidUsageError):  # no shard, or an id that cannot be one
            return HeldRows(0)
        return HeldRows(state.total_rows(), state.upper.time)

    def drop_sink(self, sink_id: str, *, epoch: int | None = None) -> CatalogState:
        return self.update(drop_sink_transition(sink_id), epoch=epoch)

    def allow_writes(self, sink_id: str, *, epoch: int | None = None) -> CatalogState:
        return self.update(allow_writes_transition(sink_id), epoch=epoch)

    def adopt_shard(self, sink_id: str, *, epoch: int | None = None) -> CatalogState:
        return self.update(adopt_shard_transition(sink_id), epoch=epoch)

    # -- maintenance -----------------------------------------------------------------------
    def collect(self, grace_ms: int) -> int:
        """Delete catalog states below the head older than ``grace_ms``; returns the count."""
        head = self._log.refresh()
        return self._log.collect_states(head.seqno, now_ms() - grace_ms)


# -- pure transitions (each returns the state itself for a no-op) ------------------------------
# The controller composes these with its own section of ``extra`` in one commit.

Transition = Callable[[CatalogState], CatalogState]


def create_collection_transition(c: CollectionDef) -> Transition:
    validate_id("collection", c.collection_id)

    def t(s: CatalogState) -> CatalogState:
        old = s.collections.get(c.collection_id)
        if old is not None:
            if old.dropped:
                raise IdReuseError(
                    f"expected a fresh collection id, found {c.collection_id!r} used by a dropped collection",
                    collection_id=c.collection_id,
                )
            if old.definition() != c.definition():
                raise IdReuseError(
                    f"expected collection {c.collection_id!r} to have its existing definition, found another",
                    collection_id=c.collection_id,
                )
            return s
        return replace(s, collections={**s.collections, c.collection_id: c})

    return t


def alter_collection_transition(collection_id: str, read_policy: dict[str, Any]) -> Transition:
    def t(s: CatalogState) -> CatalogState:
        c = s.collection(collection_id)
        if c.read_policy == read_policy:
            return s
        return replace(s, collections={**s.collections, collection_id: replace(c, read_policy=read_policy)})

    return t


def alter_collection_schema_transition(collection_id: str, schema: dict[str, Any]) -> Transition:
    """The collection's row schema becomes ``schema`` (the shard's current version: the shard is
    altered first, and checks that the change is compatible; the catalog follows it)."""

    def t(s: CatalogState) -> CatalogState:
        c = s.collection(collection_id)
        if c.schema == schema:
            return s
        return replace(s, collections={**s.collections, collection_id: replace(c, schema=schema)})

    return t


def drop_collection_transition(collection_id: str) -> Transition:
    def t(s: CatalogState) -> CatalogState:
        c = s.collections.get(collection_id)
        if c is None:
            raise UnknownCollectionError(f"expected a collection {collection_id!r}, found none")
        if c.dropped:
            return s
        sinks = {k: (replace(v, dropped=True) if v.collection_id == collection_id else v) for k, v in s.sinks.items()}
        return replace(s, collections={**s.collections, collection_id: replace(c, dropped=True)}, sinks=sinks)

    return t


def check_baseline_flags(adopt_shard: bool, replace_contents: bool) -> None:
    """At most one answer to "what does the desired topic hold?"."""
    if adopt_shard and replace_contents:
        raise InvalidUsageError(
            "expected at most one of --adopt-shard (adopt_shard) and --replace-contents (replace_contents), found both"
        )


@dataclass(frozen=True, slots=True)
class HeldRows:
    """What a collection's shard holds when a sink is created on it, from its head state:
    ``rows`` (the count the state records, as ``collection list`` shows) and ``upper`` (its
    time; None for the empty frontier)."""

    rows: int
    upper: int | None = 0


def check_sink_baseline(sink: SinkDef, held: HeldRows) -> None:
    """A sink on a collection that holds rows says what its desired topic holds (see the
    module docstring); :class:`~shared.errors.SinkBaselineRequiredError` when it does not."""
    if held.rows <= 0 or sink.adopt_shard or sink.replace_contents:
        return
    upper = "closed" if held.upper is None else held.upper
    raise SinkBaselineRequiredError(
        f"expected sink {sink.sink_id!r} on collection {sink.collection_id!r}, which holds "
        f"{held.rows} rows (upper {upper}), to say what topic {sink.desired_topic!r} holds: "
        "--adopt-shard (adopt_shard: only the changes from the collection's upper on; its rows "
        "stay) or --replace-contents (replace_contents: the whole truth; the sink retracts the "
        "rows the topic does not hold), found neither; nothing was written",
        sink_id=sink.sink_id, collection_id=sink.collection_id, rows=held.rows, upper=held.upper,
    )


def create_sink_transition(sink: SinkDef, *, held: HeldRows) -> Transition:
    """Define ``sink``; ``held`` is what its collection's shard holds now. Re-creating a live
    sink with its definition is a no-op (whatever it says of the topic); a new sink on a
    collection that holds rows must say what the topic holds (:func:`check_sink_baseline`)."""
    validate_id("sink", sink.sink_id)
    if not sink.desired_topic:
        raise InvalidUsageError("expected a desired topic name, found ''")

    def t(s: CatalogState) -> CatalogState:
        s.collection(sink.collection_id)
        old = s.sinks.get(sink.sink_id)
        if old is not None:
            if old.dropped:
                raise IdReuseError(f"expected a fresh sink id, found {sink.sink_id!r} used by a dropped sink")
            if old.definition() != sink.definition():
                raise IdReuseError(f"expected sink {sink.sink_id!r} to have its existing definition, found another")
            return s
        check_sink_baseline(sink, held)
        epoch_n = 1 + max((v.epoch for v in s.sinks.values()), default=0)
        return replace(s, sinks={**s.sinks, sink.sink_id: replace(sink, epoch=epoch_n)})

    return t


def drop_sink_transition(sink_id: str) -> Transition:
    def t(s: CatalogState) -> CatalogState:
        old = s.sinks.get(sink_id)
        if old is None:
            raise UnknownSinkError(f"expected a sink {sink_id!r}, found none")
        if old.dropped:
            return s
        return replace(s, sinks={**s.sinks, sink_id: replace(old, dropped=True)})

    return t


def adopt_shard_transition(sink_id: str) -> Transition:
    """The sink starts over from its shard's current contents as the desired baseline: a
    new epoch (so every service restarts the sink's queries, the writer with a fresh
    checkpoint) with ``adopt_shard`` set."""

    def t(s: CatalogState) -> CatalogState:
        old = s.sink(sink_id)
        if old.dropped:
            raise UnknownSinkError(f"expected a live sink {sink_id!r}, found a dropped one")
        epoch_n = 1 + max((v.epoch for v in s.sinks.values()), default=0)
        adopted = replace(old, adopt_shard=True, replace_contents=False, epoch=epoch_n)
        return replace(s, sinks={**s.sinks, sink_id: adopted})

    return t


# -- sink health (written by the write service, read by `shardsink status`) --------------------

HEALTH_ROOT = "sink-health"


@dataclass(frozen=True, slots=True)
class SinkHealth:
    """What the write service last said of a sink: ``state`` is ``ok`` or ``refusing``."""

    sink_id: str
    epoch: int
    state: str
    message: str
    partitions: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"sink_id": self.sink_id, "epoch": self.epoch, "state": self.state,
                "message": self.message, "partitions": self.partitions, "at_ms": now_ms()}


def put_sink_health(store: ObjectStore, health: SinkHealth) -> None:
    store.put(f"{HEALTH_ROOT}/{health.sink_id}.json", json.dumps(health.to_json()).encode())


def sink_health(store: ObjectStore, sink_id: str) -> dict[str, Any] | None:
    """The sink's last health record, or None when the write service never wrote one."""
    from shared.errors import ObjectNotFoundError

    try:
        return dict(json.loads(store.get(f"{HEALTH_ROOT}/{sink_id}.json")))
    except ObjectNotFoundError:
        return None


def quarantine_key(sink_id: str, epoch: int) -> str:
    return f"{HEALTH_ROOT}/{sink_id}-e{epoch}.quarantine.json"


def quarantine_record(store: ObjectStore, sink_id: str, epoch: int) -> dict[str, Any]:
    """The sink epoch's quarantine object: ``ranges`` quarantined so far and ``failing``, the
    micro-batch failing now (``batch_id``, ``failures``, ``reason``, ``at_ms``) or None."""
    from shared.errors import ObjectNotFoundError

    try:
        record = dict(json.loads(store.get(quarantine_key(sink_id, epoch))))
    except ObjectNotFoundError:
        record = {}
    return {"sink_id": sink_id, "epoch": epoch, "ranges": list(record.get("ranges", [])),
            "failing": record.get("failing")}


def sink_quarantine(store: ObjectStore, sink_id: str, epoch: int) -> list[dict[str, Any]]:
    """The input ranges the write service quarantined for a sink's epoch (each: ``topic``,
    ``partition``, ``start``, ``end``, ``batch_id``, ``failures``, ``reason``, ``at_ms``)."""
    return list(quarantine_record(store, sink_id, epoch)["ranges"])


def sink_failing(store: ObjectStore, sink_id: str, epoch: int) -> dict[str, Any] | None:
    """The write micro-batch of a sink's epoch that failed on its input and is not yet
    quarantined (``batch_id``, ``failures``, ``reason``, ``at_ms``), or None."""
    failing = quarantine_record(store, sink_id, epoch)["failing"]
    return dict(failing) if failing else None


def count_sink_failure(store: ObjectStore, sink_id: str, epoch: int, batch_id: int, reason: str) -> int:
    """One more failure of micro-batch ``batch_id`` on its input; returns how many in a row
    (a failure of another batch starts again at 1). Kept in the quarantine object, so the
    count survives a restart of the write service (one writer per sink: its driver)."""
    record = quarantine_record(store, sink_id, epoch)
    prev = record["failing"]
    failures = int(prev["failures"]) + 1 if prev and int(prev["batch_id"]) == batch_id else 1
    record["failing"] = {"batch_id": batch_id, "failures": failures, "reason": reason, "at_ms": now_ms()}
    store.put(quarantine_key(sink_id, epoch), json.dumps(record).encode())
    return failures


def add_sink_quarantine(store: ObjectStore, sink_id: str, epoch: int, ranges: list[dict[str, Any]]) -> None:
    """Record more quarantined ranges; the failing micro-batch they come from is failing no
    more (one writer per sink: the write service's driver)."""
    record = quarantine_record(store, sink_id, epoch)
    record["ranges"] = record["ranges"] + [{**r, "at_ms": now_ms()} for r in ranges]
    record["failing"] = None
    store.put(quarantine_key(sink_id, epoch), json.dumps(record).encode())


def allow_writes_transition(sink_id: str) -> Transition:
    def t(s: CatalogState) -> CatalogState:
        old = s.sink(sink_id)
        if not old.read_only:
            return s
        return replace(s, sinks={**s.sinks, sink_id: replace(old, read_only=False)})

    return t
