"""Mint reads the shard's state when an appender announced a new upper on the frontiers
topic, and at least every ``SHARD_REFRESH_S`` otherwise, not on every micro-batch (pure: the
minter's state and a counting stand-in for the shard)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from services.mint import service as mint
from services.sinkio import DECODED_SCHEMA, KIND_CONTROL, KIND_PROGRESS
from shared.catalog import SinkDef
from shared.frontier import Frontier
from shared.mint_state import MintState


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


def test_desired_ranges_are_read_only_when_a_description_can_be_minted(monkeypatch: Any) -> None:
    """While a description is in flight (the shard's upper has not moved since it was minted),
    the micro-batches' desired ranges are kept unread, merged per partition; the micro-batch
    that learns the upper moved reads them (once, tail first) and mints from the latest
    progress they hold. A read-only minter reads at every micro-batch."""
    from shared.catalog import SinkDef as Def

    clock = [100.0]
    monkeypatch.setattr(mint.time, "monotonic", lambda: clock[0])
    settings = SimpleNamespace(frontiers_topic="frontiers", descs_topic="descs")
    shard = CountingShard(upper=0)
    state = MintState("s", epoch=1, partition_count=2, as_of=0, read_only=False, nonce="n")
    producer = Producer()
    m = mint.SinkMinter(Def("s", "desired", "c"), settings, shard, state, producer)  # type: ignore[arg-type]
    reads: list[dict[int, tuple[int, int]]] = []
    progress = {0: 0, 1: 0}  # what the unread ranges say, per partition

    def read_unread(unread: dict[int, tuple[int, int]]) -> pa.Table:
        reads.append(dict(unread))
        t = records(*[(KIND_PROGRESS, "desired", progress[p]) for p in sorted(unread)])
        return t.set_column(t.schema.get_field_index("partition"), "partition",
                            pa.array(sorted(unread), pa.int32()))

    def batch(ranges: dict[int, tuple[int, int]], *rows: tuple[str, str, int | None]) -> None:
        for p, (a, b) in ranges.items():
            m.note_unread(p, a, b)
        m.process(records(*rows), read_unread)

    progress.update({0: 5, 1: 7})
    batch({0: (0, 10), 1: (0, 12)})  # nothing minted yet: read, and [0, 5) minted
    assert reads == [{0: (0, 10), 1: (0, 12)}] and len(producer.sent) == 1 and not m.unread
    progress.update({0: 9, 1: 8})
    batch({0: (10, 20), 1: (12, 15)})  # [0, 5) in flight: kept unread
    batch({0: (20, 31)})
    assert len(reads) == 1 and m.unread == {0: (10, 31), 1: (12, 15)} and len(producer.sent) == 1
    shard.upper = 5
    progress.update({0: 11, 1: 10})
    batch({1: (15, 16)}, (KIND_CONTROL, "frontiers", None))  # the upper moved: read, mint [5, 10)
    assert reads[1] == {0: (10, 31), 1: (12, 16)} and not m.unread
    assert len(producer.sent) == 2 and m.state.desired.frontier() == Frontier.at(10)
    # Read-only: the desired frontier is followed at every micro-batch (the metrics show it).
    ro_sink = Def("r", "desired", "c", read_only=True)
    catalog = SimpleNamespace(state=lambda fresh=True: SimpleNamespace(sinks={"r": ro_sink}))
    ro_settings = SimpleNamespace(frontiers_topic="frontiers", descs_topic="descs", catalog=lambda: catalog)
    ro = mint.SinkMinter(ro_sink, ro_settings, CountingShard(upper=0),
                         MintState("r", epoch=1, partition_count=2, as_of=0, read_only=True, nonce="n"),
                         Producer())  # type: ignore[arg-type]
    ro.state.last_lower = Frontier.at(0)  # as if a description were in flight
    m = ro
    before = len(reads)
    batch({0: (0, 3)})
    batch({0: (3, 4)})
    assert len(reads) == before + 2 and not ro.unread


def test_the_statements_the_source_found_are_taken_and_the_ranges_it_could_not_read_are_left_unread() -> None:
    """Mint's driver takes each desired range's latest progress statement from the
    micro-batch's logged offsets (``take_planned_progress``): a statement inside the range is
    absorbed, one below it (carried from an earlier range) means the range holds none, a
    partition without an entry (the source could not read it) is noted unread for the driver
    to read, and a statement past an unread range makes it moot."""
    from services.mint.source import planned_progress

    settings = SimpleNamespace(frontiers_topic="frontiers", descs_topic="descs")
    state = MintState("s", epoch=1, partition_count=3, as_of=0, read_only=False, nonce="n")
    m = mint.SinkMinter(SinkDef("s", "desired", "c"), settings, CountingShard(upper=0), state, Producer())  # type: ignore[arg-type]
    p0, p2 = b"progress-0", b"progress-2"
    offsets = {"desired": {"0": 50, "1": 40, "2": 30}, "frontiers": {"0": 3},
               "@progress": {"0": [44, base64.b64encode(p0).decode()], "2": [7, base64.b64encode(p2).decode()]}}
    known = planned_progress(offsets)
    planned = [("desired", 0, 20, 50), ("desired", 1, 10, 40), ("desired", 2, 10, 30), ("frontiers", 0, 2, 3)]
    assert m.take_planned_progress(planned, known) == [(0, 44, p0)]
    assert m.unread == {1: (10, 40)}  # partition 1: no entry, the driver reads it when it can matter
    # The next micro-batch: partition 1's statement found by the source, past the unread range.
    known = planned_progress({"@progress": {"1": [45, base64.b64encode(b"p1").decode()], "0": [-1, None]}})
    assert m.take_planned_progress([("desired", 1, 40, 46), ("desired", 0, 50, 60)], known) == [(1, 45, b"p1")]
    assert m.unread == {}
    # A statement below an unread range's end does not make it moot.
    m.note_unread(2, 30, 35)
    m.note_read(2, 33)
    assert m.unread == {2: (30, 35)}


def shared_minter(monkeypatch: Any) -> tuple[list[float], CountingShard, Producer, Any]:
    """A shared query's minter (``backoff``) of one sink on a one-partition topic, with a
    clock the test moves (at 100 s)."""
    clock = [100.0]
    monkeypatch.setattr(mint.time, "monotonic", lambda: clock[0])
    settings = SimpleNamespace(frontiers_topic="frontiers", descs_topic="descs")
    shard = CountingShard(upper=0)
    state = MintState("s", epoch=1, partition_count=1, as_of=0, read_only=False, nonce="n")
    producer = Producer()
    m = mint.SinkMinter(SinkDef("s", "desired", "c"), settings, shard, state, producer, backoff=True)  # type: ignore[arg-type]
    return clock, shard, producer, m


def reads_while_waiting(m: Any, clock: list[float], seconds: float) -> list[float]:
    """Micro-batches every 0.5 s for ``seconds`` while nothing comes: when (seconds from the
    start) the minter read its shard."""
    start, reads_at = clock[0], []
    for _ in range(int(seconds / 0.5)):
        clock[0] += 0.5
        if m.refresh_due(clock[0]):
            m.process(records())
            reads_at.append(clock[0] - start)
    return reads_at


def test_a_shared_minter_takes_announced_uppers_as_read_and_backs_off_its_reads_while_waiting(monkeypatch: Any) -> None:
    """The shared query's minters (``backoff``): an announcement's upper is absorbed with no
    read of the shard and mints at once; a sink waiting for its upper reads the shard after 1
    s, then after 2, 4, 8, 16 and 30 s (the most) while it does not move, and after 1 s again once it moved."""
    clock, shard, producer, m = shared_minter(monkeypatch)

    m.process(records((KIND_PROGRESS, "desired", 5)))
    assert (shard.reads, len(producer.sent)) == (1, 1)  # [0, 5) minted
    m.process(records((KIND_PROGRESS, "desired", 9)))
    m.process(records((KIND_CONTROL, "frontiers", None)), announced=[5])
    assert (shard.reads, len(producer.sent)) == (1, 2)  # no read: [5, 9) minted from the announced upper
    assert m.state.persist_frontier == Frontier.at(5)

    # 80 s waiting for [5, 9), nothing announced: 1, 2, 4, 8, 16 and 30 s apart (the most)
    assert reads_while_waiting(m, clock, 80.0) == [1.0, 3.0, 7.0, 15.0, 31.0, 61.0]
    assert shard.reads == 7 and m.refresh_every == mint.SHARD_REFRESH_MAX_S
    shard.upper = 9  # the upper moves; the next read sees it and the wait starts again at 1 s
    clock[0] += mint.SHARD_REFRESH_MAX_S
    m.process(records())
    assert m.state.persist_frontier == Frontier.at(9) and m.refresh_every == mint.SHARD_REFRESH_S


def test_a_shared_minter_waits_twice_its_last_upper_wait_before_its_first_read(monkeypatch: Any) -> None:
    """A busy deployment: the last description's upper was announced 3 s after it was minted,
    so a waiting sink's first read of the shard comes 6 s after the announcement (a read before
    would find nothing new), then 12 s later; one that waited 0.2 s reads after 1 s again."""
    clock, shard, producer, m = shared_minter(monkeypatch)

    m.process(records((KIND_PROGRESS, "desired", 5), (KIND_PROGRESS, "desired", 9)))
    assert (shard.reads, len(producer.sent)) == (1, 1)  # [0, 9) minted at 100 s
    clock[0] = 103.0
    m.process(records((KIND_CONTROL, "frontiers", None)), announced=[9])
    assert m.refresh_every == 6.0
    m.process(records((KIND_PROGRESS, "desired", 12)))
    assert len(producer.sent) == 2  # [9, 12) minted at 103 s
    # 20 s waiting for [9, 12), nothing announced
    assert reads_while_waiting(m, clock, 20.0) == [6.0, 18.0]  # then twice as long

    clock[0] += 0.2
    m.process(records((KIND_CONTROL, "frontiers", None)), announced=[12])
    assert m.state.persist_frontier == Frontier.at(12) and m.refresh_every == mint.SHARD_REFRESH_MAX_S  # waited 20 s: 40, at most 30
    m.process(records((KIND_PROGRESS, "desired", 15)))
    assert len(producer.sent) == 3  # [12, 15) minted
    clock[0] += 0.2
    m.process(records((KIND_CONTROL, "frontiers", None)), announced=[15])
    assert m.refresh_every == mint.SHARD_REFRESH_S  # waited 0.2 s: 1 s, as a quiet deployment


def test_a_shared_minter_with_its_upper_in_hand_mints_the_next_step_without_reading_the_shard(monkeypatch: Any) -> None:
    """A shared minter whose last description's upper was announced reads no shard when the
    next step's progress comes, however long after (the appenders announce every upper); once
    a description is in flight and its upper does not come, it reads after 1 s, in case the
    announcement was lost (1 s after the description was minted, not after the last
    announcement)."""
    clock, shard, producer, m = shared_minter(monkeypatch)

    m.process(records((KIND_PROGRESS, "desired", 5)))
    assert (shard.reads, len(producer.sent)) == (1, 1)  # the first micro-batch reads; [0, 5) minted
    assert not m.upper_in_hand()  # [0, 5) in flight
    clock[0] += 0.2
    m.process(records((KIND_CONTROL, "frontiers", None)), announced=[5])
    assert m.state.persist_frontier == Frontier.at(5) and m.upper_in_hand()
    clock[0] += 3.0  # the next step's progress, 3 s later: past the 1 s a read is due after
    m.process(records((KIND_PROGRESS, "desired", 9)))
    assert (shard.reads, len(producer.sent)) == (1, 2)  # [5, 9) minted from the announced upper, no read
    assert not m.upper_in_hand()
    clock[0] += 0.5  # the next micro-batch: 3.5 s since the announcement, but [5, 9) was minted 0.5 s ago
    assert not m.refresh_due(clock[0])
    m.process(records())
    assert shard.reads == 1  # no read: its upper cannot have come yet
    clock[0] += 0.5  # [5, 9)'s upper not announced within 1 s of its minting: read
    shard.upper = 9
    m.process(records())
    assert shard.reads == 2 and m.state.persist_frontier == Frontier.at(9) and m.upper_in_hand()
    # A per-sink query's minter (no backoff) reads once its second has passed, as before.
    plain = mint.SinkMinter(SinkDef("p", "desired", "c"), m.settings, shard,
                            MintState("p", epoch=1, partition_count=1, as_of=0, read_only=False, nonce="n"),
                            Producer())  # type: ignore[arg-type]
    plain.process(records((KIND_PROGRESS, "desired", 12)))
    clock[0] += 3.0
    plain.process(records((KIND_CONTROL, "frontiers", None)), announced=[12])
    clock[0] += 3.0
    plain.process(records((KIND_PROGRESS, "desired", 15)))
    assert shard.reads == 4 and not plain.upper_in_hand()
