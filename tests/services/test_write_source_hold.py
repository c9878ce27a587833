"""The write query's source holds the desired topic back between descriptions
(:mod:`services.write.source`), against the real broker: ``latestOffset`` admits the desired
records together with news on a control topic, when more of them wait than one micro-batch
admits, and at least every ``shared.spark.kafka_source.ADMIT_EVERY_S``; otherwise it keeps their
offsets where they were, and the records stay for the next admitted micro-batch."""

from __future__ import annotations

from typing import Any

import pytest

import services.write.source as ws
from shared.devstack.embedded import EmbeddedStack
from shared.spark.kafka_source import ADMIT_EVERY_S
from tests.spark.test_spark_kafka_source import create_topic, frozen_monotonic, produce, stream_reader


def reader(stack: EmbeddedStack, desired: str, control: str, **options: str) -> ws.DesiredStreamReader:
    source = ws.desired_source(desired, '{"type": "record", "name": "r", "fields": []}', 2)
    assert source[0] == ws.DESIRED_SOURCE
    r: ws.DesiredStreamReader = stream_reader(stack.bootstrap_servers, source, [desired, control], **options)
    return r


def test_desired_records_wait_for_a_description_or_a_second(
    stack: EmbeddedStack, unique_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = frozen_monotonic(monkeypatch)
    desired, control = f"write-d-{unique_id}", f"write-c-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    create_topic(stack.bootstrap_servers, control, 1)
    r = reader(stack, desired, control)
    limit: Any = r.getDefaultReadLimit()

    def latest(start: dict[str, Any]) -> dict[str, Any]:
        return r.latestOffset(start, limit)

    start = r.initialOffset()
    produce(stack.bootstrap_servers, desired, [(0, b"a"), (1, b"b"), (1, b"c")])
    end = latest(start)  # the first call (a start or a restart) admits everything
    assert end[desired] == {"0": 1, "1": 2}
    start = end
    produce(stack.bootstrap_servers, desired, [(0, b"d"), (1, b"e")])
    clock[0] += 0.1
    assert latest(start) == start  # no description, within the second: nothing new
    clock[0] += 0.3
    assert latest(start) == start
    produce(stack.bootstrap_servers, control, [(0, b"description")])
    clock[0] += 0.1
    end = latest(start)  # a description: it comes with every held desired record
    assert end[desired] == {"0": 2, "1": 3} and end[control] == {"0": 1}
    start = end
    produce(stack.bootstrap_servers, desired, [(0, b"f")])
    clock[0] += 0.5
    assert latest(start) == start
    clock[0] += ADMIT_EVERY_S  # a second without admission: admitted anyway
    end = latest(start)
    assert end[desired] == {"0": 3, "1": 3} and end[control] == {"0": 1}
    r.stop()


def test_a_backlog_larger_than_one_micro_batch_is_read_back_to_back(
    stack: EmbeddedStack, unique_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = frozen_monotonic(monkeypatch)
    desired, control = f"write-d2-{unique_id}", f"write-c2-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    create_topic(stack.bootstrap_servers, control, 1)
    r = reader(stack, desired, control, maxRecordsPerTrigger="4")
    limit: Any = r.getDefaultReadLimit()
    start = r.initialOffset()
    produce(stack.bootstrap_servers, desired, [(0, b"a"), (1, b"b")])
    start = r.latestOffset(start, limit)
    assert start[desired] == {"0": 1, "1": 1}
    produce(stack.bootstrap_servers, desired, [(0, b"c"), (1, b"d"), (1, b"e")])
    clock[0] += 0.1
    assert r.latestOffset(start, limit) == start  # 3 waiting, fewer than a micro-batch's 4
    produce(stack.bootstrap_servers, desired, [(0, b"g"), (1, b"h"), (1, b"i")])
    clock[0] += 0.1
    end = r.latestOffset(start, limit)  # 6 waiting: a full micro-batch of 4 at once
    assert sum(end[desired].values()) - sum(start[desired].values()) == 4
    clock[0] += 0.1
    nxt = r.latestOffset(end, limit)  # 2 left, below a micro-batch: they wait again
    assert nxt == end
    r.stop()
