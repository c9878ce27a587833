"""Kafka client wrappers for tests of the readers that must not trust a consumer's offsets."""

from __future__ import annotations

from typing import Any


class RewindingConsumer:
    """A consumer that reads every partition it is assigned from offset 0, whatever offset it
    was given: as librdkafka can hand back messages fetched for an earlier assignment, or fall
    back to its ``auto.offset.reset``. ``rewinds`` counts its assignments."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rewinds = 0

    def assign(self, tps: list[Any]) -> None:
        from confluent_kafka import TopicPartition

        self.rewinds += 1
        self.inner.assign([TopicPartition(tp.topic, tp.partition, 0) for tp in tps])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
