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
