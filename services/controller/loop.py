"""The controller's command loop and command log: the base every room builds on.

Contract:

- inputs: ``commands`` (assign()ed partitions, offsets kept in the catalog), the catalog,
  the shards' heads, and the upper announcements on ``frontiers`` (read from its end, by the
  same consumer), which say whose head to read again;
- state: the catalog's controller section (:class:`shared.controller_state.ControllerSection`:
  offsets, command log, reported uppers, subscribes, pending reclaims), fenced by the
  controller epoch; in memory the open collections and the waiting peeks, rebuilt by
  :meth:`CommandLoop.recover`;
- outputs: one response per command on ``responses`` (answered from the command log when an
  id is replayed, never applied twice);
- invariants: every catalog write carries the epoch (a newer controller fences this one out);
  a command's offset is committed together with its logged response.

The loop (one iteration)::

    consume a few commands (and announcements: their collections' heads are read at the tick)
    for each: answer from the command log (a replayed id) or apply it (handle_*, in the rooms)
    tick: read the heads that are due (waited on, announced, or head_refresh_ms old),
          report upper advances (frontiers.py), retire waiting peeks (peeks.py), advance
          subscribes (subscribes.py), move sinces (capabilities.py; then the maintenance
          worker compacts and gcs), reclaim dropped collections (maintenance.py)

Commit order of a command (every catalog write is fenced by the controller epoch):

1. idempotent effects outside the catalog, if any (create the shard; append with a token
   derived from the command id: a retry finds the token and is not applied twice);
2. one catalog commit: the command's catalog change, its response in the command log, and
   the command offset (``offsets[p] = o``: everything *before* o is answered);
3. produce the response, flush;
4. the next commit (or an idle commit) moves the offset past o.

After a crash between 2 and 4 the command at o is read again, found in the log, and its logged
response is sent again (identical bytes; applied once). A crash before 2 reapplies the command,
which is safe because the effects of step 1 are idempotent. A drop is committed first (the id
is dead at once) and its storage reclaimed by the tick from the ``reclaim`` list, so a crash
after the commit is finished by the next controller. Waiting peeks are logged as ``pending``
and restarted on recovery.

The rooms implement the hooks declared at the end of :class:`CommandLoop`;
:class:`services.controller.service.Controller` puts them together and runs this loop in
its process (start, serve, recover again after a transient failure, stop).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from services.controller.model import (
    READER_ID,
    ControllerSettings,
    OpenCollection,
    PendingPeek,
    b64,
    digest,
    heads_due,
    jdump,
    unb64,
)
from services.sinkio import ControlProducer
from shared.catalog import Catalog, CatalogState, CollectionDef, FencedError
from shared.codec import kind_of, message_codec, tagged
from shared.controller_state import Capabilities, CommandRejected, ControllerSection, error_kind
from shared.errors import (
    ConflictRetryError,
    DecodeError,
    IndeterminateError,
    KafkaDeliveryError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    ObjectStoreError,
    ShardsinkError,
)
from shared.frontier import Frontier
from shared.objectstore import now_ms
from shared.shard import Shard
from shared.state import CRITICAL, ShardState

if TYPE_CHECKING:
    from services.controller.maintenance import Maintenance
    from services.controller.spark_jobs import ControllerSpark

log = logging.getLogger("shardsink")

#: Failures the controller recovers from by itself (re-running recovery with backoff).
_TRANSIENT: tuple[type[BaseException], ...] = (
    ObjectStoreError, IndeterminateError, ConflictRetryError, KafkaUnavailableError, KafkaTimeoutError,
    KafkaDeliveryError, ConnectionError, TimeoutError,
)

#: Logged responses larger than this go to an S3 object named in the log.
_LOG_INLINE_MAX = 4096


@dataclass
class CommandLoop:
    settings: ControllerSettings
    #: Set once this controller has been fenced out by a newer one (it stopped writing).
    fenced: bool = False
    epoch: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        s = self.settings.service
        self.store = s.store()
        self.catalog: Catalog  # opened by recover() (it reads S3: a failure there is retried)
        self.cmd_codec = message_codec("command")
        self.resp_codec = message_codec("response")
        self.sub_codec = message_codec("subscribe_output")
        self.frontier_codec = message_codec("frontier_update")
        #: Shard heads the ticks read (:meth:`_heads`).
        self.head_reads = 0
        self.collections: dict[str, OpenCollection] = {}
        self.peeks: dict[str, PendingPeek] = {}
        self.section = ControllerSection()
        self.next_offsets: dict[int, int] = {}
        self._last_gc = 0.0
        self._last_activity = time.monotonic()
        self.producer: ControlProducer | None = None
        self.consumer: Any = None
        self._probe: Any = None  # a long-lived OffsetProbe (output partition ends)
        self.maintenance: Maintenance | None = None
        #: The Spark driver of the data-heavy work, when a master is set (spark_jobs.py).
        self.spark_jobs: ControllerSpark | None = None
        if self.settings.spark.enabled:
            from services.controller.spark_jobs import ControllerSpark, controller_session

            master = self.settings.spark.master
            assert master is not None
            self.spark_jobs = ControllerSpark(self.settings.spark, s.s3, lambda: controller_session(s, master))

    # ==============================================================================================
    # recovery (reconciliation with what the catalog and the shards say)
    # ==============================================================================================
    def recover(self) -> None:
        from confluent_kafka import TopicPartition

        from shared.io.kafka import OffsetProbe, new_consumer
        from shared.io.kafka_admin import ensure_topic

        s = self.settings
        k = s.service.kafka
        self.collections = {}
        self.peeks = {}
        ensure_topic(k, s.commands_topic, 1)
        ensure_topic(k, s.responses_topic, 1)
        # Every topic it writes exists first (responses above, a subscribe's output at its
        # Subscribe); one deleted later (tail deletes its own) is not brought back by a
        # metadata refresh of this producer, which would re-create it on brokers that create
        # topics on demand.
        self.producer = ControlProducer.create(k, "controller", auto_create_topics=False)
        if self.spark_jobs is not None:
            self.spark_jobs.start()  # in the background: the first job waits for it
        self.catalog = Catalog(self.store)
        # 1. fence out any older controller: from now on its catalog writes fail.
        self.epoch = self.catalog.claim_controller_epoch()
        state = self.catalog.state()
        self.section = ControllerSection.from_extra(state.extra)
        log.info("controller epoch %d, catalog seqno %d", self.epoch, state.seqno)
        # 2. every live collection: open its shard (creating it if a crash left only the
        #    catalog entry) and make sure the controller's critical hold is there.
        for c in state.live_collections():
            self._open_collection(c)
        # 3. waiting peeks are restarted from their logged command.
        for cid, entry in list(self.section.log.items()):
            if "pending" in entry:
                try:
                    body = self.cmd_codec.decode(unb64(entry["pending"]))["body"]
                    peek, ready = self._prepare_peek(cid, body[1])
                    if ready:
                        self._retire_peek(peek)
                    else:
                        self.peeks[cid] = peek
                except FencedError:
                    raise
                except Exception as e:  # noqa: BLE001 - answered as an error, never dropped
                    self._answer(cid, self._error(e), where="peek")
        # 4. subscribes with an unfinished output step and dropped collections not yet
        #    reclaimed are finished by the tick. Commands sent while down are read from the
        #    recorded offsets.
        #    The same consumer reads ``frontiers`` from its end: an upper announced there is
        #    read at the next tick (every head was just read above).
        ensure_topic(k, s.service.frontiers_topic, 1)
        with OffsetProbe(k) as probe:
            parts = probe.partitions_of(s.commands_topic)
            fparts = probe.partitions_of(s.service.frontiers_topic)
            fends = probe.ends([(s.service.frontiers_topic, p) for p in fparts])
        self.consumer = new_consumer(k, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "20"})
        self.next_offsets = {p: int(self.section.offsets.get(str(p), 0)) for p in parts}
        self.consumer.assign([TopicPartition(s.commands_topic, p, o) for p, o in self.next_offsets.items()]
                             + [TopicPartition(t, p, o) for (t, p), o in fends.items()])
        self._start_maintenance()

    def _open_collection(self, c: CollectionDef) -> OpenCollection:
        shard = Shard.create(self.store, c.collection_id, c.schema, since=c.since, grace_ms=self.settings.service.grace_ms)
        st = shard.refresh()
        if not st.dropped and st.reader(READER_ID) is None:
            st = shard.register_reader(READER_ID, kind=CRITICAL)
        col = OpenCollection(shard, Capabilities(st.since))
        self.collections[c.collection_id] = col
        return col

    # ==============================================================================================
    # catalog commits
    # ==============================================================================================
    def _commit(self, change: Callable[[CatalogState, ControllerSection], CatalogState | None]) -> CatalogState:
        """One fenced catalog commit of ``change`` (pure: it may run again on a race)."""

        def t(s: CatalogState) -> CatalogState:
            sec = ControllerSection.from_extra(s.extra)
            new = change(s, sec)
            base = s if new is None else new
            return replace(base, extra=sec.to_extra(s.extra))

        state = self.catalog.update(t, epoch=self.epoch)
        self.section = ControllerSection.from_extra(state.extra)
        return state

    # ==============================================================================================
    # responses
    # ==============================================================================================
    def _encode_response(self, command_id: str | None, kind: str, body: dict[str, Any]) -> bytes:
        return bytes(
            self.resp_codec.encode({"command_id": command_id, "emitted_at_ms": now_ms(), "body": tagged(kind, body)})
        )

    def _ack(self, command_id: str, **results: Any) -> bytes:
        return self._encode_response(command_id, "Ack", {"results": {k: jdump(v) for k, v in results.items()}})

    def _error_for(self, command_id: str | None, e: BaseException) -> bytes:
        fields = getattr(e, "fields", None) or {}
        out = {}
        for k, v in fields.items():
            if isinstance(v, Frontier):
                v = v.to_json()
            try:
                out[k] = json.dumps(v)
            except TypeError:
                out[k] = json.dumps(repr(v))
        return self._encode_response(
            command_id, "Error", {"kind": error_kind(e), "message": str(e) or type(e).__name__, "fields": out}
        )

    def _error(self, e: BaseException) -> Callable[[str], bytes]:
        return lambda cid: self._error_for(cid, e)

    def _send(self, value: bytes, key: str | None = None) -> None:
        assert self.producer is not None
        self.producer.send(self.settings.responses_topic, value, key=None if key is None else key.encode())

    def _flush(self) -> None:
        assert self.producer is not None
        self.producer.flush()

    def _log_entry(self, command_id: str, response: bytes, where: str) -> dict[str, Any]:
        if len(response) <= _LOG_INLINE_MAX:
            return {"o": where, "r": b64(response)}
        key = f"controller/responses/{digest(command_id)}.avro"
        self.store.put(key, response)
        return {"o": where, "k": key}

    def _logged_response(self, entry: dict[str, Any]) -> bytes | None:
        if "r" in entry:
            return unb64(entry["r"])
        if "k" in entry:
            try:
                return self.store.get(entry["k"])
            except ShardsinkError:
                return None
        return None

    def _answer(
        self,
        command_id: str,
        response: bytes | Callable[[str], bytes],
        *,
        where: str = "",
        change: Callable[[CatalogState, ControllerSection], CatalogState | None] | None = None,
        offset: tuple[int, int] | None = None,
        extra: list[bytes] | None = None,
    ) -> None:
        """Commit ``change`` with the logged response (and the offset), then send it."""
        resp = response(command_id) if callable(response) else response
        entry = self._log_entry(command_id, resp, where)
        max_entries = self.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState | None:
            new = change(s, sec) if change is not None else None
            evicted = sec.record(command_id, entry, max_entries)
            for old in evicted:
                sec.log.pop(old, None)
            if offset is not None:
                sec.offsets[str(offset[0])] = offset[1]
            return new

        self._commit(t)
        self._send(resp, command_id)
        for v in extra or ():
            self._send(v)
        self._flush()

    # ==============================================================================================
    # the command loop
    # ==============================================================================================
    def _note_announcement(self, value: bytes | None) -> None:
        """An upper announced on ``frontiers``: the tick reads that collection's head."""
        try:
            shard_id = str(self.frontier_codec.decode(value or b"")["shard_id"])
        except (DecodeError, KeyError, TypeError) as e:
            log.warning("frontiers: skipped an undecodable announcement: %s", e)
            return
        col = self.collections.get(shard_id)
        if col is not None:
            col.announced = True

    def _handle_message(self, partition: int, offset: int, value: bytes | None) -> None:
        self._last_activity = time.monotonic()
        where = f"{partition}:{offset}"
        self.next_offsets[partition] = offset + 1
        try:
            cmd = self.cmd_codec.decode(value or b"")
            command_id = str(cmd["command_id"])
            body = cmd["body"]
            kind = kind_of(body)
        except (DecodeError, KeyError, TypeError) as e:
            err = DecodeError(f"expected a Command message, found undecodable bytes at commands {where}: {e}")
            self._send(self._error_for("unknown", err), "unknown")
            self._flush()
            return
        # A replayed id is answered from the log, never applied again.
        entry = self.section.log.get(command_id)
        if entry is not None:
            if "pending" in entry:
                return  # a waiting peek: its answer comes when it is retired
            logged = self._logged_response(entry)
            if logged is not None:
                self._send(logged, command_id)
                self._flush()
                return
        handler = getattr(self, f"handle_{kind}", None)
        off = (partition, offset)
        try:
            if handler is None:
                raise CommandRejected("InvalidUsage", f"expected a known command kind, found {kind!r}")
            handler(command_id, body[1], where, off, value or b"")
        except FencedError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a typed Error response
            if not isinstance(e, (ShardsinkError, CommandRejected, ValueError)):
                log.error("command %s (%s) failed: %r", command_id, kind, e, exc_info=True)
            self._answer(command_id, self._error(e), where=where, offset=off)

    # ==============================================================================================
    # the tick
    # ==============================================================================================
    def tick(self) -> None:
        catalog = self.catalog.state(fresh=False)
        # Fencing: a newer controller's claim is seen within the catalog cache age.
        fresh = self.catalog.state()
        if fresh.controller_epoch != self.epoch:
            raise FencedError(f"expected controller epoch {self.epoch}, found {fresh.controller_epoch}")
        catalog = fresh
        live = {c.collection_id: c for c in catalog.live_collections()}
        for cid in list(self.collections):
            if cid not in live:
                self.collections.pop(cid, None)
        for cid, c in live.items():
            if cid not in self.collections:
                self._open_collection(c)
        heads = self._heads(live)
        self._report_uppers(catalog, heads)
        self._retire_peeks(live, heads)
        self._advance_subscribes(live, heads)
        self._move_sinces(catalog, heads)
        self._reclaim()
        self._maybe_gc(live)
        self._idle_offsets()

    def _heads(self, live: dict[str, CollectionDef]) -> dict[str, ShardState]:
        """Each live collection's head: read again when someone waits on it (a peek, a running
        subscribe) or its appender announced an upper, and about every ``head_refresh_ms``
        otherwise (:func:`services.controller.model.heads_due`); else the last one read (by a
        tick or a command). An idle controller then reads each quiet head about once a second,
        not at every tick: that was an S3 request per collection every 50 ms, and with many
        collections ticks as long as the reads (100 collections: 213 ms a tick)."""
        urgent = {p.collection_id for p in self.peeks.values()}
        urgent |= {sub["collection_id"] for sub in self.section.subs.values() if sub.get("state") != "done"}
        urgent |= {cid for cid in live if self.collections[cid].announced}
        now = time.monotonic()
        due = heads_due({cid: self.collections[cid].refreshed_at for cid in live}, urgent, now,
                        self.settings.head_refresh_ms / 1000.0, self.settings.tick_ms / 1000.0)
        heads: dict[str, ShardState] = {}
        for cid in due:
            col = self.collections[cid]
            col.announced = False
            heads[cid] = col.shard.refresh()
            col.refreshed_at = now
            self.head_reads += 1
        for cid in live:
            if cid not in heads:
                heads[cid] = self.collections[cid].shard.head(max_age_s=1e9)
        return heads

    def _idle_offsets(self) -> None:
        """Commit the offsets past answered commands once the loop is idle."""
        if time.monotonic() - self._last_activity < self.settings.idle_commit_ms / 1000.0:
            return
        behind = {str(p): o for p, o in self.next_offsets.items() if self.section.offsets.get(str(p), 0) < o}
        if not behind:
            return

        def t(s: CatalogState, sec: ControllerSection) -> None:
            for p, o in behind.items():
                sec.offsets[p] = max(sec.offsets.get(p, 0), o)

        self._commit(t)


    # ==============================================================================================
    # hooks the rooms implement (see service.Controller)
    # ==============================================================================================
    def _prepare_peek(self, cid: str, b: dict[str, Any]) -> tuple[PendingPeek, bool]:
        raise NotImplementedError  # peeks.py

    def _retire_peek(self, peek: PendingPeek, response: bytes | Callable[[str], bytes] | None = None) -> None:
        raise NotImplementedError  # peeks.py

    def _retire_peeks(self, live: dict[str, CollectionDef], heads: dict[str, ShardState]) -> None:
        raise NotImplementedError  # peeks.py

    def _report_uppers(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        raise NotImplementedError  # frontiers.py

    def _advance_subscribes(self, live: dict[str, CollectionDef], heads: dict[str, ShardState]) -> None:
        raise NotImplementedError  # subscribes.py

    def _move_sinces(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        raise NotImplementedError  # capabilities.py

    def _start_maintenance(self) -> None:
        raise NotImplementedError  # maintenance.py

    def _reclaim(self) -> None:
        raise NotImplementedError  # maintenance.py

    def _maybe_gc(self, live: dict[str, CollectionDef]) -> None:
        raise NotImplementedError  # maintenance.py
