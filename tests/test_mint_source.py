"""The mint query's source holds the desired topic back while the minter says it cannot use
it (:mod:`services.mint.source`), against the real broker: ``latestOffset`` admits the desired
records when the minter is not holding, together with an upper announcement on ``frontiers``,
and at least every ``shared.io.spark_kafka.ADMIT_EVERY_S``; otherwise it keeps their offsets
where they were, and the records stay for the next admitted micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import services.mint.source as ms
from shared.embedded import EmbeddedStack
from shared.io.spark_kafka import ADMIT_EVERY_S
from tests.test_spark_kafka_source import create_topic, frozen_monotonic, produce, stream_reader


def reader(stack: EmbeddedStack, desired: str, frontiers: str, hold_file: Path | None) -> ms.MintStreamReader:
    source = ms.mint_source(desired, None if hold_file is None else str(hold_file))
    assert source[0] == ms.MINT_SOURCE
    r: ms.MintStreamReader = stream_reader(stack.bootstrap_servers, source, [desired, frontiers])
    return r


def test_the_desired_topic_is_held_while_the_minter_holds_and_admitted_with_news(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = frozen_monotonic(monkeypatch)
    desired, frontiers = f"mint-d-{unique_id}", f"mint-f-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    create_topic(stack.bootstrap_servers, frontiers, 1)
    hold = ms.hold_path(str(tmp_path / "ck"))
    assert hold == str(tmp_path / "ck" / ms.HOLD_FILE)
    r = reader(stack, desired, frontiers, Path(hold))
    limit: Any = r.getDefaultReadLimit()

    def latest(start: dict[str, Any]) -> dict[str, Any]:
        return r.latestOffset(start, limit)

    start = r.initialOffset()
    produce(stack.bootstrap_servers, desired, [(0, b"a"), (1, b"b"), (1, b"c")])
    ms.write_hold(hold, False)
    end = latest(start)  # not holding: everything is admitted
    assert end[desired] == {"0": 1, "1": 2}
    start = end
    ms.write_hold(hold, True)
    produce(stack.bootstrap_servers, desired, [(0, b"d"), (1, b"e")])
    clock[0] += 0.1
    assert latest(start) == start  # holding, no news, within the second: nothing new
    produce(stack.bootstrap_servers, frontiers, [(0, b"upper")])
    clock[0] += 0.1
    end = latest(start)  # an announcement: it comes with every held desired record
    assert end[desired] == {"0": 2, "1": 3} and end[frontiers] == {"0": 1}
    start = end
    produce(stack.bootstrap_servers, desired, [(0, b"f")])
    clock[0] += 0.5
    assert latest(start) == start
    clock[0] += ADMIT_EVERY_S  # a second without admission: admitted anyway
    assert latest(start)[desired] == {"0": 3, "1": 3}
    ms.write_hold(hold, False)  # not holding any more: admitted at once
    produce(stack.bootstrap_servers, desired, [(1, b"g")])
    clock[0] += 0.1
    assert latest(start)[desired] == {"0": 3, "1": 4}
    r.stop()


def test_a_checkpoint_that_is_not_a_local_path_has_no_hold_and_admits_everything(
    stack: EmbeddedStack, unique_id: str,
) -> None:
    assert ms.hold_path("s3a://bucket/ck/mint/s-e1") is None
    ms.write_hold(None, True)  # nothing to write
    desired, frontiers = f"mint-d2-{unique_id}", f"mint-f2-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 1)
    create_topic(stack.bootstrap_servers, frontiers, 1)
    r = reader(stack, desired, frontiers, None)
    start = r.initialOffset()
    produce(stack.bootstrap_servers, desired, [(0, b"a")])
    r.latestOffset(start, r.getDefaultReadLimit())  # the first call admits, as always
    assert r.latestOffset(start, r.getDefaultReadLimit())[desired] == {"0": 1}
    r.stop()
