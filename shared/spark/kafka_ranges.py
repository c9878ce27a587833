"""Many offset ranges of Kafka partitions read at once, by one consumer (:func:`read_ranges`).

The write service's shared query runs many small units in a task, each with a range of its
sink's desired partition (:mod:`services.write.shared_source`). Read one by one
(:func:`shared.spark.kafka_source.read_range`), each range costs an assignment, a fetch round
trip and an unassignment; confluent-kafka's ``assign`` and ``unassign`` wait for librdkafka's
main thread **holding the GIL**, so every other unit thread of the worker process waits with
them (measured at 100 sinks: 44 % of the samples that held a write worker's GIL). Read
together, a task's ranges cost one assignment, fetches that carry every partition of a broker
at once, and one unassignment.

Each range gets its own outcome: its records, as RecordBatches of the source schema in offset
order, exactly the offsets ``[start, end)`` (gaps allowed, as in ``read_range``), or the error
of that range alone (records deleted by retention, nothing arriving for ``timeout_s``), so one
sink's lost history does not fail another sink's unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from shared.errors import KafkaAdapterError, KafkaDataLossError, KafkaTimeoutError
from shared.io.kafka import KafkaSettings, consumer_pool_key, new_consumer, translate
from shared.spark.consumer_pool import give_back, take_pooled

T = TypeVar("T")


#: Marks, among the topics a pooled consumer knows, a partition it paused (``<mark><topic>\0<p>``).
_PAUSED = "\0paused\0"


@dataclass(frozen=True)
class Range:
    """Offsets ``[start, end)`` of ``topic``/``partition``."""

    topic: str
    partition: int
    start: int
    end: int


@dataclass
class _Reading:
    r: Range
    offs: list[int] = field(default_factory=list)
    vals: list[Any] = field(default_factory=list)
    keys: list[Any] = field(default_factory=list)
    tss: list[Any] = field(default_factory=list)
    hdrs: list[Any] = field(default_factory=list)
    batches: list[pa.RecordBatch] = field(default_factory=list)
    error: Exception | None = None
    done: bool = False
    paused: bool = False
    next_off: int = 0


def read_ranges(
    settings: KafkaSettings,
    ranges: Sequence[Range],
    *,
    schema: pa.Schema,
    batch_size: int = 20_000,
    fail_on_data_loss: bool = True,
    timeout_s: float = 60.0,
    skip_prefixes: Mapping[str, bytes] | None = None,
    values_only: bool = False,
) -> list[list[pa.RecordBatch] | Exception]:
    """Every range's records (or its error), in the order of ``ranges``, as RecordBatches of
    ``schema`` (the Kafka source's); the options mean what they mean for
    :func:`shared.spark.kafka_source.read_range`. A partition named by two ranges is read once
    per range."""
    out: list[list[pa.RecordBatch] | Exception] = [[] for _ in ranges]
    todo: dict[tuple[str, int], int] = {}
    again: list[int] = []
    for i, r in enumerate(ranges):
        if r.end <= r.start:
            continue
        if (r.topic, r.partition) in todo:
            again.append(i)
        else:
            todo[(r.topic, r.partition)] = i
    if not todo:
        return out
    extra = {
        "enable.partition.eof": "true",
        "auto.offset.reset": "error" if fail_on_data_loss else "earliest",
        "fetch.wait.max.ms": "5",
        "queued.min.messages": str(max(batch_size, 100_000)),
    }
    # Its own pool (a pause this reader made never meets read_range's consumers).
    pool_key = consumer_pool_key(settings, extra) + "/ranges"
    consumer, known = take_pooled(pool_key) or (new_consumer(settings, **extra), set())
    pooled = False
    states = {tp: _Reading(ranges[i], next_off=ranges[i].start) for tp, i in todo.items()}
    skip = dict(skip_prefixes or {})
    try:
        _learn_topics(consumer, known, {t for t, _ in states}, timeout_s)
        from confluent_kafka import TopicPartition

        tps = [TopicPartition(t, p, s.r.start) for (t, p), s in states.items()]
        # A partition this consumer paused in an earlier read may still be, whatever the
        # assignment since: resumed (only those: a resume waits for librdkafka like an assign),
        # before it is assigned. Resumed after its assignment, its first fetch came about a
        # second late (librdkafka 2.16 against the embedded broker: a write task's read of a
        # few thousand records took 1.0-1.06 s instead of 20-90 ms, in two of three 200k bursts).
        stale = [tp for tp in tps if f"{_PAUSED}{tp.topic}\0{tp.partition}" in known]
        if stale:
            consumer.resume(stale)
            known.difference_update(f"{_PAUSED}{tp.topic}\0{tp.partition}" for tp in stale)
        consumer.assign(tps)
        known.update(f"{_PAUSED}{t}\0{p}" for t, p in _consume(consumer, states, schema, batch_size, timeout_s, skip, values_only,
                                                                  fail_on_data_loss))
        consumer.unassign()  # stops fetching and drops what was prefetched beyond the ends
        pooled = give_back(pool_key, consumer, known)
    except KafkaAdapterError as e:
        for s in states.values():
            if not s.done and s.error is None:
                s.error = e
    finally:
        if not pooled:
            consumer.close()
    for tp, i in todo.items():
        s = states[tp]
        out[i] = s.error if s.error is not None else s.batches
    if again:
        rest = read_ranges(settings, [ranges[i] for i in again], schema=schema, batch_size=batch_size, fail_on_data_loss=fail_on_data_loss,
                           timeout_s=timeout_s, skip_prefixes=skip_prefixes, values_only=values_only)
        for i, got in zip(again, rest, strict=True):
            out[i] = got
    return out


def _learn_topics(consumer: Any, known: set[str], topics: set[str], timeout_s: float) -> None:
    """The metadata of the topics the consumer does not know yet (a consumer assigned a
    partition of a topic it does not know waits up to a second for it): one round trip for
    all of them when several are new."""
    from confluent_kafka import KafkaException

    new = topics - known
    if not new:
        return
    try:
        if len(new) == 1:
            (t,) = new
            consumer.list_topics(t, timeout=timeout_s)
            known.add(t)
        else:
            md = consumer.list_topics(timeout=timeout_s)
            known.update(t for t in md.topics if md.topics[t].error is None)
            for t in new - known:
                consumer.list_topics(t, timeout=timeout_s)
                known.add(t)
    except KafkaException as e:
        raise translate(e, f"reading the metadata of {sorted(new)}") from e


def _consume(consumer: Any, states: dict[tuple[str, int], _Reading], schema: pa.Schema, batch_size: int,
             timeout_s: float, skip: Mapping[str, bytes], values_only: bool,
             fail_on_data_loss: bool) -> list[tuple[str, int]]:
    """Reads until every range is done; returns the partitions it paused. A record below a
    range's next offset (one a pooled consumer fetched for an earlier assignment, or hands back
    again) is not read twice; without ``fail_on_data_loss`` a reset to the earliest offset may
    go below a range's start on purpose (a re-created topic), so there every record counts."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    open_ = sum(1 for s in states.values() if not s.done)
    idle_since = time.monotonic()
    paused: list[tuple[str, int]] = []
    while open_:
        want = max(1, min(batch_size, 10_000, sum(s.r.end - s.next_off for s in states.values() if not s.done)))
        msgs = consumer.consume(num_messages=want, timeout=0.05)
        if not msgs:
            if time.monotonic() - idle_since > timeout_s:
                for w in states.values():
                    if not w.done:
                        w.error = KafkaTimeoutError(
                            f"expected records up to offset {w.r.end} of {w.r.topic}/{w.r.partition} within "
                            f"{timeout_s}s, found the last at {w.next_off - 1}",
                            topic=w.r.topic, partition=w.r.partition,
                        )
                        w.done = True
                return paused
            continue
        idle_since = time.monotonic()
        finished: list[_Reading] = []
        beyond: list[_Reading] = []  # read past their ends: the partition holds more
        for m in msgs:
            s = states.get((m.topic(), m.partition()))
            err = m.error()
            if s is None or s.done:
                if err is not None and s is None and err.code() != KafkaError._PARTITION_EOF:
                    raise translate(KafkaException(err), "reading many ranges")
                if s is not None and err is None and not s.paused:
                    s.paused = True
                    beyond.append(s)
                continue  # prefetched beyond a range's end
            if err is not None:
                code = err.code()
                if code == KafkaError._PARTITION_EOF:
                    if int(m.offset() or 0) >= s.r.end:
                        s.done = True
                        finished.append(s)
                    continue
                if code == KafkaError._AUTO_OFFSET_RESET or code == KafkaError.OFFSET_OUT_OF_RANGE:
                    s.error = KafkaDataLossError(
                        f"expected offsets [{s.r.start}, {s.r.end}) of {s.r.topic}/{s.r.partition} to be "
                        f"readable, found them deleted ({err.str()})",
                        topic=s.r.topic, partition=s.r.partition, start=s.r.start, end=s.r.end,
                    )
                else:
                    s.error = translate(KafkaException(err), f"reading {s.r.topic}/{s.r.partition}")
                s.done = True
                finished.append(s)
                continue
            off = int(m.offset() or 0)
            if off < s.next_off and fail_on_data_loss:
                continue
            if off >= s.r.end:
                s.done = s.paused = True
                finished.append(s)
                beyond.append(s)
                continue
            s.next_off = off + 1
            val = m.value()
            prefix = skip.get(s.r.topic)
            if not (prefix is not None and val is not None and val.startswith(prefix)):
                s.vals.append(val)
                s.offs.append(off)
                if not values_only:
                    s.keys.append(m.key())
                    tt, t = m.timestamp()
                    s.tss.append(t if tt else None)
                    s.hdrs.append(m.headers())
            if s.next_off >= s.r.end:
                s.done = True
                finished.append(s)
            elif len(s.offs) >= batch_size:
                _flush(s, schema, values_only)
        for f in finished:
            open_ -= 1
            if f.error is None:
                _flush(f, schema, values_only)
            else:
                f.batches = []
        if beyond and open_:
            # A partition that holds more than its range would be fetched on while the others
            # are read: paused (a range that ends at the partition's end is not: nothing to fetch).
            consumer.pause([TopicPartition(b.r.topic, b.r.partition) for b in beyond])
            paused.extend((b.r.topic, b.r.partition) for b in beyond)
    return paused


