"""The append service's shared query (``SHARDSINK_QUERIES=shared``): one query over ``descs``
and ``batches`` appends for every sink the instance serves.

Each micro-batch's control messages are decoded once on the driver and routed by their sink
id to the sink's :class:`services.append.service.SinkAppender` (the per-sink contract of
:mod:`services.append.service` is unchanged: one :class:`shared.append_state.AppendState` per
sink, exactly-once append by the description's token). Messages of sinks this instance does not
serve are skipped, as a per-sink query skips other sinks' messages.

State: every member's appender state is saved with each micro-batch's offsets, in one driver
state object keyed ``<sink>@<epoch>`` (:mod:`services.runtime.driver_state`); a sink that joins
starts from fresh state, one that left is dropped from it.

Failure isolation. A sink whose messages fail (its shard refuses the append, S3 keeps failing
for its collection) is held alone: its messages of the micro-batch are kept in the saved state
(``pending``) and retried, in order and before newer ones, at the next micro-batches, with
backoff; the other sinks go on. The sink is named in the log and in :attr:`SharedAppend.failing`
(metrics), until a retry succeeds.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from services.append.service import SinkAppender
from services.runtime.driver_state import DriverStateLog
from services.runtime.fleet import Fleet, KeyLocks, prepare, sink_key
from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import interruptible
from services.sinkio import KIND_CONTROL, ControlProducer, collect_decoded, decode_on_driver, read_planned_batch
from shared.append_state import AppendState
from shared.codec import message_codec
from shared.errors import DecodeError, ShardsinkError
from shared.side_by_side import SideBySide

log = logging.getLogger("shardsink.append")

#: Sinks whose messages are processed side by side (threads: S3 round trips).
PARALLEL_SINKS = 8
#: See :meth:`SharedAppend._look_back`.
JOIN_LOOKBACK = 10_000


def message_sink(topic: str, value: bytes | None, settings: ServiceSettings) -> str | None:
    """The sink id a control message is for (None: not a message of descs or batches, or one
    that does not decode: the sink it was for skips it too)."""
    try:
        if topic == settings.descs_topic:
            return str(message_codec("batch_description").decode(value or b"")["sink_id"])
        if topic == settings.batches_topic:
            return str(message_codec("written_batch").decode(value or b"")["sink_id"])
    except (DecodeError, ShardsinkError, KeyError, TypeError):
        return None
    return None


@dataclass
class SharedAppend:
    """The driver's part of the shared append query."""

    settings: ServiceSettings
    fleet: Fleet
    registry: dict[str, SinkAppender]
    producer: ControlProducer
    #: per key: the messages of a failing sink not appended yet, ``(topic, value)`` in order
    pending: dict[str, list[tuple[str, bytes | None]]] = field(default_factory=dict)
    #: per key: consecutive failures and the monotonic time of the next retry
    failing: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    #: keys of appenders made without saved state: their first micro-batch looks back
    fresh: set[str] = field(default_factory=set)
    #: where the micro-batch being processed starts (None: unknown, the checkpoint's first)
    batch_start: dict[str, dict[int, int]] | None = None

    _lock: KeyLocks = field(default_factory=KeyLocks)
    _threads: SideBySide = field(default_factory=lambda: SideBySide(PARALLEL_SINKS, "append-sinks"))

    def sync(self, members: dict[str, Any]) -> None:
        """Make the parts of the members that have none yet (called by the fleet when they
        change), side by side."""
        prepare(sorted(members), self.appender, "append")

    def appender(self, key: str, saved: dict[str, Any] | None = None) -> SinkAppender | None:
        """The member's part (made at its first use; None: not a member)."""
        with self._lock(key):
            return self._appender(key, saved)

    def _appender(self, key: str, saved: dict[str, Any] | None = None) -> SinkAppender | None:
        sink = self.fleet.members().get(key)
        if sink is None:
            return None
        a = self.registry.get(sink.sink_id)
        if a is None or sink_key(a.sink) != key:
            a = SinkAppender.create(sink, self.settings, self.producer)
            a.flush_each = False  # one flush per micro-batch (process)
            if saved is not None:
                a.state = AppendState.restore(saved)
            else:
                self.fresh.add(key)
            self.registry[sink.sink_id] = a
        a.sink = sink
        return a

    def restore(self, saved: dict[str, Any] | None) -> None:
        if not saved:
            return
        for key, st in saved.get("sinks", {}).items():
            self.appender(key, st)
        for key, msgs in saved.get("pending", {}).items():
            self.pending[key] = [(t, None if v is None else base64.b64decode(v)) for t, v in msgs]

    def state_texts(self) -> dict[str, str]:
        """Every member's appender state as JSON text, taken again only for a sink whose state
        may have changed since: it processed messages, or its state was made or restored. (At
        a hundred sinks most sinks' states stand still in a micro-batch, and each holds a
        window of remembered descriptions.)"""
        members = self.fleet.members()
        out: dict[str, str] = {}
        for a in list(self.registry.values()):
            key = sink_key(a.sink)
            if key not in members:
                continue
            c = self._texts.get(key)
            if c is None or c[0] is not a.state or key in self._dirty:
                c = (a.state, json.dumps(a.state.checkpoint(), sort_keys=True, separators=(",", ":")))
                self._texts[key] = c
            out[key] = c[1]
        self._dirty.clear()
        for key in [k for k in self._texts if k not in out]:
            del self._texts[key]
        return out

    def checkpoint_bytes(self) -> bytes:
        """The query's driver state (JSON): every member's appender state and the pending
        messages of failing sinks."""
        members = self.fleet.members()
        texts = self.state_texts()
        pending = json.dumps({k: [[t, None if v is None else base64.b64encode(v).decode()] for t, v in msgs]
                              for k, msgs in self.pending.items() if k in members}, sort_keys=True, separators=(",", ":"))
        sinks = ",".join(f"{json.dumps(k)}:{texts[k]}" for k in sorted(texts))
        return f'{{"pending":{pending},"sinks":{{{sinks}}}}}'.encode()

    def checkpoint(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.checkpoint_bytes())
        return state

    def process(self, topics: list[str], values: list[bytes | None]) -> None:
        members = self.fleet.members()
        by_id = {s.sink_id: k for k, s in members.items()}
        routed: dict[str, list[tuple[str, bytes | None]]] = {}
        for t, v in zip(topics, values, strict=True):
            sid = message_sink(t, v, self.settings)
            key = by_id.get(sid) if sid is not None else None
            if key is not None:
                routed.setdefault(key, []).append((t, v))
        for key in list(self.pending):
            if key not in members:
                del self.pending[key]
                self.failing.pop(key, None)
        looked = self._look_back(members)
        now = time.monotonic()
        work: list[tuple[str, SinkAppender, list[tuple[str, bytes | None]]]] = []
        for key in sorted(set(routed) | set(self.pending) | set(looked)):
            msgs = looked.get(key, []) + self.pending.get(key, []) + routed.get(key, [])
            fails = self.failing.get(key)
            if fails is not None and now < fails[1]:
                self.pending[key] = msgs  # backing off: held, in order
                continue
            a = self.appender(key, None)
            if a is not None:
                self._dirty.add(key)
                work.append((key, a, msgs))

        def run(item: tuple[str, SinkAppender, list[tuple[str, bytes | None]]]) -> Exception | None:
            try:
                item[1].process_messages(item[2])
            except Exception as e:  # noqa: BLE001 - one sink's failure is that sink's alone
                return e
            return None

        # The sinks' appends are S3 round trips: side by side on a few threads.
        outcomes = self._threads.map(run, work)
        # The announcements of every sink go out on one flush (a flush waits for the shared
        # producer's every message anyway).
        self.producer.flush()
        for (key, a, msgs), e in zip(work, outcomes, strict=True):
            fails = self.failing.get(key)
            if e is not None:
                a._to_delete = []
                n = (fails[0] if fails else 0) + 1
                delay = min(60.0, 2.0 ** min(n, 6) / 2)
                self.failing[key] = (n, now + delay, f"{type(e).__name__}: {e}"[:500])
                self.pending[key] = msgs
                # The state may hold half of the micro-batch: take it back to the saved one.
                saved = self._saved.get(key)
                a.state = AppendState.restore(json.loads(saved)) if saved else AppendState(a.sink.sink_id)
                log.error("append failed for this sink (held, retried in %.0fs; the other sinks go on): %s",
                          delay, e, extra={"sink_id": a.sink.sink_id})
                continue
            self.pending.pop(key, None)
            if self.failing.pop(key, None) is not None:
                log.info("append recovered for this sink", extra={"sink_id": a.sink.sink_id})
        for sid, a in list(self.registry.items()):
            if sink_key(a.sink) not in members:
                del self.registry[sid]

    #: per key: the appender's state as the micro-batch began (JSON text, :meth:`state_texts`)
    _saved: dict[str, str] = field(default_factory=dict)
    #: per key: the state object last taken as text, and its text
    _texts: dict[str, tuple[AppendState, str]] = field(default_factory=dict)
    #: keys whose state may have changed since its text was taken
    _dirty: set[str] = field(default_factory=set)

    def _look_back(self, members: dict[str, Any]) -> dict[str, list[tuple[str, bytes | None]]]:
        """The messages of sinks new to this query among the last :data:`JOIN_LOOKBACK` records
        of each partition of ``descs`` and ``batches`` before the micro-batch: a description or
        report produced before this appender took the sink (separate services follow the
        catalog each on its own clock)."""
        fresh = {k for k in self.fresh if k in members}
        self.fresh -= fresh | {k for k in self.fresh if k not in members}
        if not fresh or not self.batch_start:
            return {}
        from services.sinkio import read_ranges_on_driver
        from shared.io.kafka import OffsetProbe

        want = {members[k].sink_id: k for k in fresh}
        tps = [(t, p) for t in (self.settings.descs_topic, self.settings.batches_topic) for p in self.batch_start.get(t, {})]
        probe = OffsetProbe(self.settings.kafka, 30.0)
        try:
            lows = probe.watermarks(tps, earliest=True) if tps else {}
        finally:
            probe.close()
        ranges = [(t, p, max(lows.get((t, p), 0), e - JOIN_LOOKBACK), e) for t, p in tps
                  for e in [self.batch_start[t][p]] if e > max(lows.get((t, p), 0), e - JOIN_LOOKBACK)]
        out: dict[str, list[tuple[str, bytes | None]]] = {}
        if not ranges:
            return out
        raw = read_ranges_on_driver(self.settings.kafka, ranges)
        for t, v in zip(raw["topic"].to_pylist(), raw["value"].to_pylist(), strict=True):
            sid = message_sink(t, v, self.settings)
            if sid in want:
                out.setdefault(want[sid], []).append((t, v))
        return out


