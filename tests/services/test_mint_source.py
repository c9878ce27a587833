"""The mint query's source holds the desired topic back while the minter says it cannot use
it (:mod:`services.mint.source`), against the real broker: ``latestOffset`` admits the desired
records when the minter is not holding, together with an upper announcement on ``frontiers``,
and at least every ``shared.spark.kafka_source.ADMIT_EVERY_S``; otherwise it keeps their offsets
where they were, and the records stay for the next admitted micro-batch. Updates without a
progress statement are held too, until a statement arrives (it ends a wait for records)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import services.mint.source as ms
from shared.devstack.embedded import EmbeddedStack
from shared.spark.kafka_source import ADMIT_EVERY_S, close_pooled_consumers
from tests.spark.test_spark_kafka_source import create_topic, frozen_monotonic, produce, stream_reader


def reader(stack: EmbeddedStack, desired: str, frontiers: str, hold_file: Path | None,
           **options: str) -> ms.MintStreamReader:
    source = ms.mint_source(desired, None if hold_file is None else str(hold_file))
    assert source[0] == ms.MINT_SOURCE
    r: ms.MintStreamReader = stream_reader(stack.bootstrap_servers, source, [desired, frontiers], **options)
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
    end = latest(start)
    assert end[desired] == {"0": 3, "1": 3}
    start = end
    ms.write_hold(hold, False)  # not holding any more: a statement is admitted at once
    produce(stack.bootstrap_servers, desired, [(1, b"g")])
    clock[0] += 0.1
    assert latest(start) == start  # updates alone (no statement): mint has no use for them yet
    produce(stack.bootstrap_servers, desired, [(0, progress_statement(5))])
    clock[0] += 0.1
    assert latest(start)[desired] == {"0": 4, "1": 4}
    r.stop()


def progress_statement(t: int, partition: int = 0) -> bytes:
    from shared.desired import encode_progress
    from shared.frontier import Frontier

    return encode_progress(partition, Frontier.at(t))


def test_updates_without_a_statement_are_held_until_one_ends_the_wait_each_read_once(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not holding, the source still answers the start while the desired records it finds hold
    no progress statement (each look reads only the records after the last one it read), waits
    for the next records, and answers with the statement that ends the wait; news on
    ``frontiers`` and a second without admission admit the updates anyway."""
    import services.mint.progress as progress
    from tests.services.test_source_wait import Later

    desired, frontiers = f"mint-q-{unique_id}", f"mint-qf-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 1)
    create_topic(stack.bootstrap_servers, frontiers, 1)
    hold = tmp_path / "ck" / ms.HOLD_FILE
    ms.write_hold(str(hold), False)
    r = reader(stack, desired, frontiers, hold, waitForRecordsMs="20000")
    reads: list[tuple[int, int]] = []
    real = progress.latest_progress_records

    def counted(settings: Any, ranges: Any, prefix: Any) -> Any:
        reads.extend((a, b) for _, _, a, b in ranges)
        return real(settings, ranges, prefix)

    monkeypatch.setattr(progress, "latest_progress_records", counted)
    limit: Any = r.getDefaultReadLimit()
    later = Later(stack.bootstrap_servers)
    try:
        start = r.initialOffset()
        produce(stack.bootstrap_servers, desired, [(0, b"u1"), (0, b"u2")])
        start = r.latestOffset(start, limit)  # the first look admits, as always
        assert start[desired] == {"0": 2}
        clock = frozen_monotonic(monkeypatch)  # from here on, no second passes unless the test says so
        produce(stack.bootstrap_servers, desired, [(0, b"u3"), (0, b"u4")])
        reads.clear()
        # Updates only, and a statement produced while it waits: the answer holds both.
        t = later.send(desired, [b"u5", progress_statement(3)], after_s=0.5)
        end = r.latestOffset(start, limit)
        t.join()
        assert end[desired] == {"0": 6}
        assert ms.planned_progress(end)[0] == (5, progress_statement(3))
        # [2, 4) was read once without a statement; the look after the wait read from 4 on.
        assert reads[0] == (2, 4) and all(a >= 4 for a, _ in reads[1:]), reads
        start = end
        # Updates only, nothing after them within the budget: the start again, each record
        # read once whatever the number of looks.
        produce(stack.bootstrap_servers, desired, [(0, b"u6"), (0, b"u7")])
        r.options = dataclasses.replace(r.options, wait_for_records_ms=0)
        reads.clear()
        assert r.latestOffset(start, limit) == start
        produce(stack.bootstrap_servers, desired, [(0, b"u8")])
        assert r.latestOffset(start, limit) == start
        assert reads == [(6, 8), (8, 9)], reads
        # News on frontiers admits them.
        produce(stack.bootstrap_servers, frontiers, [(0, b"upper")])
        end = r.latestOffset(start, limit)
        assert end[desired] == {"0": 9} and end[frontiers] == {"0": 1}
        start = end
        produce(stack.bootstrap_servers, desired, [(0, b"u9")])
        assert r.latestOffset(start, limit) == start
        clock[0] += ADMIT_EVERY_S  # a second without admission: admitted anyway
        assert r.latestOffset(start, limit)[desired] == {"0": 10}
    finally:
        later.producer.flush(10)
        r.stop()
        close_pooled_consumers()


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
    assert r.latestOffset(start, r.getDefaultReadLimit()) == start  # an update alone waits for its statement
    # Nothing says it holds: a statement is admitted at once, with the updates before it (with
    # a hold file saying so, only news or a second without admission would admit it).
    produce(stack.bootstrap_servers, desired, [(0, progress_statement(1))])
    assert r.latestOffset(start, r.getDefaultReadLimit())[desired] == {"0": 2}
    r.stop()