def _flush(s: _Reading, schema: pa.Schema, values_only: bool) -> None:
    n = len(s.offs)
    if not n:
        return
    r = s.r
    if values_only:
        cols = [pa.nulls(n, pa.binary()), pa.array(s.vals, pa.binary()), pa.array([r.topic] * n, pa.string()),
                pa.array(np.full(n, r.partition, dtype=np.int32)), pa.array(s.offs, pa.int64()),
                pa.nulls(n, schema.field("timestamp").type), pa.nulls(n, schema.field("headers").type)]
    else:
        import pyarrow.compute as pc

        htype = schema.field("headers").type
        ts = pc.multiply(pa.array(s.tss, pa.int64()), 1000).cast(schema.field("timestamp").type)
        if any(h is not None for h in s.hdrs):
            headers = pa.array([None if h is None else [{"key": k, "value": v} for k, v in h] for h in s.hdrs], htype)
        else:
            headers = pa.nulls(n, htype)
        cols = [pa.array(s.keys, pa.binary()), pa.array(s.vals, pa.binary()), pa.array([r.topic] * n, pa.string()),
                pa.array(np.full(n, r.partition, dtype=np.int32)), pa.array(s.offs, pa.int64()), ts, headers]
    s.batches.append(pa.RecordBatch.from_arrays(cols, schema=schema))
    s.offs, s.vals, s.keys, s.tss, s.hdrs = [], [], [], [], []


