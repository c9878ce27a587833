"""Produce a desired collection to its Kafka topic: updates hashed to partitions, progress to
every partition.

::

    with DesiredProducer(settings, "desired-orders", row_schema) as p:
        p.send({"id": 1, "total": 10}, time=5, diff=+1)
        p.send({"id": 2, "total": 20}, time=5, diff=+1)
        p.advance_to(6)        # no more updates at times < 6, in every partition

Each update goes to partition ``row_partition(row_codec.partition_key(row_bytes), n)`` (the
hash the write service uses for the shard's read-back). librdkafka batches the records
(``linger.ms``); the producer is idempotent (``enable.idempotence``, ``acks=all``), so a
retried send neither duplicates nor reorders records within a partition.

``advance_to(t)``, in this order:

1. flush: wait until every update sent so far is acknowledged; a failed delivery raises
   :class:`~shared.errors.KafkaDeliveryError` and no progress is sent (the promise would
   cover updates that are not on the topic);
2. produce ``Progress(partition=p, frontier=t)`` to every partition ``p``;
3. flush again, so that when ``advance_to`` returns the statement is durable.

A send at a time below the frontier already advanced to raises
:class:`~shared.errors.ContractViolationError`: the producer never breaks its own promise.

The partition count is read once, when the producer starts. Kafka can add partitions to a
topic, but that changes every row's partition: re-partitioning a desired topic needs the sinks
to be restarted from a consistent point, so the producer does not follow a growing topic
silently (``refresh_partitions()`` does it on request).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from shared.codec import RowCodec
from shared.desired import encode_progress, encode_update, row_partition
from shared.errors import (
    ContractViolationError,
    DecodeError,
    InvalidUsageError,
    KafkaDeliveryError,
    KafkaTimeoutError,
)
from shared.frontier import Frontier
from shared.io.kafka import KafkaSettings, translate
from shared.io.kafka_admin import topic_partition_count

__all__ = ["DesiredProducer", "topic_progress"]


class DesiredProducer:
    """An idempotent producer of one desired topic (see the module docstring)."""

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        row_schema: Any,
        *,
        previous_row_schemas: Iterable[Any] = (),
        frontier: Frontier | None = None,
        linger_ms: int = 5,
        flush_timeout_s: float = 60.0,
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.topic = topic
        self.rows = RowCodec(row_schema, previous=previous_row_schemas)
        self.partitions = topic_partition_count(settings, topic)
        self._frontier = frontier if frontier is not None else Frontier.minimum()
        self._flush_timeout_s = flush_timeout_s
        self._settings = settings
        self._lock = threading.Lock()
        self._failures: list[KafkaError] = []
        self.sent_updates = 0
        self.sent_progress = 0
        conf = settings.config(
            **{
                "enable.idempotence": "true",
                "acks": "all",
                "linger.ms": str(linger_ms),
                **{k.replace("_", "."): v for k, v in (producer_config or {}).items()},
            }
        )
        self._closed = False
        try:
            self._producer: Any = Producer(conf)
        except (KafkaException, ValueError) as e:
            raise translate(e, "creating the desired producer") from e

    # -- state ---------------------------------------------------------------------------
    @property
    def frontier(self) -> Frontier:
        """The frontier promised so far (the minimum until the first ``advance_to``)."""
        return self._frontier

    def refresh_partitions(self) -> int:
        """Re-read the topic's partition count (this re-partitions rows: see the module doc)."""
        self.partitions = topic_partition_count(self._settings, self.topic)
        return self.partitions

    def partition_of(self, row_bytes: bytes) -> int:
        """The partition of an encoded row: by the hash of its canonical body (see
        :meth:`RowCodec.canonical`), whatever encoding of the value ``row_bytes`` is, so that it
        meets the shard's read-back of the same row. Bytes that do not decode go by the hash of
        their own body (the sink reports them in the error collection)."""
        try:
            return row_partition(self.rows.partition_key(self.rows.canonical(row_bytes)), self.partitions)
        except DecodeError:
            return row_partition(bytes(row_bytes[10:]), self.partitions)

    # -- sending -------------------------------------------------------------------------
    def send(self, row: Mapping[str, Any], time: int, diff: int = 1) -> int:
        """Queue one update; returns its partition. Raises EncodeError for a row that does not
        fit the row schema (or holds a value the collection cannot hold, such as an ``int``
        beyond 32 bits) and ContractViolationError for a time below the frontier."""
        row_bytes = self.rows.encode(row)  # canonical: its body is the partition key
        partition = row_partition(self.rows.partition_key(row_bytes), self.partitions)
        return self._send(row_bytes, time, diff, partition)

    def send_encoded(self, row_bytes: bytes, time: int, diff: int = 1) -> int:
        """Queue one update whose row is already single-object encoded with the row schema.

        The bytes go to the topic as they are, even when they do not decode: the sink checks
        every row and turns a bad one into an error row at its time."""
        return self._send(row_bytes, time, diff, None)

    def _send(self, row_bytes: bytes, time: int, diff: int, partition: int | None) -> int:
        if not self._frontier.beyond(time):
            raise ContractViolationError(
                f"expected an update at a time beyond the producer's frontier "
                f"{_show(self._frontier)}, found time {time}",
                time=time,
                frontier=self._frontier.time,
            )
        if partition is None:
            partition = self.partition_of(row_bytes)
        self._produce(encode_update(row_bytes, time, diff), partition)
        self.sent_updates += 1
        return partition

    def send_many(self, updates: Iterable[tuple[Mapping[str, Any], int, int]]) -> int:
        """Queue ``(row, time, diff)`` updates; returns how many."""
        n = 0
        for row, time, diff in updates:
            self.send(row, time, diff)
            n += 1
        return n

    def advance_to(self, t: int | None) -> Frontier:
        """Promise no more updates at times below ``t`` (``None``: none ever again).

        Flushes the updates, then sends a progress statement to every partition and flushes it
        (see the module docstring). Advancing to the current frontier again re-sends it (a
        heartbeat); advancing backwards raises ContractViolationError."""
        target = Frontier.empty() if t is None else Frontier.at(t)
        if not self._frontier.less_equal(target):
            raise ContractViolationError(
                f"expected a frontier at or beyond {_show(self._frontier)}, found {_show(target)}",
                frontier=self._frontier.time,
                requested=target.time,
            )
        self.flush()  # 1. every update acknowledged before the promise
        for p in range(self.partitions):  # 2. the promise, in every partition
            self._produce(encode_progress(p, target), p)
            self.sent_progress += 1
        self.flush()  # 3. the promise is durable
        self._frontier = target
        return target

    def flush(self) -> None:
        """Wait until every queued record is acknowledged; raise on any failed delivery."""
        if self._closed:
            return  # everything was flushed at close
        try:
            left = self._producer.flush(self._flush_timeout_s)
        except KafkaException as e:
            raise translate(e, f"flushing to topic {self.topic!r}") from e
        self._raise_failures()
        if left:
            raise KafkaTimeoutError(
                f"expected every record on {self.topic!r} acknowledged within "
                f"{self._flush_timeout_s}s, found {left} still in flight",
                topic=self.topic,
                in_flight=left,
            )

    def abort(self) -> None:
        """Drop every record still queued or in flight and forget delivery failures (use after
        a failure, before discarding the producer; nothing more is promised)."""
        if self._closed:
            return  # nothing is queued
        try:
            self._producer.purge()
            self._producer.flush(0)
        except KafkaException:
            pass
        with self._lock:
            self._failures = []

    def close(self) -> None:
        """Flush what is queued (raising on failures), then let librdkafka's client go now
        rather than whenever the garbage collector gets to it: one left behind keeps
        reconnecting to a broker that may be gone, a line on stderr each time. A closed
        producer sends nothing more; closing again does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._producer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the error; still try to deliver what was queued
            with contextlib.suppress(Exception):  # best effort while an error propagates
                self._producer.flush(self._flush_timeout_s)

    # -- internals -----------------------------------------------------------------------
    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            with self._lock:
                self._failures.append(err)

    def _raise_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            raise KafkaDeliveryError(
                f"expected every record on {self.topic!r} delivered, found {len(failures)} "
                f"failed ({first.name()}: {first.str()})",
                topic=self.topic,
                failed=len(failures),
                code=first.code(),
            )

    def _produce(self, value: bytes, partition: int) -> None:
        if self._closed:
            raise InvalidUsageError("expected an open desired producer, found one already closed")
        while True:
            try:
                self._producer.produce(
                    self.topic, value=value, partition=partition, on_delivery=self._on_delivery
                )
                break
            except BufferError:  # the local queue is full: serve delivery reports, retry
                self._producer.poll(0.05)
            except KafkaException as e:
                raise translate(e, f"producing to topic {self.topic!r}") from e
        self._producer.poll(0)


def topic_progress(
    settings: KafkaSettings, topic: str, *, window: int = 1000, timeout_s: float = 30.0
) -> tuple[int, Frontier | None] | None:
    """What a desired topic has promised so far: ``(partitions, frontier)``, where
    ``frontier`` is the furthest progress statement found in any partition (``None``: none
    yet), or ``None`` when the topic does not exist.

    Each partition is read backwards from its end, in windows of ``window`` messages that
    double, until its last progress statement (or its start) is reached: no partition is read
    whole when progress is sent regularly. A producer that starts from this frontier never
    sends an update the sink would have to refuse as late (``produce`` does).
    """
    from confluent_kafka import TopicPartition

    from shared.desired import DesiredProgress, decode_desired
    from shared.errors import DecodeError, UnknownTopicError
    from shared.io.kafka import OffsetProbe, consume_available, new_consumer

    with OffsetProbe(settings, timeout_s) as probe:
        try:
            starts = probe.start_offsets(topic)
        except UnknownTopicError:
            return None
        ends = probe.end_offsets(topic)
    furthest: Frontier | None = None
    consumer = new_consumer(settings, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "10"})
    deadline = _monotonic() + timeout_s
    try:
        for p, end in sorted(ends.items()):
            hi, size, last = end, max(1, window), None
            while hi > starts.get(p, 0) and last is None:
                lo = max(starts.get(p, 0), hi - size)
                consumer.assign([TopicPartition(topic, p, lo)])
                pos = lo
                while pos < hi:
                    if _monotonic() > deadline:
                        raise KafkaTimeoutError(
                            f"expected to read partition {p} of {topic!r} offsets [{lo}, {hi}) within "
                            f"{timeout_s:g}s, found it stopped at offset {pos}",
                            topic=topic,
                            partition=p,
                        )
                    for m in consume_available(consumer, 1000, 0.1):
                        if m.error() is not None or (m.offset() or 0) >= hi:
                            continue
                        pos = max(pos, int(m.offset() or 0) + 1)
                        try:
                            d = decode_desired(m.value() or b"")
                        except DecodeError:
                            continue
                        if isinstance(d, DesiredProgress):
                            last = d.frontier  # offsets come in order: the last one wins
                hi, size = lo, size * 2
            if last is not None:
                furthest = last if furthest is None else furthest.join(last)
    finally:
        consumer.close()
    return len(ends), furthest


def _monotonic() -> float:
    import time

    return time.monotonic()


def _show(f: Frontier) -> str:
    return "{}" if f.is_empty() else f"{{{f.time}}}"
