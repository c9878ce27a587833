"""The Kafka source for Spark (``shardsink-kafka``) against the embedded broker: it reads
every record exactly once, in order per partition, across restarts, new partitions and
micro-batch limits."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from shared.devstack.embedded import EmbeddedStack
from shared.io.kafka import KafkaSettings
from shared.kafka_offsets import advance, cap, offsets_from_json, offsets_to_json, pending
from shared.spark.kafka_connector import kafka_read_stream
from shared.spark.kafka_source import (
    KAFKA_SCHEMA,
    KafkaInputPartition,
    KafkaRangesPartition,
    pack_ranges,
    read_range,
)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(timeout=30)


def produce(bootstrap: str, topic: str, records: list[tuple[int, bytes]], rounds: int = 1) -> None:
    """``(partition, value)`` records, in ``rounds`` flushes (several record batches)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})
    step = max(1, -(-len(records) // rounds))
    for i in range(0, len(records), step):
        for part, value in records[i : i + step]:
            p.produce(topic, value=value, key=b"k" + value, partition=part,
                      headers=[("h", value)] if part == 0 else None)
        assert p.flush(30) == 0


def stream_reader(bootstrap: str, source: tuple[str, Any, dict[str, str]], topics: list[str], **options: str) -> Any:
    """The driver-side stream reader of a data source built on ``shardsink-kafka`` (the
    ``source`` argument of ``kafka_read_stream``: name, class, extra options)."""
    _, cls, extra = source
    opts = {"topics": ",".join(topics), **KafkaSettings.of(bootstrap).to_options(), **extra, **options}
    return cls(opts).streamReader(None)


def frozen_monotonic(monkeypatch: Any) -> list[float]:
    """``time.monotonic`` answers ``clock[0]``, frozen at the real clock's present; move time on
    by adding to it (admission control's clock in ``latestOffset``). It starts at the present,
    not at a fixed value: a reader's last admission was stamped by the real clock before the
    freeze, and a fixed start above it (a machine up for less than that many seconds) made a
    second without admission seem to have passed already."""
    import time

    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return clock


def run_available_now(df: Any, checkpoint: Path, tasks: list[int] | None = None) -> list[list[dict[str, Any]]]:
    """Runs the query to the current end; returns the rows of each non-empty micro-batch
    (and appends each micro-batch's number of input partitions to ``tasks``)."""
    batches: list[list[dict[str, Any]]] = []

    def collect(bdf: Any, batch_id: int) -> None:
        if tasks is not None:
            tasks.append(bdf.rdd.getNumPartitions())
        rows = [r.asDict(recursive=True) for r in bdf.collect()]
        if rows:
            batches.append(rows)

    q = (
        df.writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert not q.isActive, "expected the availableNow query to finish within 120 s"
    assert q.exception() is None
    return batches


def by_partition(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[tuple[int, bytes]]]:
    out: dict[tuple[str, int], list[tuple[int, bytes]]] = defaultdict(list)
    for r in rows:
        out[(r["topic"], r["partition"])].append((r["offset"], r["value"]))
    return dict(out)


def source(spark: Any, stack: EmbeddedStack, topics: list[str], **kw: Any) -> Any:
    return kafka_read_stream(spark, KafkaSettings.of(stack.bootstrap_servers), topics, **kw)


def test_source_reads_every_record_in_order_per_partition(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    topic = f"src-all-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 3)
    records = [(i % 3, b"r%04d" % i) for i in range(300)]
    produce(stack.bootstrap_servers, topic, records, rounds=4)

    # A micro-batch of few records is one task (the three ranges read one after the other);
    # with a small minRecordsPerTask, one task per partition: the same records either way.
    for min_per_task, want_tasks in ((None, 1), (50, 3)):
        df = source(spark, stack, [topic])
        if min_per_task is not None:
            df = (spark.readStream.format("shardsink-kafka").option("bootstrap", stack.bootstrap_servers)
                  .option("topics", topic).option("minRecordsPerTask", min_per_task).load())
        assert df.schema == KAFKA_SCHEMA
        tasks: list[int] = []
        rows = [r for b in run_available_now(df, tmp_path / f"ckpt-{min_per_task}", tasks) for r in b]
        assert tasks and tasks[0] == want_tasks

        assert len(rows) == 300
        got = by_partition(rows)
        for p in range(3):
            want = [v for part, v in records if part == p]
            assert got[(topic, p)] == list(enumerate(want))
        r0 = next(r for r in rows if r["partition"] == 0)
        assert r0["key"] == b"k" + r0["value"]
        assert r0["headers"] == [{"key": "h", "value": r0["value"]}]
        r1 = next(r for r in rows if r["partition"] == 1)
        assert r1["headers"] is None and r1["timestamp"] is not None


def test_skip_value_prefixes_drops_records_in_the_reader_and_keeps_offsets(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    topic, other = f"src-skip-{unique_id}", f"src-skip-other-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 2)
    create_topic(stack.bootstrap_servers, other, 1)
    records = [(i % 2, (b"drop%03d" if i % 3 else b"keep%03d") % i) for i in range(120)]
    produce(stack.bootstrap_servers, topic, records, rounds=3)
    produce(stack.bootstrap_servers, other, [(0, b"drop-but-other-topic")])

    df = source(spark, stack, [topic, other], skip_value_prefixes={topic: b"drop"}, max_records_per_trigger=25)
    batches = run_available_now(df, tmp_path / "ckpt")
    got = by_partition([r for b in batches for r in b])
    for p in range(2):
        mine = [v for part, v in records if part == p]
        want = [(o, v) for o, v in enumerate(mine) if v.startswith(b"keep")]
        assert 0 < len(want) < len(mine)  # the partition has records of both kinds
        assert got[(topic, p)] == want
    assert got[(other, 0)] == [(0, b"drop-but-other-topic")]
    # a restart reads nothing again: the skipped records' offsets were consumed
    produce(stack.bootstrap_servers, topic, [(0, b"keep-late")])
    again = run_available_now(source(spark, stack, [topic, other], skip_value_prefixes={topic: b"drop"}), tmp_path / "ckpt")
    assert [(r["partition"], r["value"]) for b in again for r in b] == [(0, b"keep-late")]


def test_read_range_reuses_its_consumer_and_reads_exact_ranges(stack: EmbeddedStack, unique_id: str) -> None:
    """Consecutive, overlapping and backward ranges of two topics in one process (one pooled
    consumer, re-assigned each time, whatever the topic) return exactly their offsets."""
    import random

    import shared.spark.kafka_source as sk

    topic, other = f"src-pool-{unique_id}", f"src-pool2-{unique_id}"
    for t in (topic, other):
        create_topic(stack.bootstrap_servers, t, 1)
        produce(stack.bootstrap_servers, t, [(0, b"v%03d" % i) for i in range(300)], rounds=3)
    settings = KafkaSettings.of(stack.bootstrap_servers)
    rng = random.Random(5)
    ranges = [(0, 1), (1, 100), (100, 300), (299, 300), (50, 60), (0, 300)]
    ranges += [(s, min(300, s + rng.choice([1, 7, 150]))) for s in (rng.randrange(300) for _ in range(20))]
    sk.close_pooled_consumers()
    made = []
    real = sk.new_consumer

    def counted(*a: Any, **kw: Any) -> Any:
        made.append(1)
        return real(*a, **kw)

    sk.new_consumer = counted  # type: ignore[assignment]
    try:
        for i, (s, e) in enumerate(ranges):
            t = (topic, other)[i % 2]
            rows = [r for b in read_range(settings, t, 0, s, e, batch_size=64) for r in b.to_pylist()]
            assert [(r["offset"], r["value"]) for r in rows] == [(o, b"v%03d" % o) for o in range(s, e)]
        assert len(made) == 1 and sk.pooled_consumers() == 1  # one consumer served every range of both topics
        # a reader that stops early closes its consumer instead of pooling it
        g = read_range(settings, topic, 0, 0, 300, batch_size=10)
        next(g)
        assert sk.pooled_consumers() == 0
        g.close()
        assert sk.pooled_consumers() == 0
    finally:
        sk.new_consumer = real  # type: ignore[assignment]
    sk.close_pooled_consumers()
    assert sk.pooled_consumers() == 0


def test_restarted_query_reads_each_record_once(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    topic = f"src-restart-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 2)
    first = [(i % 2, b"a%03d" % i) for i in range(40)]
    produce(stack.bootstrap_servers, topic, first, rounds=2)
    ckpt = tmp_path / "ckpt"

    run1 = [r for b in run_available_now(source(spark, stack, [topic]), ckpt) for r in b]
    second = [(i % 2, b"b%03d" % i) for i in range(30)]
    produce(stack.bootstrap_servers, topic, second, rounds=3)
    run2 = [r for b in run_available_now(source(spark, stack, [topic]), ckpt) for r in b]
    run3 = [r for b in run_available_now(source(spark, stack, [topic]), ckpt) for r in b]

    assert sorted(r["value"] for r in run1) == sorted(v for _, v in first)
    assert sorted(r["value"] for r in run2) == sorted(v for _, v in second)
    assert run3 == []
    got = by_partition(run1 + run2)
    for p in range(2):
        want = [v for part, v in first + second if part == p]
        assert got[(topic, p)] == list(enumerate(want))


def test_partitions_that_appear_mid_stream_are_read_from_offset_zero(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    # Tansu 0.6 does not implement CreatePartitions (KIP-195), so on the embedded broker the
    # new partitions come from a listed topic created mid-stream: the same path (partitions
    # absent from the start offsets begin at 0). Growing an existing topic is covered by
    # test_new_partition_of_an_existing_topic_starts_at_zero below.
    bs = stack.bootstrap_servers
    old, new = f"src-old-{unique_id}", f"src-new-{unique_id}"
    create_topic(bs, old, 1)
    produce(bs, old, [(0, b"o%02d" % i) for i in range(10)])
    ckpt = tmp_path / "ckpt"
    run1 = [r for b in run_available_now(source(spark, stack, [old, new]), ckpt) for r in b]
    assert sorted(r["value"] for r in run1) == [b"o%02d" % i for i in range(10)]

    create_topic(bs, new, 2)
    added = [(i % 2, b"n%02d" % i) for i in range(12)]
    produce(bs, new, added, rounds=2)
    produce(bs, old, [(0, b"o10")])
    run2 = [r for b in run_available_now(source(spark, stack, [old, new]), ckpt) for r in b]
    got = by_partition(run2)
    assert got[(old, 0)] == [(10, b"o10")]
    for p in range(2):
        assert got[(new, p)] == list(enumerate(v for part, v in added if part == p))


def test_max_records_per_trigger_limits_each_micro_batch(
    spark: Any, stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    topic = f"src-limit-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 2)
    records = [(i % 2, b"m%03d" % i) for i in range(50)]
    produce(stack.bootstrap_servers, topic, records, rounds=2)

    df = source(spark, stack, [topic], max_records_per_trigger=12)
    batches = run_available_now(df, tmp_path / "ckpt")

    assert [len(b) for b in batches] == [12, 12, 12, 12, 2]
    rows = [r for b in batches for r in b]
    assert sorted(r["value"] for r in rows) == sorted(v for _, v in records)


# -- offset arithmetic (pure) --------------------------------------------------------------


def test_offsets_json_round_trip_uses_string_partitions() -> None:
    o = {"t": {1: 5, 0: 3}}
    j = offsets_to_json(o)
    assert j == {"t": {"0": 3, "1": 5}}
    assert offsets_from_json(j) == o


def test_new_partition_of_an_existing_topic_starts_at_zero() -> None:
    start = {"t": {0: 7, 1: 3}}
    latest = {"t": {0: 9, 1: 3, 2: 4}}
    end = advance(start, latest)
    assert end == {"t": {0: 9, 1: 3, 2: 4}}
    assert pending(start, end) == [("t", 0, 7, 9), ("t", 2, 0, 4)]


def test_advance_never_moves_a_partition_backwards() -> None:
    assert advance({"t": {0: 7}}, {"t": {0: 5}, "u": {}}) == {"t": {0: 7}, "u": {}}


def test_cap_shares_the_limit_by_backlog_and_always_progresses() -> None:
    start = {"t": {0: 0, 1: 0}}
    end = {"t": {0: 90, 1: 10}, "u": {0: 0}}
    capped = cap(start, end, 10)
    assert capped == {"t": {0: 9, 1: 1}, "u": {0: 0}}
    assert cap(start, {"t": {0: 1, 1: 1}}, 1) == {"t": {0: 1, 1: 0}}
    assert cap(start, end, 1000) == end


def test_pack_ranges_makes_tasks_of_at_least_the_minimum_and_keeps_ranges_whole() -> None:
    def r(p: int, n: int) -> KafkaInputPartition:
        return KafkaInputPartition("t", p, 100, 100 + n)

    def ranges_of(task: Any) -> list[tuple[int, int, int]]:
        rs = task.ranges if isinstance(task, KafkaRangesPartition) else (task,)
        return [(x.partition, x.start, x.end) for x in rs]

    small = [r(0, 10), r(1, 5), r(2, 0)]
    one = pack_ranges(small, 1000)
    assert len(one) == 1 and ranges_of(one[0]) == [(0, 100, 110), (1, 100, 105), (2, 100, 100)]
    single = [r(3, 7)]
    assert pack_ranges(single, 1000) == single  # the same partition object: a plain read
    big = [r(p, n) for p, n in enumerate([9000, 8000, 3000, 1000, 500])]
    tasks = pack_ranges(big, 10_000)  # 21,500 records: three tasks
    assert len(tasks) == 3
    flat = sorted(x for t in tasks for x in ranges_of(t))
    assert flat == sorted((x.partition, x.start, x.end) for x in big)  # every range once, whole
    sizes = sorted(sum(e - s for _, s, e in ranges_of(t)) for t in tasks)
    assert sizes == [4500, 8000, 9000]
    each = pack_ranges(big, 1)  # never more tasks than ranges
    assert len(each) == 5 and all(isinstance(t, KafkaInputPartition) for t in each)


def test_a_source_runner_stopped_by_spark_exits_quietly_and_other_failures_still_report() -> None:
    """Spark stops a source's runner by closing its socket: the runner reads EOF and calls the
    reader's ``stop()``, then would print a BrokenPipeError traceback reporting the EOF over
    the closed socket. Run as that runner module, ``stop()`` during an EOF ends the process
    quietly; during any other failure, or outside the runner, it returns and the failure is
    reported as before."""
    import subprocess
    import sys

    def runner(exc: str, as_runner: bool = True) -> subprocess.CompletedProcess[str]:
        code = f"""
import sys, types
if {as_runner!r}:
    sys.modules["__main__"].__spec__ = types.SimpleNamespace(name="pyspark.sql.streaming.python_streaming_source_runner")
from shared.spark.kafka_source import KafkaStreamReader
reader = KafkaStreamReader.__new__(KafkaStreamReader)
reader._probe = None
try:
    try:
        raise {exc}
    finally:
        reader.stop()
except BaseException as e:
    print("reported", type(e).__name__, file=sys.stderr)
    sys.exit(3)
"""
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    quiet = runner("EOFError")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    for exc, as_runner in (("RuntimeError('boom')", True), ("EOFError", False)):
        loud = runner(exc, as_runner)
        assert loud.returncode == 3 and loud.stderr.strip().startswith("reported"), (exc, as_runner, loud.stderr)


def test_read_range_values_only_keeps_values_and_offsets_and_nulls_the_rest(stack: EmbeddedStack, unique_id: str) -> None:
    """The write source's lean read: the same values and offsets as a full read, with the
    keys, timestamps and headers (which the desired decode never reads) null."""
    import shared.spark.kafka_source as sk

    topic = f"src-lean-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 1)
    produce(stack.bootstrap_servers, topic, [(0, b"v%03d" % i) for i in range(50)], rounds=2)
    settings = KafkaSettings.of(stack.bootstrap_servers)
    full = [r for b in read_range(settings, topic, 0, 5, 45) for r in b.to_pylist()]
    lean = [r for b in read_range(settings, topic, 0, 5, 45, values_only=True) for r in b.to_pylist()]
    assert [(r["offset"], r["value"]) for r in lean] == [(r["offset"], r["value"]) for r in full]
    assert all(r["key"] is not None and r["headers"] and r["timestamp"] is not None for r in full)
    assert all(r["key"] is None and r["headers"] is None and r["timestamp"] is None for r in lean)
    sk.close_pooled_consumers()


def test_the_source_looks_a_topics_partitions_up_again_after_the_ttl(monkeypatch: Any) -> None:
    """A topic's partition list is kept ``PARTITIONS_TTL_S`` (a metadata request per topic at
    every trigger otherwise); partitions added meanwhile are seen after it; a topic that does
    not exist yet is looked up at every call, so it is read as soon as it exists."""
    from shared.errors import UnknownTopicError
    from shared.spark import kafka_source
    from shared.spark.kafka_connector import KafkaDataSource
    from shared.io.kafka import OffsetProbe

    clock = frozen_monotonic(monkeypatch)
    broker: dict[str, list[int]] = {"a": [0]}
    asked: list[str] = []

    def partitions_of(self: OffsetProbe, topic: str) -> list[int]:
        asked.append(topic)
        if topic not in broker:
            raise UnknownTopicError(f"no {topic}", topic=topic)
        return list(broker[topic])

    monkeypatch.setattr(OffsetProbe, "partitions_of", partitions_of)
    r = stream_reader("127.0.0.1:9", ("shardsink-kafka", KafkaDataSource, {}), ["a", "b"])
    assert (r._parts("a"), r._parts("b")) == ([0], [])
    broker["a"], broker["b"] = [0, 1], [0]
    clock[0] += kafka_source.PARTITIONS_TTL_S / 2
    assert (r._parts("a"), r._parts("b")) == ([0], [0])  # a: kept; b: asked again, exists now
    clock[0] += kafka_source.PARTITIONS_TTL_S / 2
    assert r._parts("a") == [0, 1]
    assert asked == ["a", "b", "b", "a"]


def test_the_source_renews_many_topics_partition_lists_with_one_request(monkeypatch: Any) -> None:
    """A shared source reads a topic per sink: when several topics' partition lists are due,
    one metadata request for the cluster's topics renews them all (not one request per topic);
    a topic that does not exist yet has no partitions and is asked for again at the next look;
    lists still fresh are not asked for; partitions added are seen once the lists are due."""
    from shared.spark import kafka_source
    from shared.spark.kafka_connector import KafkaDataSource
    from shared.io.kafka import OffsetProbe

    clock = frozen_monotonic(monkeypatch)
    broker: dict[str, list[int]] = {"a": [0], "b": [0, 1]}
    many: list[list[str]] = []
    one: list[str] = []

    def partitions_of_many(self: OffsetProbe, topics: Any) -> dict[str, list[int]]:
        topics = list(topics)
        many.append(topics)
        return {t: list(broker[t]) for t in topics if t in broker}

    def partitions_of(self: OffsetProbe, topic: str) -> list[int]:
        one.append(topic)
        return list(broker[topic])

    monkeypatch.setattr(OffsetProbe, "partitions_of_many", partitions_of_many)
    monkeypatch.setattr(OffsetProbe, "partitions_of", partitions_of)
    r = stream_reader("127.0.0.1:9", ("shardsink-kafka", KafkaDataSource, {}), ["a", "b", "c"])
    assert r._tps(["a", "b", "c"]) == [("a", 0), ("b", 0), ("b", 1)]
    assert many == [["a", "b", "c"]] and one == []
    broker["c"], broker["a"] = [0], [0, 1]
    clock[0] += kafka_source.PARTITIONS_TTL_S / 2
    # a and b are fresh; c alone is due: asked for by itself, and found now
    assert r._tps(["a", "b", "c"]) == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    assert many == [["a", "b", "c"]] and one == ["c"]
    clock[0] += kafka_source.PARTITIONS_TTL_S / 2
    # a and b are due (c is not yet): one request renews both, and a's new partition shows
    assert r._tps(["a", "b", "c"]) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]
    assert many == [["a", "b", "c"], ["a", "b"]] and one == ["c"]


def test_latest_offset_holds_the_query_while_the_brokers_cannot_be_reached(monkeypatch: Any) -> None:
    """Issue 32: a ``latestOffset`` whose look at the brokers fails because they cannot be
    reached (a network partition) or time out answers its start (no micro-batch) after a short
    pause, instead of failing the query; the next look after the heal answers the new end. A
    refused configuration still fails."""
    from shared.errors import KafkaConfigError, KafkaTimeoutError, KafkaUnavailableError
    from shared.spark import kafka_source
    from shared.spark.kafka_connector import KafkaDataSource
    from shared.io.kafka import OffsetProbe

    monkeypatch.setattr(kafka_source, "UNREACHABLE_PAUSE_S", 0.0)
    monkeypatch.setattr(OffsetProbe, "partitions_of", lambda self, topic: [0])
    answer: list[Any] = [KafkaUnavailableError("listing offsets: No leaders found")]

    def ends(self: OffsetProbe, tps: Any) -> dict[tuple[str, int], int]:
        if isinstance(answer[0], Exception):
            raise answer[0]
        return {tp: answer[0] for tp in tps}

    monkeypatch.setattr(OffsetProbe, "ends", ends)
    r = stream_reader("127.0.0.1:9", ("shardsink-kafka", KafkaDataSource, {}), ["a"])
    limit = r.getDefaultReadLimit()
    start = {"a": {"0": 5}}
    assert r.latestOffset(start, limit) == start
    answer[0] = KafkaTimeoutError("expected end-of-partition within 30s")
    assert r.latestOffset(start, limit) == start
    answer[0] = 9  # healed
    assert r.latestOffset(start, limit) == {"a": {"0": 9}}
    answer[0] = KafkaConfigError("expected a valid client config")
    with pytest.raises(KafkaConfigError):
        r.latestOffset(start, limit)
