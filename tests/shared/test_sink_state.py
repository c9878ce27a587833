"""The mint / write / append state machines: unit tests and an in-memory simulation.

The simulation drives MintState, WriteState and AppendState with a trivial in-memory shard
(batches of updates + an upper + compare-and-append with idempotency tokens) under random
interleavings and random re-deliveries of control messages, and checks after every append
made by the sink that the shard equals the desired collection accumulated below its upper.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from shared.correction import Correction
from shared.desired import row_partition
from shared.errors import InvalidUsageError, SinkProtocolError
from shared.frontier import Frontier
from shared.append_state import (
    AppendAction,
    AppendState,
    Committed,
    DeleteStaged,
    EnsureUpperAtLeast,
    PublishUpper,
    ReadyToAppend,
    UpperMismatch,
)
from shared.sink_messages import BatchDescription, BatchReport
from shared.write_state import (
    Idle,
    NothingToWrite,
    Skip,
    Stage,
    Wait,
    WriteState,
    error_key,
    error_partition,
)
from shared.mint_state import MintState

SINK = "s1"


def desc(
    lower: int, upper: int | None, epoch: int = 1, worker: int = 0, parts: int = 2
) -> BatchDescription:
    return BatchDescription(
        sink_id=SINK,
        lower=Frontier.at(lower),
        upper=Frontier.empty() if upper is None else Frontier.at(upper),
        epoch=epoch,
        token=f"{SINK}:{epoch}:{lower}",
        append_worker=worker,
        partition_count=parts,
    )


# -- messages ---------------------------------------------------------------------------------


def test_description_round_trips_and_accepts_ints() -> None:
    d = BatchDescription(SINK, 3, None, epoch=2, token="t", append_worker=1, partition_count=4)  # type: ignore[arg-type]
    assert d.lower == Frontier.at(3) and d.upper.is_empty()
    assert BatchDescription.from_dict(d.to_dict()) == d
    assert d.order_key() == (3, 2)


@pytest.mark.parametrize(
    "kw",
    [
        {"lower": 5, "upper": 5},
        {"lower": 6, "upper": 5},
        {"lower": None, "upper": None},
        {"lower": 1, "upper": 2, "partition_count": 0},
        {"lower": 1, "upper": 2, "token": ""},
    ],
)
def test_invalid_descriptions_are_typed_errors(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"sink_id": SINK, "epoch": 0, "token": "t", **kw}
    with pytest.raises(InvalidUsageError, match="expected"):
        BatchDescription(**args)


def test_report_round_trips_with_schema_field_names() -> None:
    r = BatchReport.for_description(desc(1, 4), 1, {"parts": ["k"]}, rows=3, now_ms=9)
    d = r.to_dict()
    assert d["writer_partition"] == 1 and d["desc_token"] == "s1:1:1" and d["empty"] is False
    assert BatchReport.from_dict(d) == r
    assert BatchReport.for_description(desc(1, 4), 0).empty
    with pytest.raises(InvalidUsageError):
        BatchReport.for_description(desc(1, 4), 2)


def test_error_rows_route_back_to_their_writer_partition() -> None:
    assert error_partition(error_key(3, "bad row: x"), 5) == 3
    assert 0 <= error_partition("no prefix", 5) < 5


# -- mint ---------------------------------------------------------------------------------------


def test_no_description_while_read_only() -> None:
    m = MintState(SINK, epoch=1, partition_count=1, read_only=True)
    m.absorb_desired_progress(0, 10)
    assert m.maybe_mint() is None
    m.allow_writes()
    d = m.maybe_mint()
    assert d is not None and (d.lower, d.upper) == (Frontier.at(0), Frontier.at(10))


def test_mints_only_when_desired_ahead_and_persist_advanced() -> None:
    m = MintState(SINK, epoch=1, partition_count=2)
    m.absorb_desired_progress(0, 5)
    assert m.maybe_mint() is None  # partition 1 holds the desired frontier at 0
    m.absorb_desired_progress(1, 7)
    first = m.maybe_mint()
    assert first is not None and first.upper == Frontier.at(5) and first.partition_count == 2
    m.absorb_desired_progress(0, 9)
    assert m.maybe_mint() is None  # the shard's upper has not moved since
    m.absorb_shard_upper(5)
    second = m.maybe_mint()
    assert second is not None and (second.lower, second.upper) == (Frontier.at(5), Frontier.at(7))
    m.absorb_shard_upper(7)
    m.absorb_shard_upper(6)  # regressions are ignored
    assert m.maybe_mint() is None  # desired (7) is not ahead of persist (7)


def test_lowers_strictly_increase_and_append_workers_round_robin() -> None:
    rng = random.Random(3)
    m = MintState(SINK, epoch=4, partition_count=1, append_workers=3, as_of=2)
    lowers: list[int] = []
    workers: list[int] = []
    desired = upper = 0
    for _ in range(300):
        if rng.random() < 0.5:
            desired += rng.randrange(3)
            m.absorb_desired_progress(0, desired)
        else:
            upper = rng.randint(upper, max(upper, desired))
            m.absorb_shard_upper(upper)
        d = m.maybe_mint()
        if d is not None:
            assert d.lower.time is not None
            lowers.append(d.lower.time)
            workers.append(d.append_worker)
    assert len(lowers) > 10
    assert lowers[0] >= 2  # as_of
    assert all(a < b for a, b in zip(lowers, lowers[1:]))
    assert workers == [i % 3 for i in range(len(workers))]


def test_restarted_minter_may_reuse_a_lower_with_a_new_identity() -> None:
    a = MintState(SINK, epoch=1, partition_count=1)
    b = MintState(SINK, epoch=2, partition_count=1)
    for m in (a, b):
        m.absorb_desired_progress(0, 4)
    da, db = a.maybe_mint(), b.maybe_mint()
    assert da is not None and db is not None
    assert da.lower == db.lower and da.token != db.token and db.order_key() > da.order_key()


# -- write --------------------------------------------------------------------------------------


def writer(partition: int = 0, parts: int = 1, upper: int = 0) -> WriteState:
    w = WriteState(SINK, partition, parts)
    w.absorb_persist_snapshot(upper, [], [])
    return w


def test_writer_writes_when_persist_and_desired_are_complete() -> None:
    w = writer()
    w.absorb_desired_updates([b"a", b"b"], [1, 3], [1, 1])
    d = desc(0, 3, parts=1)
    assert isinstance(w.maybe_write(d), Wait)  # desired frontier 0 < upper 3
    w.absorb_desired_progress(3)
    out = w.maybe_write()
    assert isinstance(out, Stage)
    assert out.updates.to_list() == [(b"a", 1, 1)]
    assert out.report("h").staged == "h" and out.report("h").rows == 1
    assert isinstance(w.maybe_write(), Idle)  # consumed: written once
    assert isinstance(w.maybe_write(d), Idle)  # a re-delivery is ignored


def test_writer_reports_nothing_to_write() -> None:
    w = writer()
    w.absorb_desired_progress(5)
    out = w.maybe_write(desc(0, 5, parts=1))
    assert isinstance(out, NothingToWrite)
    rep = out.report()
    assert rep.empty and rep.partition == 0 and rep.desc_token == "s1:1:0"


def test_writer_skips_outdated_descriptions() -> None:
    w = writer(upper=0)
    w.absorb_desired_progress(10)
    w.absorb_persist_batch(0, 4, [b"x"], [2], [1])
    out = w.maybe_write(desc(2, 8, parts=1))
    assert isinstance(out, Skip)
    # A held description becomes outdated when the shard moves past its lower.
    assert isinstance(w.maybe_write(desc(5, 9, parts=1)), Wait)
    w.absorb_persist_batch(4, 6)
    assert isinstance(w.maybe_write(), Idle)
    assert w.description is None


def test_writer_waits_for_the_shard_to_reach_lower() -> None:
    w = writer(upper=0)
    w.absorb_desired_updates([b"a"], [7])
    w.absorb_desired_progress(10)
    assert isinstance(w.maybe_write(desc(5, 9, parts=1)), Wait)
    w.absorb_persist_batch(0, 5)  # e.g. the appender's bump to the first lower
    out = w.maybe_write()
    assert isinstance(out, Stage) and out.updates.to_list() == [(b"a", 7, 1)]


def test_writer_keeps_the_newest_description() -> None:
    w = writer()
    w.absorb_desired_progress(10)
    assert w.absorb_description(desc(0, 4, epoch=1, parts=1))
    assert w.absorb_description(desc(0, 6, epoch=2, parts=1))  # a restarted minter's
    assert not w.absorb_description(desc(0, 4, epoch=1, parts=1))  # re-delivered old one
    out = w.maybe_write()
    assert isinstance(out, NothingToWrite) and out.desc.epoch == 2


def test_writer_needs_its_snapshot_before_writing() -> None:
    w = WriteState(SINK, 0, 1)
    w.absorb_desired_progress(5)
    assert isinstance(w.maybe_write(desc(0, 5, parts=1)), Wait)
    w.begin_persist_snapshot(0)
    assert isinstance(w.maybe_write(), Wait)
    w.end_persist_snapshot()
    assert isinstance(w.maybe_write(), NothingToWrite)
    with pytest.raises(SinkProtocolError):
        w.begin_persist_snapshot(3)


def test_read_back_cancels_and_is_idempotent() -> None:
    w = writer(upper=0)
    w.absorb_desired_updates([b"a", b"b"], [0, 1])
    w.absorb_desired_progress(2)
    out = w.maybe_write(desc(0, 2, parts=1))
    assert isinstance(out, Stage)
    assert w.absorb_persist_batch(0, 2, [b"a", b"b"], [0, 1], [1, 1])
    assert not w.absorb_persist_batch(0, 2, [b"a", b"b"], [0, 1], [1, 1])  # re-delivered
    assert w.correction.contents().is_empty()
    with pytest.raises(SinkProtocolError, match="expected a read-back batch starting"):
        w.absorb_persist_batch(3, 4)


def test_junk_in_the_shard_is_corrected() -> None:
    w = WriteState(SINK, 0, 1)
    w.absorb_persist_snapshot(3, [b"junk", b"a"], [1, 2], [1, 1])
    w.absorb_desired_updates([b"a", b"b"], [0, 0])
    w.absorb_desired_progress(6)
    out = w.maybe_write(desc(3, 6, parts=1))
    assert isinstance(out, Stage)
    assert out.updates.to_list() == [(b"b", 3, 1), (b"junk", 3, -1)]


def test_a_contract_violation_names_the_update_it_was() -> None:
    w = writer(partition=1, parts=2)
    w.absorb_desired_progress(5)
    described: list[int] = []

    def describe(i: int) -> str:
        described.append(i)
        return f"update at t/1@{40 + i}, diff {[1, -1, 1][i]}: row r{i}"

    assert w.absorb_desired_updates([b"ok", b"late", b"late2"], [6, 2, 4], [1, -1, 1], describe=describe) == 2
    assert described == [1, 2]  # only the violations are described
    w.absorb_desired_progress(8)
    out = w.maybe_write(desc(0, 8, parts=2))
    assert isinstance(out, Stage)
    assert sorted((k.decode(), t, d) for k, t, d in out.errors.to_list()) == [
        ("partition 1: expected an update at a time beyond the partition's progress {5}, found one at time 2 "
         "(update at t/1@41, diff -1: row r1)", 2, 1),
        ("partition 1: expected an update at a time beyond the partition's progress {5}, found one at time 4 "
         "(update at t/1@42, diff 1: row r2)", 4, 1),
    ]


def test_contract_violations_and_bad_rows_go_to_the_error_collection() -> None:
    w = writer(partition=1, parts=2)
    w.absorb_desired_progress(5)
    assert w.absorb_desired_updates([b"late", b"ok"], [2, 6]) == 1
    w.absorb_desired_error("cannot decode offset 17", 7)
    w.absorb_desired_progress(8)
    out = w.maybe_write(desc(0, 8, parts=2))
    assert isinstance(out, Stage)
    assert out.updates.to_list() == [(b"ok", 6, 1)]
    errors = [(k.decode(), t, d) for k, t, d in out.errors.to_list()]
    assert errors == [
        ("partition 1: cannot decode offset 17", 7, 1),
        (
            "partition 1: expected an update at a time beyond the partition's progress {5}, "
            "found one at time 2",
            2,
            1,
        ),
    ]
    assert w.contract_violations == 1 and w.decode_errors == 1
    assert all(error_partition(k.decode(), 2) == 1 for k in out.errors.keys.to_pylist())


# -- append -------------------------------------------------------------------------------------


def ready(actions: list[AppendAction]) -> ReadyToAppend | None:
    out = [a for a in actions if isinstance(a, ReadyToAppend)]
    assert len(out) <= 1
    return out[0] if out else None


def deleted(actions: list[AppendAction]) -> list[Any]:
    return [h for a in actions if isinstance(a, DeleteStaged) for h in a.staged]


def test_append_waits_for_every_partition() -> None:
    app = AppendState(SINK, 0)
    d = desc(0, 5, parts=3)
    acts = app.absorb_description(d)
    assert [type(a) for a in acts] == [EnsureUpperAtLeast]
    acts = app.absorb_shard_upper(0)
    assert ready(acts) is None
    assert ready(app.absorb_report(BatchReport.for_description(d, 0, "h0"))) is None
    assert ready(app.absorb_report(BatchReport.for_description(d, 2))) is None
    assert ready(app.absorb_report(BatchReport.for_description(d, 0, "h0"))) is None  # dup
    r = ready(app.absorb_report(BatchReport.for_description(d, 1, "h1")))
    assert r is not None and r.staged == ("h0", "h1") and r.desc == d
    with pytest.raises(SinkProtocolError, match="append in flight"):
        app.absorb_report(BatchReport.for_description(d, 1, "h1"))
    acts = app.on_append_result(d, Committed(Frontier.at(5)))
    assert acts == [PublishUpper(SINK, Frontier.at(5), d.token)]
    assert app.lower == Frontier.at(5)
    # A re-delivered report of the committed description is never deleted.
    assert app.absorb_report(BatchReport.for_description(d, 1, "h1")) == []


def test_the_remembered_window_is_bounded_and_an_old_checkpoint_is_cut_down_and_digested() -> None:
    """An appender remembers its last REMEMBER descriptions, appended ones as digests of their
    handles: a restored checkpoint of the older, larger window of whole handles is cut to the
    newest and digested; a re-delivered report of a remembered appended description is still
    never deleted, another report of it still is."""
    from shared.append_state import REMEMBER

    app = AppendState(SINK, 0)
    n = REMEMBER + 40
    for i in range(n):
        d = desc(i, i + 1, parts=1)
        app.absorb_description(d)
        app.absorb_shard_upper(i)
        r = ready(app.absorb_report(BatchReport.for_description(d, 0, f"h{i}")))
        assert r is not None and r.staged == (f"h{i}",)
        app.on_append_result(d, Committed(Frontier.at(i + 1)))
    cp = app.checkpoint()
    assert len(cp["seen"]) == len(cp["appended"]) == REMEMBER
    assert all(re.fullmatch(r"b2:[0-9a-f]{24}", h) for _, hs in cp["appended"] for h in hs)  # digests, not handles
    # the checkpoint of before: a window of 4096, whole handles
    old = {**cp, "seen": [[f"{SINK}:1:{i}", [i, 1], True] for i in range(n)],
           "appended": [[f"{SINK}:1:{i}", [f"h{i}"]] for i in range(n)]}
    back = AppendState.restore(json.loads(json.dumps(old)))
    assert back.checkpoint()["appended"] == cp["appended"] and len(back.checkpoint()["seen"]) == REMEMBER
    last = desc(n - 1, n, parts=1)
    assert back.absorb_report(BatchReport.for_description(last, 0, f"h{n - 1}")) == []  # the committed one: kept
    assert deleted(back.absorb_report(BatchReport.for_description(last, 0, "other"))) == ["other"]
    forgotten = desc(0, 1, parts=1)  # no longer remembered: neither appended nor deleted
    assert back.absorb_report(BatchReport.for_description(forgotten, 0, "late")) == []


def test_reports_may_arrive_before_their_description() -> None:
    app = AppendState(SINK, 0)
    app.absorb_shard_upper(0)
    d = desc(0, 5, parts=2)
    assert app.absorb_report(BatchReport.for_description(d, 0, "h0")) == []
    assert app.absorb_report(BatchReport.for_description(d, 1)) == []
    r = ready(app.absorb_description(d))
    assert r is not None and r.staged == ("h0",)


def test_remint_with_an_old_lower_never_appends_the_old_batches() -> None:
    app = AppendState(SINK, 0)
    app.absorb_shard_upper(0)
    old, new = desc(0, 5, epoch=1, parts=2), desc(0, 7, epoch=2, parts=2)
    app.absorb_description(old)
    app.absorb_report(BatchReport.for_description(old, 0, "old0"))
    # The minter restarted (epoch 2) and minted the same lower again.
    acts = app.absorb_description(new)
    assert deleted(acts) == ["old0"]
    # The old description's remaining report arrives late: deleted, never counted.
    acts = app.absorb_report(BatchReport.for_description(old, 1, "old1"))
    assert deleted(acts) == ["old1"] and ready(acts) is None
    assert app.absorb_description(old) == []  # a re-delivered old description is ignored
    assert ready(app.absorb_report(BatchReport.for_description(new, 0, "new0"))) is None
    r = ready(app.absorb_report(BatchReport.for_description(new, 1, "new1")))
    assert r is not None and r.desc == new and r.staged == ("new0", "new1")
    assert all(rep.desc_token == new.token for rep in r.reports)


def test_upper_mismatch_adopts_the_current_upper() -> None:
    app = AppendState(SINK, 0)
    app.absorb_shard_upper(3)
    d = desc(3, 9, parts=1)
    app.absorb_description(d)
    r = ready(app.absorb_report(BatchReport.for_description(d, 0, "h")))
    assert r is not None
    acts = app.on_append_result(d, UpperMismatch(Frontier.at(6)))
    assert deleted(acts) == ["h"]
    assert PublishUpper(SINK, Frontier.at(6)) in acts
    assert app.lower == Frontier.at(6)
    # The next description starts at the adopted upper.
    nxt = desc(6, 9, epoch=1, parts=1)
    assert ready(app.absorb_description(nxt)) is None
    assert ready(app.absorb_report(BatchReport.for_description(nxt, 0))) is not None


def test_bump_the_shard_upper_to_the_first_lower() -> None:
    app = AppendState(SINK, 0)
    d = desc(10, 12, parts=1)  # as_of 10, shard upper still 0
    acts = app.absorb_description(d)
    assert acts == [EnsureUpperAtLeast(d, Frontier.at(10))]
    app.absorb_shard_upper(10)  # the adapter bumped it
    r = ready(app.absorb_report(BatchReport.for_description(d, 0, "h")))
    assert r is not None
    # The seeds' rule on append: an upper below lower is bumped, then the append retried.
    acts = app.on_append_result(d, UpperMismatch(Frontier.at(4)))
    assert acts == [EnsureUpperAtLeast(d, Frontier.at(10))]
    r = ready(app.absorb_shard_upper(10))
    assert r is not None and r.desc == d


def test_descriptions_of_other_appenders_are_not_appended_or_deleted() -> None:
    app = AppendState(SINK, 1)
    app.absorb_shard_upper(0)
    d = desc(0, 5, worker=0, parts=1)
    assert app.absorb_description(d) == []
    assert app.absorb_report(BatchReport.for_description(d, 0, "h")) == []
    # Moving on past it does not delete the other appender's handles either.
    acts = app.absorb_description(desc(5, 7, worker=1, parts=1))
    assert deleted(acts) == []


def test_a_second_write_of_a_partition_is_deleted() -> None:
    app = AppendState(SINK, 0)
    app.absorb_shard_upper(0)
    d = desc(0, 5, parts=2)
    app.absorb_description(d)
    app.absorb_report(BatchReport.for_description(d, 0, "first"))
    acts = app.absorb_report(BatchReport.for_description(d, 0, "second"))
    assert deleted(acts) == ["second"]


def test_a_second_write_of_a_partition_arriving_after_the_append_is_deleted() -> None:
    # A restarted writer re-wrote a description that the appender had already appended with
    # the first writer's parts: the late parts were never appended and must not be left.
    app = AppendState(SINK, 0)
    app.absorb_shard_upper(0)
    d = desc(0, 5, parts=2)
    app.absorb_description(d)
    app.absorb_report(BatchReport.for_description(d, 0, "first-0"))
    r = ready(app.absorb_report(BatchReport.for_description(d, 1, "first-1")))
    assert r is not None
    app.on_append_result(d, Committed(Frontier.at(5)))
    acts = app.absorb_report(BatchReport.for_description(d, 0, "second-0"))
    acts += app.absorb_report(BatchReport.for_description(d, 1, "first-1"))  # a re-delivery
    assert deleted(acts) == ["second-0"]


def test_conflicting_descriptions_for_one_lower_and_epoch_are_protocol_errors() -> None:
    app = AppendState(SINK, 0)
    app.absorb_description(desc(0, 5))
    other = BatchDescription(SINK, Frontier.at(0), Frontier.at(6), 1, "other", 0, 2)
    with pytest.raises(SinkProtocolError, match="one description per lower and epoch"):
        app.absorb_description(other)


# -- simulation ---------------------------------------------------------------------------------


@dataclass
class SimShard:
    """A shard model: appended batches, an upper, staged handles, idempotency tokens."""

    upper: int = 0
    batches: list[tuple[int, int, list[tuple[bytes, int, int]], list[tuple[bytes, int, int]]]] = (
        field(default_factory=list)
    )
    staged: dict[int, tuple[list[tuple[bytes, int, int]], list[tuple[bytes, int, int]]]] = field(
        default_factory=dict
    )
    committed: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    tokens: set[str] = field(default_factory=set)
    refused_deletes: int = 0
    next_handle: int = 0

    def stage(self, rows: list[tuple[bytes, int, int]], errs: list[tuple[bytes, int, int]]) -> int:
        self.next_handle += 1
        self.staged[self.next_handle] = (rows, errs)
        return self.next_handle

    def compare_and_append(
        self, handles: tuple[int, ...], expected: int, new: Frontier, token: str | None
    ) -> Committed | UpperMismatch:
        assert new.time is not None
        if token is not None and token in self.tokens:
            return Committed(new)
        if self.upper != expected:
            return UpperMismatch(Frontier.at(self.upper))
        rows: list[tuple[bytes, int, int]] = []
        errs: list[tuple[bytes, int, int]] = []
        for h in handles:
            assert h not in self.deleted, "appended a deleted staged batch"
            assert h not in self.committed, "appended a staged batch twice"
            r, e = self.staged[h]
            rows += r
            errs += e
        assert all(expected <= t < new.time for _, t, _ in rows + errs), (
            "times outside [lower, upper)"
        )
        self.batches.append((expected, new.time, rows, errs))
        self.committed.update(handles)
        if token is not None:
            self.tokens.add(token)
        self.upper = new.time
        return Committed(new)

    def delete(self, handles: tuple[int, ...]) -> None:
        for h in handles:
            if h in self.committed:
                self.refused_deletes += 1  # the storage layer protects committed parts
            else:
                self.deleted.add(h)

    def contents(self, errors: bool = False) -> Counter[bytes]:
        acc: Counter[bytes] = Counter()
        for _, _, rows, errs in self.batches:
            for k, _, d in errs if errors else rows:
                acc[k] += d
        return Counter({k: v for k, v in acc.items() if v})


@dataclass
class Upstream:
    """The desired topic: per-partition logs of updates and progress statements."""

    rng: random.Random
    partitions: int
    logs: list[list[tuple[str, Any]]] = field(default_factory=list)
    time: int = 0
    truth: list[tuple[bytes, int, int]] = field(default_factory=list)
    live: Counter[bytes] = field(default_factory=Counter)
    violations: int = 0
    next_key: int = 0

    def __post_init__(self) -> None:
        self.logs = [[] for _ in range(self.partitions)]

    def step(self) -> None:
        rng = self.rng
        for _ in range(rng.randrange(6)):
            t = self.time + rng.randrange(3)  # several times per progress step
            if self.live and rng.random() < 0.4:
                key = rng.choice(sorted(self.live))
                diff = -1
            else:
                key = f"r{self.next_key % 40}".encode()  # keys recur: retractions meet
                self.next_key += 1
                diff = 1
            self.live[key] += diff
            self.live = +self.live
            self.truth.append((key, t, diff))
            self.logs[row_partition(key, self.partitions)].append(("update", (key, t, diff)))
        if self.time > 2 and rng.random() < 0.05:
            # A contract violation: an update below the partition's progress.
            p = rng.randrange(self.partitions)
            self.logs[p].append(("update", (b"late", self.time - 2, 1)))
            self.violations += 1
        self.time += rng.randint(1, 3)
        for log in self.logs:
            log.append(("progress", self.time))

    def truth_below(self, upper: int) -> Counter[bytes]:
        acc: Counter[bytes] = Counter()
        for k, t, d in self.truth:
            if t < upper:
                acc[k] += d
        return Counter({k: v for k, v in acc.items() if v})


class Feed:
    """A consumer's cursor on a list-backed topic, with random re-deliveries."""

    def __init__(
        self, log: list[Any], rng: random.Random, redeliver: float, start: int = 0
    ) -> None:
        self.log, self.rng, self.redeliver, self.pos = log, rng, redeliver, start

    def next(self) -> Any | None:
        if self.pos and self.rng.random() < self.redeliver:
            return self.log[self.rng.randrange(self.pos)]
        if self.pos < len(self.log):
            self.pos += 1
            return self.log[self.pos - 1]
        return None


