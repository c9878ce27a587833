"""The mint service: decides the next batch ``[lower, upper)`` for each sink.

Contract (the seeds' mint operator):

- inputs: the desired topic's progress statements (per partition; the desired frontier is the
  least of the latest), the shard's upper (read from the shard itself on every micro-batch,
  never inferred from read-back data), and the sink's read-only flag (from the catalog);
  ``frontiers`` messages only wake the query up when the upper moves;
- output: a :class:`shared.sink_messages.BatchDescription` on ``descs`` when writes are allowed,
  the desired frontier is ahead of the shard's upper, and the upper advanced since the last
  description. Lowers are unique and strictly increasing. A description minted at an upper
  an appender announced carries what that append added (the announcement's ``appended``),
  for the writers' read-back.
- identity: each start of the query takes a new epoch (wall-clock milliseconds) and a random
  nonce in its tokens, so a restarted minter's description with an old lower supersedes the
  old one, and batches written for the old one are never appended under it.
- recovery: the query's checkpoint (``<checkpoint root>/mint/<sink>-e<epoch>``) is durable;
  the desired progress per partition is saved with each micro-batch's offsets
  (:mod:`services.runtime.driver_state`), so a restarted minter reads only what came after them,
  never the desired topic's history. Its first description (a new epoch) supersedes any in
  flight.
- cost: no Spark job per micro-batch, and no desired record read on the driver: the
  query's source (:mod:`services.mint.source`) finds each admitted desired range's latest
  progress statement while it plans the micro-batch, reading the range's tail back to it
  (:func:`services.mint.progress.read_latest_progress`: a partition's progress only moves forward,
  so the last statement is the one that counts), and carries it in the offsets Spark logs for
  the micro-batch; the driver takes it from there (:func:`services.mint.source.planned_progress`)
  and reads only the ``frontiers`` records by the logged offsets. The desired updates are the
  write service's to read. A range whose tail the source could not read is the driver's to
  read, and only when the desired frontier can matter: while a description is in flight (the
  shard's upper has not moved since the last one), no description can be minted whatever the
  desired frontier, so such ranges are kept as unread (``unread``: per partition, from the
  first offset not read to the last planned) and read, tail first, at the micro-batch that
  learns the upper moved (a later statement from the source makes them moot). A read-only
  minter reads at every micro-batch (its desired frontier is what the metrics show). The
  unread ranges are saved with the driver state, so a restarted minter reads them. The source
  also holds the desired records back while a description is in flight, so they do not
  trigger micro-batches that could decide nothing.

One active minter per sink: run one mint service (or one all-in-one application).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from services.runtime.settings import ServiceSettings
from services.runtime.checkpoints import checkpoint_path
from services.runtime.supervisor import interruptible
from services.mint.progress import read_latest_progress_of
from services.runtime.driver_state import DriverStateLog
from services.sinkio import (
    KIND_CONTROL,
    KIND_PROGRESS,
    ControlProducer,
    collect_decoded,
    decode_on_driver,
    planned_ranges,
    read_ranges_on_driver,
    u64,
)
from shared.catalog import SinkDef
from shared.codec import message_codec
from shared.shard import Shard
from shared.mint_state import MintState
from shared.frontier import Frontier
from shared.sink_messages import AppendedBatch, as_frontier

log = logging.getLogger("shardsink.mint")

#: The longest mint goes without reading the shard's state (see :meth:`SinkMinter.process`).
SHARD_REFRESH_S = 1.0
#: With :attr:`SinkMinter.backoff` (the shared query's minters), a sink waiting for its upper
#: reads the shard 1 s after its description was minted (or after its last read, if later), or
#: after twice the last description's wait for its announced
#: upper when that was longer (a busy deployment: a read before it finds nothing new), then
#: after twice as long each time the upper has not moved, up to this: the appenders'
#: announcements carry the uppers, and an appender that restarts announces again the upper
#: it had not saved; the reads only cover an appender gone for good. (At 8 s, in a run of
#: 100 sinks on 2 cores whose steps took 10-30 s, these reads were a quarter of the driver's
#: samples, for uppers the next announcement brought anyway.)
SHARD_REFRESH_MAX_S = 30.0


@dataclass
class SinkMinter:
    sink: SinkDef
    settings: ServiceSettings
    shard: Shard
    state: MintState
    producer: ControlProducer
    minted: int = 0
    micro_batches: int = 0
    shard_refreshes: int = 0
    #: When the shard's state was last read (monotonic seconds; None: never).
    refreshed_at: float | None = None
    #: Desired ranges planned and not read yet, per partition: ``[start, end)`` (see the
    #: module docstring).
    unread: dict[int, tuple[int, int]] = field(default_factory=dict)
    desired_reads: int = 0
    #: Back off the reads of a waiting sink's shard (:data:`SHARD_REFRESH_MAX_S`).
    backoff: bool = False
    #: The current wait between reads of the shard while the upper does not move.
    refresh_every: float = SHARD_REFRESH_S
    #: When the last description was minted (monotonic seconds; None: its upper came since).
    minted_at: float | None = None
    #: The newest announced upper that came with what its append added to the shard: the next
    #: description minted at that lower carries it, for the writers' read-back.
    appended: tuple[Frontier, AppendedBatch] | None = None

    def upper_in_hand(self) -> bool:
        """Whether a shared minter (:attr:`backoff`) has its shard's upper and waits for none:
        it read the shard or was told an upper, and the last description's upper came. The
        appenders announce every upper the shard reaches, so the timed read, which covers a
        lost announcement, waits until a description is in flight (measured at 10 sinks: the
        read at each step's progress was 2 of a step's 10 or so S3 requests)."""
        return self.backoff and self.refreshed_at is not None and self.state.persist_advanced()

    def refresh_due(self, now: float) -> bool:
        """Whether the shard's state is due to be read again (never read, or read
        :attr:`refresh_every` ago). A shared minter (:attr:`backoff`) counts from the later of
        the last read (or announcement) and the last description's minting: the read covers a
        lost announcement of that description's upper, which cannot come before it was minted.
        (Counted from the last announcement alone, a step minted 2 s after its predecessor's
        upper came read the shard in the next micro-batch, before any write could have run: at
        100 sinks, three quarters of the mint driver's time.)"""
        if self.refreshed_at is None:
            return True
        since = self.refreshed_at
        if self.backoff and self.minted_at is not None:
            since = max(since, self.minted_at)
        return now - since >= self.refresh_every

    def note_unread(self, partition: int, start: int, end: int) -> None:
        """A micro-batch planned ``[start, end)`` of a desired partition."""
        old = self.unread.get(partition)
        self.unread[partition] = (start if old is None else min(old[0], start), end if old is None else max(old[1], end))

    def take_planned_progress(
        self, planned: Sequence[tuple[str, int, int, int]], known: Mapping[int, tuple[int, bytes] | None]
    ) -> list[tuple[int, int, bytes]]:
        """Of a micro-batch's ``planned`` ranges, the desired partitions' latest progress
        statements that the source found while planning (``known``:
        :func:`services.mint.source.planned_progress`), as ``(partition, offset, value)``; a
        desired range without an entry is noted unread (the driver reads it when it can
        matter), one whose latest statement is below it holds none."""
        statements: list[tuple[int, int, bytes]] = []
        for t, p, lo, hi in planned:
            if t != self.sink.desired_topic:
                continue
            if p not in known:
                self.note_unread(p, lo, hi)
                continue
            found = known[p]
            if found is not None and found[0] >= lo:
                statements.append((p, found[0], found[1]))
                self.note_read(p, found[0])
        return statements

    def note_read(self, partition: int, offset: int) -> None:
        """The latest progress statement of a desired partition up to ``offset`` is known: an
        unread range before it holds only older statements, which cannot move the frontier."""
        old = self.unread.get(partition)
        if old is not None and old[1] <= offset:
            del self.unread[partition]

    def wants_desired(self) -> bool:
        """Whether the desired frontier can matter now: read-only (the metrics follow it), or a
        description can be minted (the persist frontier moved since the last one)."""
        return self.state.read_only or self.state.persist_advanced()

    def absorb_progress(self, table: pa.Table) -> None:
        kinds = table["kind"].to_pylist()
        parts = table["partition"].to_pylist()
        frs = table["frontier"].to_pylist()
        closed = table["frontier_closed"].to_pylist()
        topics = table["topic"].to_pylist()
        for i, kind in enumerate(kinds):
            if kind == KIND_PROGRESS and topics[i] == self.sink.desired_topic:
                self.state.absorb_desired_progress(parts[i], None if closed[i] else u64(frs[i]))

    @staticmethod
    def create(sink: SinkDef, settings: ServiceSettings, partitions: int, producer: ControlProducer | None = None) -> SinkMinter:
        """``producer``: one shared by the sinks of a shared query (None: a producer of its own)."""
        shard = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms)
        state = MintState(
            sink.sink_id,
            epoch=int(time.time() * 1000),
            partition_count=partitions,
            as_of=sink.as_of,
            read_only=sink.read_only,
            nonce=uuid.uuid4().hex[:8],
        )
        return SinkMinter(sink, settings, shard, state, producer or ControlProducer.create(settings.kafka, f"mint-{sink.sink_id}"))

    def process(self, table: pa.Table, read_unread: Callable[[dict[int, tuple[int, int]]], pa.Table] | None = None,
                announced: Sequence[Any] | None = None, flush: bool = True,
                appended: Sequence[tuple[Any, AppendedBatch]] = ()) -> None:
        """One micro-batch: ``table`` holds its decoded records (all of them, or without the
        desired ranges noted unread, which ``read_unread`` reads and decodes when they can
        matter). ``announced``: the uppers the micro-batch's announcements carry (decoded by
        the caller; an int, or None for the empty frontier): absorbed as read, so an
        announcement costs no read of the shard. ``flush``: False when the caller flushes the
        shared producer once for every sink (before it saves the micro-batch's state).
        ``appended``: ``(upper, what its append added)`` of the announcements that carry it: a
        description minted at the newest such upper carries it to the writers."""
        kinds = table["kind"].to_pylist()
        topics = table["topic"].to_pylist()
        self.absorb_progress(table)
        if self.state.read_only:
            sink = self.settings.catalog().state(fresh=False).sinks.get(self.sink.sink_id)
            if sink is not None and not sink.read_only:
                self.state.allow_writes()
        # The shard's upper moves when a batch is appended, and every appender announces that
        # on the frontiers topic, which this query reads: the shard's state (a few S3
        # requests, the driver's largest cost per mint micro-batch) is read when such an
        # announcement arrived, and at least every SHARD_REFRESH_S in case one was lost (a
        # shared minter: only while it waits for a description's upper). A stale upper can
        # only make a description that no append accepts (its lower is below the upper),
        # never a wrong append; and the minter then waits for its upper, so it reads.
        news = any(k == KIND_CONTROL and t == self.settings.frontiers_topic for k, t in zip(kinds, topics, strict=True))
        now = time.monotonic()
        if announced:
            # An announced upper is one the shard reached (uppers only move forward): as good
            # as a read, and free. A later append of another replica shows at the next read.
            before = self.state.persist_frontier
            for upper in announced:
                self.state.absorb_shard_upper(as_frontier(upper))
            for upper, added in appended:
                f = as_frontier(upper)
                if self.appended is None or self.appended[0].less_than(f):
                    self.appended = (f, added)
            self.refreshed_at = now
            self.refresh_every = SHARD_REFRESH_S
            if self.backoff and self.minted_at is not None and before.less_than(self.state.persist_frontier):
                waited, self.minted_at = now - self.minted_at, None
                self.refresh_every = min(SHARD_REFRESH_MAX_S, max(SHARD_REFRESH_S, 2 * waited))
        elif news or (self.refresh_due(now) and not self.upper_in_hand()):
            before = self.state.persist_frontier
            self.state.absorb_shard_upper(self.shard.refresh().upper)
            self.refreshed_at = now
            self.shard_refreshes += 1
            if self.backoff:
                moved = before.less_than(self.state.persist_frontier)
                self.refresh_every = SHARD_REFRESH_S if moved else min(SHARD_REFRESH_MAX_S, 2 * self.refresh_every)
        if self.unread and read_unread is not None and self.wants_desired():
            self.absorb_progress(read_unread(self.unread))
            self.unread = {}
            self.desired_reads += 1
        desc = self.state.maybe_mint(int(time.time() * 1000))
        if desc is not None:
            if self.appended is not None and self.appended[0] == desc.lower:
                desc = replace(desc, appended=self.appended[1])
            self.appended = None
            self.producer.send(
                self.settings.descs_topic,
                message_codec("batch_description").encode(desc.to_dict()),
                key=self.sink.sink_id.encode(),
            )
            if flush:
                self.producer.flush()
            self.minted += 1
            self.minted_at = time.monotonic()
            log.debug("minted [%s, %s)", desc.lower, desc.upper, extra={"sink_id": self.sink.sink_id})
        self.micro_batches += 1


