"""Topic administration: idempotent creation with a partition count, and growth.

``ensure_topic`` is safe to call from every service at start-up and from tests: a topic that
exists already is left as it is (with at least the requested partitions: it grows when it has
fewer and the broker supports ``CreatePartitions``). The call returns once the brokers' metadata
shows every partition, so a producer that looks the count up right after sees all of them.

The embedded Tansu broker does not implement ``CreatePartitions`` (KIP-195): growing a topic
there raises :class:`~shared.errors.KafkaAdapterError` with code ``_UNSUPPORTED_FEATURE``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewPartitions,
    NewTopic,
)

from shared.errors import KafkaTimeoutError, UnknownTopicError
from shared.io.kafka import KafkaSettings, translate

__all__ = ["admin_client", "ensure_topic", "grow_topic", "topic_partition_count"]


def admin_client(settings: KafkaSettings) -> AdminClient:
    try:
        return AdminClient(settings.config())
    except (KafkaException, ValueError) as e:
        raise translate(e, "creating a Kafka admin client") from e


def topic_partition_count(
    settings: KafkaSettings | AdminClient, topic: str, timeout_s: float = 10.0
) -> int:
    """The number of partitions of ``topic`` (UnknownTopicError if it does not exist)."""
    admin = settings if isinstance(settings, AdminClient) else admin_client(settings)
    try:
        md = admin.list_topics(topic, timeout=timeout_s)
    except KafkaException as e:
        raise translate(e, f"reading the metadata of topic {topic!r}") from e
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        found = "no such topic" if t is None or t.error is None else t.error.str()
        raise UnknownTopicError(f"expected topic {topic!r} to exist, found {found}", topic=topic)
    return len(t.partitions)


def _wait_for_partitions(admin: AdminClient, topic: str, partitions: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last: int | str = "no metadata"
    while True:
        try:
            n = topic_partition_count(admin, topic, timeout_s=max(0.5, deadline - time.monotonic()))
            if n >= partitions:
                return n
            last = n
        except UnknownTopicError as e:
            last = str(e)
        if time.monotonic() >= deadline:
            raise KafkaTimeoutError(
                f"expected topic {topic!r} to show {partitions} partitions within {timeout_s}s, "
                f"found {last}",
                topic=topic,
            )
        time.sleep(0.05)


def ensure_topic(
    settings: KafkaSettings,
    topic: str,
    partitions: int,
    *,
    replication_factor: int = -1,
    config: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; grow it if it has
    fewer. Returns the partition count (``>= partitions``).

    ``replication_factor=-1`` takes the broker's default. ``config`` are topic configs
    (``retention.ms``...), applied only when the topic is created.
    """
    if partitions < 1:
        raise ValueError(f"expected a partition count >= 1, found {partitions}")
    admin = admin_client(settings)
    new = NewTopic(
        topic,
        num_partitions=partitions,
        replication_factor=replication_factor,
        config=dict(config or {}),
    )
    try:
        futures = admin.create_topics([new], operation_timeout=timeout_s, request_timeout=timeout_s)
        futures[topic].result(timeout=timeout_s)
    except KafkaException as e:
        err = e.args[0] if e.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise translate(e, f"creating topic {topic!r}") from e
        # it exists: keep it, growing it if it has fewer partitions than asked for
        if _wait_for_partitions(admin, topic, 1, timeout_s) < partitions:
            return grow_topic(settings, topic, partitions, timeout_s=timeout_s)
    return _wait_for_partitions(admin, topic, partitions, timeout_s)


def grow_topic(
    settings: KafkaSettings, topic: str, partitions: int, *, timeout_s: float = 30.0
) -> int:
    """Grow ``topic`` to ``partitions`` partitions (no-op if it has as many already)."""
    admin = admin_client(settings)
    if topic_partition_count(admin, topic, timeout_s) >= partitions:
        return topic_partition_count(admin, topic, timeout_s)
    try:
        futures = admin.create_partitions(
            [NewPartitions(topic, partitions)],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        futures[topic].result(timeout=timeout_s)
    except KafkaException as e:
        raise translate(e, f"growing topic {topic!r} to {partitions} partitions") from e
    return _wait_for_partitions(admin, topic, partitions, timeout_s)