class Replica:
    """One full sink (mint, writers, appenders) with its own control topics."""

    def __init__(
        self,
        name: str,
        epoch: int,
        shard: SimShard,
        up: Upstream,
        rng: random.Random,
        *,
        appenders: int,
        read_only: bool,
        redeliver: float,
        on_commit: Any,
        as_of: int = 0,
    ) -> None:
        self.name, self.shard, self.up, self.rng = name, shard, up, rng
        self.redeliver, self.on_commit, self.as_of = redeliver, on_commit, as_of
        self.n_appenders = appenders
        self.descs: list[BatchDescription] = []
        self.reports: list[BatchReport] = []
        self.epoch = epoch
        self.read_only = read_only
        self.start_minter()
        self.writers = [self.start_writer(p) for p in range(up.partitions)]
        self.appenders = [self.start_appender(i, 0, 0) for i in range(appenders)]

    # -- restarts -------------------------------------------------------------------------
    def start_minter(self) -> None:
        self.epoch += 10
        self.mint = MintState(
            SINK,
            self.epoch,
            self.up.partitions,
            as_of=self.as_of,
            read_only=self.read_only,
            append_workers=self.n_appenders,
        )
        old_feeds = getattr(self, "mint_feeds", None)
        self.mint_feeds = [Feed(log, self.rng, 0.0) for log in self.up.logs]
        self.mint_ckpt: tuple[str, list[int]] | None = None
        if old_feeds is not None:
            # A restarted minter catches up at once: it re-reads the progress its predecessor
            # had read and the shard's upper, so it re-mints the pending lower right away.
            for p, (new, old) in enumerate(zip(self.mint_feeds, old_feeds)):
                while new.pos < old.pos:
                    msg = new.next()
                    if msg is not None and msg[0] == "progress":
                        self.mint.absorb_desired_progress(p, msg[1])
            self.mint.absorb_shard_upper(self.shard.upper)

    def restart_minter_from_checkpoint(self) -> None:
        """A restarted minter as the service runs it: a new epoch, the desired progress of
        its last committed micro-batch restored, its feeds resumed at that batch's offsets
        (what it had read after them, uncommitted, is read again)."""
        ckpt = self.mint_ckpt
        self.epoch += 10
        self.mint = MintState(
            SINK, self.epoch, self.up.partitions, as_of=self.as_of, read_only=self.read_only,
            append_workers=self.n_appenders,
        )
        positions = [0] * len(self.up.logs)
        if ckpt is not None:
            self.mint.restore(json.loads(ckpt[0]))
            positions = ckpt[1]
        self.mint_feeds = [Feed(log, self.rng, 0.0, start=pos) for log, pos in zip(self.up.logs, positions)]
        self.mint_ckpt = ckpt

    def restart_appender_from_checkpoint(self, i: int) -> None:
        """A restarted appender as the service runs it: the state of its last committed
        micro-batch, its feeds resumed at that batch's offsets."""
        ckpt = self.appenders[i].get("ckpt")
        if ckpt is None:
            self.appenders[i] = self.start_appender(i, 0, 0)
            return
        state, descs_pos, reports_pos = ckpt
        ap = self.start_appender(i, descs_pos, reports_pos)
        ap["state"] = AppendState.restore(json.loads(state))
        ap["ckpt"] = ckpt
        self.appenders[i] = ap

    def start_writer(self, p: int) -> dict[str, Any]:
        w = WriteState(
            SINK,
            p,
            self.up.partitions,
            correction=Correction(chunk_target=8, min_stage=4),
            errors=Correction(chunk_target=8, min_stage=4),
        )
        n = self.up.partitions
        w.begin_persist_snapshot(self.shard.upper)
        for _, _, rows, errs in self.shard.batches:
            mine = [r for r in rows if row_partition(r[0], n) == p]
            my_errs = [e for e in errs if error_partition(e[0].decode(), n) == p]
            w.absorb_persist_snapshot_part(
                [k for k, _, _ in mine],
                [t for _, t, _ in mine],
                [d for _, _, d in mine],
                error_keys=[k for k, _, _ in my_errs],
                error_times=[t for _, t, _ in my_errs],
                error_diffs=[d for _, _, d in my_errs],
            )
        w.end_persist_snapshot()
        return {
            "state": w,
            "desired": Feed(self.up.logs[p], self.rng, 0.0),
            "listen": Feed(
                self.shard.batches, self.rng, self.redeliver, start=len(self.shard.batches)
            ),
            "descs": Feed(self.descs, self.rng, self.redeliver),
        }

    def start_appender(self, i: int, descs_from: int, reports_from: int) -> dict[str, Any]:
        return {
            "state": AppendState(SINK, i),
            "descs": Feed(self.descs, self.rng, self.redeliver, start=descs_from),
            "reports": Feed(self.reports, self.rng, self.redeliver, start=reports_from),
        }

    # -- steps ----------------------------------------------------------------------------
    def step(self) -> None:
        rng = self.rng
        x = rng.random()
        if x < 0.2:
            self.step_mint()
        elif x < 0.7:
            self.step_writer(rng.choice(self.writers))
        else:
            self.step_appender(rng.choice(self.appenders))

    def step_mint(self) -> None:
        m = self.mint
        if self.rng.random() < 0.5:
            m.absorb_shard_upper(self.shard.upper)  # read from the shard itself
        else:
            p = self.rng.randrange(len(self.mint_feeds))
            for _ in range(4):
                msg = self.mint_feeds[p].next()
                if msg is not None and msg[0] == "progress":
                    m.absorb_desired_progress(p, msg[1])
        d = m.maybe_mint()
        if d is not None:
            self.descs.append(d)
        if self.rng.random() < 0.8:  # the micro-batch commits (else a crash would replay it)
            self.mint_ckpt = (json.dumps(m.checkpoint()), [f.pos for f in self.mint_feeds])

    def step_writer(self, wr: dict[str, Any]) -> None:
        w: WriteState = wr["state"]
        x = self.rng.random()
        if x < 0.5:
            for _ in range(3):
                msg = wr["desired"].next()
                if msg is None:
                    break
                if msg[0] == "progress":
                    w.absorb_desired_progress(msg[1])
                else:
                    k, t, d = msg[1]
                    w.absorb_desired_updates([k], [t], [d])
        elif x < 0.8:
            b = wr["listen"].next()
            if b is not None:
                lower, upper, rows, errs = b
                n = self.up.partitions
                mine = [r for r in rows if row_partition(r[0], n) == w.partition]
                my_errs = [e for e in errs if error_partition(e[0].decode(), n) == w.partition]
                w.absorb_persist_batch(
                    lower,
                    upper,
                    [k for k, _, _ in mine],
                    [t for _, t, _ in mine],
                    [d for _, _, d in mine],
                    error_keys=[k for k, _, _ in my_errs],
                    error_times=[t for _, t, _ in my_errs],
                    error_diffs=[d for _, _, d in my_errs],
                )
        else:
            d = wr["descs"].next()
            if d is not None:
                w.absorb_description(d)
        out = w.maybe_write()
        if isinstance(out, Stage):
            handle = self.shard.stage(out.updates.to_list(), out.errors.to_list())
            self.reports.append(out.report(handle))
        elif isinstance(out, NothingToWrite):
            self.reports.append(out.report())

    def step_appender(self, ap: dict[str, Any]) -> None:
        a: AppendState = ap["state"]
        x = self.rng.random()
        if x < 0.45:
            d = ap["descs"].next()
            acts = a.absorb_description(d) if d is not None else []
        elif x < 0.9:
            r = ap["reports"].next()
            acts = a.absorb_report(r) if r is not None else []
        else:
            acts = a.absorb_shard_upper(self.shard.upper)
        self.run(a, acts)
        if self.rng.random() < 0.8:  # the micro-batch commits (else a crash would replay it)
            ap["ckpt"] = (json.dumps(a.checkpoint()), ap["descs"].pos, ap["reports"].pos)

    def run(self, a: AppendState, acts: list[AppendAction]) -> None:
        """The append adapter: carry out the decisions against the shard."""
        queue = list(acts)
        while queue:
            act = queue.pop(0)
            if isinstance(act, EnsureUpperAtLeast):
                lower = act.lower.time
                assert lower is not None
                while self.shard.upper < lower:
                    self.shard.compare_and_append((), self.shard.upper, act.lower, None)
                queue += a.absorb_shard_upper(self.shard.upper)
            elif isinstance(act, ReadyToAppend):
                d = act.desc
                fresh = d.token not in self.shard.tokens
                outcome = self.shard.compare_and_append(act.staged, d.lower_time, d.upper, d.token)
                if fresh and isinstance(outcome, Committed):
                    self.on_commit(self.name, d)
                queue += a.on_append_result(d, outcome)
            elif isinstance(act, DeleteStaged):
                self.shard.delete(act.staged)
            elif isinstance(act, PublishUpper):
                pass  # frontiers: the minter reads the shard's upper directly here


