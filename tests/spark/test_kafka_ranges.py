"""``read_ranges``: many partitions' offset ranges read together by one consumer (the write
service's shared query reads a task's units' desired ranges with it), against the embedded
broker: each range gets exactly its records, or its own error, and the others are unharmed."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.errors import KafkaTimeoutError
from shared.io.kafka import KafkaSettings
from shared.spark.consumer_pool import close_pooled_consumers
from shared.spark.kafka_ranges import Range, read_ranges
from shared.spark.kafka_source import _arrow_schema, read_range
from tests.kafka_fixture import RewindingConsumer
from tests.spark.test_spark_kafka_source import create_topic, produce


SCHEMA = _arrow_schema()


def rows(batches: Any) -> list[tuple[str, int, int, bytes]]:
    assert not isinstance(batches, Exception), batches
    return [(r["topic"], r["partition"], r["offset"], r["value"]) for b in batches for r in b.to_pylist()]


@pytest.fixture(scope="module")
def topics(stack: EmbeddedStack) -> Iterator[tuple[KafkaSettings, str, str]]:
    run = uuid.uuid4().hex[:10]
    a, b = f"ranges-a-{run}", f"ranges-b-{run}"
    create_topic(stack.bootstrap_servers, a, 3)
    create_topic(stack.bootstrap_servers, b, 1)
    produce(stack.bootstrap_servers, a, [(p, b"a%d-%03d" % (p, i)) for i in range(200) for p in range(3)], rounds=4)
    produce(stack.bootstrap_servers, b, [(0, b"b0-%03d" % i) for i in range(120)], rounds=3)
    yield KafkaSettings.of(stack.bootstrap_servers), a, b
    close_pooled_consumers()


def test_each_range_gets_exactly_its_records_as_read_range_gives_them(topics: tuple[KafkaSettings, str, str]) -> None:
    settings, a, b = topics
    rng = random.Random(11)
    for _ in range(5):
        ranges = [Range(a, p, s, min(200, s + rng.choice([1, 5, 60, 200]))) for p in range(3) for s in [rng.randrange(200)]]
        ranges.append(Range(b, 0, 0, 120))
        ranges.append(Range(a, 1, 10, 10))  # empty
        ranges.append(Range(a, 0, 3, 9))  # a partition named twice
        for values_only in (True, False):
            got = read_ranges(settings, schema=SCHEMA, ranges=ranges, batch_size=16, values_only=values_only)
            assert len(got) == len(ranges)
            for r, batches in zip(ranges, got, strict=True):
                want = [(x["topic"], x["partition"], x["offset"], x["value"])
                        for bt in read_range(settings, r.topic, r.partition, r.start, r.end, values_only=values_only)
                        for x in bt.to_pylist()]
                assert rows(batches) == want
                assert [o for _, _, o, _ in want] == list(range(r.start, r.end))
                if not values_only and batches:
                    full = [x for bt in batches for x in bt.to_pylist()]
                    assert all(x["key"] == b"k" + x["value"] for x in full)
                    assert all(x["timestamp"] is not None for x in full)


def test_skipped_prefixes_are_left_out_and_their_offsets_still_end_the_range(topics: tuple[KafkaSettings, str, str]) -> None:
    settings, a, b = topics
    got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 2, 0, 50), Range(b, 0, 0, 50)], skip_prefixes={a: b"a2-00"}, values_only=True)
    assert [o for _, _, o, _ in rows(got[0])] == list(range(10, 50))
    assert [o for _, _, o, _ in rows(got[1])] == list(range(50))


def test_a_range_that_never_fills_fails_alone(topics: tuple[KafkaSettings, str, str]) -> None:
    """A range past the partition's end times out with its own error; the ranges read with it
    still get every record."""
    settings, a, b = topics
    got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 190, 200), Range(b, 0, 100, 500), Range(a, 1, 0, 200)], timeout_s=2.0,
                      values_only=True)
    assert [o for _, _, o, _ in rows(got[0])] == list(range(190, 200))
    assert isinstance(got[1], KafkaTimeoutError)
    assert "500" in str(got[1]) and "119" in str(got[1])
    assert [o for _, _, o, _ in rows(got[2])] == list(range(200))


def test_a_partition_paused_past_its_range_is_read_again_by_the_next_call(topics: tuple[KafkaSettings, str, str]) -> None:
    """A range far below its partition's end is paused once read (the consumer would fetch on
    while the others are read); the pooled consumer reads that partition again at the next call."""
    import shared.spark.consumer_pool as cp
    import shared.spark.kafka_ranges as kr

    settings, a, b = topics
    close_pooled_consumers()
    # The first call also waits for b/0's records past its end, which never come: a/0's records
    # past its range certainly arrive while that range is open (had every other range ended
    # first, nothing would be left to pause for).
    got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 0, 5), Range(a, 1, 0, 200), Range(b, 0, 0, 130)],
                      timeout_s=2.0, values_only=True, batch_size=7)
    marks = [m for v in cp._POOL.values() for _, known in v for m in known if m.startswith(kr._PAUSED)]
    assert marks == [f"{kr._PAUSED}{a}\0{0}"], marks
    assert [o for _, _, o, _ in rows(got[0])] == list(range(5))
    assert [o for _, _, o, _ in rows(got[1])] == list(range(200))
    assert isinstance(got[2], KafkaTimeoutError)
    for k in range(1, 4):  # the pooled consumer reads the paused partition again
        got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 5 * k, 5 * k + 5), Range(a, 1, 0, 200), Range(b, 0, 0, 120)],
                          timeout_s=5.0, values_only=True, batch_size=7)
        assert [o for _, _, o, _ in rows(got[0])] == list(range(5 * k, 5 * k + 5))
        assert [o for _, _, o, _ in rows(got[1])] == list(range(200))
        assert [o for _, _, o, _ in rows(got[2])] == list(range(120))


def test_a_paused_partition_is_resumed_before_it_is_assigned_again(topics: tuple[KafkaSettings, str, str]) -> None:
    """A pooled consumer's partition paused by an earlier call is resumed before the next call
    assigns it: resumed after the assignment, librdkafka fetched it about a second late (a
    write task's read of a few thousand records took 1.0-1.06 s instead of 20-90 ms)."""
    import shared.spark.consumer_pool as cp

    settings, a, b = topics
    close_pooled_consumers()
    read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 0, 5), Range(a, 1, 0, 200), Range(b, 0, 0, 130)],
                timeout_s=2.0, values_only=True, batch_size=7)
    calls: list[tuple[str, list[tuple[str, int]]]] = []

    class Recording:
        """The pooled consumer, its assignments and resumptions recorded in order."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def assign(self, tps: Any) -> None:
            calls.append(("assign", [(tp.topic, tp.partition) for tp in tps]))
            self.inner.assign(tps)

        def resume(self, tps: Any) -> None:
            calls.append(("resume", [(tp.topic, tp.partition) for tp in tps]))
            self.inner.resume(tps)

    (key, entries), = [(k, v) for k, v in cp._POOL.items() if v]
    cp._POOL[key] = [(Recording(c), known) for c, known in entries]
    got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 5, 10), Range(b, 0, 0, 120)], timeout_s=5.0,
                      values_only=True, batch_size=7)
    assert [o for _, _, o, _ in rows(got[0])] == list(range(5, 10))
    assert [o for _, _, o, _ in rows(got[1])] == list(range(120))
    assert calls[:2] == [("resume", [(a, 0)]), ("assign", [(a, 0), (b, 0)])], calls
    close_pooled_consumers()


def test_records_below_a_range_are_never_read_into_it(topics: tuple[KafkaSettings, str, str]) -> None:
    """A pooled consumer that hands back records from below a range's start (or again) must not
    put them into the range: a write unit would absorb those updates twice. Both readers take
    each record once, from the range's start."""
    import shared.spark.consumer_pool as cp

    settings, a, b = topics
    for reader in ("read_ranges", "read_range"):
        close_pooled_consumers()
        # one read fills the pool with the reader's consumer, which is then wrapped
        if reader == "read_ranges":
            read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 0, 5)], values_only=True)
        else:
            list(read_range(settings, a, 0, 0, 5, values_only=True))
        (key, entries), = [(k, v) for k, v in cp._POOL.items() if v]
        wrapped = [(RewindingConsumer(c), known) for c, known in entries]
        cp._POOL[key] = list(wrapped)
        if reader == "read_ranges":
            got = read_ranges(settings, schema=SCHEMA, ranges=[Range(a, 0, 150, 180), Range(b, 0, 60, 100)],
                              values_only=True, timeout_s=5.0)
            assert [o for _, _, o, _ in rows(got[0])] == list(range(150, 180)), reader
            assert [o for _, _, o, _ in rows(got[1])] == list(range(60, 100)), reader
        else:
            got_one = [x for bt in read_range(settings, a, 0, 150, 180, values_only=True, timeout_s=5.0)
                       for x in bt.to_pylist()]
            assert [x["offset"] for x in got_one] == list(range(150, 180)), reader
            assert [x["value"] for x in got_one] == [b"a0-%03d" % i for i in range(150, 180)], reader
        assert sum(w.rewinds for w, _ in wrapped) >= 1, f"expected {reader} to read with the rewinding consumer"
    close_pooled_consumers()


