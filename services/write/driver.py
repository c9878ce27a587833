"""The write query's driver: :func:`start_write_query` builds the query (the write source,
:mod:`services.write.source`, carrying the :class:`services.write.job.WriteJob` its tasks
run) and its ``foreachBatch``, which sets the micro-batch id as the job's local property, runs
the batch's job and hands the rows it returns to the sink's :class:`SinkWriter`: it produces
the partitions' reports and flushes them (only then does Spark commit the micro-batch), keeps
the metrics (:class:`WriteMetrics`) and publishes the sink's health.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import functions as F

from services.runtime.checkpoints import checkpoint_path
from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import interruptible
from services.sinkio import ROUTED_DDL, ControlProducer, decode_partition
from services.write.executor import write_batches
from services.write.job import OUTPUT_DDL, WriteJob, report_message
from services.write.quarantine import load_quarantine
from services.write.source import BATCH_PROPERTY, desired_source
from shared.catalog import SinkDef, SinkHealth, put_sink_health
from shared.errors import HistoryUnprovenError, ShardsinkError
from shared.io.kafka_admin import topic_partition_count
from shared.shard import Shard, StagedBatch
from shared.sink_messages import BatchReport
from shared.spark.kafka_connector import _connector, kafka_read_stream

log = logging.getLogger("shardsink.write")


@dataclass
class WriteMetrics:
    desired_updates: int = 0
    decode_errors: int = 0
    contract_violations: int = 0
    batches_staged: int = 0
    reports_sent: int = 0
    rows_staged: int = 0
    error_rows_staged: int = 0
    micro_batches: int = 0
    buffer_updates: int = 0
    buffer_bytes: int = 0
    history_unproven_partitions: int = 0
    quarantined_ranges: int = 0


@dataclass
class SinkWriter:
    """The driver's part of one sink's write query: produce the partitions' reports, keep the
    metrics, publish the sink's health (what ``shardsink status`` shows)."""

    sink: SinkDef
    settings: ServiceSettings
    partitions: int
    producer: ControlProducer
    metrics: WriteMetrics = field(default_factory=WriteMetrics)
    #: latest statistics per writer partition (cumulative counters and gauges)
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    unproven: dict[int, str] = field(default_factory=dict)
    #: False when the caller flushes a producer it shares with other sinks once for them all
    #: (the shared query: one flush per micro-batch, not one per sink), before Spark commits.
    flush_each: bool = True

    def _note_error_rows(self, report: Any) -> None:
        """A log line and the ``error_rows_staged`` metric when a staged batch holds error rows
        (updates that could not be written as rows; the parts count them)."""
        errors = sum(p.errors for p in StagedBatch.from_json(json.loads(report.staged)).parts)
        if errors:
            self.metrics.error_rows_staged += errors
            log.warning(
                "sink %s: %d error row(s) staged for times [%s, %s) by writer partition %d (updates "
                "that could not be written as rows; each names its source offset and the reason: "
                "snapshot(include_errors=True), tail or subscribe show them)",
                self.sink.sink_id, errors, report.lower.to_json(), report.upper.to_json(), report.partition,
                extra={"sink_id": self.sink.sink_id},
            )

    def handle(self, rows: pa.Table) -> None:
        """One micro-batch of the stateful step's output (a few rows per partition)."""
        wps = rows["wp"].to_pylist() if rows.num_rows else []
        kinds = rows["kind"].to_pylist() if rows.num_rows else []
        bodies = rows["body"].to_pylist() if rows.num_rows else []
        refused: dict[int, str] = {}
        for wp, kind, body in zip(wps, kinds, bodies, strict=True):
            if kind in ("report", "reported"):  # reported: the executor produced it
                report = BatchReport.from_dict(json.loads(body))
                if kind == "report":
                    self.producer.send(self.settings.batches_topic, report_message(body), key=self.sink.sink_id.encode())
                self.metrics.reports_sent += 1
                if report.staged is not None:
                    self.metrics.batches_staged += 1
                    self.metrics.rows_staged += report.rows
                    self._note_error_rows(report)
            elif kind == "refuse":
                refused[wp] = body
            elif kind == "stats":
                self.stats[wp] = json.loads(body)
                log.debug("partition %d: step timings (input, restore, absorb, read back, stage, "
                          "checkpoint) %s s", wp, self.stats[wp].get("timing"), extra={"sink_id": self.sink.sink_id})
        if self.flush_each:
            self.producer.flush()
        self.metrics.micro_batches += 1
        m = self.metrics
        vals = list(self.stats.values())
        m.desired_updates = sum(int(s["desired_updates"]) for s in vals)
        m.decode_errors = sum(int(s["decode_errors"]) for s in vals)
        m.contract_violations = sum(int(s["contract_violations"]) for s in vals)
        m.buffer_updates = sum(int(s["buffer_updates"]) for s in vals)
        m.buffer_bytes = sum(int(s["buffer_bytes"]) for s in vals)
        unproven = {wp: s["unproven"] for wp, s in self.stats.items() if s.get("unproven")}
        unproven.update(refused)
        if unproven != self.unproven:
            self.unproven = unproven
            self.publish_health()
        # After the health object: whoever sees the metric finds the health that explains it.
        m.history_unproven_partitions = len(unproven)

    def publish_health(self) -> None:
        if self.unproven:
            err = HistoryUnprovenError(
                f"expected sink {self.sink.sink_id!r} to have seen the desired history behind "
                f"its shard, found partitions {sorted(self.unproven)} missing part of it: "
                f"{next(iter(self.unproven.values()))}. The sink writes nothing until an "
                f"operator runs `shardsink sink adopt {self.sink.sink_id}`",
                sink_id=self.sink.sink_id,
            )
            log.error("%s", err, extra={"sink_id": self.sink.sink_id})
            health = SinkHealth(self.sink.sink_id, self.sink.epoch, "refusing", str(err), sorted(self.unproven))
        else:
            health = SinkHealth(self.sink.sink_id, self.sink.epoch, "ok", "", [])
        try:
            put_sink_health(self.settings.store(), health)
        except ShardsinkError as e:  # the log line and metric stand; status catches up later
            log.warning("could not publish the sink's health: %s", e, extra={"sink_id": self.sink.sink_id})


