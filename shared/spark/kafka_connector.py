"""Kafka for Spark Structured Streaming without the ``spark-sql-kafka`` jar: the
``shardsink-kafka`` data source, its reader :mod:`shared.spark.kafka_source` and its writer
:mod:`shared.spark.kafka_sink` under one short name, and the choice between it and Spark's own
connector.

Built on PySpark's Python Data Source API (``pyspark.sql.datasource``) over confluent-kafka.
Register once per session, then use the short name ``shardsink-kafka``::

    register_kafka_source(spark)
    df = (spark.readStream.format("shardsink-kafka")
          .option("bootstrap", "127.0.0.1:9092").option("topics", "a,b")
          .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", 100000)
          .load())
    (df.select("key", "value").writeStream.format("shardsink-kafka")
       .option("bootstrap", "127.0.0.1:9092").option("topic", "out")
       .option("checkpointLocation", "/ckpt").start())

or, with the connector choice made by settings, :func:`kafka_read_stream` /
:func:`kafka_write_stream` (ours by default; Spark's own ``format("kafka")`` when
``SHARDSINK_SPARK_KAFKA_CONNECTOR=builtin`` and the jar is on the classpath). The source's
options and columns are described in :mod:`shared.spark.kafka_source`, the sink's in
:mod:`shared.spark.kafka_sink`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, DataSourceStreamReader
from pyspark.sql.types import StructType

from shared.errors import KafkaConfigError
from shared.io.kafka import KafkaSettings
from shared.spark.kafka_sink import KafkaStreamWriter, SinkOptions
from shared.spark.kafka_source import KAFKA_SCHEMA, KafkaStreamReader, SourceOptions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.readwriter import DataStreamWriter

#: The short name of the data source, for reading and writing alike.
SOURCE_NAME = "shardsink-kafka"
#: Env var choosing the connector: ``shardsink`` (default) or ``builtin`` (``format("kafka")``).
CONNECTOR_ENV = "SHARDSINK_SPARK_KAFKA_CONNECTOR"


class KafkaDataSource(DataSource):
    """``shardsink-kafka``: streaming reader and writer (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return KAFKA_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(SourceOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        return KafkaStreamWriter(SinkOptions.parse(self.options), schema)


def register_kafka_source(spark: SparkSession) -> None:
    """Register ``shardsink-kafka`` with the session (idempotent)."""
    spark.dataSource.register(KafkaDataSource)


def _connector(connector: str | None) -> str:
    """``connector``, else env :data:`CONNECTOR_ENV`, else ``shardsink``: ``shardsink`` or
    ``builtin``."""
    c = (connector or os.environ.get(CONNECTOR_ENV) or "shardsink").strip().lower()
    if c not in ("shardsink", "builtin"):
        raise KafkaConfigError(f"expected {CONNECTOR_ENV} 'shardsink' or 'builtin', found {c!r}")
    return c


def kafka_read_stream(
    spark: SparkSession,
    settings: KafkaSettings,
    topics: Sequence[str],
    *,
    starting_offsets: str = "earliest",
    max_records_per_trigger: int | None = None,
    connector: str | None = None,
    history_gap_topics: Sequence[str] = (),
    simulated_low_watermarks_file: str | None = None,
    skip_value_prefixes: Mapping[str, bytes] | None = None,
    source: tuple[str, Any, Mapping[str, str]] | None = None,
    wait_for_records_ms: int = 0,
) -> DataFrame:
    """A streaming DataFrame of Kafka records (columns as in :mod:`shared.spark.kafka_source`).

    ``source`` (ours only): ``(name, DataSource class, extra options)`` of a data source built
    on this one (same options, its own schema), used instead of ``shardsink-kafka``.

    ``connector`` (default: env ``SHARDSINK_SPARK_KAFKA_CONNECTOR``, else ``shardsink``):
    ``shardsink`` is :class:`KafkaDataSource`; ``builtin`` is Spark's ``format("kafka")`` (needs
    the ``spark-sql-kafka`` jar; the headers column then follows Spark's connector).
    ``skip_value_prefixes`` (``{topic: prefix}``): records to drop in the reader (ours only:
    the builtin connector returns them, so callers must still filter).
    """
    if _connector(connector) == "builtin":
        r = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", settings.bootstrap)
            .option("subscribe", ",".join(topics))
            .option("startingOffsets", starting_offsets)
            .option("includeHeaders", "true")
        )
        for k, v in settings.options:
            r = r.option(f"kafka.{k}", v)
        if max_records_per_trigger:
            r = r.option("maxOffsetsPerTrigger", str(max_records_per_trigger))
        return r.load()
    register_kafka_source(spark)
    if source is not None:
        spark.dataSource.register(source[1])
    r = spark.readStream.format(source[0] if source else SOURCE_NAME).option("topics", ",".join(topics))
    for k, v in (source[2] if source else {}).items():
        r = r.option(k, v)
    r = r.option("startingOffsets", starting_offsets)
    for k, v in settings.to_options().items():
        r = r.option(k, v)
    if max_records_per_trigger:
        r = r.option("maxRecordsPerTrigger", str(max_records_per_trigger))
    if history_gap_topics:
        r = r.option("historyGapTopics", ",".join(history_gap_topics))
    if simulated_low_watermarks_file:
        r = r.option("simulatedLowWatermarksFile", simulated_low_watermarks_file)
    if skip_value_prefixes:
        r = r.option("skipValuePrefixes", ",".join(f"{t}={p.hex()}" for t, p in skip_value_prefixes.items()))
    if wait_for_records_ms:
        r = r.option("waitForRecordsMs", str(wait_for_records_ms))
    return r.load()


def kafka_write_stream(
    df: DataFrame,
    settings: KafkaSettings,
    *,
    topic: str | None = None,
    connector: str | None = None,
) -> DataStreamWriter:
    """A DataStreamWriter to Kafka (set the checkpoint and trigger, then ``start()``)."""
    if _connector(connector) == "builtin":
        w = df.writeStream.format("kafka").option("kafka.bootstrap.servers", settings.bootstrap)
        for k, v in settings.options:
            w = w.option(f"kafka.{k}", v)
        if topic:
            w = w.option("topic", topic)
        return w
    register_kafka_source(df.sparkSession)
    w = df.writeStream.format(SOURCE_NAME)
    for k, v in settings.to_options().items():
        w = w.option(k, v)
    if topic:
        w = w.option("topic", topic)
    return w