def simulate(
    seed: int,
    *,
    partitions: int = 3,
    replicas: int = 1,
    appenders: int = 2,
    redeliver: float = 0.1,
    junk: float = 0.0,
    restarts: float = 0.0,
    restart_kinds: tuple[str, ...] = ("mint", "write"),
    as_of: int = 0,
    steps: int = 30,
    upstream_rate: float = 0.04,
) -> dict[str, int]:
    rng = random.Random(seed)
    shard = SimShard()
    up = Upstream(rng, partitions)
    checks = {"commits": 0, "junk": 0, "restarts": 0}
    appender_restarts = "append" in restart_kinds or "append-checkpoint" in restart_kinds

    def on_commit(name: str, d: BatchDescription) -> None:
        # After each upper advance made by the sink: the shard equals the desired
        # collection accumulated below the upper.
        assert d.upper.time is not None
        if d.upper.time > as_of:
            assert shard.contents() == up.truth_below(d.upper.time), (name, d)
        checks["commits"] += 1

    reps = [
        Replica(
            f"r{i}",
            epoch=i,
            shard=shard,
            up=up,
            rng=rng,
            appenders=appenders,
            read_only=(i > 0),
            redeliver=redeliver,
            on_commit=on_commit,
            as_of=as_of,
        )
        for i in range(replicas)
    ]
    produced = 0
    for _ in range(50_000):
        if produced < steps and rng.random() < upstream_rate:
            up.step()
            produced += 1
        if replicas > 1 and reps[1].mint.read_only and rng.random() < 0.01:
            reps[1].read_only = False
            reps[1].mint.allow_writes()
        if junk and rng.random() < junk and shard.upper + 1 < up.time and shard.upper >= as_of:
            victim = rng.choice(sorted(up.truth_below(shard.upper)) or [b"r0"])
            rows = [(b"junk", shard.upper, 1), (victim, shard.upper, -1)]
            shard.batches.append((shard.upper, shard.upper + 1, rows, []))
            shard.upper += 1
            checks["junk"] += 1
        r = rng.choice(reps)
        if restarts and produced < steps and rng.random() < restarts:
            what = rng.choice(restart_kinds)
            checks["restarts"] += 1
            if what == "mint":
                r.start_minter()
            elif what == "mint-checkpoint":
                r.restart_minter_from_checkpoint()
            elif what == "append-checkpoint":
                r.restart_appender_from_checkpoint(rng.randrange(len(r.appenders)))
            elif what == "write":
                p = rng.randrange(partitions)
                r.writers[p] = r.start_writer(p)
            else:
                i = rng.randrange(len(r.appenders))
                old = r.appenders[i]
                r.appenders[i] = r.start_appender(
                    i, rng.randint(0, old["descs"].pos), rng.randint(0, old["reports"].pos)
                )
        r.step()
        if (
            produced >= steps
            and shard.upper >= up.time
            and all(not rep.mint.read_only for rep in reps)
        ):
            break
    assert produced == steps
    assert shard.upper >= up.time, f"stuck at upper {shard.upper} < desired {up.time}"
    assert shard.contents() == up.truth_below(shard.upper)
    errors = shard.contents(errors=True)
    assert sum(errors.values()) == up.violations
    assert all(k.startswith(b"partition ") for k in errors)
    if not appender_restarts:
        assert shard.refused_deletes == 0, "asked to delete parts of a committed batch"
    # Every staged batch is either committed or deleted, except those still held.
    return checks


