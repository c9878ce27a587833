"""The write service's source: the Kafka source (``shardsink-kafka``) partitioned by writer
partition, with the desired topic's decode (:func:`services.sinkio.decode_partition`) run
inside its ``read()``.

A micro-batch has one input partition per writer partition that has input: writer partition
``p`` reads desired partition ``p``'s range (the desired topic is partitioned by row hash,
so a partition's updates and the shard rows routed to it meet there) and, when the batch holds
control messages (``descs``), the whole control range too, so that every writer partition sees
every description. A partition with neither is not read (its state stays as it was). The
write step then runs over each input partition as it is (``mapInArrow`` in the same stage: no
shuffle), see :mod:`services.write.executor`.

Two forms. With a write job (:func:`desired_source`'s ``step``: the write service's own
source), ``read()`` also runs the write step on the decoded input in the same Python worker
(:func:`services.write.executor.run_write_step`) and yields only the step's output, a few rows
per writer partition (:data:`services.write.job.OUTPUT_DDL`): the desired updates never
cross into the JVM, where turning Arrow batches into rows and back into Arrow for a
``mapInArrow`` was most of the JVM's work per update. The micro-batch id comes from the
task's local property :data:`BATCH_PROPERTY`, which the write query's ``foreachBatch`` sets
before it runs the batch's job. Without one (the builtin connector's path keeps its own
``mapInArrow``), each record crosses from Python to the JVM once, already decoded and
checked, as columns :data:`services.sinkio.ROUTED_DDL`.

Admission control holds the desired topic back between descriptions. The writer stages a
batch only when a description arrives; desired records admitted before it change nothing
but the correction buffer, and each micro-batch that admits them costs its planning, logs
and a task per writer partition (about 60 ms of CPU on this project's 2-core machines).
``latestOffset`` therefore admits the desired topic's records together with news on a
control topic (a description, an upper announced: they are read in the same micro-batch),
when more of them wait than one micro-batch admits, or at least every
:data:`shared.spark.kafka_source.ADMIT_EVERY_S`, so that the buffer never lags the topic by more
than that (:class:`shared.spark.holding_source.HoldingStreamReader`). Holding only ever delays
records: the next admitted micro-batch covers every held one.

Same options as ``shardsink-kafka``, plus ``shardsinkDecode`` (JSON: desired topic, row
schema, writer partitions, quarantined ranges).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows

from services.sinkio import ROUTED_DDL, decode_partition
from services.write.job import OUTPUT_DDL
from shared.errors import SinkProtocolError
from shared.spark.holding_source import HoldingStreamReader
from shared.spark.kafka_source import KafkaInputPartition, SourceOptions
from shared.spark.kafka_connector import KafkaDataSource
from shared.kafka_offsets import Offsets
from shared.spark.worker_heap import settle

DESIRED_SOURCE = "shardsink-desired"
DECODE_OPTION = "shardsinkDecode"
#: The local property that carries the micro-batch id to the write step's tasks.
BATCH_PROPERTY = "shardsink.write.batchId"


class WriterPartition(InputPartition):
    """Writer partition ``wp``'s input of one micro-batch: its desired range (None: no new
    desired records) and the control ranges."""

    def __init__(self, wp: int, desired: KafkaInputPartition | None, control: Sequence[KafkaInputPartition]) -> None:
        super().__init__((wp, None if desired is None else desired.value, tuple(c.value for c in control)))
        self.wp = wp
        self.desired = desired
        self.control = tuple(control)


def writer_partitions(
    ranges: Sequence[KafkaInputPartition], desired_topic: str, route_to: int
) -> list[WriterPartition]:
    """The micro-batch's input partitions: one per writer partition with a desired range, or
    one per writer partition when there are control records."""
    control = [r for r in ranges if r.topic != desired_topic]
    desired = {r.partition: r for r in ranges if r.topic == desired_topic}
    wps = range(route_to) if control else sorted(desired)
    return [WriterPartition(wp, desired.get(wp), control) for wp in wps]


class DesiredStreamReader(HoldingStreamReader):
    """Holds the desired topic back between descriptions (module docstring); a writer that
    catches up (more desired records waiting than one micro-batch admits) reads them back to
    back."""

    #: The decode needs values and offsets only (the history-gap marker is the source's own
    #: record, not a header of the topic's).
    values_only = True

    def __init__(self, options: SourceOptions, decode: dict[str, Any], step: Any = None) -> None:
        super().__init__(options, held=decode["desired_topic"])
        self.decode = decode
        #: The write job (:class:`services.write.job.WriteJob`) whose step ``read()`` runs.
        self.step = step

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "decode": self.decode, "step": self.step}

    def admits(self, start: Offsets, end: Offsets, limit: ReadLimit) -> bool:
        return isinstance(limit, ReadMaxRows) and self.waiting(start) >= int(limit.max_rows)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        d = self.decode
        topic, n = d["desired_topic"], int(d["route_to"])
        parts = self.input_ranges(start, end)
        for r in parts:
            if r.topic == topic and r.partition >= n:
                raise SinkProtocolError(
                    f"expected the desired topic {topic!r} to keep its {n} partitions, found "
                    f"partition {r.partition}: the correction buffers are keyed by partition; "
                    "run `shardsink sink adopt` to start a new checkpoint",
                    topic=topic,
                )
        return writer_partitions(parts, topic, n)

    def read(self, partition: Any) -> Iterator[pa.RecordBatch]:
        settle()
        assert isinstance(partition, WriterPartition)
        d = self.decode
        fn = decode_partition(
            d["desired_topic"], d["row_schema"], route_to=int(d["route_to"]), executor=False,
            quarantine=[(int(p), int(s), int(e), str(r)) for p, s, e, r in d["quarantine"]],
            only_wp=partition.wp,
        )
        ranges = ([partition.desired] if partition.desired is not None else []) + list(partition.control)
        raw = itertools.chain.from_iterable(self._read_one(r) for r in ranges)
        decoded: Iterator[pa.RecordBatch] = fn(raw)
        if self.step is None:
            return decoded
        # Imported here: the query's source runner, a fresh process on a restart's critical
        # path, plans and never steps (without the executor's side, and boto3 with it, its
        # imports of this module went from 1.04 to 0.70 s on a loaded 2-core machine); the
        # executors' daemon has it loaded already (worker_daemon.PRELOAD).
        from services.write.executor import run_write_step

        return run_write_step(self.step, partition.wp, _batch_id(), decoded)


def _batch_id() -> int:
    """The micro-batch id the write query's ``foreachBatch`` set for this job's tasks."""
    ctx = TaskContext.get()
    raw = ctx.getLocalProperty(BATCH_PROPERTY) if ctx is not None else None
    if raw is None:
        raise SinkProtocolError(
            f"expected the task's local property {BATCH_PROPERTY!r} (set by the write query's "
            "foreachBatch), found none: the write source runs only inside the write query"
        )
    return int(raw)


class DesiredDataSource(KafkaDataSource):
    """``shardsink-desired``: a streaming reader only. A subclass made by
    :func:`desired_source` carries a write job (``step``) and a name of its own."""

    #: The write job whose step ``read()`` runs (None: ``read()`` yields the decoded input).
    step: ClassVar[Any] = None

    @classmethod
    def name(cls) -> str:
        return DESIRED_SOURCE

    def schema(self) -> str:  # type: ignore[override]
        if self.step is not None:
            return OUTPUT_DDL
        return ROUTED_DDL

    def streamReader(self, schema: Any) -> DesiredStreamReader:
        low = {k.lower(): v for k, v in self.options.items()}
        return DesiredStreamReader(SourceOptions.parse(self.options), json.loads(low[DECODE_OPTION.lower()]), self.step)


def desired_source(
    desired_topic: str, row_schema_json: str, route_to: int, quarantine: list[tuple[int, int, int, str]] | None = None,
    step: Any = None, name: str | None = None,
) -> tuple[str, type[DesiredDataSource], dict[str, str]]:
    """The ``source`` argument of :func:`shared.spark.kafka_connector.kafka_read_stream`.

    ``step`` (a :class:`services.write.job.WriteJob`) makes ``read()`` run the write step
    (see the module docstring); the data source is then a class of its own, registered under
    ``name`` (one per write query: the session's registry is shared by every sink's query),
    which carries the job to the planning process and the executors inside its pickle, not in
    the options that plans and the UI show."""
    decode = {"desired_topic": desired_topic, "row_schema": row_schema_json, "route_to": route_to,
              "quarantine": [list(q) for q in (quarantine or [])]}
    options = {DECODE_OPTION: json.dumps(decode)}
    if step is None:
        return DESIRED_SOURCE, DesiredDataSource, options
    source_name = name or f"{DESIRED_SOURCE}-write"
    cls = type("DesiredWriteSource", (DesiredDataSource,), {
        "step": step,
        "name": classmethod(lambda _cls: source_name),
        "__doc__": f"``{source_name}``: the write query's source (decode and write step in read()).",
    })
    return source_name, cls, options
