"""Shared queries (``SHARDSINK_QUERIES=shared``): one streaming query per service serves every
sink of the instance.

:class:`Fleet` follows the catalog like :class:`services.runtime.supervisor.Supervisor`, but
instead of a query per sink it keeps one query, started once, and a membership: the live sinks
this instance serves whose desired topic exists. Sinks join and leave the membership at the
query's next micro-batch, without a restart:

- the query's driver step asks :meth:`Fleet.members` at each micro-batch;
- the query's source runner (a Python process of its own, on the driver) reads the same
  membership from :attr:`Fleet.members_file`, a small JSON file in the query's checkpoint,
  rewritten (atomically) when it changes: ``{"sinks": {"<sink>@<epoch>": {definition...}}}``.

A sink's state lives under ``<root>/<service>-shared/<sink>-e<epoch>`` (the write service's
state versions) or in the query's driver state, keyed ``<sink>@<epoch>``: a re-created sink (a
new epoch) starts from fresh state, and a dropped sink's folder is removed as the per-sink
supervisor removes its checkpoints. A failed query is restarted with backoff; one sink's
failure is the service's to hold without failing the query (see each service's shared
module).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.runtime.checkpoints import checkpoint_owner
from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import stop_query
from shared.catalog import Catalog, SinkDef
from shared.side_by_side import side_by_side

log = logging.getLogger("shardsink")


def sink_key(sink: SinkDef) -> str:
    """A sink's key in a shared query: ``<sink>@<epoch>`` (a Kafka topic name holds no ``@``,
    so a key never reads as a topic)."""
    return f"{sink.sink_id}@{sink.epoch}"


def shared_root(settings: ServiceSettings, service: str) -> str:
    """Where a service's shared query keeps its checkpoint and its sinks' state."""
    return f"{settings.checkpoint_dir.rstrip('/')}/{service}-shared"


def shared_checkpoint(settings: ServiceSettings, service: str) -> str:
    """The shared query's checkpoint (one per share of the sinks, :attr:`ServiceSettings.sink_shard`)."""
    shard = settings.sink_shard
    return f"{shared_root(settings, service)}/query-{shard.index}of{shard.count}"


def sink_state_dir(settings: ServiceSettings, service: str, sink: SinkDef) -> str:
    """A sink's own state folder beside the shared query's checkpoint."""
    return f"{shared_root(settings, service)}/{sink.sink_id}-e{sink.epoch}"


#: Members' parts made side by side when many join at once (a start with a hundred sinks):
#: making one is a few S3 and Kafka round trips.
PREPARE_THREADS = 8


