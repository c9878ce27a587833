"""A shard's upper watched from a thread, for the benchmarks that time when it moves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class UpperWatch:
    """Polls a shard's upper in a thread; remembers when it first reached each value.

    ``on_error`` is told about a failed poll (a transient S3 error: the next poll goes on)."""

    def __init__(self, shard: Any, poll_s: float = 0.02, on_error: Callable[[str], None] | None = None) -> None:
        self.shard = shard
        self.poll_s = poll_s
        self.on_error = on_error
        self.upper = 0
        self.reached: list[tuple[float, int]] = []  # (monotonic, upper) at each advance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="upper-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                u = self.shard.refresh().upper.time or 0
            except Exception as e:  # noqa: BLE001 - a transient S3 error: poll again
                if self.on_error is not None:
                    self.on_error(f"upper poll failed: {e}")
                u = self.upper
            if u > self.upper:
                self.upper = u
                self.reached.append((time.monotonic(), u))
            self._stop.wait(self.poll_s)

    def when(self, frontier: int) -> float | None:
        for t, u in self.reached:
            if u >= frontier:
                return t
        return None

    def wait(self, frontier: int, timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        while self.upper < frontier:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected the upper to reach {frontier} within {timeout_s}s ({what}), found {self.upper}")
            time.sleep(0.01)
        return self.when(frontier) or time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class AnnouncedUpperWatch:
    """A shard's upper as its appenders announce it on the ``frontiers`` topic (each
    announcement follows the compare-and-append that made the upper durable), timed by the
    announcement's own ``updated_at_ms``: what :class:`UpperWatch` gives, without polling the
    S3 server 50 times a second. On the embedded stack that polling took a sizeable share of
    the two cores from the sink it measured (moto serves each request in Python), while the
    plain-Spark baseline it is compared with was timed from a local file. The shard itself is
    read once a second too, so an announcement lost to a delivery failure cannot hide an
    upper (that one is then timed when the read saw it).

    ``kafka``: the services' Kafka settings; ``frontiers_topic``: where appenders announce."""

    def __init__(self, shard: Any, kafka: Any, frontiers_topic: str, check_s: float = 1.0,
                 on_error: Callable[[str], None] | None = None) -> None:
        from confluent_kafka import OFFSET_END, TopicPartition

        from shared.io.kafka import new_consumer

        self.shard = shard
        self.check_s = check_s
        self.on_error = on_error
        self.upper = 0
        self.reached: list[tuple[float, int]] = []
        # Wall clock -> monotonic, to compare announcement times with the benchmarks' clocks.
        self._skew = time.monotonic() - time.time()
        self._lock = threading.Lock()
        self._consumer = new_consumer(kafka, **{"fetch.wait.max.ms": "100"})
        self._consumer.assign([TopicPartition(frontiers_topic, 0, OFFSET_END)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announced-upper-watch", daemon=True)
        self._thread.start()

    def _advance(self, u: int, at: float) -> None:
        with self._lock:
            if u > self.upper:
                self.upper = u
                self.reached.append((at, u))

    def _run(self) -> None:
        from shared.codec import message_codec
        from shared.frontier import Frontier

        codec = message_codec("frontier_update")
        shard_id = self.shard.shard_id
        next_check = 0.0
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.05)
                if msg is not None and msg.error() is None and msg.value():
                    try:
                        d = codec.decode(msg.value())
                        if d.get("shard_id") == shard_id:
                            f = Frontier.from_json(d["upper"])
                            u = 2**64 - 1 if f.time is None else f.time
                            self._advance(u, d["updated_at_ms"] / 1000 + self._skew)
                    except Exception as e:  # noqa: BLE001 - not ours to judge: the check below reads the shard
                        if self.on_error is not None:
                            self.on_error(f"undecodable frontier announcement: {e}")
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + self.check_s
                    try:
                        self._advance(self.shard.refresh().upper.time or 0, time.monotonic())
                    except Exception as e:  # noqa: BLE001 - a transient S3 error: check again later
                        if self.on_error is not None:
                            self.on_error(f"upper check failed: {e}")
        finally:
            self._consumer.close()

    def when(self, frontier: int) -> float | None:
        with self._lock:
            for t, u in self.reached:
                if u >= frontier:
                    return t
        return None

    def wait(self, frontier: int, timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        while self.upper < frontier:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected the upper to reach {frontier} within {timeout_s}s ({what}), found {self.upper}")
            time.sleep(0.01)
        return self.when(frontier) or time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
