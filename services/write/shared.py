"""The write service's shared query (``SHARDSINK_QUERIES=shared``): one query writes for every
sink the instance serves (its source and tasks: :mod:`services.write.shared_source`).

The driver's step per micro-batch: set the batch id as the job's local property, run the batch
(the units' write steps on the executors) and route the rows it returns by sink to the sink's
:class:`services.write.driver.SinkWriter` (metrics, health, and the reports the executors
could not deliver, produced and flushed before Spark commits the micro-batch), as a per-sink
query's driver does. Each unit's report is produced by its executor as the unit ends
(:func:`services.write.shared_source._send_reports`): at 100 sinks a report waited
0.6-0.7 s (p50) for the rest of the micro-batch's units when the driver produced them all.
The per-sink contract of :mod:`services.write.service` is unchanged; a sink's state versions live under its
own folder (:func:`services.runtime.fleet.sink_state_dir`), numbered by the shared query's
micro-batches.

Failure isolation. A unit (a sink's writer partition) that fails returns a ``fail`` row; the
driver records it in the replay file, so the next micro-batches give the unit its input again
(:mod:`services.write.shared_source`, "Replays") while the other sinks go on; the sink is named
in the log, in ``shardsink status`` (its failing input, as a per-sink query's) and in the
metrics. The quarantine contract holds per sink: after ``quarantine_after`` failures in a row
on its input (not an infrastructure error), the failing unit's desired range is quarantined
(its updates become error rows) and the sink goes on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from services.runtime.fleet import Fleet, KeyLocks, prepare, sink_key
from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import interruptible
from services.sinkio import ControlProducer
from services.write.driver import SinkWriter
from services.write.quarantine import _NOT_THE_INPUT
from services.write.shared_source import SHARED_OUTPUT_SCHEMA, read_replay, replay_path, shared_write_source, write_replay
from services.write.source import BATCH_PROPERTY
from shared.catalog import SinkDef, add_sink_quarantine, count_sink_failure, sink_quarantine

log = logging.getLogger("shardsink.write")


def is_input_error(text: str) -> bool:
    """A failure of the write step that is not an infrastructure or protocol error."""
    return not any(name in text for name in _NOT_THE_INPUT)


@dataclass
class SharedWrite:
    """The driver's part of the shared write query."""

    settings: ServiceSettings
    fleet: Fleet
    registry: dict[str, SinkWriter]
    producer: ControlProducer
    #: per key, per writer partition: the input a failed unit must get again
    replay: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per key: ``{wp: (failures in a row, last error)}`` of its failing units
    failing: dict[str, dict[int, tuple[int, str]]] = field(default_factory=dict)
    micro_batches: int = 0

    @property
    def replay_file(self) -> str:
        return replay_path(self.fleet.members_file)

    _lock: KeyLocks = field(default_factory=KeyLocks)

    def sync(self, members: dict[str, Any]) -> None:
        """Make the parts of the members that have none yet (called by the fleet when they
        change), side by side."""
        prepare(sorted(members), self.writer, "write")

    def writer(self, key: str) -> SinkWriter | None:
        """The member's part (made at its first use; None: not a member)."""
        with self._lock(key):
            return self._writer(key)

    def _writer(self, key: str) -> SinkWriter | None:
        sink = self.fleet.members().get(key)
        if sink is None:
            return None
        w = self.registry.get(sink.sink_id)
        if w is None or sink_key(w.sink) != key:
            from shared.io.kafka_admin import topic_partition_count

            w = SinkWriter(sink=sink, settings=self.settings, partitions=topic_partition_count(self.settings.kafka, sink.desired_topic),
                           producer=self.producer, flush_each=False)  # handle() flushes once for every sink
            w.metrics.quarantined_ranges = len(sink_quarantine(self.settings.store(), sink.sink_id, sink.epoch))
            self.registry[sink.sink_id] = w
        w.sink = sink
        return w

    def handle(self, rows: pa.Table) -> None:
        members = self.fleet.members()
        # A copy to the writer partitions' entries: the file is rewritten when they change.
        replay = {k: {wp: dict(r) for wp, r in v.items()} for k, v in self.replay.items() if k in members}
        keys = rows["sink"].to_pylist() if rows.num_rows else []
        for key in sorted(set(keys)):
            sub = rows.filter(pc.equal(rows["sink"], key))
            w = self.writer(key)
            if w is None:
                continue  # left the service since the micro-batch was planned
            failed = sub.filter(pc.equal(sub["kind"], "fail"))
            ok = sub.filter(pc.not_equal(sub["kind"], "fail"))
            done = set(ok["wp"].to_pylist())
            for wp in done:
                replay.get(key, {}).pop(str(wp), None)
                if self.failing.get(key, {}).pop(int(wp), None) is not None:
                    log.info("writer partition %d recovered", wp, extra={"sink_id": w.sink.sink_id})
            if ok.num_rows:
                w.handle(ok.drop_columns(["sink"]))
            for wp, body in zip(failed["wp"].to_pylist(), failed["body"].to_pylist(), strict=True):
                self._failed(w.sink, key, int(wp), json.loads(body), replay)
            if key in replay and not replay[key]:
                del replay[key]
            if key in self.failing and not self.failing[key]:
                del self.failing[key]
        self.producer.flush()
        for key in list(self.failing):
            if key not in members:
                del self.failing[key]
        for sid, w in list(self.registry.items()):
            if sink_key(w.sink) not in members:
                del self.registry[sid]
        if replay != self.replay or not self.micro_batches:
            self.replay = replay
            write_replay(self.replay_file, replay)
        self.micro_batches += 1

    def _failed(self, sink: SinkDef, key: str, wp: int, body: dict[str, Any], replay: dict[str, Any]) -> None:
        error = str(body.get("error", ""))
        n = self.failing.get(key, {}).get(wp, (0, ""))[0] + 1
        self.failing.setdefault(key, {})[wp] = (n, error)
        replay.setdefault(key, {})[str(wp)] = {"from": body.get("from"), "descs": body.get("descs", [])}
        log.error("writer partition %d failed (%d in a row; held and retried, the other sinks go on): %s",
                  wp, n, error, extra={"sink_id": sink.sink_id})
        store = self.settings.store()
        start, end = body.get("from"), body.get("end")
        try:
            count_sink_failure(store, sink.sink_id, sink.epoch, int(start if start is not None else -1), error[:300])
        except Exception as e:  # noqa: BLE001 - the log line and the metric stand
            log.warning("could not record the failure: %s", e, extra={"sink_id": sink.sink_id})
        q = self.settings.quarantine_after
        if q <= 0 or n < q or start is None or end is None or not is_input_error(error + str(body.get("trace", ""))):
            return
        add_sink_quarantine(store, sink.sink_id, sink.epoch, [{
            "topic": sink.desired_topic, "partition": wp, "start": int(start), "end": int(end),
            "batch_id": -1, "failures": n, "reason": error[:300],
        }])
        log.error("writer partition %d failed %d times on the same input: its desired range [%s, %s) is quarantined "
                  "to the error collection: %s", wp, n, start, end, error[:300], extra={"sink_id": sink.sink_id})
        self.fleet.refresh(key)  # the next plan decodes the range as error rows
        w = self.registry.get(sink.sink_id)
        if w is not None:
            w.metrics.quarantined_ranges += 1