def test_a_task_of_many_ranges_reads_them_in_waves_in_order(topics: tuple[KafkaSettings, str, str], monkeypatch: Any) -> None:
    """The source's task of several ranges: small ones together, in waves of at most
    WAVE_RECORDS records, a large one or one with lost history by the single-range reader,
    batches in the ranges' order; the first range that fails fails the task."""
    import shared.spark.kafka_ranges as kr
    from shared.spark.kafka_source import KafkaInputPartition, SourceOptions

    settings, a, b = topics
    monkeypatch.setattr(kr, "WAVE_RECORDS", 100)
    opts = SourceOptions.parse({"topics": f"{a},{b}", **settings.to_options(), "timeoutSeconds": "3"})
    ranges = [KafkaInputPartition(a, 0, 0, 40), KafkaInputPartition(a, 1, 0, 40), KafkaInputPartition(a, 2, 0, 150),
              KafkaInputPartition(b, 0, 0, 50), KafkaInputPartition(a, 0, 40, 100), KafkaInputPartition(a, 1, 60, 70, lost_from=40)]
    alone: list[tuple[str, int, int]] = []

    def read_one(r: Any) -> Any:
        alone.append((r.topic, r.partition, r.start))
        return read_range(settings, r.topic, r.partition, r.start, r.end, values_only=True)

    got = [(x["topic"], x["partition"], x["offset"]) for bt in kr.read_in_waves(opts, ranges, True, read_one, SCHEMA) for x in bt.to_pylist()]
    assert got == [(r.topic, r.partition, o) for r in ranges for o in range(r.start, r.end)]
    # the first two together; large; waves of one (the next would pass the limit); lost history
    assert alone == [(a, 2, 0), (b, 0, 0), (a, 0, 40), (a, 1, 60)]
    with pytest.raises(KafkaTimeoutError):
        list(kr.read_in_waves(opts, [KafkaInputPartition(a, 0, 0, 10), KafkaInputPartition(b, 0, 100, 130)], True, read_one, SCHEMA))


