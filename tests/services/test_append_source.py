"""The append query's source holds ``descs`` back until reports arrive
(:mod:`services.append.source`), against the real broker: ``latestOffset`` admits the
descriptions together with news on ``batches``, and at least every
``shared.spark.kafka_source.ADMIT_EVERY_S``;
otherwise it keeps their offsets where they were, and they stay for the next admitted
micro-batch."""

from __future__ import annotations

from typing import Any

import pytest

import services.append.source as aps
from shared.devstack.embedded import EmbeddedStack
from shared.spark.kafka_source import ADMIT_EVERY_S
from tests.spark.test_spark_kafka_source import create_topic, frozen_monotonic, produce, stream_reader


def test_descriptions_wait_for_reports_or_a_second(
    stack: EmbeddedStack, unique_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = frozen_monotonic(monkeypatch)
    descs, batches = f"append-d-{unique_id}", f"append-b-{unique_id}"
    create_topic(stack.bootstrap_servers, descs, 1)
    create_topic(stack.bootstrap_servers, batches, 2)
    source = aps.append_source(descs)
    assert source[0] == aps.APPEND_SOURCE
    r = stream_reader(stack.bootstrap_servers, source, [descs, batches])
    limit: Any = r.getDefaultReadLimit()
    start = r.initialOffset()
    produce(stack.bootstrap_servers, descs, [(0, b"d1")])
    end = r.latestOffset(start, limit)  # the first call (a start or a restart) admits everything
    assert end[descs] == {"0": 1}
    start = end
    produce(stack.bootstrap_servers, descs, [(0, b"d2")])
    clock[0] += 0.2
    assert r.latestOffset(start, limit) == start  # a description alone, within the second: held
    produce(stack.bootstrap_servers, batches, [(1, b"report of d2")])
    clock[0] += 0.2
    end = r.latestOffset(start, limit)  # a report: admitted with its description
    assert end[descs] == {"0": 2} and end[batches] == {"0": 0, "1": 1}
    start = end
    produce(stack.bootstrap_servers, descs, [(0, b"d3")])
    clock[0] += 0.5
    assert r.latestOffset(start, limit) == start
    clock[0] += ADMIT_EVERY_S  # no report within a second: the description comes anyway
    assert r.latestOffset(start, limit)[descs] == {"0": 3}
    r.stop()
