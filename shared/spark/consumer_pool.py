"""The Kafka consumers a process keeps between its reads of topic ranges
(:func:`shared.spark.kafka_source.read_range`)."""

from __future__ import annotations

import threading
from typing import Any

#: Consumers kept between reads, per configuration, in each process (Spark reuses its Python
#: workers; the driver reads ranges for mint and append): a new consumer costs a connection and
#: a metadata round trip (about 50 ms on the embedded broker), while re-assigning a kept one to
#: another partition, of any topic, costs a few milliseconds. A consumer is taken out while in
#: use, so one range never shares it with another; it is unassigned when a range is read to
#: its end and kept for the next. One used by a read that failed or stopped early is closed
#: instead, and so is one beyond :data:`POOL_IDLE_MAX` idle ones of its configuration: the
#: pool is as large as the reads that ran at once, not one consumer (and its threads) per
#: partition ever read, which a process serving a hundred sinks would pay for in idle CPU.
_POOL: dict[str, list[tuple[Any, set[str]]]] = {}
_POOL_LOCK = threading.Lock()
#: Idle consumers kept per configuration.
POOL_IDLE_MAX = 16


def take_pooled(key: str) -> tuple[Any, set[str]] | None:
    """An idle consumer of the configuration and the topics it has the metadata of."""
    with _POOL_LOCK:
        idle = _POOL.get(key)
        return idle.pop() if idle else None


def give_back(key: str, consumer: Any, known: set[str]) -> bool:
    with _POOL_LOCK:
        idle = _POOL.setdefault(key, [])
        if len(idle) >= POOL_IDLE_MAX:
            return False
        idle.append((consumer, known))
        return True


def pooled_consumers() -> int:
    """How many idle consumers this process keeps."""
    with _POOL_LOCK:
        return sum(len(v) for v in _POOL.values())


def close_pooled_consumers() -> int:
    """Close this process's pooled consumers (a long-lived process that read ranges directly
    and is done with the broker). Returns how many were closed."""
    with _POOL_LOCK:
        consumers = [c for v in _POOL.values() for c, _ in v]
        _POOL.clear()
    for consumer in consumers:
        try:
            consumer.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
    return len(consumers)
