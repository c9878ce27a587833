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


def after_list_offsets(monkeypatch: pytest.MonkeyPatch, r: Any, step: Any) -> list[bool]:
    """Run ``step`` once, right after the broker answers the reader's next ``ListOffsets``
    (before the probes of the partitions whose answer moved); the list says whether it ran."""
    probe = r._p()
    real = probe.watermarks
    fired: list[bool] = []

    def then_step(tps: Any, earliest: bool = False) -> Any:
        got = real(tps, earliest=earliest)
        if not fired and not earliest:
            fired.append(True)
            step()
        return got

    monkeypatch.setattr(probe, "watermarks", then_step)
    return fired


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


def test_a_description_comes_with_the_desired_records_produced_before_it_per_sink(
    stack: EmbeddedStack, unique_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-sink write source takes the control topic's ends before the desired topic's: a
    description produced after the broker answered ``ListOffsets`` (and seen by the probe of
    the control partition that moved) comes with the desired records produced before it."""
    frozen_monotonic(monkeypatch)
    desired, control = f"write-d3-{unique_id}", f"write-c3-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    create_topic(stack.bootstrap_servers, control, 1)
    r = reader(stack, desired, control)
    limit: Any = r.getDefaultReadLimit()
    start = r.latestOffset(r.initialOffset(), limit)
    produce(stack.bootstrap_servers, control, [(0, b"an earlier description")])

    def step() -> None:
        produce(stack.bootstrap_servers, desired, [(0, b"u0"), (1, b"u1")])
        produce(stack.bootstrap_servers, control, [(0, b"its description")])

    fired = after_list_offsets(monkeypatch, r, step)
    end = r.latestOffset(start, limit)
    assert fired
    assert end[control] == {"0": 2} and end[desired] == {"0": 1, "1": 1}, end
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


def test_the_shared_write_source_admits_a_sinks_records_with_its_description(
    stack: EmbeddedStack, unique_id: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared write query's source (:class:`services.write.shared_source.WriteFleetReader`)
    holds every member's desired records; a description admits its own sink's (the micro-batch
    then plans units for that sink only), and every member's are admitted at least every
    ``ADMIT_ALL_EVERY_S``."""
    from types import SimpleNamespace

    import services.write.shared_source as wss
    from services.runtime.fleet import write_members
    from shared.catalog import SinkDef
    from shared.codec import message_codec
    from shared.frontier import Frontier
    from shared.sink_messages import BatchDescription
    from shared.spark.fleet_source import MEMBERS_OPTION
    from shared.spark.kafka_source import KafkaInputPartition

    clock = frozen_monotonic(monkeypatch)
    descs = f"wf-descs-{unique_id}"
    create_topic(stack.bootstrap_servers, descs, 1)
    sinks = {}
    for i in range(2):
        d = f"wf-d{i}-{unique_id}"
        create_topic(stack.bootstrap_servers, d, 2)
        sink = SinkDef(f"s{i}-{unique_id}", d, f"c{i}-{unique_id}", epoch=1)
        sinks[f"{sink.sink_id}@1"] = sink
    members = str(tmp_path / "write-shared" / "members.json")
    write_members(members, sinks)
    settings = SimpleNamespace(descs_topic=descs)
    cls = type("T", (wss.WriteFleetDataSource,), {"settings": settings, "parallelism": 2})
    r: wss.WriteFleetReader = stream_reader(stack.bootstrap_servers, (cls.name(), cls, {MEMBERS_OPTION: members}), [descs])
    limit: Any = r.getDefaultReadLimit()
    (ka, a), (kb, b) = sorted(sinks.items())
    start = r.latestOffset(r.initialOffset(), limit)  # the first look admits everything there is (nothing)
    produce(stack.bootstrap_servers, a.desired_topic, [(0, b"a0"), (1, b"a1")])
    produce(stack.bootstrap_servers, b.desired_topic, [(0, b"b0"), (1, b"b1"), (1, b"b2")])
    clock[0] += 0.1
    assert r.latestOffset(start, limit) == start  # held, no news
    desc = BatchDescription(a.sink_id, Frontier.at(0), Frontier.at(5), 1, "tok", partition_count=2)
    produce(stack.bootstrap_servers, descs, [(0, message_codec("batch_description").encode(desc.to_dict()))])
    clock[0] += 0.1
    reads: list[tuple[str, int, int, int]] = []
    real_read = wss.read_range

    def counted(settings: Any, topic: str, partition: int, lo: int, hi: int, **kw: Any) -> Any:
        reads.append((topic, partition, lo, hi))
        return real_read(settings, topic, partition, lo, hi, **kw)

    monkeypatch.setattr(wss, "read_range", counted)
    end = r.latestOffset(start, limit)
    assert end[descs] == {"0": 1}
    assert end[ka] == {"0": 1, "1": 1}  # a's description admits a's records
    assert end[kb] == start[kb] == {"0": 0, "1": 0}  # b's stay held
    # The micro-batch's planning finds that description without reading the range again.
    assert reads == [(descs, 0, 0, 1)]
    found = r._descriptions([KafkaInputPartition(descs, 0, 0, 1)], r.members())
    assert {sid: [(p, o) for p, o, _ in got] for sid, got in found.items()} == {a.sink_id: [(0, 0)]}
    assert reads == [(descs, 0, 0, 1)]
    clock[0] += wss.ADMIT_ALL_EVERY_S
    e2 = r.latestOffset(end, limit)
    assert e2[kb] == {"0": 1, "1": 2}  # every member's, at least this often
    # Each member has its own clock: b's description admits b's records and starts b's clock
    # again; ADMIT_ALL_EVERY_S after a's last admission a's records come, while b's newer ones
    # stay held (one member's clock never admits the others').
    produce(stack.bootstrap_servers, a.desired_topic, [(0, b"a2")])
    produce(stack.bootstrap_servers, b.desired_topic, [(0, b"b3")])
    clock[0] += wss.ADMIT_ALL_EVERY_S / 2
    desc_b = BatchDescription(b.sink_id, Frontier.at(0), Frontier.at(5), 1, "tok-b", partition_count=2)
    produce(stack.bootstrap_servers, descs, [(0, message_codec("batch_description").encode(desc_b.to_dict()))])
    e3 = r.latestOffset(e2, limit)
    assert e3[kb] == {"0": 2, "1": 2} and e3[ka] == e2[ka] == {"0": 1, "1": 1}
    produce(stack.bootstrap_servers, b.desired_topic, [(1, b"b4")])
    clock[0] += wss.ADMIT_ALL_EVERY_S / 2
    e4 = r.latestOffset(e3, limit)
    assert e4[ka] == {"0": 2, "1": 1}  # a's clock ran out
    assert e4[kb] == e3[kb]  # b's did not: b4 stays held
    r.stop()


def test_a_description_comes_with_the_desired_records_produced_before_it(
    stack: EmbeddedStack, unique_id: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A description minted while the shared write source takes its ends (after the broker
    answered ``ListOffsets``, before the probe of the ``descs`` partition that moved) is in the
    micro-batch only with its sink's desired records produced before it: the control topics'
    ends are taken first, the members' after. Taken in one look, the description came and the
    records stayed held, and the writer waited for the sink's next admission (up to
    ``ADMIT_ALL_EVERY_S``)."""
    from types import SimpleNamespace

    import services.write.shared_source as wss
    from services.runtime.fleet import write_members
    from shared.catalog import SinkDef
    from shared.codec import message_codec
    from shared.frontier import Frontier
    from shared.sink_messages import BatchDescription
    from shared.spark.fleet_source import MEMBERS_OPTION

    frozen_monotonic(monkeypatch)
    descs = f"wr-descs-{unique_id}"
    create_topic(stack.bootstrap_servers, descs, 1)
    desired = f"wr-d-{unique_id}"
    create_topic(stack.bootstrap_servers, desired, 2)
    sink = SinkDef(f"s-{unique_id}", desired, f"c-{unique_id}", epoch=1)
    key = f"{sink.sink_id}@1"
    members = str(tmp_path / "write-shared" / "members.json")
    write_members(members, {key: sink})
    cls = type("T", (wss.WriteFleetDataSource,), {"settings": SimpleNamespace(descs_topic=descs), "parallelism": 2})
    r: wss.WriteFleetReader = stream_reader(stack.bootstrap_servers, (cls.name(), cls, {MEMBERS_OPTION: members}), [descs])
    limit: Any = r.getDefaultReadLimit()
    encode = message_codec("batch_description").encode
    start = r.latestOffset(r.initialOffset(), limit)  # the first look: nothing there
    # Another sink's description moves the descs partition: the next look probes its end.
    other = BatchDescription(f"other-{unique_id}", Frontier.at(0), Frontier.at(5), 1, "tok-0", partition_count=2)
    produce(stack.bootstrap_servers, descs, [(0, encode(other.to_dict()))])

    def step() -> None:  # the sink's step, then its description
        produce(stack.bootstrap_servers, desired, [(0, b"u0"), (1, b"u1")])
        desc = BatchDescription(sink.sink_id, Frontier.at(0), Frontier.at(5), 1, "tok-1", partition_count=2)
        produce(stack.bootstrap_servers, descs, [(0, encode(desc.to_dict()))])

    fired = after_list_offsets(monkeypatch, r, step)
    end = r.latestOffset(start, limit)
    assert fired
    if end[descs] == {"0": 2}:  # the description is in this micro-batch: its records too
        assert end[key] == {"0": 1, "1": 1}, end
    else:
        assert end[descs] == {"0": 1} and end[key] == start[key], end
    # Either way the next micro-batch holds them together.
    e2 = r.latestOffset(end, limit)
    assert e2[descs] == {"0": 2} and e2[key] == {"0": 1, "1": 1}, e2
    r.stop()