def start_write_query(spark: Any, settings: ServiceSettings, sink: SinkDef, registry: dict[str, SinkWriter] | None = None) -> Any:
    partitions = topic_partition_count(settings.kafka, sink.desired_topic)
    shard = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms)
    schema_json = json.dumps(shard.refresh().schema)
    writer = SinkWriter(
        sink=sink,
        settings=settings,
        partitions=partitions,
        producer=ControlProducer.create(settings.kafka, f"write-{sink.sink_id}"),
    )
    if registry is not None:
        registry[sink.sink_id] = writer
    checkpoint = checkpoint_path(settings, "write", sink)
    job = WriteJob(sink, settings, partitions, schema_json, settings.descs_topic, checkpoint)

    quarantined = load_quarantine(settings, sink)
    writer.metrics.quarantined_ranges = len(quarantined)
    builtin = _connector(None) == "builtin"
    df = kafka_read_stream(
        spark,
        settings.kafka,
        [sink.desired_topic, settings.descs_topic],
        starting_offsets="earliest",
        max_records_per_trigger=settings.max_records_per_trigger,
        history_gap_topics=[sink.desired_topic],
        simulated_low_watermarks_file=settings.simulated_low_watermarks_file,
        # ours: one input partition per writer partition, decoded and written inside the
        # source's read() (the updates never cross into the JVM)
        source=None if builtin else desired_source(
            sink.desired_topic, schema_json, partitions, quarantined, step=job,
            name=f"shardsink-write-{sink.sink_id}-{sink.epoch}",
        ),
        wait_for_records_ms=settings.source_wait_ms,
    )
    sc = spark.sparkContext

    def each(batch_df: Any, batch_id: int) -> None:
        if builtin:
            routed = batch_df.select("topic", "partition", "offset", "value", "headers").mapInArrow(
                decode_partition(sink.desired_topic, schema_json, route_to=partitions, quarantine=quarantined),
                ROUTED_DDL,
            ).repartition(max(1, partitions), F.col("wp"))
            writer.handle(routed.mapInArrow(write_batches(job, batch_id), OUTPUT_DDL).toArrow())
            return
        # The source's tasks run the write step of this batch: they read its id from the job's
        # local properties (set on this thread, which submits the job).
        sc.setLocalProperty(BATCH_PROPERTY, str(batch_id))
        try:
            writer.handle(batch_df.toArrow())
        finally:
            sc.setLocalProperty(BATCH_PROPERTY, None)

    name = f"write-{sink.sink_id}-{sink.epoch}"  # the query's name: its supervisor marks it while stopping it
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
