"""The append service: commits each description's staged parts as one batch, exactly once.

Contract (the seeds' append operator):

- inputs: ``descs`` and ``batches`` (reports, one per writer partition per description);
- for the current description it waits until every writer partition has reported, then
  ``compare_and_append``s all staged parts as one logical batch, with the description's
  token as the idempotency token (a retry after an unknown outcome is recognised);
- on an upper mismatch (another replica appended first) it adopts the shard's upper as its
  new lower and moves on: the self-correcting loop fixes the contents later;
- it bumps the shard upper to a description's lower when the upper is below it (a sink whose
  as-of is beyond the shard's upper); it deletes staged parts it will never append (the
  storage layer refuses to delete anything a committed batch references);
- it publishes every upper advance once on ``frontiers``.

Recovery: the query's checkpoint (``<checkpoint root>/append/<sink>-e<epoch>``) is durable,
and the appender's state (the description in flight, the reports received, what was
appended) is saved with each micro-batch's offsets (:mod:`services.runtime.driver_state`): a
restarted appender goes on from the offsets Spark resumes from, never re-reading ``descs``
and ``batches`` from their start. A micro-batch Spark re-runs after a crash repeats its
actions from the saved state: a compare-and-append carries the description's token (one that
landed is recognised), deletions and upper publications are idempotent. A new checkpoint
(a new sink, or one whose state is unusable) starts from the topics' earliest offsets: then
descriptions below the shard's upper are outdated and their staged parts are deleted. For
that, a micro-batch's descriptions are absorbed before its reports (a report whose
description is unknown cannot be told apart from another appender's and is left alone), and
the deletions a micro-batch decides are carried out together at its end, in one call (the
storage layer keeps every part a committed batch references). Parts that no appender deletes
(a description superseded while its appender was down) are collected by the shard's garbage
collection after the grace period.

Cost: the control messages come to the driver as they are and are decoded there (a
micro-batch is one Spark job of one task).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from services.runtime.settings import ServiceSettings
from services.runtime.checkpoints import checkpoint_path
from services.runtime.supervisor import interruptible
from services.runtime.driver_state import DriverStateLog
from services.sinkio import (
    KIND_CONTROL,
    ControlProducer,
    collect_decoded,
    decode_on_driver,
    read_planned_batch,
)
from shared.catalog import SinkDef
from shared.codec import message_codec
from shared.errors import DecodeError, ShardsinkError, StagedBatchExpiredError, UpperMismatchError
from shared.frontier import Frontier
from shared.shard import Shard, StagedBatch
from shared.state import ShardState
from shared.append_state import (
    AppendAction,
    AppendState,
    Committed,
    DeleteStaged,
    EnsureUpperAtLeast,
    PublishUpper,
    ReadyToAppend,
    UpperMismatch,
)
from shared.sink_messages import AppendedBatch, BatchDescription, BatchReport

log = logging.getLogger("shardsink.append")

#: A micro-batch starts from the shard head this appender committed or read at most this long
#: ago, without a read (:meth:`SinkAppender._upper_to_start_from`). Any age is safe; a short
#: one reads again every sink whose steps come slower (at 10 s, in a run of 100 sinks on 2
#: cores whose steps took 10-30 s: an eighth of the driver's samples).
HEAD_MAX_AGE_S = 60.0


@dataclass
class AppendMetrics:
    appends: int = 0
    upper_mismatches: int = 0
    staged_deleted: int = 0
    bumps: int = 0
    micro_batches: int = 0


def appended_batch(state: ShardState, desc: BatchDescription) -> AppendedBatch | None:
    """What ``desc``'s append added to the shard, as ``state`` (the committed state, or the head
    that already held the token) shows it: the objects of every batch above the description's
    lower, for a reader whose contents reach that lower. None when the state is already
    beyond the description's upper (another append landed since), or a batch there starts
    below the lower (merged across it): that reader then reads the state itself."""
    if state.upper != desc.upper or any(b.lower.less_than(desc.lower) for b in state.batches if not b.upper.less_equal(desc.lower)):
        return None
    return AppendedBatch(desc.lower, tuple(state.keys_above(desc.lower)), len(state.versions))


@dataclass
class SinkAppender:
    sink: SinkDef
    settings: ServiceSettings
    shard: Shard
    state: AppendState
    producer: ControlProducer
    metrics: AppendMetrics
    _to_delete: list[StagedBatch] = field(default_factory=list)
    #: what each description committed in this run of actions added to the shard, by token,
    #: until its upper is announced (with it)
    _appended: dict[str, AppendedBatch | None] = field(default_factory=dict)
    #: Flush the producer after each step (False: the shared query flushes once per
    #: micro-batch for every sink, before it saves the micro-batch's state).
    flush_each: bool = True

    @staticmethod
    def create(sink: SinkDef, settings: ServiceSettings, producer: ControlProducer | None = None) -> SinkAppender:
        """``producer``: one shared by the sinks of a shared query (None: a producer of its own)."""
        shard = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms)
        return SinkAppender(
            sink, settings, shard, AppendState(sink.sink_id),
            producer or ControlProducer.create(settings.kafka, f"append-{sink.sink_id}"), AppendMetrics()
        )

    def _handles(self, staged: tuple[Any, ...]) -> list[StagedBatch]:
        return [StagedBatch.from_json(json.loads(s)) for s in staged if s is not None]

    def run_actions(self, actions: list[AppendAction]) -> None:
        queue: deque[AppendAction] = deque(actions)
        while queue:
            a = queue.popleft()
            if isinstance(a, ReadyToAppend):
                try:
                    st = self.shard.compare_and_append_staged(self._handles(a.staged), a.desc.lower, a.desc.upper, token=a.desc.token)
                    self._appended[a.desc.token] = appended_batch(st, a.desc)
                    outcome: Committed | UpperMismatch = Committed(a.desc.upper)
                    self.metrics.appends += 1
                except UpperMismatchError as e:
                    outcome = UpperMismatch(e.fields["current"])
                    self.metrics.upper_mismatches += 1
                except StagedBatchExpiredError:
                    outcome = UpperMismatch(self.shard.refresh().upper)
                queue.extend(self.state.on_append_result(a.desc, outcome))
            elif isinstance(a, EnsureUpperAtLeast):
                while True:
                    cur = self.shard.refresh().upper
                    if not cur.less_than(a.lower):
                        break
                    try:
                        self.shard.compare_and_append(None, cur, a.lower)
                        self.metrics.bumps += 1
                    except UpperMismatchError:
                        continue
                queue.extend(self.state.absorb_shard_upper(self.shard.refresh().upper))
            elif isinstance(a, DeleteStaged):
                self._to_delete.extend(self._handles(a.staged))
            elif isinstance(a, PublishUpper):
                # What the append added goes with its upper, for the writers' read-back.
                done = self._appended.pop(a.desc_token, None) if a.desc_token is not None else None
                msg: dict[str, Any] = {
                    "shard_id": self.sink.collection_id,
                    "sink_id": self.sink.sink_id,
                    "upper": a.upper.to_json(),
                    "desc_token": a.desc_token,
                    "updated_at_ms": int(time.time() * 1000),
                    "appended": None if done is None else done.to_dict(),
                }
                self.producer.send(self.settings.frontiers_topic, message_codec("frontier_update").encode(msg), key=self.sink.collection_id.encode())
        self._appended.clear()  # an upper is published in the same run as its append, or never
        if self.flush_each:
            self.producer.flush()

    def delete_decided(self) -> None:
        """Delete the staged parts decided so far (parts a committed batch references are
        kept by the storage layer)."""
        if self._to_delete:
            batch, self._to_delete = self._to_delete, []
            self.metrics.staged_deleted += self.shard.delete_staged(batch)

    def process(self, table: pa.Table) -> None:
        kinds = table["kind"].to_pylist()
        topics = table["topic"].to_pylist()
        values = table["value"].to_pylist()
        self.process_messages([(t, v) for k, t, v in zip(kinds, topics, values, strict=True) if k == KIND_CONTROL])

    def _upper_to_start_from(self) -> Frontier:
        """The shard's upper a micro-batch starts from: the head this appender committed or
        read within :data:`HEAD_MAX_AGE_S`, else one read from the store. A cached upper can
        only be behind the shard's (uppers never go back), and behind is safe: a description
        whose lower is ahead of it asks for the shard's upper (``EnsureUpperAtLeast``), the
        compare-and-append is checked against the head it probes on a mismatch, and fewer
        descriptions look outdated (so fewer staged parts are deleted). In steady state the
        head is this appender's own last commit, and the read was a GET of a state that does
        not exist yet: one request per sink and micro-batch (a third of the driver's time at
        100 sinks) that told nothing new."""
        return self.shard.head(max_age_s=HEAD_MAX_AGE_S).upper

    def process_messages(self, messages: list[tuple[str, bytes | None]]) -> None:
        """One micro-batch's control messages ``(topic, value)`` (others' are skipped)."""
        actions: list[AppendAction] = list(self.state.absorb_shard_upper(self._upper_to_start_from()))
        self.run_actions(actions)
        desc_codec = message_codec("batch_description")
        report_codec = message_codec("written_batch")
        # Descriptions first: after a restart, the replayed reports of outdated descriptions
        # are then known to be this appender's and are deleted.
        rows = sorted(messages, key=lambda r: r[0] != self.settings.descs_topic)
        for topic, value in rows:
            try:
                if topic == self.settings.descs_topic:
                    desc = BatchDescription.from_dict(desc_codec.decode(value or b""))
                    if desc.sink_id != self.sink.sink_id:
                        continue
                    self.run_actions(self.state.absorb_description(desc))
                elif topic == self.settings.batches_topic:
                    report = BatchReport.from_dict(report_codec.decode(value or b""))
                    if report.sink_id != self.sink.sink_id:
                        continue
                    self.run_actions(self.state.absorb_report(report))
            except (DecodeError, ShardsinkError) as e:
                if self.state.in_flight is not None:
                    raise
                log.warning("skipping a bad control message: %s", e, extra={"sink_id": self.sink.sink_id})
        self.delete_decided()
        self.metrics.micro_batches += 1


def start_append_query(spark: Any, settings: ServiceSettings, sink: SinkDef, registry: dict[str, SinkAppender] | None = None) -> Any:
    from shared.spark.kafka_connector import _connector, kafka_read_stream

    appender = SinkAppender.create(sink, settings)
    checkpoint = checkpoint_path(settings, "append", sink)
    states = DriverStateLog(spark, checkpoint)
    try:
        saved = states.restore()
    except (FileNotFoundError, ValueError) as e:
        log.warning("starting a new append checkpoint (the old one has no usable state: %s)", e,
                    extra={"sink_id": sink.sink_id})
        states.reset()
        saved = None
    if saved is not None:
        appender.state = AppendState.restore(saved)
    if registry is not None:
        registry[sink.sink_id] = appender
    from services.append.source import append_source

    # Descriptions are held back until reports arrive (services/append/source.py).
    df = kafka_read_stream(spark, settings.kafka, [settings.descs_topic, settings.batches_topic],
                           starting_offsets="earliest", source=append_source(settings.descs_topic),
                           wait_for_records_ms=settings.source_wait_ms)
    ours = _connector(None) != "builtin"

    def each(batch_df: Any, batch_id: int) -> None:
        # Ours: the records are read on the driver by the batch's logged offsets (no job).
        raw = read_planned_batch(states.files, batch_id, settings.kafka) if ours else None
        if raw is not None:
            table = decode_on_driver(raw, None)
        else:
            table = collect_decoded(batch_df, None, on_driver=True)
        appender.process(table)
        states.save(batch_id, appender.state.checkpoint())

    name = f"append-{sink.sink_id}-{sink.epoch}"  # the query's name: its supervisor marks it while stopping it
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