class KeyLocks:
    """One lock per member key: a shared driver makes a member's part under its key's lock,
    so different members' parts are made side by side (the fleet's thread preparing new
    members, the micro-batch's thread using them)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.RLock] = {}

    def __call__(self, key: str) -> threading.RLock:
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.RLock()
            return lock


def prepare(keys: list[str], make: Callable[[str], Any], what: str) -> None:
    """``make(key)`` for each of ``keys`` on a few threads (a part that cannot be made now is
    made at the sink's first micro-batch instead, with the error logged here)."""
    def one(key: str) -> None:
        try:
            make(key)
        except Exception as e:  # noqa: BLE001 - made at the sink's first micro-batch instead
            log.warning("%s: could not prepare %s: %s", what, key, e)

    side_by_side(one, keys, PREPARE_THREADS)


def write_members(path: str, members: dict[str, SinkDef], extra: dict[str, dict[str, Any]] | None = None) -> None:
    """The membership file the shared query's source reads (a temporary file renamed into
    place: a reader never sees half of it); ``extra``: more fields per key."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    extra = extra or {}
    body = {"sinks": {k: {**s.to_json(), **extra.get(k, {})}
                      for k, s in sorted(members.items())}}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, sort_keys=True)
    os.replace(tmp, path)


@dataclass
class Fleet:
    """One service's shared query and the sinks it serves (module docstring)."""

    name: str
    settings: ServiceSettings
    #: Starts the shared query (called once, and again after a failure); returns it.
    start_query: Callable[[Fleet], Any]
    #: Whether a sink can be served yet (its desired topic exists); asked once per new sink.
    ready: Callable[[SinkDef], bool] = lambda _sink: True
    #: Called when a member's definition changes in place (read-only -> writable).
    on_change: Callable[[SinkDef], None] | None = None
    #: More fields of a member's entry in the members file (asked once per member, and again
    #: after :meth:`refresh`), e.g. the write service's row schema and quarantined ranges.
    describe: Callable[[SinkDef], dict[str, Any]] | None = None
    #: Deletes folders under the service's shared root that the predicate rejects.
    reap: Callable[[Callable[[str], bool]], Any] | None = None
    #: Called with the members after they changed (the shared driver makes its per-sink parts
    #: then, so a sink's parts exist before its first micro-batch).
    on_members: Callable[[dict[str, SinkDef]], None] | None = None
    query: Any = None
    restarts: int = 0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _members: dict[str, SinkDef] = field(default_factory=dict)
    _described: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _catalog: Catalog | None = None
    _failures: int = 0
    _retry_at: float = 0.0
    _started_at: float = 0.0
    _reaped: bool = False

    @property
    def checkpoint(self) -> str:
        return shared_checkpoint(self.settings, self.name)

    @property
    def members_file(self) -> str:
        """A local file (the source runner runs on the driver's machine): in the checkpoint when
        that is local, else in the temporary folder."""
        cp = self.checkpoint
        if cp.startswith("file:") or "://" not in cp:
            return cp.removeprefix("file:") + "/members.json"
        import hashlib
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"shardsink-{hashlib.sha1(cp.encode()).hexdigest()[:12]}", "members.json")

    def refresh(self, key: str) -> None:
        """Describe a member again and rewrite the members file now."""
        with self._lock:
            self._described.pop(key, None)
            members = dict(self._members)
        self._write(members)

    def _write(self, members: dict[str, SinkDef]) -> None:
        extra: dict[str, dict[str, Any]] = {}
        if self.describe is not None:
            for key, sink in members.items():
                if key not in self._described:
                    self._described[key] = self.describe(sink)
                extra[key] = self._described[key]
            for key in list(self._described):
                if key not in members:
                    del self._described[key]
        write_members(self.members_file, members, extra)

    def members(self) -> dict[str, SinkDef]:
        """The sinks served now, by :func:`sink_key`."""
        with self._lock:
            return dict(self._members)

    def member(self, sink_id: str) -> SinkDef | None:
        with self._lock:
            return next((s for s in self._members.values() if s.sink_id == sink_id), None)

    def _keep(self, name: str, live: dict[str, SinkDef]) -> bool:
        owner = checkpoint_owner(name)
        if owner is None:
            return True  # the queries' checkpoints
        sink_id, epoch = owner
        if epoch < 0 or not self.settings.serves(sink_id):
            return epoch >= 0
        sink = live.get(sink_id)
        return sink is not None and sink.epoch == epoch

    def poll_once(self) -> None:
        if self._catalog is None:
            self._catalog = self.settings.catalog()
        self.apply({s.sink_id: s for s in self._catalog.state().live_sinks()})

    def apply(self, live: dict[str, SinkDef]) -> None:
        """Follow the catalog's live sinks: membership, the members file, clean-up, the query."""
        wanted = {sid: s for sid, s in live.items() if self.settings.serves(sid)}
        with self._lock:
            old = dict(self._members)
        members: dict[str, SinkDef] = {}
        for sink in wanted.values():
            key = sink_key(sink)
            if key in old or self.ready(sink):
                members[key] = sink
        changed = members != old
        for key, sink in members.items():
            if key in old and old[key] != sink and self.on_change is not None:
                try:
                    self.on_change(sink)
                except Exception as e:  # noqa: BLE001 - a nudge is an optimisation
                    log.warning("announcing the change failed: %s", e, extra={"sink_id": sink.sink_id})
        if changed or not os.path.exists(self.members_file):
            self._write(members)
            with self._lock:
                self._members = members
            if self.on_members is not None:
                try:
                    self.on_members(members)
                except Exception as e:  # noqa: BLE001 - the driver makes them at its next micro-batch
                    log.warning("%s: preparing the new members failed: %s", self.name, e)
            for key in sorted(set(members) - set(old)):
                log.info("%s takes the sink (epoch %d; %d sinks now)", self.name, members[key].epoch, len(members),
                         extra={"sink_id": members[key].sink_id})
            for key in sorted(set(old) - set(members)):
                log.info("%s leaves the sink (epoch %d; %d sinks now)", self.name, old[key].epoch, len(members),
                         extra={"sink_id": old[key].sink_id})
        if self.reap is not None and (not self._reaped or set(old) - set(members)):
            self._reaped = True
            try:
                gone = self.reap(lambda name: self._keep(name, live))
                if gone:
                    log.info("removed %s state of %s", self.name, gone)
            except Exception as e:  # noqa: BLE001 - a failed clean-up must not stop the service
                log.warning("removing old %s state failed: %s", self.name, e)
        self._supervise()

    def _supervise(self) -> None:
        q = self.query
        if q is not None and not q.isActive:
            exc = q.exception()
            if self.clock() - self._started_at > self.max_backoff_s:
                self._failures = 0
            delay = min(self.max_backoff_s, self.backoff_s * 2**self._failures)
            self._failures += 1
            self._retry_at = self.clock() + delay
            self.restarts += 1
            log.error("the shared %s query failed, restarting in %.1fs: %s", self.name, delay, exc)
            self.query = None
        if self.query is None and self.clock() >= self._retry_at:
            self.query = self.start_query(self)
            self._started_at = self.clock()
            log.info("started the shared %s query", self.name)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - the fleet must outlive bad polls
                log.error("catalog poll failed: %s", e, exc_info=True)
            self._stop.wait(self.settings.catalog_poll_ms / 1000.0)

    def start(self) -> Fleet:
        self._thread = threading.Thread(target=self.run_forever, name=f"{self.name}-fleet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        q, self.query = self.query, None
        stop_query(q)


@dataclass
class FleetGroup:
    """The fleets of one application (``python -m services``) following the catalog together:
    one catalog read per poll, applied to the fleets in their order. Given write, append,
    mint, a sink joins the writer and the appender before the minter can mint its first
    description, so no description of a new sink reaches a service that does not serve it yet."""

    settings: ServiceSettings
    fleets: list[Fleet]
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _catalog: Catalog | None = None

    def poll_once(self) -> None:
        if self._catalog is None:
            self._catalog = self.settings.catalog()
        live = {s.sink_id: s for s in self._catalog.state().live_sinks()}
        for f in self.fleets:
            try:
                f.apply(live)
            except Exception as e:  # noqa: BLE001 - one service's trouble is not the others'
                log.error("%s: applying the catalog failed: %s", f.name, e, exc_info=True)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - the group must outlive bad polls
                log.error("catalog poll failed: %s", e, exc_info=True)
            self._stop.wait(self.settings.catalog_poll_ms / 1000.0)

    def start(self) -> FleetGroup:
        self._thread = threading.Thread(target=self.run_forever, name="fleets", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for f in self.fleets:
            f.stop()
