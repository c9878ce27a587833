"""Fault injection for tests and fault campaigns (``bench/chaos.py``): an object store that
fails, times out or loses acknowledgements, and the ``SHARDSINK_FAULTS`` setting that puts it
(and a Kafka producer whose deliveries fail) under the services. Never set in a deployment.

``SHARDSINK_FAULTS`` is a comma-separated list of ``name=value`` (see :class:`Faults`), e.g.
``error_p=0.02,lost_ack_p=0.02,latency_ms=5``. With it, the services' S3 store is wrapped in a
:class:`FaultyObjectStore` and their control producers report injected delivery errors.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.errors import IndeterminateError, ObjectStoreError
from shared.objectstore import ObjectInfo, ObjectStore


@dataclass
class FaultPlan:
    """What a :class:`FaultyObjectStore` injects. Probabilities are per call.

    - ``error_p``: fail before sending (a determinate :class:`ObjectStoreError`);
    - ``lost_ack_p``: perform a ``put`` and then report a timeout (:class:`IndeterminateError`):
      "the PUT landed but the client saw a timeout";
    - ``timeout_p``: report a timeout without performing the call (also indeterminate);
    - ``latency_s``: (min, max) extra latency added to every call.
    """

    error_p: float = 0.0
    lost_ack_p: float = 0.0
    timeout_p: float = 0.0
    latency_s: tuple[float, float] = (0.0, 0.0)
    seed: int | None = None
    #: Only calls whose key matches this predicate are faulted (default: all).
    applies_to: Callable[[str], bool] | None = None


@dataclass
class FaultCounters:
    errors: int = 0
    lost_acks: int = 0
    timeouts: int = 0
    calls: int = 0


@dataclass
class FaultyObjectStore:
    """Wraps another store and injects the faults of a :class:`FaultPlan`."""

    inner: ObjectStore
    plan: FaultPlan = field(default_factory=FaultPlan)
    counters: FaultCounters = field(default_factory=FaultCounters)
    enabled: bool = True

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()

    def _roll(self, key: str, op: str) -> str | None:
        if not self.enabled:
            return None
        if self.plan.applies_to is not None and not self.plan.applies_to(key):
            return None
        with self._lock:
            self.counters.calls += 1
            lo, hi = self.plan.latency_s
            delay = self._rng.uniform(lo, hi) if hi > 0 else 0.0
            r = self._rng.random()
        if delay:
            time.sleep(delay)
        if r < self.plan.error_p:
            with self._lock:
                self.counters.errors += 1
            raise ObjectStoreError(f"injected error on {op} {key!r}", key=key, injected=True)
        r -= self.plan.error_p
        if r < self.plan.timeout_p:
            with self._lock:
                self.counters.timeouts += 1
            raise IndeterminateError(f"injected timeout on {op} {key!r}", key=key, injected=True)
        r -= self.plan.timeout_p
        if op == "put" and r < self.plan.lost_ack_p:
            return "lost_ack"
        return None

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        fault = self._roll(key, "put")
        self.inner.put(key, data, if_absent=if_absent)
        if fault == "lost_ack":
            with self._lock:
                self.counters.lost_acks += 1
            raise IndeterminateError(
                f"injected timeout after the PUT of {key!r} landed", key=key, injected=True
            )

    def get(self, key: str) -> bytes:
        self._roll(key, "get")
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        self._roll(key, "head")
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._roll(key, "delete")
        self.inner.delete(key)

    def delete_many(self, keys: list[str]) -> None:
        for k in keys:
            self._roll(k, "delete")
        self.inner.delete_many(keys)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._roll(prefix, "list")
        return self.inner.list(prefix, start_after)


@dataclass(frozen=True, slots=True)
class Faults:
    """Injected faults (test only, env ``SHARDSINK_FAULTS``). Probabilities are per call.

    - ``error_p``: an S3 call fails before it is sent (determinate);
    - ``lost_ack_p``: an S3 PUT lands, then reports a timeout (indeterminate);
    - ``timeout_p``: an S3 call reports a timeout without being performed (indeterminate);
    - ``latency_ms``: up to this much extra latency on every S3 call (uniform);
    - ``kafka_error_p``: a control message is not produced and its delivery reports an error
      the broker gives for a batch it did not append (``NOT_ENOUGH_REPLICAS``), and so does
      every later one until the producer is flushed (no gaps, as with an idempotent
      producer);
    - ``kafka_lost_ack_p``: a control message is produced, then its delivery reports a
      timeout (``_MSG_TIMED_OUT``: it may have been appended, as librdkafka says of a
      message that timed out in flight).
    """

    error_p: float = 0.0
    lost_ack_p: float = 0.0
    timeout_p: float = 0.0
    latency_ms: float = 0.0
    kafka_error_p: float = 0.0
    kafka_lost_ack_p: float = 0.0

    @staticmethod
    def parse(text: str) -> Faults | None:
        """``"error_p=0.02,latency_ms=5"`` -> Faults; ``""`` -> None."""
        if not text.strip():
            return None
        names = set(Faults.__dataclass_fields__)
        values: dict[str, float] = {}
        for item in text.split(","):
            name, sep, value = item.strip().partition("=")
            if not sep or name not in names:
                raise ValueError(f"expected SHARDSINK_FAULTS items name=value with a name in {sorted(names)}, found {item!r}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"expected a number for {name} in SHARDSINK_FAULTS, found {value!r}") from None
        return Faults(**values)

    def wrap_store(self, store: Any) -> Any:
        plan = FaultPlan(
            error_p=self.error_p,
            lost_ack_p=self.lost_ack_p,
            timeout_p=self.timeout_p,
            latency_s=(0.0, self.latency_ms / 1000.0),
        )
        return FaultyObjectStore(store, plan)

    def wrap_producer(self, producer: Any) -> Any:
        if self.kafka_error_p <= 0 and self.kafka_lost_ack_p <= 0:
            return producer
        return _FaultyProducer(producer, self.kafka_error_p, self.kafka_lost_ack_p)


class _FaultyProducer:
    """A confluent_kafka Producer whose deliveries sometimes report an injected error.

    Like an idempotent producer, it never leaves a gap: after an injected error every later
    message also fails until the next ``flush`` (the tail of the batch is lost, not a message
    in its middle)."""

    def __init__(self, inner: Any, error_p: float, lost_ack_p: float) -> None:
        import random

        self._inner = inner
        self._error_p = error_p
        self._lost_ack_p = lost_ack_p
        self._rng = random.Random()
        self._failing = False

    def flush(self, *args: Any, **kw: Any) -> Any:
        self._failing = False
        return self._inner.flush(*args, **kw)

    def produce(self, topic: str, value: Any = None, key: Any = None, on_delivery: Any = None, **kw: Any) -> None:
        r = self._rng.random()
        if (self._failing or r < self._error_p + self._lost_ack_p) and on_delivery is not None:
            from confluent_kafka import KafkaError

            if self._failing or r < self._error_p:
                self._failing = True
                # never produced, nor is anything after it until flush: the broker's answer
                # for a batch it did not append
                on_delivery(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS, "injected: not appended (SHARDSINK_FAULTS)"), None)
                return
            self._inner.produce(topic, value=value, key=key, **kw)  # produced, reported failed
            on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT, "injected: lost acknowledgement (SHARDSINK_FAULTS)"), None)
            return
        self._inner.produce(topic, value=value, key=key, on_delivery=on_delivery, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def faults_from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    return Faults.parse((os.environ if env is None else env).get("SHARDSINK_FAULTS", ""))
