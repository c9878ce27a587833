"""The mint service's shared query (``SHARDSINK_QUERIES=shared``): one query over ``frontiers``
and every member sink's desired topic mints for every sink the instance serves.

The query's source (:class:`shared.spark.fleet_source.FleetStreamReader`) plans each
micro-batch's ranges: ``frontiers``, and each member's desired partitions under the sink's key.
The driver reads no desired update: the source finds, while planning, each admitted desired
range's latest progress statement (its tail, :class:`services.mint.source.MintFleetReader`, the
partitions of all sinks concurrently) and logs them with the micro-batch's offsets; the driver
reads a range's tail itself only when the source could not. It routes the ``frontiers`` announcements by sink id,
and runs the sink's :class:`services.mint.service.SinkMinter` (the per-sink contract of
:mod:`services.mint.service` is unchanged: strictly increasing lowers, a new epoch per start).
An announcement on ``frontiers`` carries its shard's new upper, which every member sink of the
collection absorbs as read (no read of the shard). A member with nothing new costs nothing,
except a sink waiting for its upper to move, whose shard is read in case an announcement was
lost: after :data:`services.mint.service.SHARD_REFRESH_S`, then twice as long each time the upper
has not moved, up to :data:`services.mint.service.SHARD_REFRESH_MAX_S`. The micro-batch's
descriptions go out on one flush.

State: per member (``<sink>@<epoch>``), the minter's state and its unread ranges, saved with
each micro-batch's offsets. Failure isolation: a member whose tail cannot be read keeps the
range as unread (read when it can matter, as :mod:`services.mint.service` says); a member whose
step fails is logged by name and retried at the next micro-batch; the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from services.mint.service import SinkMinter
from services.mint.source import fleet_planned_progress
from services.sinkio import desired_prefixes
from services.runtime.driver_state import DriverStateLog, planned_offsets
from services.runtime.fleet import Fleet, KeyLocks, prepare, sink_key
from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import interruptible
from services.mint.progress import decode_statements_on_driver, latest_progress_records, read_latest_progress_of
from services.sinkio import RAW_SCHEMA, ControlProducer, decode_on_driver, planned_ranges, read_ranges_on_driver
from shared.catalog import SinkDef
from shared.codec import message_codec
from shared.errors import DecodeError, ShardsinkError
from shared.side_by_side import SideBySide
from shared.sink_messages import AppendedBatch

log = logging.getLogger("shardsink.mint")

#: Sinks whose steps run side by side (threads: S3 round trips).
PARALLEL_SINKS = 8


@dataclass
class SharedMint:
    """The driver's part of the shared mint query."""

    settings: ServiceSettings
    fleet: Fleet
    registry: dict[str, SinkMinter]
    producer: ControlProducer
    failing: dict[str, str] = field(default_factory=dict)

    _lock: KeyLocks = field(default_factory=KeyLocks)
    _threads: SideBySide = field(default_factory=lambda: SideBySide(PARALLEL_SINKS, "mint-sinks"))

    def sync(self, members: dict[str, Any]) -> None:
        """Make the parts of the members that have none yet (called by the fleet when they
        change), side by side."""
        prepare(sorted(members), self.minter, "mint")

    def minter(self, key: str, saved: dict[str, Any] | None = None) -> SinkMinter | None:
        """The member's part (made at its first use; None: not a member)."""
        with self._lock(key):
            return self._minter(key, saved)

    def _minter(self, key: str, saved: dict[str, Any] | None = None) -> SinkMinter | None:
        from shared.io.kafka_admin import topic_partition_count

        sink = self.fleet.members().get(key)
        if sink is None:
            return None
        m = self.registry.get(sink.sink_id)
        if m is None or sink_key(m.sink) != key:
            m = SinkMinter.create(sink, self.settings, topic_partition_count(self.settings.kafka, sink.desired_topic), self.producer)
            if saved is not None:
                m.state.restore(saved)
                m.unread = {int(p): (int(a), int(b)) for p, (a, b) in saved.get("unread", {}).items()}
            m.backoff = True  # the announcements carry the uppers: reads only cover a lost one
            self.registry[sink.sink_id] = m
        if m.state.read_only and not sink.read_only:
            m.state.allow_writes()
        m.sink = sink
        return m

    def _failed(self, key: str, sink: Any, e: Exception) -> None:
        if key not in self.failing:
            log.error("mint failed for this sink (retried at the next micro-batch; the other sinks go on): %s",
                      e, extra={"sink_id": sink.sink_id})
        self.failing[key] = f"{type(e).__name__}: {e}"[:500]

    def restore(self, saved: dict[str, Any] | None) -> None:
        for key, st in (saved or {}).get("sinks", {}).items():
            try:
                self.minter(key, st)
            except ShardsinkError as e:
                log.warning("could not restore the minter of %s: %s", key, e)

    def checkpoint(self) -> dict[str, Any]:
        members = self.fleet.members()
        return {"sinks": {sink_key(m.sink): {**m.state.checkpoint(), "unread": {str(p): list(r) for p, r in m.unread.items()}}
                          for m in self.registry.values() if sink_key(m.sink) in members}}

    def process(self, ranges: list[tuple[str, int, int, int]] | None,
                progress: dict[str, dict[int, tuple[int, bytes] | None]] | None = None) -> None:
        """One micro-batch: ``ranges`` as planned (None: the first of a checkpoint, whose start
        Spark does not log: every member's shard is read, every desired partition's tail too).
        ``progress``: the latest statements the source found while planning, by member key
        and partition (:class:`services.mint.source.MintFleetReader`); a range without one
        has its tail read here."""
        s = self.settings
        members = self.fleet.members()
        prefix = desired_prefixes()[0]
        if ranges is None:
            ranges = _first_ranges(s, members)
            first = True
        else:
            first = False
        frontier_ranges = [r for r in ranges if r[0] == s.frontiers_topic]
        desired = [r for r in ranges if r[0] in members]
        # Announcements by shard: every sink of the collection learns the upper, whoever
        # appended (another replica, or the controller).
        announced: dict[str, list[tuple[int, bytes]]] = {}
        uppers: dict[str, list[Any]] = {}
        appended: dict[str, list[tuple[Any, AppendedBatch]]] = {}
        if frontier_ranges:
            raw = read_ranges_on_driver(s.kafka, frontier_ranges)
            codec = message_codec("frontier_update")
            for off, value in zip(raw["offset"].to_pylist(), raw["value"].to_pylist(), strict=True):
                try:
                    msg = codec.decode(value or b"")
                    shard_id, upper = str(msg["shard_id"]), msg["upper"]
                except (DecodeError, ShardsinkError, KeyError, TypeError):
                    continue
                announced.setdefault(shard_id, []).append((off, value))
                uppers.setdefault(shard_id, []).append(upper)
                added = AppendedBatch.from_dict(msg.get("appended"))
                if added is not None:
                    appended.setdefault(shard_id, []).append((upper, added))

        known = (progress or {}) if not first else {}  # a first batch reads its ranges from 0
        todo = [r for r in desired if r[1] not in known.get(r[0], {})]
        try:  # the tails read together: one consumer, one assignment
            got: list[Any] = latest_progress_records(
                s.kafka, [(members[key].desired_topic, p, a, b) for key, p, a, b in todo], prefix)
        except ShardsinkError as e:
            got = [e] * len(todo)
        read = dict(zip(todo, got, strict=True))
        tails = [read[r] if r in read else _found(known[r[0]][r[1]], r[2]) for r in desired]
        statements: dict[str, list[tuple[str, int, int, bytes]]] = {}
        unread: dict[str, list[tuple[int, int, int]]] = {}
        for (key, p, a, b), found in zip(desired, tails, strict=True):
            if isinstance(found, ShardsinkError):
                unread.setdefault(key, []).append((p, a, b))
            elif found is not None:
                statements.setdefault(key, []).append((members[key].desired_topic, p, found[0], found[1]))
            else:
                statements.setdefault(key, [])
        now = time.monotonic()
        work: list[tuple[str, Any, SinkMinter]] = []
        for key, sink in sorted(members.items()):
            news = key in statements or key in unread or sink.collection_id in announced
            try:
                m = self.minter(key)
            except Exception as e:  # noqa: BLE001 - one sink's failure is that sink's alone
                self._failed(key, sink, e)
                continue
            if m is None:
                continue
            waiting = not m.state.persist_advanced() and m.refresh_due(now)
            if news or first or waiting or m.unread or m.state.read_only:
                work.append((key, sink, m))  # else nothing new for this sink: it costs nothing

        def raw_of(key: str, sink: Any) -> pa.Table:
            rows = [(t, p, o, v) for t, p, o, v in statements.get(key, [])]
            rows += [(s.frontiers_topic, 0, o, v) for o, v in announced.get(sink.collection_id, [])]
            return pa.table({
                "topic": pa.array([r[0] for r in rows], pa.string()),
                "partition": pa.array([r[1] for r in rows], pa.int32()),
                "offset": pa.array([r[2] for r in rows], pa.int64()),
                "value": pa.array([r[3] for r in rows], pa.binary()),
            }, schema=RAW_SCHEMA)

        # Every sink's statements decoded as one batch (a decoder's fixed cost is most of a
        # sink's); should that fail, each sink decodes its own, its failure its own.
        decoded: dict[str, pa.Table] = {}
        if all(sink.desired_topic != s.frontiers_topic for _, sink, _ in work):
            try:
                tables = decode_statements_on_driver([(sink.desired_topic, raw_of(key, sink)) for key, sink, _ in work])
                decoded = {key: t for (key, _, _), t in zip(work, tables, strict=True)}
            except Exception as e:  # noqa: BLE001 - each sink's step decodes its own then
                log.warning("decoding the sinks' statements together failed, each sink decodes its own: %s", e)

        def run(item: tuple[str, Any, SinkMinter]) -> Exception | None:
            key, sink, m = item
            try:
                for p, a, b in unread.get(key, []):
                    m.note_unread(p, a, b)
                for _, p, o, _ in statements.get(key, []):
                    m.note_read(p, o)
                topic = sink.desired_topic

                def read_unread(ur: dict[int, tuple[int, int]]) -> pa.Table:
                    got = read_latest_progress_of(s.kafka, topic, ur, prefix)
                    return decode_on_driver(got, topic, progress_only=True)

                if first:
                    m.refreshed_at = None  # a new checkpoint: read the shard now
                got = decoded.get(key)
                m.process(got if got is not None else decode_on_driver(raw_of(key, sink), topic, progress_only=True), read_unread,
                          announced=uppers.get(sink.collection_id), flush=False, appended=appended.get(sink.collection_id, ()))
            except Exception as e:  # noqa: BLE001 - one sink's failure is that sink's alone
                return e
            return None

        # The sinks' steps are mostly S3 reads of their shards: side by side on a few threads.
        outcomes = self._threads.map(run, work)
        # The micro-batch's descriptions are durable before its state is saved (one flush for
        # every sink: a flush waits for the shared producer's every message anyway).
        self.producer.flush()
        for (key, sink, _), err in zip(work, outcomes, strict=True):
            if err is not None:
                self._failed(key, sink, err)
            elif self.failing.pop(key, None) is not None:
                log.info("mint recovered for this sink", extra={"sink_id": sink.sink_id})
        for sid, m in list(self.registry.items()):
            if sink_key(m.sink) not in members:
                del self.registry[sid]
        for key in list(self.failing):
            if key not in members:
                del self.failing[key]