def test_split_waves_keeps_order_bounds_each_wave_and_puts_large_or_marked_items_alone() -> None:
    """Waves of at most the limit in order; an item above the limit or one marked alone is a
    wave by itself; nothing is dropped or repeated."""
    from shared.spark import kafka_ranges as kr

    sizes = [30, 50, 40, 250, 10, 10, 99, 1, 60]
    got = list(kr.split_waves(sizes, lambda n: n, 100))
    assert got == [[30, 50], [40], [250], [10, 10], [99, 1], [60]]
    marked = list(kr.split_waves(sizes, lambda n: n, 100, alone=lambda n: n == 99 or n > 100))
    assert marked == [[30, 50], [40], [250], [10, 10], [99], [1, 60]]
    assert list(kr.split_waves([], lambda n: n, 100)) == []


def test_a_range_deep_in_a_partition_of_many_batches_is_read_with_the_embedded_stack_s_settings(
        stack: EmbeddedStack) -> None:
    """The embedded broker lists a partition's record batches within a fetch's wait: 12,000
    one-record batches take longer than the range readers' own 5 ms, and a fetch of their last
    offsets then came back empty again and again (shared/io/kafka.py, "Fetch waits"). With the
    stack's settings (their least fetch wait) the ranges come whole, the newest included."""
    from confluent_kafka import Producer

    topic = f"ranges-deep-{uuid.uuid4().hex[:10]}"
    create_topic(stack.bootstrap_servers, topic, 1)
    p = Producer({"bootstrap.servers": stack.bootstrap_servers, "linger.ms": 0})
    n = 12_000
    for i in range(n):
        p.produce(topic, value=b"v%05d" % i, partition=0)
        p.flush()  # one batch per record
    settings = KafkaSettings.from_env(stack.env())
    assert settings.fetch_wait_ms >= 50
    ranges = [Range(topic, 0, n - 3, n), Range(topic, 0, n // 2, n // 2 + 5)]
    got = read_ranges(settings, schema=SCHEMA, ranges=ranges, timeout_s=30.0, values_only=True)
    assert [(o, v) for _, _, o, v in rows(got[0])] == [(o, b"v%05d" % o) for o in range(n - 3, n)]
    assert [(o, v) for _, _, o, v in rows(got[1])] == [(o, b"v%05d" % o) for o in range(n // 2, n // 2 + 5)]
