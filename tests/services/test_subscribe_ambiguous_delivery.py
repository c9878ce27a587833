"""Subscribe output stays exactly once and in order when deliveries fail ambiguously.

A Kafka producer can report a message failed (a timeout) or leave it pending past a flush's
deadline while the message is still in flight: it may land on the topic later. The
subscribes room must not count the topic and re-send while anything it produced before can
still land. The scenarios below are deterministic: a wrapper around a real producer (the
embedded broker) holds one chunk "in flight", reports it failed or leaves it pending, and
lets it land at the first later produce call or when the producer is closed (a closed
producer has nothing left in flight).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer

from services.controller.service import Controller
from services.controller.subscribes import _SUB_CHUNK
from services.sinkio import ControlProducer
from shared.devstack.embedded import EmbeddedStack
from shared.io.kafka_admin import ensure_topic
from tests.controller_fixture import controller_settings, read_subscribe
from tests.kafka_fixture import RewindingConsumer


class _InFlightLate:
    """A producer whose messages ``[first, first + count)`` (by produce call) stay in flight:
    with ``reported_failed`` their delivery reports say "timed out" at once, otherwise they
    stay pending (``flush`` keeps returning them). They land, in order, before the next
    message produced after them, or when the producer is closed. ``purge`` does not stop
    them (librdkafka: purging in-flight messages only voids their acknowledgements)."""

    def __init__(self, inner: Any, first: int, count: int, *, reported_failed: bool) -> None:
        self.inner = inner
        self.first = first
        self.count = count
        self.reported_failed = reported_failed
        self.calls = 0
        self.held: list[tuple[str, bytes, Any, dict[str, Any], Any]] = []
        self.landed_late = 0
        self.closed = False

    def _land_held(self) -> None:
        for topic, value, key, kw, cb in self.held:
            self.inner.produce(topic, value=value, key=key, on_delivery=cb, **kw)
        self.landed_late += len(self.held)
        self.held = []

    def produce(self, topic: str, value: bytes, key: Any = None, on_delivery: Any = None, **kw: Any) -> None:
        i = self.calls
        self.calls += 1
        if self.first <= i < self.first + self.count:
            if self.reported_failed and on_delivery is not None:
                on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT, "test: timed out in flight"), None)
                on_delivery = None
            self.held.append((topic, value, key, kw, on_delivery))
            return
        self._land_held()
        self.inner.produce(topic, value=value, key=key, on_delivery=on_delivery, **kw)

    def flush(self, timeout: float = -1) -> int:
        if self.held and not self.reported_failed:
            time.sleep(min(max(timeout, 0.0), 0.2))
            return len(self.held) + int(self.inner.flush(0))
        return int(self.inner.flush(timeout))

    def poll(self, timeout: float = 0) -> int:
        return int(self.inner.poll(timeout))

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        if in_flight:  # their acknowledgements are void; the messages are still on the wire
            for j, (topic, value, key, kw, cb) in enumerate(self.held):
                if cb is not None:
                    cb(KafkaError(KafkaError._PURGE_INFLIGHT, "test: purged in flight"), None)
                self.held[j] = (topic, value, key, kw, None)
        self.inner.purge(in_queue=in_queue, in_flight=in_flight, blocking=blocking)

    def close(self, *args: Any) -> bool:
        self._land_held()  # a closed producer has nothing left in flight
        self.inner.flush(30)
        self.closed = True
        return bool(self.inner.close(*args))

    def __len__(self) -> int:
        return len(self.held) + len(self.inner)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reported_failed", [True, False], ids=["reported-failed-lands-later", "pending-past-flush"])
def test_a_step_whose_chunk_lands_after_a_failed_flush_is_on_the_topic_once_in_order(
    stack: EmbeddedStack, reported_failed: bool
) -> None:
    """The second chunk of a 2.5-chunk step is delivered late (reported failed, or still
    pending when the flush gives up): the output holds every change once, in order, and the
    progress statement after all of them."""
    cs = controller_settings(stack)
    ctl = Controller(cs)
    room = ctl.rooms.subscribes
    room.flush_timeout_s = 3.0  # the pending scenario gives up quickly (the default is 30 s)
    topic = f"sub-late-{uuid.uuid4().hex[:8]}"
    ensure_topic(cs.service.kafka, topic, 1)
    enc = ctl.sub_codec.encode
    n = 2 * _SUB_CHUNK + _SUB_CHUNK // 2
    msgs = [bytes(enc({"subscribe_id": "ours", "time": i // 100, "progressed": False, "diff": 1, "row": b"r%d" % i}))
            for i in range(n)]
    msgs.append(bytes(enc({"subscribe_id": "ours", "time": n // 100 + 1, "progressed": True, "diff": None,
                           "row": None})))
    made: list[_InFlightLate] = []

    def new_producer(delaying: bool) -> Any:
        inner = Producer(cs.service.kafka.config(**{"enable.idempotence": True}))
        p = _InFlightLate(inner, _SUB_CHUNK if delaying else 10**9, _SUB_CHUNK, reported_failed=reported_failed)
        made.append(p)
        return p

    # The room's first output producer delays the second chunk; one made after it is
    # healthy. (The controller's shared producer delays it too, for code producing through it.)
    made_by_room = [0]

    def room_producer() -> Any:
        made_by_room[0] += 1
        return new_producer(made_by_room[0] == 1)

    room.new_output_producer = room_producer
    ctl.producer = ControlProducer(new_producer(True))
    try:
        ctl._produce_step("ours", topic, msgs, (0, 0))
    finally:
        room.close()
        for p in made:
            if p.closed:
                continue
            p._land_held()  # whatever was still in flight lands now (as it would on the wire)
            p.inner.flush(10)
    got = read_subscribe(stack, topic, "ours", until_final=False, timeout_s=8)
    want = [(i // 100, False) for i in range(n)] + [(n // 100 + 1, True)]
    assert sum(p.landed_late for p in made) >= 1, "expected the scenario to deliver a chunk late"
    assert len(got) == len(want), f"expected {len(want)} messages, found {len(got)} (doubled: {len(got) - len(want)})"
    assert [(m["time"], m["progressed"]) for m in got] == want, "expected every change once, in order, progress last"
    assert [m["row"] for m in got[:-1]] == [b"r%d" % i for i in range(n)]


def _one_step(stack: EmbeddedStack, prefix: str) -> tuple[Any, Any, str, list[bytes]]:
    """A controller's settings and subscribes room, a new output topic, and a step of
    ``_SUB_CHUNK + 300`` changes of subscribe "ours" (change ``i`` at time ``i``)."""
    cs = controller_settings(stack)
    ctl = Controller(cs)
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    ensure_topic(cs.service.kafka, topic, 1)
    enc = ctl.sub_codec.encode
    msgs = [bytes(enc({"subscribe_id": "ours", "time": i, "progressed": False, "diff": 1, "row": b"r%d" % i}))
            for i in range(_SUB_CHUNK + 300)]
    return cs, ctl.rooms.subscribes, topic, msgs


class _Rejecting:
    """A producer whose message ``at`` (by produce call) is rejected by the broker (a definite
    error, ``NOT_ENOUGH_REPLICAS``: not appended), and so is every later one until the next
    flush (an idempotent producer leaves no gap). With ``lost_ack_at`` that message lands but
    its delivery reports a timeout (it may have been appended)."""

    def __init__(self, inner: Any, at: int, lost_ack_at: int = -1) -> None:
        self.inner = inner
        self.at = at
        self.lost_ack_at = lost_ack_at
        self.calls = 0
        self.failing = False

    def produce(self, topic: str, value: bytes, key: Any = None, on_delivery: Any = None, **kw: Any) -> None:
        i = self.calls
        self.calls += 1
        if i == self.at or self.failing:
            self.failing = True
            on_delivery(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS, "test: not appended"), None)
            return
        if i == self.lost_ack_at:
            self.inner.produce(topic, value=value, key=key, **kw)
            on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT, "test: lost acknowledgement"), None)
            return
        self.inner.produce(topic, value=value, key=key, on_delivery=on_delivery, **kw)

    def flush(self, timeout: float = -1) -> int:
        self.failing = False
        return int(self.inner.flush(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lost_ack", [False, True], ids=["rejected-only", "rejected-and-lost-ack"])
def test_a_chunk_the_broker_rejected_goes_on_with_the_same_producer_without_settling(
    stack: EmbeddedStack, lost_ack: bool
) -> None:
    """A chunk whose failures are all definite (the broker did not append them; nothing is in
    flight) is counted and the same producer goes on, with no wait for the partition's end to
    hold still; one with a report that may hide an append (a timeout) still takes the whole
    path: a new producer, the settle, the count. Either way the output holds every message
    once, in order."""
    cs, room, topic, msgs = _one_step(stack, "sub-rej")
    n = len(msgs)
    made: list[_Rejecting] = []

    def room_producer() -> Any:
        first = not made
        p = _Rejecting(Producer(cs.service.kafka.config(**{"enable.idempotence": True})),
                       at=700 if first else -1, lost_ack_at=300 if first and lost_ack else -1)
        made.append(p)
        return p

    settles = [0]
    settle = room._settle_end

    def counted_settle(topic: str) -> None:
        settles[0] += 1
        settle(topic)

    room.new_output_producer = room_producer
    room._settle_end = counted_settle  # type: ignore[method-assign]
    try:
        room.produce_step("ours", topic, msgs, (0, 0))
    finally:
        room.close()
    got = read_subscribe(stack, topic, "ours", until_final=False, timeout_s=8)
    assert [m["time"] for m in got] == list(range(n)), "expected every message once, in order"
    if lost_ack:
        assert (len(made), settles[0]) == (2, 1), "expected a new producer and a settle after a possible append"
    else:
        assert (len(made), settles[0]) == (1, 0), "expected the same producer to go on, with no settle"


@pytest.mark.timeout(300)
def test_a_count_whose_consumer_rewinds_takes_each_message_once_from_its_start(stack: EmbeddedStack) -> None:
    """After a chunk the broker rejected in part, the room counts what landed from the chunk's
    start. A counting consumer that reads from the partition's start instead (a reset to the
    earliest offset, or messages fetched before) must not make the count larger: a count too
    large skips as many messages of the step, a gap on the output (the quick fault campaign
    once lost 16 changes, one chunk of the smallest size). The output holds every message
    once, in order."""
    from shared.io.kafka import new_consumer

    cs, room, topic, msgs = _one_step(stack, "sub-rew")
    n = len(msgs)

    def room_producer() -> Any:
        return _Rejecting(Producer(cs.service.kafka.config(**{"enable.idempotence": True})), at=_SUB_CHUNK + 100)

    counter = RewindingConsumer(new_consumer(cs.service.kafka, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "10"}))
    room.new_output_producer = room_producer
    room._counter = counter
    try:
        room.produce_step("ours", topic, msgs, (0, 0))
    finally:
        room.close()
    got = read_subscribe(stack, topic, "ours", until_final=False, timeout_s=8)
    assert counter.rewinds >= 1, "expected the room to count with the rewinding consumer"
    assert [m["time"] for m in got] == list(range(n)), "expected every message once, in order"