def start_mint_query(spark: Any, settings: ServiceSettings, sink: SinkDef, registry: dict[str, SinkMinter] | None = None) -> Any:
    from shared.io.kafka_admin import topic_partition_count
    from shared.spark.kafka_connector import _connector, kafka_read_stream

    minter = SinkMinter.create(sink, settings, topic_partition_count(settings.kafka, sink.desired_topic))
    checkpoint = checkpoint_path(settings, "mint", sink)
    states = DriverStateLog(spark, checkpoint)
    try:
        saved = states.restore()
    except (FileNotFoundError, ValueError) as e:
        log.warning("starting a new mint checkpoint (the old one has no usable state: %s)", e,
                    extra={"sink_id": sink.sink_id})
        states.reset()
        saved = None
    if saved is not None:
        minter.state.restore(saved)
        minter.unread = {int(p): (int(a), int(b)) for p, (a, b) in saved.get("unread", {}).items()}
    if registry is not None:
        registry[sink.sink_id] = minter
    from services.sinkio import desired_prefixes

    # Desired updates (union index 0 of the current desired schema) are dropped by the source
    # on the executors: mint needs only progress statements (decode_partition drops them
    # too, for the builtin connector and older schema versions).
    update_prefix = desired_prefixes()[0]
    from services.runtime.driver_state import planned_offsets
    from services.mint.source import hold_path, mint_source, planned_progress, write_hold

    hold_file = hold_path(checkpoint)
    write_hold(hold_file, False)  # a new minter can mint: nothing is held at its start
    holding = [False]
    df = kafka_read_stream(
        spark,
        settings.kafka,
        [sink.desired_topic, settings.frontiers_topic],
        starting_offsets="earliest",
        skip_value_prefixes={sink.desired_topic: update_prefix},
        source=mint_source(sink.desired_topic, hold_file),
        wait_for_records_ms=settings.source_wait_ms,
    )
    desired_topic = sink.desired_topic
    # Ours: the few records are read on the driver by the batch's logged offsets. The builtin
    # connector cannot drop updates in the reader: decode on the executors then.
    ours = _connector(None) != "builtin"

    def read_unread(unread: dict[int, tuple[int, int]]) -> pa.Table:
        raw = read_latest_progress_of(settings.kafka, desired_topic, unread, update_prefix)
        return decode_on_driver(raw, desired_topic, progress_only=True)

    def each(batch_df: Any, batch_id: int) -> None:
        logged = planned_offsets(states.files, batch_id) if ours else None
        planned = planned_ranges(states.files, batch_id, logged) if logged is not None else None
        if planned is not None:
            # The source found each desired range's latest progress statement while planning
            # (services/mint/source.py): take it from the logged offsets; a range it could not
            # read is read here, when it can matter.
            statements = minter.take_planned_progress(planned, planned_progress(logged))
            raw = read_ranges_on_driver(settings.kafka, [r for r in planned if r[0] != desired_topic])
            if statements:
                raw = pa.concat_tables([raw, pa.table({
                    "topic": pa.array([desired_topic] * len(statements), pa.string()),
                    "partition": pa.array([p for p, _, _ in statements], pa.int32()),
                    "offset": pa.array([o for _, o, _ in statements], pa.int64()),
                    "value": pa.array([v for _, _, v in statements], pa.binary()),
                }).cast(raw.schema)])
            minter.process(decode_on_driver(raw, desired_topic, progress_only=True), read_unread)
        else:
            minter.process(collect_decoded(batch_df, desired_topic, progress_only=True, on_driver=ours))
        states.save(batch_id, {**minter.state.checkpoint(),
                               "unread": {str(p): list(r) for p, r in minter.unread.items()}})
        hold = not minter.wants_desired()  # a description in flight: the source holds desired back
        if hold != holding[0]:
            write_hold(hold_file, hold)
            holding[0] = hold

    name = f"mint-{sink.sink_id}-{sink.epoch}"  # the query's name: its supervisor marks it while stopping it
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
