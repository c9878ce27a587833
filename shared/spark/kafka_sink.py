"""The Kafka sink for Spark Structured Streaming, without the ``spark-sql-kafka`` jar.

Built on PySpark's Python Data Source API (``pyspark.sql.datasource``) over confluent-kafka:
:class:`KafkaStreamWriter` is the writer of the ``shardsink-kafka`` data source
(:mod:`shared.spark.kafka_connector`, which registers it, with the source of
:mod:`shared.spark.kafka_source`).

Input columns: ``value`` (binary or string, required), ``key`` (binary or string),
``topic`` (string; else the ``topic`` option), ``partition`` (int; null or absent: librdkafka's
partitioner on the key), ``headers`` (``array<struct<key string, value binary>>``).
Each task produces with an idempotent producer (``enable.idempotence=true``, ``acks=all``),
then ``flush()``es, and only then returns its commit message; a record not acknowledged
raises :class:`~shared.errors.KafkaDeliveryError`, so the task and the micro-batch fail and
Spark (or the restarted query) runs the batch again.

Exactly-once for consumers: message ids, not transactions
---------------------------------------------------------
A retried micro-batch produces again what its failed attempt may already have delivered, so
the sink is at-least-once on the wire. Every record carries a header ``shardsink-id`` =
``"{query_id}:{batch_id}:{task_partition}:{seq}"`` (query id from the checkpoint, so stable
across restarts; batch id from the task's local property ``streaming.sql.batchId``; ``seq``
the record's position in the task's input). A retry of the same batch gives each record the
same id when the task's input is deterministic (true for this source and any plan without an
unordered shuffle before the sink). A consumer drops replays by id: per (topic, kafka
partition, query, task partition) the ids arrive in increasing ``(batch, seq)`` order (the
idempotent producer keeps order without gaps per kafka partition), so a record whose
``(batch, seq)`` is not above the highest seen is a replay.

Kafka transactions were tried on the embedded broker and are not usable there: Tansu 0.6
accepts ``init_transactions``/``commit_transaction``/``abort_transaction`` but a
``read_committed`` consumer still returns the records of an aborted transaction. Hence ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException, Producer
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructType

from shared.errors import KafkaConfigError, KafkaDeliveryError
from shared.io.kafka import KafkaSettings, translate
from shared.spark.kafka_common import HEADER_TYPE, int_option
from shared.spark.worker_heap import settle

if TYPE_CHECKING:
    import pyarrow as pa

#: Header carrying the sink's message id (see the module docstring).
ID_HEADER = "shardsink-id"


@dataclass(frozen=True, slots=True)
class SinkOptions:
    settings: KafkaSettings
    topic: str | None = None
    id_header: str | None = ID_HEADER
    flush_timeout_s: float = 60.0
    #: Test hook: when set and the file does not exist, the first task to produce
    #: ``fail_after_records`` records creates it and fails (after flushing them).
    fail_marker: str | None = None
    fail_after_records: int = 1

    @staticmethod
    def parse(options: Mapping[str, str]) -> SinkOptions:
        low = {k.lower(): v for k, v in options.items()}
        idh = low.get("idheader", ID_HEADER)
        return SinkOptions(
            settings=KafkaSettings.from_options(options),
            topic=low.get("topic") or None,
            id_header=idh or None,
            flush_timeout_s=float(low.get("flushtimeoutseconds", 60.0)),
            fail_marker=low.get("testfailmarker") or None,
            fail_after_records=int_option(low, "testfailafterrecords", 1) or 1,
        )


@dataclass
class KafkaCommitMessage(WriterCommitMessage):
    partition_id: int
    records: int


class InjectedFailure(RuntimeError):
    """Raised by the sink's test hook (``testFailMarker``)."""


