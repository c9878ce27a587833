"""The Kafka sink for Spark (``shardsink-kafka``) against the embedded broker: records land
with their keys, partitions and headers plus a message id; under an injected task failure the
retried micro-batch duplicates records on the wire and the consumer-side Deduplicator gives
exactly-once."""

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
from shared.spark.kafka import (
    ID_HEADER,
    Deduplicator,
    MessageId,
    kafka_read_stream,
    kafka_write_stream,
)


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
    ids = [MessageId.parse(dict(m.headers())[ID_HEADER]) for m in out]
    assert len(set(ids)) == 60
    assert {i.query_id for i in ids} == {str(q.id)}
    assert {i.batch_id for i in ids} == {0}


def test_sink_retry_after_injected_failure_is_exactly_once_through_the_deduplicator(
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
    dedup = Deduplicator()
    kept = [m for m in raw if dedup.is_new(m.topic(), m.partition(), m.headers())]
    assert Counter(m.value() for m in kept) == Counter(v for _, v in records)
    assert dedup.dropped == len(raw) - 200

    # a restarted consumer with the saved state keeps dropping replays
    restored = Deduplicator.from_json(dedup.to_json())
    assert not any(restored.is_new(m.topic(), m.partition(), m.headers()) for m in raw)


def test_deduplicator_passes_records_without_ids_and_orders_by_batch_then_seq() -> None:
    d = Deduplicator()
    assert d.is_new("t", 0, None)
    assert d.is_new("t", 0, [("other", b"x")])
    h = lambda s: [(ID_HEADER, s.encode())]  # noqa: E731
    assert d.is_new("t", 0, h("q:1:0:5"))
    assert not d.is_new("t", 0, h("q:1:0:5"))
    assert not d.is_new("t", 0, h("q:1:0:2"))
    assert d.is_new("t", 0, h("q:2:0:0"))  # next batch restarts seq
    assert d.is_new("t", 0, h("q:1:1:0"))  # another task of the batch
    assert d.is_new("t", 1, h("q:1:0:0"))  # another kafka partition
    assert MessageId.parse("a:b:c:1:2:3") == MessageId("a:b:c", 1, 2, 3)