def _found(found: tuple[int, bytes] | None, start: int) -> tuple[int, bytes] | None:
    """A statement the source found for a range starting at ``start`` (one below it is an
    older range's: the range holds none)."""
    return found if found is not None and found[0] >= start else None


def _first_ranges(settings: ServiceSettings, members: Mapping[str, SinkDef]) -> list[tuple[str, int, int, int]]:
    """Every member's desired partitions from offset 0 to their ends, ``(key, partition, 0,
    end)`` (the first micro-batch of a checkpoint, whose start Spark does not log): one probe
    for all of them (one metadata request per topic, one ListOffsets, one fetch of the last
    batches), not a probe and an admin client per member."""
    from shared.io.kafka import OffsetProbe

    with OffsetProbe(settings.kafka, 30.0) as probe:
        parts = {key: probe.partitions_of(sink.desired_topic) for key, sink in members.items()}
        ends = probe.ends({(members[k].desired_topic, p) for k, ps in parts.items() for p in ps})
    return [(key, p, 0, end) for key, ps in parts.items() for p in ps if (end := ends[(members[key].desired_topic, p)]) > 0]


def start_shared_mint_query(spark: Any, settings: ServiceSettings, fleet: Fleet, registry: dict[str, SinkMinter],
                            shared: list[SharedMint] | None = None) -> Any:
    from services.mint.source import MintFleetDataSource
    from shared.spark.fleet_source import MEMBERS_OPTION
    from shared.spark.kafka_connector import kafka_read_stream

    checkpoint = fleet.checkpoint
    states = DriverStateLog(spark, checkpoint)
    try:
        saved = states.restore()
    except (FileNotFoundError, ValueError) as e:
        log.warning("starting a new shared mint checkpoint (the old one has no usable state: %s)", e)
        states.reset()
        saved = None
    registry.clear()
    mint = SharedMint(settings, fleet, registry, ControlProducer.create(settings.kafka, "mint-shared"))
    mint.restore(saved)
    if shared is not None:
        shared[:] = [mint]
    fleet.on_members = mint.sync
    mint.sync(fleet.members())
    df = kafka_read_stream(
        spark, settings.kafka, [settings.frontiers_topic], starting_offsets="latest",
        source=(MintFleetDataSource.name(), MintFleetDataSource, {MEMBERS_OPTION: fleet.members_file}),
        wait_for_records_ms=settings.source_wait_ms,
    )

    from shared.spark.fleet_source import write_holds

    write_holds(fleet.members_file, set())  # nothing held at the start
    holding: list[set[str]] = [set()]

    def each(batch_df: Any, batch_id: int) -> None:
        logged = planned_offsets(states.files, batch_id)
        ranges = planned_ranges(states.files, batch_id, logged) if logged is not None else None
        mint.process(ranges, fleet_planned_progress(logged))
        states.save(batch_id, mint.checkpoint())
        # A sink with a description in flight cannot use its desired records until its upper
        # moves (announced on frontiers, which ends the hold): the source holds them back.
        held = {sink_key(m.sink) for m in list(mint.registry.values()) if not m.wants_desired()}
        if held != holding[0]:
            write_holds(fleet.members_file, held)
            holding[0] = held

    name = f"mint-shared-{settings.sink_shard.index}of{settings.sink_shard.count}"
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
