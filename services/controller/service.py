"""The controller: a command loop over ``commands``, answering on ``responses``.

It owns the catalog (collections, sinks, read policies), a critical reader hold on every
collection's shard (so since = the meet of the read policy's implied capability and the
holds of peeks, subscribes and sinks), frontier reporting, peeks, subscribes and drops.
Not a Spark application: one process, one thread for the loop and one maintenance worker
that compacts and garbage-collects shards off the loop (a merge of many batches must not
delay the answer to a peek).

The loop (one iteration)::

    consume a few commands (assign()ed partitions, offsets kept in the catalog)
    for each: answer from the command log (a replayed id) or apply it (handle_*)
    tick: report upper advances, move sinces (then ask the worker to compact and gc),
          retire waiting peeks, advance subscribes, reclaim dropped collections

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

Subscribe output (per step: changes in ``[lower, frontier)`` then a progress statement):

1. commit the intent ``emitting = {to, offset}`` (``offset``: the output partition's end);
2. produce the step's messages (sorted: deterministic), flush;
3. commit ``progress = to``.

On recovery a subscribe with an intent counts its messages already on the topic after
``offset`` and produces only the rest of the (re-computed, identical) step: no gap, no
duplicate. Its hold keeps since at or below its progress, so the step re-computes the same.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from services.common import ServiceSettings
from services.sinkio import ControlProducer
from shared.avro_arrow import arrow_to_rows, parse_row_schema
from shared.catalog import (
    Catalog,
    CatalogState,
    CollectionDef,
    FencedError,
    SinkDef,
    allow_writes_transition,
    alter_collection_transition,
    create_collection_transition,
    create_sink_transition,
    drop_collection_transition,
    drop_sink_transition,
)
from shared.codec import RowCodec, kind_of, message_codec, tagged
from shared.controller_state import (
    Capabilities,
    CommandRejected,
    ControllerSection,
    error_kind,
    should_report,
    sink_hold,
    subscribe_hold,
    subscribe_step,
)
from shared.errors import (
    ConflictRetryError,
    DecodeError,
    IndeterminateError,
    KafkaAdapterError,
    KafkaDeliveryError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    ObjectStoreError,
    ShardDroppedError,
    ShardNotFoundError,
    ShardsinkError,
)
from shared.frontier import Frontier
from shared.objectstore import now_ms
from shared.read_policy import ValidFrom, policy_from_avro, policy_from_json
from shared.shard import DIFF, ERROR, TIME, Shard, validate_shard_id
from shared.state import CRITICAL, ShardState

log = logging.getLogger("shardsink")

#: Failures the controller recovers from by itself (re-running recovery with backoff).
_TRANSIENT: tuple[type[BaseException], ...] = (
    ObjectStoreError, IndeterminateError, ConflictRetryError, KafkaUnavailableError, KafkaTimeoutError,
    KafkaDeliveryError, ConnectionError, TimeoutError,
)

READER_ID = "controller"
#: Subscribe output is produced in chunks of this many messages (see _produce_step), and a
#: step gives up for this tick after this many failed chunks.
_SUB_CHUNK = 1000
_SUB_FAILURES = 100
#: Logged responses larger than this go to an S3 object named in the log.
_LOG_INLINE_MAX = 4096


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """Controller settings (env / flags parsed once in ``__main__``)."""

    service: ServiceSettings
    commands_topic: str = "commands"
    responses_topic: str = "responses"
    tick_ms: int = 50
    #: How long a peek at a time not yet readable waits before NotReadableYet.
    peek_timeout_ms: int = 30_000
    #: Peek results up to this many encoded bytes are answered inline.
    max_inline_bytes: int = 64 * 1024
    #: Bound of the command log (idempotent replay of command ids).
    log_max_entries: int = 1000
    #: Routine gc of live shards and of old catalog states.
    gc_interval_ms: int = 30_000
    #: A dropped collection's objects are deleted after this long (0: at once).
    reclaim_grace_ms: int = 0
    #: Commit the command offset when idle for this long.
    idle_commit_ms: int = 500

    def __post_init__(self) -> None:
        if self.tick_ms <= 0 or self.peek_timeout_ms < 0 or self.max_inline_bytes < 0 or self.log_max_entries < 1:
            raise ValueError(
                "expected tick_ms > 0, peek_timeout_ms >= 0, max_inline_bytes >= 0, log_max_entries >= 1, found "
                f"{self.tick_ms}, {self.peek_timeout_ms}, {self.max_inline_bytes}, {self.log_max_entries}"
            )


@dataclass
class PendingPeek:
    command_id: str
    collection_id: str
    as_of: int
    limit: int | None
    max_inline: int
    deadline: float


@dataclass
class _Collection:
    """In-memory view of a live collection (rebuilt on start)."""

    shard: Shard
    caps: Capabilities
    row_codec: RowCodec
    batches_seen: int = -1


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


def _j(v: Any) -> str:
    return json.dumps(v)


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:32]


class Maintenance:
    """Compaction and gc of shards in one worker thread, off the command loop.

    The loop asks (:meth:`request`); the worker merges (``compact_below_since`` when since
    moved, then the tiered ``compact``) and collects garbage. A merge commits only if its
    batches are all still there, so racing appends, other compactors or a drop are safe; a
    failed job is logged and run again after a pause (backoff up to 30 s). At most one job
    per collection is pending: requests for a collection already waiting merge into it.
    """

    def __init__(self, store: Any, grace_ms: int, *, max_merges: int = 8) -> None:
        self.store = store
        self.grace_ms = grace_ms
        self.max_merges = max_merges
        self._jobs: dict[str, dict[str, bool]] = {}
        self._shards: dict[str, Shard] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self.jobs_done = 0
        self.errors = 0
        self._backoff = 0.5
        self._thread = threading.Thread(target=self._run, name="controller-maintenance", daemon=True)
        self._thread.start()

    def request(self, collection_id: str, *, below_since: bool = False, compact: bool = False, gc: bool = False) -> None:
        with self._cond:
            job = self._jobs.setdefault(collection_id, {"below_since": False, "compact": False, "gc": False})
            job["below_since"] |= below_since
            job["compact"] |= compact
            job["gc"] |= gc
            self._cond.notify()

    def forget(self, collection_id: str) -> None:
        with self._cond:
            self._jobs.pop(collection_id, None)
            self._shards.pop(collection_id, None)

    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                cid = next(iter(self._jobs))
                job = self._jobs.pop(cid)
                shard = self._shards.get(cid)
                if shard is None:
                    shard = self._shards[cid] = Shard(self.store, cid, grace_ms=self.grace_ms)
                self._busy = True
            retry = False
            try:
                self._do(cid, shard, job)
            except (ShardDroppedError, ShardNotFoundError):
                self.forget(cid)
            except Exception as e:  # noqa: BLE001 - the job is asked again after a pause
                self.errors += 1
                retry = True
                log.warning("maintenance failed, retrying in %.1fs: %r", self._backoff, e,
                            extra={"collection_id": cid})
            with self._cond:
                self._busy = False
                self.jobs_done += 1
                if retry:
                    self._cond.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, 30.0)
                else:
                    self._backoff = 0.5
            if retry:
                self.request(cid, **job)

    def _do(self, cid: str, shard: Shard, job: dict[str, bool]) -> None:
        if job["below_since"]:
            shard.compact_below_since()
        if job["below_since"] or job["compact"]:
            if shard.compact(max_merges=self.max_merges) >= self.max_merges:
                self.request(cid, compact=True)  # more to merge: yield to other collections
        if job["gc"]:
            shard.gc()


@dataclass
class Controller:
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
        self.collections: dict[str, _Collection] = {}
        self.peeks: dict[str, PendingPeek] = {}
        self.section = ControllerSection()
        self.next_offsets: dict[int, int] = {}
        self._last_gc = 0.0
        self._last_activity = time.monotonic()
        self.producer: ControlProducer | None = None
        self.consumer: Any = None
        self._probe: Any = None  # a long-lived OffsetProbe (output partition ends)
        self.maintenance: Maintenance | None = None

    # ==============================================================================================
    # lifecycle
    # ==============================================================================================
    def start(self) -> Controller:
        """Run the loop in a thread; returns once the controller serves commands."""
        self._thread = threading.Thread(target=self._run_guarded, name="controller", daemon=True)
        self._thread.start()
        while not self._ready.wait(0.1):
            if not self._thread.is_alive():
                raise RuntimeError(f"controller failed to start: {self.error!r}")
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run_guarded(self) -> None:
        """Run; a transient failure (S3 or Kafka unreachable, an outcome unknown) while
        recovering or serving restarts from recovery with exponential backoff instead of
        stopping the process. Anything else stops it (recorded in ``error``)."""
        backoff = 0.5
        try:
            while True:
                try:
                    self.run()
                    return
                except _TRANSIENT as e:
                    if self._stop.is_set():
                        return
                    log.warning("controller: transient failure, recovering again in %.1fs: %r", backoff, e)
                    if self._stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, 30.0)
                except BaseException as e:  # noqa: BLE001 - recorded for start()/tests, logged
                    self.error = e
                    log.error("controller stopped: %r", e, exc_info=True)
                    return
        finally:
            self._ready.set()

    def run(self) -> None:
        """Recover, then serve until stopped or fenced."""
        try:
            self.recover()
            self._ready.set()
            tick_s = self.settings.tick_ms / 1000.0
            while not self._stop.is_set():
                msgs = self.consumer.consume(num_messages=64, timeout=tick_s)
                for m in msgs:
                    if m.error() is not None:
                        log.warning("commands consumer: %s", m.error())
                        continue
                    self._handle_message(int(m.partition()), int(m.offset()), m.value())
                try:
                    self.tick()
                except FencedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a bad tick must not stop the loop
                    log.error("tick failed: %r", e, exc_info=True)
                    self._stop.wait(0.2)
        except FencedError as e:
            self.fenced = True
            log.error("fenced out by a newer controller: %s", e)
        finally:
            if self.maintenance is not None:
                self.maintenance.stop()
                self.maintenance = None
            if self.consumer is not None:
                try:
                    self.consumer.close()
                except Exception:  # noqa: BLE001
                    pass
                self.consumer = None
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            if self.producer is not None:
                try:
                    self.producer.flush(5)
                except Exception:  # noqa: BLE001
                    pass
                self.producer = None

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
        self.producer = ControlProducer.create(k, "controller")
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
                    body = self.cmd_codec.decode(_unb64(entry["pending"]))["body"]
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
        with OffsetProbe(k) as probe:
            parts = probe.partitions_of(s.commands_topic)
        self.consumer = new_consumer(k, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "20"})
        self.next_offsets = {p: int(self.section.offsets.get(str(p), 0)) for p in parts}
        self.consumer.assign([TopicPartition(s.commands_topic, p, o) for p, o in self.next_offsets.items()])
        self.maintenance = Maintenance(self.store, s.service.grace_ms)

    def _open_collection(self, c: CollectionDef) -> _Collection:
        shard = Shard.create(self.store, c.collection_id, c.schema, since=c.since, grace_ms=self.settings.service.grace_ms)
        st = shard.refresh()
        if not st.dropped and st.reader(READER_ID) is None:
            st = shard.register_reader(READER_ID, kind=CRITICAL)
        col = _Collection(shard, Capabilities(st.since), RowCodec(c.schema))
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
        return self._encode_response(command_id, "Ack", {"results": {k: _j(v) for k, v in results.items()}})

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
            return {"o": where, "r": _b64(response)}
        key = f"controller/responses/{_digest(command_id)}.avro"
        self.store.put(key, response)
        return {"o": where, "k": key}

    def _logged_response(self, entry: dict[str, Any]) -> bytes | None:
        if "r" in entry:
            return _unb64(entry["r"])
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

    # -- collections ---------------------------------------------------------------------------
    def handle_CreateCollection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = validate_shard_id(b["collection_id"])
        try:
            schema = parse_row_schema(json.loads(b["row_schema"]))
        except json.JSONDecodeError as e:
            raise CommandRejected("SchemaError", f"expected the row schema as JSON text, found: {e}") from None
        since = int(b.get("initial_since") or 0)
        policy = ValidFrom(Frontier.at(since)) if b.get("read_policy") is None else policy_from_avro(b["read_policy"])
        cdef = CollectionDef(collection_id, schema, since, policy.to_json())
        create = create_collection_transition(cdef)
        create(self.catalog.state())  # validate first: reuse of a dropped or other definition
        # 1. the shard (idempotent: opens it if a crash left it without a catalog entry)
        col = self._open_collection(cdef)
        st = col.shard.refresh()
        # 2. catalog entry, response, offset in one commit
        self._answer(
            cid,
            self._ack(cid, collection_id=collection_id, since=st.since.to_json(), upper=st.upper.to_json()),
            where=where,
            offset=off,
            change=lambda s, sec: create(s),
        )

    def handle_AlterCollection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        c = self.catalog.state().collection(b["collection_id"])
        try:
            schema = parse_row_schema(json.loads(b["row_schema"]))
        except json.JSONDecodeError as e:
            raise CommandRejected("SchemaError", f"expected the row schema as JSON text, found: {e}") from None
        if schema != c.schema:
            raise CommandRejected(
                "SchemaError",
                f"expected the collection's current row schema (schema evolution is not supported by "
                f"the shard storage yet), found another for {c.collection_id!r}",
                collection_id=c.collection_id,
            )
        self._answer(cid, self._ack(cid, collection_id=c.collection_id), where=where, offset=off)

    def handle_SetReadPolicy(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        policy = policy_from_avro(b["policy"])
        alter = alter_collection_transition(b["collection_id"], policy.to_json())
        alter(self.catalog.state())
        self._answer(
            cid, self._ack(cid, collection_id=b["collection_id"], policy=policy.to_json()),
            where=where, offset=off, change=lambda s, sec: alter(s),
        )

    def handle_DropCollection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = b["collection_id"]
        self.catalog.state().collection(collection_id)  # a dropped or unknown id is an error
        drop = drop_collection_transition(collection_id)
        due = now_ms() + self.settings.reclaim_grace_ms

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState:
            sec.reclaim[collection_id] = due
            return drop(s)

        self._answer(cid, self._ack(cid, collection_id=collection_id), where=where, offset=off, change=t)
        # Readers are told at once (peeks answered, subscribes closed, upper {} reported) and
        # the storage is reclaimed, by the tick.

    # -- sinks -----------------------------------------------------------------------------------
    def handle_CreateSink(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        state = self.catalog.state()
        c = state.collection(b["collection_id"])
        as_of = b.get("as_of")
        if as_of is None:
            existing = state.sinks.get(b["sink_id"])
            if existing is not None and not existing.dropped:
                as_of = existing.as_of
            else:
                upper = self.collections[c.collection_id].shard.refresh().upper
                as_of = upper.time if upper.time is not None else 0
        sink = SinkDef(b["sink_id"], b["desired_topic"], c.collection_id, as_of=int(as_of), read_only=bool(b.get("read_only")))
        create = create_sink_transition(sink)
        create(state)
        self._answer(
            cid, self._ack(cid, sink_id=sink.sink_id, as_of=sink.as_of),
            where=where, offset=off, change=lambda s, sec: create(s),
        )

    def handle_DropSink(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        self.catalog.state().sink(b["sink_id"])
        drop = drop_sink_transition(b["sink_id"])
        self._answer(cid, self._ack(cid, sink_id=b["sink_id"]), where=where, offset=off, change=lambda s, sec: drop(s))

    def handle_AllowWrites(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        state = self.catalog.state()
        ids = b.get("sink_ids")
        if ids is None:
            ids = [s.sink_id for s in state.live_sinks()]
        for sid in ids:
            state.sink(sid)
        ts = [allow_writes_transition(sid) for sid in ids]

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState:
            for f in ts:
                s = f(s)
            return s

        self._answer(cid, self._ack(cid, sink_ids=list(ids)), where=where, offset=off, change=t)
        from services.runner import nudge

        for sid in ids:
            try:
                nudge(self.settings.service, state.sinks[sid])
            except Exception as e:  # noqa: BLE001 - a nudge only speeds things up
                log.warning("nudge failed: %r", e, extra={"sink_id": sid})

    # -- append ----------------------------------------------------------------------------------
    def handle_Append(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = b["collection_id"]
        self.catalog.state().collection(collection_id)
        col = self.collections[collection_id]
        token = f"cmd-{_digest(cid)}"
        state = col.shard.refresh()
        if state.find_token(token) is None:
            expected = state.upper if b.get("expected_upper") is None else Frontier.at(int(b["expected_upper"]))
            new = Frontier.from_json(b.get("new_upper"))
            rows = []
            for u in b["updates"]:
                t, d = int(u["time"]), int(u["diff"])
                if new.time is not None and t >= new.time:
                    raise CommandRejected(
                        "UpdateBeyondUpper",
                        f"expected every update's time < new upper {new!r}, found {t}",
                        collection_id=collection_id, time=t, new_upper=new.to_json(),
                    )
                if not expected.is_empty() and t < (expected.time or 0):
                    raise CommandRejected(
                        "InvalidUsage",
                        f"expected every update's time >= expected upper {expected!r}, found {t}",
                        collection_id=collection_id, time=t, expected_upper=expected.to_json(),
                    )
                try:
                    row = col.row_codec.decode(u["row"])
                except DecodeError as e:
                    raise CommandRejected("DecodeError", f"expected rows of the collection's schema, found: {e}") from None
                rows.append((row, t, d))
            if not expected.less_equal(new):
                raise CommandRejected(
                    "InvalidUsage", f"expected new upper >= expected upper {expected!r}, found {new!r}",
                    collection_id=collection_id,
                )
            state = col.shard.compare_and_append(rows or None, expected, new, token=token)
        self._answer(cid, self._ack(cid, collection_id=collection_id, upper=state.upper.to_json()), where=where, offset=off)

    # -- peeks ------------------------------------------------------------------------------------
    def handle_Peek(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        peek, ready = self._prepare_peek(cid, b)
        if ready:
            self._answer(cid, self._peek_response(peek), where=where, offset=off)
            return
        # Not readable yet: wait (logged as pending, so that it survives a restart).
        max_entries = self.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.record(cid, {"o": where, "pending": _b64(raw)}, max_entries)
            sec.offsets[str(off[0])] = off[1] + 1

        self._commit(t)
        self.peeks[cid] = peek

    def _prepare_peek(self, cid: str, b: dict[str, Any]) -> tuple[PendingPeek, bool]:
        """Validate a peek; returns it and whether it is readable now."""
        from shared.errors import SinceViolationError

        collection_id = b["collection_id"]
        self.catalog.state().collection(collection_id)
        col = self.collections[collection_id]
        state = col.shard.refresh()
        as_of = b.get("as_of")
        if as_of is None:
            as_of = max((state.upper.time or 1) - 1, 0) if not state.upper.is_empty() else 0
        as_of = int(as_of)
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(
                f"expected as_of >= since {state.since!r}, found {as_of}",
                collection_id=collection_id, as_of=as_of, since=state.since,
            )
        limit = b.get("limit")
        if limit is not None and int(limit) < 0:
            raise CommandRejected("InvalidUsage", f"expected a limit >= 0, found {limit}")
        max_inline = b.get("max_inline_bytes")
        peek = PendingPeek(
            cid, collection_id, as_of, None if limit is None else int(limit),
            self.settings.max_inline_bytes if max_inline is None else int(max_inline),
            time.monotonic() + self.settings.peek_timeout_ms / 1000.0,
        )
        return peek, state.upper.is_empty() or as_of < (state.upper.time or 0)

    def _peek_response(self, peek: PendingPeek) -> bytes:
        col = self.collections[peek.collection_id]
        table = col.shard.snapshot(peek.as_of)
        if peek.limit is not None:
            table = table.slice(0, peek.limit)
        row_cols = col.shard.row_columns
        has_errors = table.num_rows > 0 and table[ERROR].null_count != table.num_rows
        result: tuple[str, dict[str, Any]] | None = None
        if not has_errors and table.nbytes <= 4 * peek.max_inline + 1024:
            rows = arrow_to_rows(table.select(row_cols), col.row_codec.schema)
            encoded = [col.row_codec.encode(r) for r in rows]
            size = sum(len(e) + 10 for e in encoded)
            if size <= peek.max_inline:
                diffs = table[DIFF].to_pylist()
                result = tagged(
                    "InlineRows", {"rows": [{"row": e, "count": int(d)} for e, d in zip(encoded, diffs, strict=True)]}
                )
        if result is None:
            out = table.select([*row_cols, *([ERROR] if has_errors else []), DIFF])
            buf = io.BytesIO()
            pq.write_table(out, buf, compression="snappy")
            key = f"peeks/{peek.collection_id}/{_digest(peek.command_id)}.parquet"
            self.store.put(key, buf.getvalue())
            prefix = self.settings.service.s3.prefix
            full = (prefix.rstrip("/") + "/" if prefix else "") + key
            result = tagged(
                "StoredRows",
                {"bucket": self.settings.service.s3.bucket, "key": full, "format": "parquet", "row_count": out.num_rows},
            )
        return self._encode_response(
            peek.command_id, "PeekResult", {"collection_id": peek.collection_id, "as_of": peek.as_of, "result": result}
        )

    def _retire_peek(self, peek: PendingPeek, response: bytes | Callable[[str], bytes] | None = None) -> None:
        """Answer a logged (pending) peek: replace its log entry by the response."""
        resp = response if response is not None else self._peek_response(peek)
        self.peeks.pop(peek.command_id, None)
        self._answer(peek.command_id, resp, where="peek")

    def handle_CancelPeek(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        target = b["peek_command_id"]
        peek = self.peeks.pop(target, None)
        if peek is None:
            self._answer(cid, self._ack(cid, peek_command_id=target, canceled=False), where=where, offset=off)
            return
        canceled = self._encode_response(target, "PeekCanceled", {"peek_command_id": target})
        entry = self._log_entry(target, canceled, "peek")
        max_entries = self.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.record(target, entry, max_entries)

        self._commit(t)
        self._send(canceled, target)
        self._answer(cid, self._ack(cid, peek_command_id=target, canceled=True), where=where, offset=off)

    # -- subscribes -------------------------------------------------------------------------------
    def handle_Subscribe(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        from shared.errors import SinceViolationError
        from shared.io.kafka_admin import ensure_topic

        collection_id = b["collection_id"]
        self.catalog.state().collection(collection_id)
        col = self.collections[collection_id]
        state = col.shard.refresh()
        topic = str(b["output_topic"])
        if not topic or len(topic) > 249:
            raise CommandRejected("InvalidUsage", f"expected an output topic name, found {topic!r}")
        as_of = b.get("as_of")
        as_of = (state.since.time or 0) if as_of is None else int(as_of)
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(
                f"expected as_of >= since {state.since!r}, found {as_of}",
                collection_id=collection_id, as_of=as_of, since=state.since,
            )
        up_to = b.get("up_to")
        ensure_topic(self.settings.service.kafka, topic, 1)
        sub = {
            "collection_id": collection_id,
            "topic": topic,
            "as_of": as_of,
            "up_to": None if up_to is None else int(up_to),
            "with_snapshot": bool(b.get("with_snapshot", True)),
            "progress": None,
            "state": "active" if up_to is None or int(up_to) > as_of else "closing",
            "emitting": None,
        }

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.subs[cid] = sub

        self._answer(
            cid, self._ack(cid, subscribe_id=cid, output_topic=topic, as_of=as_of),
            where=where, offset=off, change=t,
        )

    def handle_CancelSubscribe(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        target = b["subscribe_command_id"]
        sub = self.section.subs.get(target)
        if sub is None:
            raise CommandRejected("IdentifierMissing", f"expected a subscribe {target!r}, found none", subscribe_id=target)
        active = sub.get("state") == "active"

        def t(s: CatalogState, sec: ControllerSection) -> None:
            if sec.subs.get(target, {}).get("state") == "active":
                sec.subs[target]["state"] = "closing"

        self._answer(cid, self._ack(cid, subscribe_id=target, canceled=active), where=where, offset=off, change=t)

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
        heads: dict[str, ShardState] = {}
        for cid in live:
            heads[cid] = self.collections[cid].shard.refresh()
        self._report_uppers(catalog, heads)
        self._retire_peeks(live, heads)
        self._advance_subscribes(live, heads)
        self._move_sinces(catalog, heads)
        self._reclaim()
        self._maybe_gc(live)
        self._idle_offsets()

    # -- frontier reporting ---------------------------------------------------------------------
    def _report_uppers(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        changes: dict[str, int | None] = {}
        for cid, st in heads.items():
            rep = self.section.reported
            prev = Frontier.from_json(rep[cid]) if cid in rep else None
            if should_report(prev, st.upper):
                changes[cid] = st.upper.to_json()
        for cid, c in catalog.collections.items():
            if c.dropped and cid in self.section.reported and self.section.reported[cid] is not None:
                changes[cid] = None
        if not changes:
            return
        for cid, up in changes.items():
            self._send(self._encode_response(None, "FrontierUpper", {"collection_id": cid, "upper": up}), cid)
        self._flush()

        def t(s: CatalogState, sec: ControllerSection) -> None:
            for cid, up in changes.items():
                prev = sec.reported.get(cid, -1)
                if cid not in sec.reported or (prev is not None and (up is None or up > prev)):
                    sec.reported[cid] = up

        self._commit(t)

    # -- peeks -------------------------------------------------------------------------------------
    def _retire_peeks(self, live: dict[str, CollectionDef], heads: dict[str, ShardState]) -> None:
        for peek in list(self.peeks.values()):
            st = heads.get(peek.collection_id)
            if st is None:
                err = ShardDroppedError(f"expected a live collection {peek.collection_id!r}, found it dropped",
                                        collection_id=peek.collection_id)
                self._retire_peek(peek, self._error(err))
            elif st.upper.is_empty() or peek.as_of < (st.upper.time or 0):
                self._retire_peek(peek)
            elif time.monotonic() >= peek.deadline:
                from shared.errors import NotReadableYetError

                err2 = NotReadableYetError(
                    f"expected as_of < upper {st.upper!r} within the peek timeout of "
                    f"{self.settings.peek_timeout_ms} ms, found {peek.as_of}",
                    collection_id=peek.collection_id, as_of=peek.as_of, upper=st.upper,
                    timeout_ms=self.settings.peek_timeout_ms,
                )
                self._retire_peek(peek, self._error(err2))

    # -- read capabilities ----------------------------------------------------------------------
    def _move_sinces(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        for cid, st in heads.items():
            if st.dropped:
                continue
            col = self.collections[cid]
            c = catalog.collections[cid]
            policy = policy_from_json(c.read_policy, default_since=c.since)
            holds: dict[str, Frontier] = {}
            for p in self.peeks.values():
                if p.collection_id == cid:
                    holds[f"peek:{p.command_id}"] = Frontier.at(p.as_of)
            for sid, sub in self.section.subs.items():
                if sub["collection_id"] == cid and sub.get("state") != "done":
                    holds[f"subscribe:{sid}"] = subscribe_hold(sub)
            for s in catalog.live_sinks():
                if s.collection_id == cid:
                    holds[f"sink:{s.sink_id}"] = sink_hold(st.upper)
            col.caps = col.caps.advance_implied(policy, st.upper).with_holds(holds)
            target = col.caps.since(st.upper)
            hold = st.reader(READER_ID)
            current = hold.since if hold is not None else st.since
            moved = current.less_than(target)
            if moved:
                st = col.shard.downgrade_since(READER_ID, target)
            if moved or len(st.batches) != col.batches_seen:
                assert self.maintenance is not None
                self.maintenance.request(cid, below_since=moved, compact=True)
                col.batches_seen = len(st.batches)

    # -- drops -----------------------------------------------------------------------------------
    def _reclaim(self) -> None:
        done: list[str] = []
        for cid, due in self.section.reclaim.items():
            shard = Shard(self.store, cid, grace_ms=self.settings.service.grace_ms)
            try:
                shard.drop()
            except ShardNotFoundError:
                done.append(cid)
                continue
            shard.gc(grace_ms=self.settings.reclaim_grace_ms)
            if now_ms() >= due and len(shard.list_objects()) <= 1:
                done.append(cid)
        if done:
            def t(s: CatalogState, sec: ControllerSection) -> None:
                for cid in done:
                    sec.reclaim.pop(cid, None)

            self._commit(t)

    def _maybe_gc(self, live: dict[str, CollectionDef]) -> None:
        if time.monotonic() - self._last_gc < self.settings.gc_interval_ms / 1000.0:
            return
        self._last_gc = time.monotonic()
        assert self.maintenance is not None
        for cid in live:
            self.maintenance.request(cid, gc=True)
        self.catalog.collect(self.settings.service.grace_ms)

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

    # -- subscribes ------------------------------------------------------------------------------
    def _advance_subscribes(self, live: dict[str, CollectionDef], heads: dict[str, ShardState]) -> None:
        for sid in list(self.section.subs):
            sub = self.section.subs[sid]
            if sub.get("state") == "done":
                continue
            try:
                self._advance_subscribe(sid, sub, heads)
            except FencedError:
                raise
            except Exception as e:  # noqa: BLE001 - one failing subscribe must not stop the others
                log.error("subscribe %s failed: %r", sid, e, exc_info=True)

    def _advance_subscribe(self, sid: str, sub: dict[str, Any], heads: dict[str, ShardState]) -> None:
        cid = sub["collection_id"]
        emitting = sub.get("emitting")
        if emitting is not None:
            # Recovery: a step was intended and may be partly on the topic.
            to = Frontier.from_json(emitting["to"])
            msgs = self._step_messages(sid, sub, to, bool(emitting.get("final")), emitting.get("lower_kind"))
            start = int(emitting["offset"])
            self._produce_step(sid, sub["topic"], msgs, self._count_on_topic(sub["topic"], sid, start))
            self._finish_step(sid, to, bool(emitting.get("final")))
            return
        st = heads.get(cid)
        if st is None or sub.get("state") == "closing":
            # Dropped collection or cancelled: the final progress statement only.
            to = Frontier.empty()
            self._emit_step(sid, sub, to, True, "final")
            return
        step = subscribe_step(sub, st.upper)
        if step is None:
            return
        _, to, _ = step
        up_to = sub.get("up_to")
        final = to.is_empty() or (up_to is not None and to == Frontier.at(int(up_to)))
        self._emit_step(sid, sub, to, final, "step")

    def _emit_step(self, sid: str, sub: dict[str, Any], to: Frontier, final: bool, lower_kind: str) -> None:
        from shared.io.kafka import OffsetProbe

        msgs = self._step_messages(sid, sub, to, final, lower_kind)
        if self._probe is None:
            self._probe = OffsetProbe(self.settings.service.kafka)
        offset = self._probe.ends([(sub["topic"], 0)])[(sub["topic"], 0)]
        intent = {"to": to.to_json(), "final": final, "offset": offset, "lower_kind": lower_kind}

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.subs[sid]["emitting"] = intent

        self._commit(t)
        self._produce_step(sid, sub["topic"], msgs, (0, offset))
        self._finish_step(sid, to, final)

    def _finish_step(self, sid: str, to: Frontier, final: bool) -> None:
        def t(s: CatalogState, sec: ControllerSection) -> None:
            sub = sec.subs[sid]
            sub["emitting"] = None
            if not to.is_empty():
                sub["progress"] = to.time
            if final:
                sub["state"] = "done"

        self._commit(t)

    def _produce_step(self, sid: str, topic: str, msgs: list[bytes], known: tuple[int, int]) -> None:
        """Make ``msgs`` the messages of subscribe ``sid`` on ``topic`` after the step's start.

        ``known = (n, pos)``: the first ``n`` of ``msgs`` are on the topic, all before offset
        ``pos``. The rest go out in chunks, each flushed. A chunk that fails may have partly
        landed (a delivery error fails the messages after it too, never leaving a gap; a
        message may land and still report an error): the messages of ``sid`` from ``pos`` on
        are counted and production goes on after them. So a failure costs a re-count of
        one chunk, not of the whole step, and a large step still completes when deliveries
        fail now and then. After ``_SUB_FAILURES`` failed chunks the error is raised; the
        next tick resumes from the recorded intent.
        """
        n, pos = known
        failures = 0
        while n < len(msgs):
            chunk = msgs[n : n + _SUB_CHUNK]
            delivered = [-1]

            def on_delivery(err: Any, msg: Any, delivered: list[int] = delivered) -> None:
                if err is None and msg is not None and msg.offset() is not None:
                    delivered[0] = max(delivered[0], int(msg.offset()))
                assert self.producer is not None
                self.producer._on_delivery(err, msg)

            for m in chunk:
                self._produce_sub(topic, m, sid, on_delivery)
            try:
                self._flush()
            except KafkaAdapterError:
                failures += 1
                if failures >= _SUB_FAILURES:
                    raise
                landed, pos = self._count_on_topic(topic, sid, pos)
                n += landed
                continue
            n += len(chunk)
            pos = max(pos, delivered[0] + 1)

    def _produce_sub(self, topic: str, value: bytes, sid: str, on_delivery: Callable[[Any, Any], None]) -> None:
        assert self.producer is not None
        while True:
            try:
                self.producer.producer.produce(topic, value=value, key=sid.encode(), partition=0, on_delivery=on_delivery)
                return
            except BufferError:
                self.producer.producer.poll(0.05)

    def _step_messages(self, sid: str, sub: dict[str, Any], to: Frontier, final: bool, lower_kind: str | None) -> list[bytes]:
        """The (deterministic) messages of one step: sorted changes, progress, final."""
        enc = self.sub_codec.encode
        out: list[bytes] = []
        cid = sub["collection_id"]
        if lower_kind != "final" and cid in self.collections:
            col = self.collections[cid]
            state = col.shard.refresh()
            progress = sub.get("progress")
            as_of = int(sub["as_of"])
            changes: list[tuple[int, bytes, int]] = []
            if progress is None:
                lower = as_of + 1
                if sub.get("with_snapshot", True):
                    snap = col.shard.snapshot(as_of)
                    changes += self._changes(col, snap, as_of)
            else:
                lower = int(progress)
            if to.is_empty() or lower < (to.time or 0):
                table = col.shard.updates_between(state, lower, to)
                changes += self._changes(col, table, None)
            changes.sort(key=lambda c: (c[0], c[1], c[2]))
            for t, row, d in changes:
                out.append(enc({"subscribe_id": sid, "time": t, "progressed": False, "diff": d, "row": row}))
            if not to.is_empty():
                out.append(enc({"subscribe_id": sid, "time": to.time, "progressed": True, "diff": None, "row": None}))
        if final:
            out.append(enc({"subscribe_id": sid, "time": None, "progressed": True, "diff": None, "row": None}))
        return [bytes(m) for m in out]

    @staticmethod
    def _changes(col: _Collection, table: pa.Table, at: int | None) -> list[tuple[int, bytes, int]]:
        if table.num_rows == 0:
            return []
        ok = table.filter(pc.is_null(table[ERROR]))  # error rows have no row to send
        rows = arrow_to_rows(ok.select(col.shard.row_columns), col.row_codec.schema)
        diffs = ok[DIFF].to_pylist()
        times = [at] * ok.num_rows if at is not None else ok[TIME].to_pylist()
        return [(int(t), col.row_codec.encode(r), int(d)) for t, r, d in zip(times, rows, diffs, strict=True)]

    def _count_on_topic(self, topic: str, sid: str, start: int) -> tuple[int, int]:
        """How many messages of subscribe ``sid`` partition 0 of ``topic`` holds from offset
        ``start``, and the offset up to which they were counted."""
        from confluent_kafka import TopicPartition

        from shared.io.kafka import OffsetProbe, new_consumer

        with OffsetProbe(self.settings.service.kafka) as probe:
            end = probe.ends([(topic, 0)])[(topic, 0)]
        if end <= start:
            return 0, start
        c = new_consumer(self.settings.service.kafka, **{"auto.offset.reset": "earliest"})
        n = 0
        try:
            c.assign([TopicPartition(topic, 0, start)])
            pos = start
            deadline = time.monotonic() + 60
            while pos < end and time.monotonic() < deadline:
                for m in c.consume(num_messages=1000, timeout=0.2):
                    if m.error() is not None:
                        continue
                    pos = max(pos, int(m.offset() or 0) + 1)
                    try:
                        if self.sub_codec.decode(m.value() or b"")["subscribe_id"] == sid:
                            n += 1
                    except DecodeError:
                        continue
        finally:
            c.close()
        if pos < end:
            # A partial count would make the caller produce messages already there again.
            raise KafkaTimeoutError(
                f"expected to read {topic}/0 from {start} to {end} within 60 s, reached {pos}", topic=topic
            )
        return n, pos


def new_command_id() -> str:
    return uuid.uuid4().hex