def start_shared_write_query(spark: Any, settings: ServiceSettings, fleet: Fleet, registry: dict[str, SinkWriter],
                             shared: list[SharedWrite] | None = None) -> Any:
    from shared.spark.kafka_connector import kafka_read_stream

    registry.clear()
    app = SharedWrite(settings, fleet, registry, ControlProducer.create(settings.kafka, "write-shared"))
    app.replay = read_replay(app.replay_file)
    if shared is not None:
        shared[:] = [app]
    fleet.on_members = app.sync
    app.sync(fleet.members())
    sc = spark.sparkContext
    parallelism = max(1, int(sc.defaultParallelism))
    df = kafka_read_stream(
        spark, settings.kafka, [settings.descs_topic], starting_offsets="latest",
        max_records_per_trigger=settings.max_records_per_trigger,
        simulated_low_watermarks_file=settings.simulated_low_watermarks_file,
        source=shared_write_source(settings, fleet.members_file, parallelism),
        wait_for_records_ms=settings.source_wait_ms,
    )

    def each(batch_df: Any, batch_id: int) -> None:
        sc.setLocalProperty(BATCH_PROPERTY, str(batch_id))
        try:
            rows = batch_df.toArrow()
        finally:
            sc.setLocalProperty(BATCH_PROPERTY, None)
        app.handle(rows if rows.num_rows else SHARED_OUTPUT_SCHEMA.empty_table())

    name = f"write-shared-{settings.sink_shard.index}of{settings.sink_shard.count}"
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", fleet.checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )
