"""Mint reads the shard's state when an appender announced a new upper on the frontiers
topic, and at least every ``SHARD_REFRESH_S`` otherwise, not on every micro-batch (pure: the
minter's state and a counting stand-in for the shard)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from services.mint import service as mint
from services.sinkio import DECODED_SCHEMA, KIND_CONTROL, KIND_PROGRESS
from shared.catalog import SinkDef
from shared.frontier import Frontier
from shared.sink_state import MintState


@dataclass
class CountingShard:
    upper: int
    reads: int = 0

    def refresh(self) -> Any:
        self.reads += 1
        return SimpleNamespace(upper=Frontier.at(self.upper))


class Producer:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append(value)

    def flush(self) -> None:
        pass


def records(*rows: tuple[str, str, int | None]) -> pa.Table:
    """(kind, topic, frontier) rows in the decoded schema (partition 0)."""
    cols: dict[str, list[Any]] = {f.name: [None] * len(rows) for f in DECODED_SCHEMA}
    cols["kind"] = [k for k, _, _ in rows]
    cols["topic"] = [t for _, t, _ in rows]
    cols["frontier"] = [f for _, _, f in rows]
    cols["frontier_closed"] = [False] * len(rows)
    cols["partition"] = [0] * len(rows)
    cols["offset"] = list(range(len(rows)))
    return pa.Table.from_pydict(cols, schema=DECODED_SCHEMA)


def test_the_shard_is_read_on_an_announced_upper_and_at_least_every_second(monkeypatch: Any) -> None:
    clock = [100.0]
    monkeypatch.setattr(mint.time, "monotonic", lambda: clock[0])
    sink = SinkDef("s", "desired", "c")
    settings = SimpleNamespace(frontiers_topic="frontiers", descs_topic="descs")
    shard = CountingShard(upper=0)
    state = MintState("s", epoch=1, partition_count=1, as_of=0, read_only=False, nonce="n")
    producer = Producer()
    m = mint.SinkMinter(sink, settings, shard, state, producer)  # type: ignore[arg-type]

    m.process(records((KIND_PROGRESS, "desired", 5)))  # the first micro-batch reads it
    assert (shard.reads, len(producer.sent)) == (1, 1)  # and mints [0, 5)
    clock[0] += 0.3
    m.process(records((KIND_PROGRESS, "desired", 9)))  # no announcement, 0.3 s later: not read
    assert shard.reads == 1 and len(producer.sent) == 1  # [0, 5) still in flight
    shard.upper = 5
    clock[0] += 0.1
    m.process(records((KIND_CONTROL, "frontiers", None)))  # an appender announced an upper
    assert shard.reads == 2 and len(producer.sent) == 2  # and [5, 9) is minted at once
    clock[0] += 0.5
    m.process(records())  # nothing new, within the second: not read
    assert shard.reads == 2
    clock[0] += mint.SHARD_REFRESH_S
    m.process(records())  # a second passed: read again, in case an announcement was lost
    assert shard.reads == 3
    assert m.shard_refreshes == 3 and m.micro_batches == 5