@pytest.mark.parametrize("seed", range(12))
def test_simulation_contents_follow_desired(seed: int) -> None:
    checks = simulate(seed, redeliver=0.15)
    assert checks["commits"] > 0


@pytest.mark.parametrize("seed", range(8))
def test_simulation_corrects_junk_injected_into_the_shard(seed: int) -> None:
    checks = simulate(100 + seed, junk=0.01)
    assert checks["commits"] > 0


@pytest.mark.parametrize("seed", range(8))
def test_simulation_two_replicas_racing_give_no_doubled_data(seed: int) -> None:
    checks = simulate(200 + seed, replicas=2, junk=0.005)
    assert checks["commits"] > 0


@pytest.mark.parametrize("seed", range(8))
def test_simulation_survives_restarts_of_mint_and_write(seed: int) -> None:
    simulate(300 + seed, restarts=0.01, redeliver=0.1)


@pytest.mark.parametrize("seed", range(6))
def test_simulation_survives_appender_restarts(seed: int) -> None:
    simulate(400 + seed, restarts=0.01, restart_kinds=("mint", "write", "append"), replicas=2)


@pytest.mark.parametrize("seed", range(8))
def test_simulation_survives_restarts_from_checkpointed_driver_state(seed: int) -> None:
    # Mint and append restarted as the services do: from the state saved with their last
    # committed micro-batch, resuming their topics at that batch's offsets (a re-run of the
    # uncommitted work included), never from the topics' start.
    checks = simulate(
        700 + seed, restarts=0.02, restart_kinds=("mint-checkpoint", "append-checkpoint", "write"),
        replicas=2, redeliver=0.1,
    )
    assert checks["restarts"] > 0 and checks["commits"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_simulation_appender_restarts_from_checkpoint_alone_lose_nothing(seed: int) -> None:
    # No re-deliveries and no minter restart to paper over a lost description: what the
    # appender knew must come back from its checkpoint, or the sink stalls.
    checks = simulate(800 + seed, restarts=0.03, restart_kinds=("append-checkpoint",), redeliver=0.0)
    assert checks["restarts"] > 0 and checks["commits"] > 0


def test_checkpoints_of_mint_and_append_round_trip_through_json() -> None:
    m = MintState(SINK, 5, 3)
    m.absorb_desired_progress(0, 40)
    m.absorb_desired_progress(2, None)  # the empty frontier
    m2 = MintState(SINK, 6, 4)
    m2.restore(json.loads(json.dumps(m.checkpoint())))
    assert [m2.desired.progress(p) for p in range(4)] == [Frontier.at(40), Frontier.minimum(), Frontier.empty(), Frontier.minimum()]
    with pytest.raises(InvalidUsageError):
        m2.restore({"v": 2})

    a = AppendState(SINK, 0)
    d = BatchDescription(SINK, Frontier.at(0), Frontier.at(10), epoch=1, token="t1", partition_count=2)
    acts = a.absorb_description(d)
    assert acts == [EnsureUpperAtLeast(d, Frontier.at(0))]
    assert a.absorb_shard_upper(Frontier.at(0)) == [PublishUpper(SINK, Frontier.at(0), None)]
    r0 = BatchReport.for_description(d, 0, staged='{"k":"a"}', rows=3)
    assert a.absorb_report(r0) == []
    pending = BatchReport(SINK, "t2", 1, Frontier.at(10), Frontier.at(20), 1, 2, staged="x")
    assert a.absorb_report(pending) == []
    b = AppendState.restore(json.loads(json.dumps(a.checkpoint())))
    assert b.checkpoint() == a.checkpoint()
    # The restored appender completes the description exactly as the original would.
    r1 = BatchReport.for_description(d, 1, staged=None)
    got, want = b.absorb_report(r1), a.absorb_report(r1)
    assert got == want and len(got) == 1 and isinstance(got[0], ReadyToAppend)
    assert got[0].staged == ('{"k":"a"}',)


@pytest.mark.parametrize("seed", range(8))
def test_simulation_reminted_descriptions_never_mix_batches(seed: int) -> None:
    # A minter restarted often re-mints descriptions with lowers already minted; reports of
    # the old epochs arrive late and re-delivered; contents must stay exact.
    checks = simulate(600 + seed, restarts=0.03, restart_kinds=("mint",), redeliver=0.2)
    assert checks["restarts"] > 0


@pytest.mark.parametrize("seed", range(4))
def test_simulation_with_as_of_beyond_the_shard_upper(seed: int) -> None:
    simulate(500 + seed, as_of=6)


# -- the write state's checkpoint ---------------------------------------------------------------


def _write_state_with_everything() -> WriteState:
    """A write state with a correction buffer, error rows and a staged batch of each."""
    ws = WriteState("s", 1, 3)
    ws.absorb_persist_snapshot(0, [b"old"], [1])
    ws.absorb_desired_progress(0)
    ws.absorb_desired_updates([b"a", b"b", b"c"], [2, 3, 12], [1, 2, -1])
    ws.absorb_desired_error("bad row", 4)
    ws.absorb_desired_progress(10)
    desc = BatchDescription("s", Frontier.at(0), Frontier.at(10), 7, "tok", partition_count=3)
    upd, errs = ws.correction.updates_before(10), ws.errors.updates_before(10)
    ws.remember_staged(desc, ["shards/x/data/p-w1of3.parquet"], Stage(desc, 1, upd, errs))
    return ws


def _state_summary(ws: WriteState) -> tuple[Any, ...]:
    staged = {sid: (str(up), u.to_list(), e.to_list()) for sid, (up, u, e) in ws._staged.items()}
    return (ws.correction.contents().to_list(), ws.errors.contents().to_list(), staged,
            dict(ws._staged_parts), str(ws.desired_frontier), str(ws.persist_frontier), ws.correction.since)


def test_a_write_state_checkpoint_restores_every_buffer_and_staged_batch() -> None:
    import pyarrow as pa

    ws = _write_state_with_everything()
    blob = ws.to_checkpoint()
    restored = WriteState.from_checkpoint(blob)
    assert _state_summary(restored) == _state_summary(ws)
    # Every buffer, as it was absorbed (not only equal to the original: both could be empty).
    assert restored.correction.contents().to_list() == [(b"a", 2, 1), (b"b", 3, 2), (b"c", 12, -1), (b"old", 1, -1)]
    assert restored.errors.contents().to_list() == [(b"partition 1: bad row", 4, 1)]
    (sid, (upper, staged, staged_errors)), = restored._staged.items()
    assert sid == "shards/x/data/p-w1of3.parquet" and upper == Frontier.at(10)
    assert staged.to_list() == [(b"a", 2, 1), (b"b", 3, 2), (b"old", 1, -1)]
    assert staged_errors.to_list() == [(b"partition 1: bad row", 4, 1)]
    # Which buffer a row belongs to is written once per buffer (a dictionary), not per row.
    table = pa.ipc.open_stream(pa.py_buffer(blob)).read_all()
    assert pa.types.is_dictionary(table["which"].type)
    assert sorted(table["which"].combine_chunks().dictionary.to_pylist()) == sorted(
        ["c", "e"] + [f"{k}:{sid}" for sid in ws._staged for k in ("su", "se")])
    # An empty state round-trips too.
    empty = WriteState("s", 0, 3)
    assert _state_summary(WriteState.from_checkpoint(empty.to_checkpoint())) == _state_summary(empty)


def test_a_write_state_checkpoint_of_the_earlier_format_still_loads() -> None:
    """Checkpoints written before ``which`` became a dictionary column (a string per row)
    load as they are: a writer upgraded in place resumes from its checkpoint."""
    import pyarrow as pa

    ws = _write_state_with_everything()
    table = pa.ipc.open_stream(pa.py_buffer(ws.to_checkpoint())).read_all()
    old = table.set_column(0, pa.field("which", pa.string()), table["which"].cast(pa.string()))
    old = old.replace_schema_metadata(table.schema.metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as w:
        w.write_table(old)
    assert _state_summary(WriteState.from_checkpoint(sink.getvalue().to_pybytes())) == _state_summary(ws)


def test_a_write_state_checkpoint_whose_rows_are_not_grouped_by_buffer_still_loads() -> None:
    """A checkpoint's buffers are read as slices when its rows come buffer after buffer (as
    ``to_checkpoint`` writes them); buffers whose rows are interleaved load the same."""
    import pyarrow as pa

    ws = _write_state_with_everything()
    table = pa.ipc.open_stream(pa.py_buffer(ws.to_checkpoint())).read_all()
    # The buffers' rows interleaved, each buffer's own rows in their order.
    codes = table["which"].combine_chunks().indices.to_pylist()
    runs = [[i for i, c in enumerate(codes) if c == code] for code in sorted(set(codes))]
    order = [run[k] for k in range(max(map(len, runs))) for run in runs if k < len(run)]
    assert len(runs) >= 3 and order != sorted(order)
    shuffled = table.take(pa.array(order))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, shuffled.schema) as w:
        w.write_table(shuffled)
    assert _state_summary(WriteState.from_checkpoint(sink.getvalue().to_pybytes())) == _state_summary(ws)
