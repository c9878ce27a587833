"""Shared queries (``SHARDSINK_QUERIES=shared``, issue 34): one streaming query per service
serves many sinks.

The real embedded stack and real Spark: one :class:`Services` (mint, write, append in one
application) for the module, in shared mode. The tests check that many sinks converge side by
side, each to its own model at every upper seen; that sinks join and leave without a restart
of the queries while the others keep moving; and that one failing sink is held alone and named
while the others converge.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.runtime.fleet import sink_key
from services.sinkio import read_ranges_on_driver
from services.write.context import part_tag
from shared.codec import message_codec
from shared.io.kafka import end_offsets
from shared.sink_messages import BatchDescription
from shared.catalog import quarantine_record
from shared.devstack.embedded import EmbeddedStack
from tests.services.test_sink_e2e import (
    DEADLINE_S,
    POLL_S,
    SCHEMA,
    Harness,
    Workload,
    describe_diff,
    kv_row,
    services_harness,
    shard_contents,
)

#: Per sink: the updates whose row holds this text make its write step fail.
FAIL_MARK = "poison"


@pytest.fixture(scope="module")
def running(stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with services_harness(stack, spark, tmp_path_factory, SHARDSINK_QUERIES="shared",
                          SHARDSINK_TEST_FAIL_ON_ROW=FAIL_MARK, SHARDSINK_QUARANTINE_AFTER="0") as harness:
        yield harness


@pytest.fixture
def h(running: Harness) -> Iterator[Harness]:
    running.sinks = []
    yield running
    catalog = running.settings.catalog()
    for sid in running.sinks:
        catalog.drop_sink(sid)
    running.sinks = []


class Sink:
    """One sink of a test, its shard and its workload."""

    def __init__(self, h: Harness, name: str, seed: int) -> None:
        self.sid, self.cid, self.topic = f"s-{name}", f"c-{name}", f"desired-{name}"
        self.shard = h.collection(self.cid, SCHEMA, self.topic, partitions=2)
        self.work: Workload = h.workload(self.topic, SCHEMA, kv_row, seed=seed)
        self.seen: list[int] = []

    def check(self) -> int:
        """The shard's upper now; at a new one, its snapshot must equal the model."""
        upper = self.shard.refresh().upper.time
        assert upper is not None
        if upper > 0 and (not self.seen or upper != self.seen[-1]):
            assert upper <= self.work.frontier, f"{self.sid}: upper {upper} beyond the desired frontier {self.work.frontier}"
            contents = shard_contents(self.shard, upper - 1)
            expected = self.work.model(upper)
            assert contents.rows == expected, f"{self.sid} at {upper - 1}: " + describe_diff(contents.rows, expected)
            self.seen.append(upper)
        return upper


def create_sinks(h: Harness, sinks: list[Sink]) -> None:
    catalog = h.settings.catalog()
    from shared.catalog import SinkDef

    for s in sinks:
        catalog.create_sink(SinkDef(s.sid, s.topic, s.cid))
        h.sinks.append(s.sid)


def converge(h: Harness, sinks: list[Sink], deadline_s: float = DEADLINE_S * 2) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        behind = [s for s in sinks if s.check() < s.work.frontier]
        if not behind:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"expected every sink at its desired frontier within {deadline_s}s, found "
                        f"{[(s.sid, s.seen[-1:] , s.work.frontier) for s in behind][:5]}; "
                        f"{h.diagnostics([s.sid for s in behind[:3]])}")
        time.sleep(POLL_S)


def wait_started(h: Harness) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not all(f.query is not None and f.query.isActive for f in h.services.fleets.values()):
        assert time.monotonic() < deadline, "expected the three shared queries to start"
        time.sleep(POLL_S)


def descriptions(h: Harness) -> dict[str, list[BatchDescription]]:
    """Every description on the harness's ``descs`` topic, by sink."""
    topic = h.settings.descs_topic
    raw = read_ranges_on_driver(h.settings.kafka, [(topic, p, 0, e) for p, e in end_offsets(h.settings.kafka, topic).items() if e])
    codec = message_codec("batch_description")
    out: dict[str, list[BatchDescription]] = {}
    for v in raw["value"].to_pylist():
        d = BatchDescription.from_dict(codec.decode(v))
        out.setdefault(d.sink_id, []).append(d)
    return out


def queries(h: Harness) -> dict[str, Any]:
    return {n: f.query for n, f in h.services.fleets.items()}


def test_twenty_sinks_converge_each_to_its_model_at_every_upper(h: Harness, unique_id: str) -> None:
    wait_started(h)
    before = {n: id(q) for n, q in queries(h).items()}
    sinks = [Sink(h, f"{unique_id}-{i}", seed=i) for i in range(20)]
    create_sinks(h, sinks)
    rng = random.Random(7)
    for _ in range(3):
        for s in sinks:
            s.work.step(n=rng.randrange(5, 25), length=rng.randrange(1, 4))
        for s in sinks:
            s.check()
    converge(h, sinks)
    for s in sinks:  # one more step each, after its upper came
        s.work.step(n=rng.randrange(5, 25), length=1)
    converge(h, sinks)
    for s in sinks:
        assert s.seen and s.seen[-1] == s.work.frontier
        Harness.verify_uppers(s.shard, s.work)
    # Mint put on the descriptions it minted at an announced upper what that append added,
    # for the writers to follow without reading the shard's state: the objects of the
    # description before it, each a writer partition's.
    carried = 0
    described = descriptions(h)
    for s in sinks:
        ds = sorted(described[s.sid], key=lambda d: d.lower_time)
        assert ds[0].appended is None  # the first: no append came before it
        for prev, d in zip(ds, ds[1:], strict=False):
            if d.appended is not None:
                carried += 1
                assert (d.appended.lower, d.lower) == (prev.lower, prev.upper)
                assert all(k.startswith(f"{s.shard.prefix}data/") and part_tag(k) in ((0, 2), (1, 2))
                           for k in d.appended.parts), d.appended
    assert carried > 0
    # One query per service served them all: none was restarted, none added.
    assert {n: id(q) for n, q in queries(h).items()} == before
    assert sum(f.restarts for f in h.services.fleets.values()) == 0
    names = sorted(q.name for q in h.services.spark.streams.active)
    assert [n for n in names if any(s.sid in n for s in sinks)] == []
    assert sorted(n.split("-shared")[0] for n in names if "-shared-" in n) == ["append", "mint", "write"]


def test_sinks_join_and_leave_while_the_others_keep_moving(h: Harness, unique_id: str) -> None:
    steady = [Sink(h, f"{unique_id}-a{i}", seed=100 + i) for i in range(3)]
    create_sinks(h, steady)
    for s in steady:
        s.work.step()
    converge(h, steady)
    started = {n: id(q) for n, q in queries(h).items()}

    joining = [Sink(h, f"{unique_id}-b{i}", seed=200 + i) for i in range(2)]
    create_sinks(h, joining)
    catalog = h.settings.catalog()
    leaving = steady[0]
    catalog.drop_sink(leaving.sid)
    h.sinks.remove(leaving.sid)
    others = steady[1:]
    # The others keep moving during the change: each step reaches its shard.
    for _ in range(3):
        for s in others + joining:
            s.work.step(n=10)
        converge(h, others + joining)
    assert {n: id(q) for n, q in queries(h).items()} == started, "expected the same queries, never restarted"
    # The dropped sink left every service, and its state folder went.
    dropped_key = f"{leaving.sid}@"
    deadline = time.monotonic() + DEADLINE_S
    root = h.settings.checkpoint_dir
    import os

    def left() -> bool:
        members = [k for f in h.services.fleets.values() for k in f.members()]
        folders = [n for d in ("write-shared", "mint-shared", "append-shared") if os.path.isdir(f"{root}/{d}")
                   for n in os.listdir(f"{root}/{d}")]
        return not any(k.startswith(dropped_key) for k in members) and not any(n.startswith(f"{leaving.sid}-e") for n in folders)

    while not left():
        assert time.monotonic() < deadline, "expected the dropped sink's membership and state to go"
        time.sleep(POLL_S)
    assert all(s.seen for s in joining)


def test_one_failing_sink_is_held_alone_and_named_while_the_others_converge(h: Harness, unique_id: str) -> None:
    good = [Sink(h, f"{unique_id}-g{i}", seed=300 + i) for i in range(3)]
    bad = Sink(h, f"{unique_id}-bad", seed=399)
    create_sinks(h, good + [bad])
    for s in good + [bad]:
        s.work.step()
    converge(h, good + [bad])
    bad.work.send((1, FAIL_MARK), bad.work.frontier, 1)
    bad.work.producer.advance_to(bad.work.frontier + 1)
    stuck_at = bad.check()
    for _ in range(3):
        for s in good:
            s.work.step(n=10)
        converge(h, good)
    # The failing sink is named, and held where it was.
    sink = h.settings.catalog().state().sinks[bad.sid]
    assert sink_key(sink) in h.services.failing().get("write", {}), h.services.failing()
    # `shardsink status` names it too: its failing input, from the sink's quarantine record.
    failing = quarantine_record(h.settings.store(), bad.sid, sink.epoch)["failing"]
    assert failing is not None and FAIL_MARK in failing["reason"], failing
    assert bad.check() == stuck_at
    assert sum(f.restarts for f in h.services.fleets.values()) == 0