def test_the_source_finds_each_desired_ranges_latest_progress_statement_while_planning(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The minter's driver takes the desired partitions' latest statements from the logged
    offsets (``planned_progress``) instead of reading the topic: each is the statement the
    driver's own tail read finds; a range without one keeps the one before (or none); a range
    the source could not read has no entry, so the minter reads it itself."""
    from shared.codec import MARKER, message_codec

    prefix = MARKER + message_codec("desired").fingerprint + b"\x00"
    desired, frontiers = f"mint-p-{unique_id}", f"mint-pf-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    create_topic(stack.bootstrap_servers, frontiers, 1)
    hold = str(tmp_path / "ck" / ms.HOLD_FILE)
    ms.write_hold(hold, False)
    r = reader(stack, desired, frontiers, Path(hold), skipValuePrefixes=f"{desired}={prefix.hex()}")
    try:
        check_latest_progress(r, stack, desired, prefix, monkeypatch)
    finally:
        r.stop()
        close_pooled_consumers()  # this process's pooled consumers go before the broker does


def check_latest_progress(r: ms.MintStreamReader, stack: EmbeddedStack, desired: str, prefix: bytes,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    from services.mint.progress import latest_progress_record
    from shared.codec import RowCodec
    from shared.desired import encode_progress, encode_update
    from shared.errors import KafkaUnavailableError
    from shared.frontier import Frontier
    from shared.kafka_offsets import offsets_from_json

    rows = RowCodec({"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]})

    def updates(n: int, part: int) -> list[tuple[int, bytes]]:
        return [(part, encode_update(rows.encode({"k": i}), 1, 1)) for i in range(n)]

    limit: Any = r.getDefaultReadLimit()
    start = r.initialOffset()
    # Partition 0: statements at 5 and 3 behind updates; partition 1: updates only.
    produce(stack.bootstrap_servers, desired,
            updates(700, 0) + [(0, encode_progress(0, Frontier.at(5)))] + updates(40, 0)
            + [(0, encode_progress(0, Frontier.at(7)))] + updates(3, 0) + updates(20, 1), rounds=3)
    end = r.latestOffset(start, limit)
    assert offsets_from_json(end)[desired] == {0: 745, 1: 20}
    got = ms.planned_progress(end)
    assert got[0] == latest_progress_record(r.options.settings, desired, 0, 0, 745, prefix)
    assert got[0] is not None and got[0][0] == 741 and got[0][1] == encode_progress(0, Frontier.at(7))
    assert got[1] is None  # read, and none there
    # Nothing new: the annotation is carried, so the offsets equal the start (no new batch).
    start = end
    assert r.latestOffset(start, limit) == start
    # Partition 1 gets a statement, partition 0 only updates: 0 keeps its (older) statement.
    produce(stack.bootstrap_servers, desired, updates(5, 0) + updates(5, 1) + [(1, encode_progress(1, Frontier.at(9)))])
    end = r.latestOffset(start, limit)
    got = ms.planned_progress(end)
    assert got[0] is not None and got[0][0] == 741  # below this range's start: nothing new in it
    assert got[1] == (25, encode_progress(1, Frontier.at(9)))
    # A tail the source cannot read: no entry for that partition.
    start = end
    produce(stack.bootstrap_servers, desired, updates(2, 0))

    def unavailable(*a: Any) -> None:
        raise KafkaUnavailableError("broker gone")

    monkeypatch.setattr("services.mint.progress.latest_progress_records", unavailable)
    end = r.latestOffset(start, limit)
    got = ms.planned_progress(end)
    assert 0 not in got and got[1] == (25, encode_progress(1, Frontier.at(9)))
    assert ms.planned_progress({desired: {"0": 3}}) == {}  # offsets without the annotation


def test_the_shared_mint_source_finds_each_members_latest_statement_while_planning(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared mint query's source (:class:`services.mint.source.MintFleetReader`) logs, for
    each admitted member range, its latest progress statement (``[-1, null]`` for a range
    without one) in the offsets, by member key and partition, which the driver takes instead
    of reading the tails; with nothing new it answers the start as it is (no micro-batch)."""
    from services.runtime.fleet import write_members
    from shared.catalog import SinkDef
    from shared.spark.fleet_source import MEMBERS_OPTION

    frontiers = f"mint-ff-{unique_id}"
    create_topic(stack.bootstrap_servers, frontiers, 1)
    sinks = {}
    for i in range(2):
        d = f"mint-fd{i}-{unique_id}"
        create_topic(stack.bootstrap_servers, d, 2)
        sink = SinkDef(f"s{i}-{unique_id}", d, f"c{i}-{unique_id}", epoch=3)
        sinks[f"{sink.sink_id}@3"] = sink
    members = str(tmp_path / "mint-shared" / "members.json")
    write_members(members, sinks)
    source = (ms.MintFleetDataSource.name(), ms.MintFleetDataSource, {MEMBERS_OPTION: members})
    r: ms.MintFleetReader = stream_reader(stack.bootstrap_servers, source, [frontiers])
    limit: Any = r.getDefaultReadLimit()
    (k0, s0), (k1, s1) = sorted(sinks.items())
    start = r.initialOffset()
    produce(stack.bootstrap_servers, s0.desired_topic,
            [(0, b"u"), (0, progress_statement(4)), (0, b"u"), (0, progress_statement(7)), (0, b"u"), (1, b"u")])
    produce(stack.bootstrap_servers, s1.desired_topic, [(1, progress_statement(9, 1))])
    end = r.latestOffset(start, limit)
    assert end[k0] == {"0": 5, "1": 1} and end[k1] == {"0": 0, "1": 1}
    got = ms.fleet_planned_progress(end)
    assert got[k0] == {0: (3, progress_statement(7)), 1: None}  # the latest of partition 0; none on 1
    assert got[k1] == {1: (0, progress_statement(9, 1))}
    assert r.latestOffset(end, limit) == end  # nothing new: the start, annotation and all
    produce(stack.bootstrap_servers, s1.desired_topic, [(1, b"u"), (1, progress_statement(12, 1))])
    later = r.latestOffset(end, limit)
    assert ms.fleet_planned_progress(later) == {k1: {1: (2, progress_statement(12, 1))}}  # only the new range
    # A sink held back (its description in flight) and nothing new: a micro-batch anyway every
    # HELD_TICK_S, in which the driver reads the shard of a sink that waits (a lost announcement).
    from shared.spark.fleet_source import write_holds

    clock = frozen_monotonic(monkeypatch)
    assert r.latestOffset(later, limit) == later  # nobody held: no micro-batch
    write_holds(members, {k0})
    clock[0] += ms.HELD_TICK_S
    ticked = r.latestOffset(later, limit)
    assert ticked[ms.TICK_KEY] == 1 and ms.PROGRESS_KEY not in ticked
    assert {k: v for k, v in ticked.items() if k != ms.TICK_KEY} == {k: v for k, v in later.items() if k != ms.PROGRESS_KEY}
    assert r.latestOffset(ticked, limit) == ticked  # within the second: nothing
    clock[0] += ms.HELD_TICK_S
    assert r.latestOffset(ticked, limit)[ms.TICK_KEY] == 2
    r.stop()
    close_pooled_consumers()


def test_the_shared_mint_source_spaces_a_busy_fleets_micro_batches(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a micro-batch that admitted BUSY_MEMBERS members or more, the shared mint source
    plans the next one no sooner than BUSY_SPACING_S after it (it waits, then looks); after
    one that admitted fewer (a sink alone), it looks at once."""
    import time
    import types

    from services.runtime.fleet import write_members
    from shared.catalog import SinkDef
    from shared.spark.fleet_source import MEMBERS_OPTION

    frontiers = f"mint-bf-{unique_id}"
    create_topic(stack.bootstrap_servers, frontiers, 1)
    sinks = {}
    for i in range(ms.BUSY_MEMBERS):
        d = f"mint-bd{i}-{unique_id}"
        create_topic(stack.bootstrap_servers, d, 1)
        sinks[f"b{i}-{unique_id}@1"] = SinkDef(f"b{i}-{unique_id}", d, f"bc{i}-{unique_id}", epoch=1)
    members = str(tmp_path / "mint-shared" / "members.json")
    write_members(members, sinks)
    source = (ms.MintFleetDataSource.name(), ms.MintFleetDataSource, {MEMBERS_OPTION: members})
    r: ms.MintFleetReader = stream_reader(stack.bootstrap_servers, source, [frontiers])
    limit: Any = r.getDefaultReadLimit()
    clock = frozen_monotonic(monkeypatch)
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    # The source's own waits only (the Kafka reads under it keep the real sleep).
    monkeypatch.setattr(ms, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    keys = sorted(sinks)
    start = r.initialOffset()
    for k in keys:
        produce(stack.bootstrap_servers, sinks[k].desired_topic, [(0, progress_statement(5))])
    busy = r.latestOffset(start, limit)
    assert all(busy[k] == {"0": 1} for k in keys) and not slept  # every member admitted at once
    clock[0] += 0.1  # the micro-batch ran for 100 ms
    produce(stack.bootstrap_servers, sinks[keys[0]].desired_topic, [(0, progress_statement(8))])
    alone = r.latestOffset(busy, limit)
    assert slept == [pytest.approx(ms.BUSY_SPACING_S - 0.1)]  # waited out the spacing, then looked
    assert alone[keys[0]] == {"0": 2} and all(alone[k] == {"0": 1} for k in keys[1:])
    produce(stack.bootstrap_servers, sinks[keys[1]].desired_topic, [(0, progress_statement(9))])
    after_alone = r.latestOffset(alone, limit)
    assert len(slept) == 1 and after_alone[keys[1]] == {"0": 2}  # one member admitted: no wait
    r.stop()
    close_pooled_consumers()