def _check_sink_schema(schema: StructType, options: SinkOptions) -> None:
    names = set(schema.fieldNames())
    if "value" not in names:
        raise KafkaConfigError(f"expected a 'value' column, found columns {sorted(names)}")
    if "topic" not in names and not options.topic:
        raise KafkaConfigError("expected a 'topic' option or a 'topic' column, found neither")
    allowed: dict[str, tuple[type, ...]] = {
        "key": (BinaryType, StringType),
        "value": (BinaryType, StringType),
        "topic": (StringType,),
        "partition": (IntegerType, LongType),
    }
    for f in schema.fields:
        if f.name in allowed and not isinstance(f.dataType, allowed[f.name]):
            raise KafkaConfigError(
                f"expected column {f.name!r} of type "
                f"{' or '.join(t.__name__ for t in allowed[f.name])}, found {f.dataType}"
            )
        if f.name == "headers" and f.dataType != HEADER_TYPE:
            raise KafkaConfigError(
                f"expected column 'headers' of type {HEADER_TYPE.simpleString()}, found "
                f"{f.dataType.simpleString()}"
            )


class KafkaStreamWriter(DataSourceStreamArrowWriter):
    """Produces each task's records with an idempotent producer, flushes, then returns the
    commit message. Commit order per task: (1) produce every record, (2) flush and check
    every delivery, (3) return the commit message; Spark commits the batch only after every
    task did (3). ``commit``/``abort`` have nothing to do: delivered records stay delivered,
    and consumers drop replays by id (see the module docstring)."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        _check_sink_schema(schema, options)
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        settle()
        o = self.options
        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx else 0
        batch_id = (ctx.getLocalProperty("streaming.sql.batchId") if ctx else None) or "-1"
        query_id = (ctx.getLocalProperty("sql.streaming.queryId") if ctx else None) or "none"
        id_prefix = f"{query_id}:{batch_id}:{pid}:"
        failures: list[Any] = []

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)

        conf = o.settings.config(
            **{
                "enable.idempotence": "true",
                "acks": "all",
                "linger.ms": "5",
                "delivery.report.only.error": True,
                "on_delivery": on_delivery,
            }
        )
        try:
            producer = Producer(conf)
        except (KafkaException, ValueError, TypeError) as e:
            raise translate(e, "creating a Kafka producer") from e
        idh = o.id_header
        seq = 0
        try:
            for rb in iterator:
                names = rb.schema.names
                n = rb.num_rows

                def col(name: str) -> list[Any]:
                    return rb.column(name).to_pylist() if name in names else [None] * n

                keys, vals, topics, parts, hdrs = (
                    col("key"), col("value"), col("topic"), col("partition"), col("headers")
                )
                for i in range(n):
                    key = keys[i]
                    val = vals[i]
                    if isinstance(key, str):
                        key = key.encode()
                    if isinstance(val, str):
                        val = val.encode()
                    topic = topics[i] or o.topic
                    if not topic:
                        raise KafkaConfigError(
                            f"expected a topic for record {seq} (column or option), found null"
                        )
                    h = [(x["key"], x["value"]) for x in hdrs[i]] if hdrs[i] else []
                    if idh:
                        h.append((idh, (id_prefix + str(seq)).encode()))
                    part = parts[i]
                    while True:
                        try:
                            if part is None:
                                producer.produce(topic, val, key, headers=h or None)
                            else:
                                producer.produce(topic, val, key, partition=int(part),
                                                 headers=h or None)
                            break
                        except BufferError:
                            producer.poll(0.05)
                        except KafkaException as e:
                            raise translate(e, f"producing to {topic}") from e
                    seq += 1
                    if o.fail_marker and seq == o.fail_after_records:
                        self._maybe_inject_failure(producer)
                producer.poll(0)
                if failures:
                    break
            remaining = producer.flush(o.flush_timeout_s)
            if failures:
                raise KafkaDeliveryError(
                    f"expected every record of batch {batch_id} task {pid} delivered, found "
                    f"{len(failures)} failed: {failures[0]}",
                    batch_id=batch_id, partition_id=pid,
                )
            if remaining:
                raise KafkaDeliveryError(
                    f"expected every record of batch {batch_id} task {pid} acknowledged within "
                    f"{o.flush_timeout_s}s, found {remaining} outstanding",
                    batch_id=batch_id, partition_id=pid,
                )
        except BaseException:
            producer.purge()  # nothing of a failed attempt keeps trickling out after it
            producer.flush(0)
            raise
        return KafkaCommitMessage(partition_id=pid, records=seq)

    def _maybe_inject_failure(self, producer: Any) -> None:
        marker = self.options.fail_marker
        assert marker
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        producer.flush(self.options.flush_timeout_s)  # the records so far are delivered
        raise InjectedFailure(f"injected failure after {self.options.fail_after_records} records")

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass
