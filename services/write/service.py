"""The write service: keeps the correction buffer ``desired - shard`` per desired partition
and stages the difference for each batch description. It never appends.

Contract (the seeds' write operator, with Kafka making order and completeness explicit):

- inputs: the sink's desired topic (updates and progress, partitioned by row hash), ``descs``
  (batch descriptions), ``frontiers`` (shard upper advances: a cue to read the shard back);
- state: one :class:`shared.sink_state.WriteState` per desired partition. Desired updates go
  in positively; the shard's own contents (a snapshot at start, then each appended range,
  read from the shard itself) go in negated, routed by the same row hash;
- for a description whose lower equals the persist frontier and whose upper is at or below
  the partition's desired frontier, the partition stages its consolidated updates before
  ``upper`` as data objects, and reports on ``batches`` (also when there is nothing to write);
- bad input (undecodable messages, rows that do not match the schema, updates below their
  partition's progress) becomes error rows at their time, in the shard's error collection.

Recovery: the state is rebuilt at query start (desired topic from the earliest offset, shard
snapshot at its upper), so a killed writer comes back in step; re-written descriptions are
recognised by the appender (one report per partition per description).

Micro-batch commit order (``foreachBatch``, all on the driver except decoding):

1. decode the micro-batch in the executors (one task per Kafka partition), collect;
2. absorb desired updates and progress, partition by partition, in offset order;
3. read the shard's head; absorb (negated) everything appended since the persist frontier;
4. absorb descriptions; for each partition decide; stage data objects (S3, in parallel);
5. produce the reports and flush them; only then does Spark commit the micro-batch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from services.common import ServiceSettings, checkpoint_path
from services.sinkio import (
    KIND_BAD,
    KIND_CONTROL,
    KIND_PROGRESS,
    KIND_UPDATE,
    ControlProducer,
    collect_decoded,
    u64,
)
from shared.avro_arrow import rows_to_arrow
from shared.catalog import SinkDef
from shared.codec import RowCodec, message_codec
from shared.desired import row_partition
from shared.errors import DecodeError, ShardsinkError
from shared.frontier import Frontier
from shared.shard import DIFF, ERROR, TIME, Shard
from shared.sink_state import (
    BatchDescription,
    NothingToWrite,
    Stage,
    WriteState,
    error_partition,
)

log = logging.getLogger("shardsink.write")


@dataclass
class WriteMetrics:
    desired_updates: int = 0
    decode_errors: int = 0
    contract_violations: int = 0
    batches_staged: int = 0
    reports_sent: int = 0
    rows_staged: int = 0
    micro_batches: int = 0
    buffer_updates: int = 0
    buffer_bytes: int = 0


@dataclass
class SinkWriter:
    """The write side of one sink, driven by micro-batches (pure decisions in WriteState)."""

    sink: SinkDef
    settings: ServiceSettings
    shard: Shard
    row_codec: RowCodec
    partitions: int
    producer: ControlProducer
    states: list[WriteState] = field(default_factory=list)
    metrics: WriteMetrics = field(default_factory=WriteMetrics)
    hydrated: bool = False
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=8))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def create(sink: SinkDef, settings: ServiceSettings, partitions: int) -> SinkWriter:
        shard = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms)
        codec = RowCodec(shard.refresh().schema)
        w = SinkWriter(
            sink=sink,
            settings=settings,
            shard=shard,
            row_codec=codec,
            partitions=partitions,
            producer=ControlProducer.create(settings.kafka, f"write-{sink.sink_id}"),
        )
        w.states = [WriteState(sink.sink_id, p, partitions) for p in range(partitions)]
        return w

    # -- keys ------------------------------------------------------------------------------
    def _partition_of_key(self, key: bytes) -> int:
        return row_partition(self.row_codec.partition_key(key), self.partitions)

    def _rows_to_keys(self, table: pa.Table) -> tuple[list[list[bytes]], list[list[int]], list[list[int]], list[list[bytes]], list[list[int]], list[list[int]]]:
        """Split shard rows (row columns, _error, _time, _diff) into per-partition keys."""
        n = self.partitions
        keys: list[list[bytes]] = [[] for _ in range(n)]
        times: list[list[int]] = [[] for _ in range(n)]
        diffs: list[list[int]] = [[] for _ in range(n)]
        ekeys: list[list[bytes]] = [[] for _ in range(n)]
        etimes: list[list[int]] = [[] for _ in range(n)]
        ediffs: list[list[int]] = [[] for _ in range(n)]
        if table.num_rows == 0:
            return keys, times, diffs, ekeys, etimes, ediffs
        names = self.shard.row_columns
        rows = table.select(names).to_pylist()
        errs = table[ERROR].to_pylist()
        ts = table[TIME].to_pylist()
        ds = table[DIFF].to_pylist()
        for row, err, t, d in zip(rows, errs, ts, ds, strict=True):
            if err is not None:
                p = error_partition(err, n)
                ekeys[p].append(err.encode())
                etimes[p].append(t)
                ediffs[p].append(d)
                continue
            key = self.row_codec.encode(row)
            p = self._partition_of_key(key)
            keys[p].append(key)
            times[p].append(t)
            diffs[p].append(d)
        return keys, times, diffs, ekeys, etimes, ediffs

    # -- hydration -------------------------------------------------------------------------
    def hydrate(self) -> None:
        """Negate the shard's snapshot at its upper into every partition's buffer."""
        state = self.shard.refresh()
        upper = state.upper
        if upper.time is not None and upper.time > 0 and state.since.less_equal(Frontier.at(upper.time - 1)):
            snap = self.shard.snapshot(upper.time - 1)
            at = upper.time - 1
            snap = snap.append_column(TIME, pa.array([at] * snap.num_rows, pa.uint64()))
        else:
            snap = self.shard.part_schema.empty_table().select([*self.shard.row_columns, ERROR, DIFF])
            snap = snap.append_column(TIME, pa.array([], pa.uint64()))
        k, t, d, ek, et, ed = self._rows_to_keys(snap)
        for p, ws in enumerate(self.states):
            ws.absorb_persist_snapshot(
                upper, k[p], np.array(t[p], np.uint64), np.array(d[p], np.int64),
                error_keys=ek[p], error_times=np.array(et[p], np.uint64), error_diffs=np.array(ed[p], np.int64),
            )
        self.hydrated = True
        log.info("hydrated from shard upper %s (%d rows)", upper, snap.num_rows, extra={"sink_id": self.sink.sink_id})

    def read_back(self) -> None:
        """Absorb (negated) everything the shard gained since the persist frontier."""
        persist = self.states[0].persist_frontier
        state = self.shard.refresh()
        if not persist.less_than(state.upper) or persist.time is None:
            return
        table = self.shard.updates_between(state, persist.time, state.upper)
        k, t, d, ek, et, ed = self._rows_to_keys(table)
        for p, ws in enumerate(self.states):
            ws.absorb_persist_batch(
                persist, state.upper, k[p], np.array(t[p], np.uint64), np.array(d[p], np.int64),
                error_keys=ek[p], error_times=np.array(et[p], np.uint64), error_diffs=np.array(ed[p], np.int64),
            )

    # -- desired input ---------------------------------------------------------------------
    def absorb_desired(self, table: pa.Table, desired_topic: str) -> None:
        """Updates and progress in offset order per partition (runs of updates vectorised)."""
        if table.num_rows == 0:
            return
        kinds = table["kind"].to_pylist()
        topics = table["topic"].to_pylist()
        parts = table["partition"].to_pylist()
        rows = table["row"].to_pylist()
        times = table["time"].to_pylist()
        diffs = table["diff"].to_pylist()
        frs = table["frontier"].to_pylist()
        closed = table["frontier_closed"].to_pylist()
        errs = table["error"].to_pylist()
        run: dict[int, tuple[list[bytes], list[int], list[int]]] = {}

        def flush(p: int) -> None:
            r = run.pop(p, None)
            if r and r[0]:
                ws = self._state(p)
                self.metrics.contract_violations += ws.absorb_desired_updates(
                    r[0], np.array(r[1], np.uint64), np.array(r[2], np.int64)
                )
                self.metrics.desired_updates += len(r[0])

        for i, kind in enumerate(kinds):
            if topics[i] != desired_topic or kind == KIND_CONTROL:
                continue
            p = parts[i]
            if kind == KIND_UPDATE:
                t = u64(times[i])
                assert t is not None
                r = run.setdefault(p, ([], [], []))
                r[0].append(rows[i])
                r[1].append(t)
                r[2].append(diffs[i])
            elif kind == KIND_PROGRESS:
                flush(p)
                self._state(p).absorb_desired_progress(None if closed[i] else u64(frs[i]))
            elif kind == KIND_BAD:
                flush(p)
                ws = self._state(p)
                # A row that does not match the schema keeps its time and diff; a message
                # that does not decode at all has none: it lands at the partition's frontier.
                at = Frontier.at(u64(times[i]) or 0) if times[i] is not None else ws.desired_frontier.join(ws.persist_frontier)
                if at.time is not None:
                    ws.absorb_desired_error(errs[i] or "bad desired message", at.time, diffs[i] if diffs[i] is not None else 1)
                    self.metrics.decode_errors += 1
        for p in list(run):
            flush(p)

    def _state(self, p: int) -> WriteState:
        if p >= len(self.states):
            raise ShardsinkError(
                f"expected desired partitions < {len(self.states)}, found {p}: the topic grew; "
                "the writer restarts with the new partition count",
                sink_id=self.sink.sink_id,
            )
        return self.states[p]

    # -- staging ---------------------------------------------------------------------------
    def _stage(self, decision: Stage) -> str:
        upd, errs = decision.updates, decision.errors
        parts: list[pa.Table] = []
        if len(upd):
            dicts = [self.row_codec.decode(k) for k in upd.keys.to_pylist()]
            body = rows_to_arrow(dicts, self.shard.head(max_age_s=1e9).schema) if dicts else None
            assert body is not None
            body = body.append_column(TIME, pa.array(upd.times, pa.uint64()))
            body = body.append_column(DIFF, pa.array(upd.diffs, pa.int64()))
            body = body.append_column(ERROR, pa.nulls(len(upd), pa.string()))
            parts.append(self.shard.to_table(body))
        if len(errs):
            etab = pa.table(
                {
                    **{f.name: pa.nulls(len(errs), f.type) for f in self.shard.row_schema},
                    TIME: pa.array(errs.times, pa.uint64()),
                    DIFF: pa.array(errs.diffs, pa.int64()),
                    ERROR: pa.array([k.decode("utf-8", "replace") for k in errs.keys.to_pylist()], pa.string()),
                }
            )
            parts.append(self.shard.to_table(etab))
        staged = self.shard.stage(pa.concat_tables(parts))
        self.metrics.rows_staged += staged.rows
        self.metrics.batches_staged += 1
        return json.dumps(staged.to_json(), sort_keys=True)

    def write_descriptions(self, descs: list[BatchDescription]) -> None:
        for d in descs:
            for ws in self.states:
                ws.absorb_description(d)
        decisions = [ws.maybe_write() for ws in self.states]
        futures: list[tuple[Stage | NothingToWrite, Any]] = []
        for dec in decisions:
            if isinstance(dec, Stage):
                futures.append((dec, self._pool.submit(self._stage, dec)))
            elif isinstance(dec, NothingToWrite):
                futures.append((dec, None))
        codec = message_codec("written_batch")
        now = int(time.time() * 1000)
        for dec, fut in futures:
            if isinstance(dec, Stage):
                assert fut is not None
                report = dec.report(fut.result(), now)
            else:
                assert isinstance(dec, NothingToWrite)
                report = dec.report(now)
            self.producer.send(self.settings.batches_topic, codec.encode(report.to_dict()), key=self.sink.sink_id.encode())
            self.metrics.reports_sent += 1
        self.producer.flush()

    # -- one micro-batch -------------------------------------------------------------------
    def process(self, table: pa.Table) -> None:
        with self._lock:
            if not self.hydrated:
                self.hydrate()
            self.absorb_desired(table, self.sink.desired_topic)
            self.read_back()
            descs: list[BatchDescription] = []
            desc_codec = message_codec("batch_description")
            control = table.filter(
                pc.and_(pc.equal(table["kind"], KIND_CONTROL), pc.equal(table["topic"], self.settings.descs_topic))
            ) if table.num_rows else table
            for value in control["value"].to_pylist() if control.num_rows else []:
                try:
                    raw = desc_codec.decode(value or b"")
                    d = BatchDescription.from_dict(raw)
                except (DecodeError, ShardsinkError) as e:
                    log.warning("skipping a bad description: %s", e, extra={"sink_id": self.sink.sink_id})
                    continue
                if d.sink_id == self.sink.sink_id:
                    descs.append(d)
            self.write_descriptions(descs)
            self.metrics.micro_batches += 1
            self.metrics.buffer_updates = sum(ws.correction.size() + ws.errors.size() for ws in self.states)
            self.metrics.buffer_bytes = sum(ws.correction.bytes() + ws.errors.bytes() for ws in self.states)


def start_write_query(spark: Any, settings: ServiceSettings, sink: SinkDef, registry: dict[str, SinkWriter] | None = None) -> Any:
    from shared.io.kafka_admin import topic_partition_count
    from shared.io.spark_kafka import kafka_read_stream

    partitions = topic_partition_count(settings.kafka, sink.desired_topic)
    writer = SinkWriter.create(sink, settings, partitions)
    if registry is not None:
        registry[sink.sink_id] = writer
    df = kafka_read_stream(
        spark, settings.kafka, [sink.desired_topic, settings.descs_topic, settings.frontiers_topic], starting_offsets="earliest"
    )
    schema_json = json.dumps(writer.shard.refresh().schema)
    desired_topic = sink.desired_topic

    def each(batch_df: Any, batch_id: int) -> None:
        table = collect_decoded(batch_df, desired_topic, row_schema_json=schema_json)
        writer.process(table)

    return (
        df.writeStream.foreachBatch(each)
        .option("checkpointLocation", checkpoint_path(settings, "write", sink))
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(f"write-{sink.sink_id}-{sink.epoch}")
        .start()
    )
