"""The Kafka sink for Spark (``shardsink-kafka``) against the embedded broker: records land
with their keys, partitions and headers plus a message id; under an injected task failure the
retried micro-batch duplicates records on the wire with the same ids, so a consumer that drops
replays by id gets exactly-once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.errors import StreamingQueryException

from shared.devstack.embedded import EmbeddedStack
from shared.io.kafka import KafkaSettings, end_offsets
from shared.spark.kafka_connector import kafka_read_stream, kafka_write_stream
from shared.spark.kafka_sink import ID_HEADER


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(timeout=30)


def produce(bootstrap: str, topic: str, records: list[tuple[int, bytes]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for part, value in records:
        p.produce(topic, value=value, key=b"k" + value, partition=part)
    assert p.flush(30) == 0


def consume_all(bootstrap: str, topic: str) -> list[Any]:
    """Every record of every partition, in offset order per partition (plain confluent-kafka)."""
    ends = end_offsets(KafkaSettings.of(bootstrap), topic)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "check", "enable.auto.commit": False})
    out: list[Any] = []
    try:
        for p, end in sorted(ends.items()):
            if end == 0:
                continue
            c.assign([TopicPartition(topic, p, 0)])
            while True:
                m = c.poll(10)
                assert m is not None, f"expected records up to {end} in {topic}/{p}"
                assert m.error() is None, m.error()
                out.append(m)
                if m.offset() == end - 1:
                    break
    finally:
        c.close()
    return out


def start_pipeline(spark: Any, stack: EmbeddedStack, src: str, dst: str, ckpt: Path,
                   **sink_options: str) -> Any:
    settings = KafkaSettings.of(stack.bootstrap_servers)
    df = kafka_read_stream(spark, settings, [src]).selectExpr("key", "value", "partition")
    w = kafka_write_stream(df, settings, topic=dst)
    for k, v in sink_options.items():
        w = w.option(k, v)
    return w.option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start()


def test_sink_writes_key_value_partition_and_a_unique_id_per_record(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    bs = stack.bootstrap_servers
    src, dst = f"sink-in-{unique_id}", f"sink-out-{unique_id}"
    create_topic(bs, src, 2)
    create_topic(bs, dst, 2)
    records = [(i % 2, b"s%03d" % i) for i in range(60)]
    produce(bs, src, records)

    q = start_pipeline(spark, stack, src, dst, tmp_path / "ckpt")
    q.awaitTermination(120)
    assert q.exception() is None

    out = consume_all(bs, dst)
    assert sorted((m.partition(), m.value()) for m in out) == sorted(records)
    assert all(m.key() == b"k" + m.value() for m in out)
    # "{query_id}:{batch_id}:{task_partition}:{seq}"
    ids = [tuple(dict(m.headers())[ID_HEADER].decode().rsplit(":", 3)) for m in out]
    assert len(set(ids)) == 60
    assert {query_id for query_id, _, _, _ in ids} == {str(q.id)}
    assert {int(batch_id) for _, batch_id, _, _ in ids} == {0}


def test_sink_retry_after_injected_failure_is_exactly_once_by_message_id(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    bs = stack.bootstrap_servers
    src, dst = f"fail-in-{unique_id}", f"fail-out-{unique_id}"
    create_topic(bs, src, 2)
    create_topic(bs, dst, 3)
    records = [(i % 2, b"f%03d" % i) for i in range(200)]
    produce(bs, src, records)
    ckpt, marker = tmp_path / "ckpt", tmp_path / "failed-once"
    options = {"testFailMarker": str(marker), "testFailAfterRecords": "30"}

    # drop the partition column: the records spread over dst's 3 partitions by key
    q1 = start_pipeline(spark, stack, src, dst, ckpt, **options)
    with pytest.raises(StreamingQueryException, match="injected failure"):
        q1.awaitTermination(120)
    assert marker.exists()
    delivered_by_failed_attempt = consume_all(bs, dst)
    assert len(delivered_by_failed_attempt) >= 30

    q2 = start_pipeline(spark, stack, src, dst, ckpt, **options)  # the batch runs again
    q2.awaitTermination(120)
    assert q2.exception() is None
    assert q2.id == q1.id

    raw = consume_all(bs, dst)
    assert len(raw) >= 200 + 30  # the retry duplicated what the failed attempt delivered
    # the retry gave every record the id its failed attempt gave it: one value per id
    kept: dict[bytes, bytes] = {}
    for m in raw:
        assert kept.setdefault(dict(m.headers())[ID_HEADER], m.value()) == m.value()
    assert Counter(kept.values()) == Counter(v for _, v in records)