def start_shared_append_query(spark: Any, settings: ServiceSettings, fleet: Fleet, registry: dict[str, SinkAppender],
                              shared: list[SharedAppend] | None = None) -> Any:
    from services.append.source import append_source
    from shared.spark.kafka_connector import _connector, kafka_read_stream

    checkpoint = fleet.checkpoint
    states = DriverStateLog(spark, checkpoint)
    try:
        saved = states.restore()
    except (FileNotFoundError, ValueError) as e:
        log.warning("starting a new shared append checkpoint (the old one has no usable state: %s)", e)
        states.reset()
        saved = None
    registry.clear()
    app = SharedAppend(settings, fleet, registry, ControlProducer.create(settings.kafka, "append-shared"))
    app.restore(saved)
    if shared is not None:
        shared[:] = [app]
    fleet.on_members = app.sync
    app.sync(fleet.members())
    df = kafka_read_stream(spark, settings.kafka, [settings.descs_topic, settings.batches_topic],
                           starting_offsets="earliest", source=append_source(settings.descs_topic),
                           wait_for_records_ms=settings.source_wait_ms)
    ours = _connector(None) != "builtin"

    def each(batch_df: Any, batch_id: int) -> None:
        from services.runtime.driver_state import planned_offsets
        from shared.kafka_offsets import offsets_from_json

        before = planned_offsets(states.files, batch_id - 1) if batch_id > 0 else None
        app.batch_start = offsets_from_json(before) if before else None
        raw = read_planned_batch(states.files, batch_id, settings.kafka) if ours else None
        table = decode_on_driver(raw, None) if raw is not None else collect_decoded(batch_df, None, on_driver=True)
        keep = [i for i, k in enumerate(table["kind"].to_pylist()) if k == KIND_CONTROL]
        topics = table["topic"].to_pylist()
        values = table["value"].to_pylist()
        app._saved = app.state_texts()
        app.process([topics[i] for i in keep], [values[i] for i in keep])
        states.save(batch_id, app.checkpoint_bytes())

    name = f"append-shared-{settings.sink_shard.index}of{settings.sink_shard.count}"
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