#: A task of several ranges reads them together in waves of at most this many records (a
#: range above it is read alone, streamed): a wave's records are held until it is read.
WAVE_RECORDS = 200_000


def split_waves(items: Iterable[T], size: Callable[[T], int], limit: int,
                alone: Callable[[T], bool] | None = None) -> Iterator[list[T]]:
    """``items`` in order, in waves whose sizes add up to at most ``limit`` (an item above it,
    or one ``alone`` says so of, is a wave by itself)."""
    wave: list[T] = []
    total = 0
    for it in items:
        n = size(it)
        if alone is not None and alone(it):
            if wave:
                yield wave
            yield [it]
            wave, total = [], 0
            continue
        if wave and total + n > limit:
            yield wave
            wave, total = [], 0
        wave.append(it)
        total += n
    if wave:
        yield wave


def read_in_waves(options: Any, ranges: Sequence[Any], values_only: bool,
                  read_one: Callable[[Any], Iterator[pa.RecordBatch]], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """A task's ranges (:class:`shared.spark.kafka_source.KafkaInputPartition`, with the source's
    ``options`` and ``schema``) in their order, the small ones read together by :func:`read_ranges`, a large
    one or one with lost history by ``read_one``; the first range that fails fails the task."""

    def together(wave: list[Any]) -> Iterator[pa.RecordBatch]:
        if len(wave) == 1:
            yield from read_one(wave[0])
            return
        got = read_ranges(options.settings, [Range(r.topic, r.partition, r.start, r.end) for r in wave], schema=schema,
                          batch_size=options.records_per_arrow_batch, fail_on_data_loss=options.fail_on_data_loss,
                          timeout_s=options.timeout_s,
                          skip_prefixes={t: p for t in {r.topic for r in wave} if (p := options.skip_prefix(t)) is not None},
                          values_only=values_only)
        for g in got:
            if isinstance(g, Exception):
                raise g
            yield from g

    def alone(r: Any) -> bool:
        return getattr(r, "lost_from", None) is not None or r.end - r.start > WAVE_RECORDS

    for wave in split_waves(ranges, lambda r: r.end - r.start, WAVE_RECORDS, alone):
        yield from together(wave)
