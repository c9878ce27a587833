"""A stateful model-based test of a shard on the moto S3 server (issue 2, section 3.2).

hypothesis drives a real :class:`Shard` and a naive reference model side by side: the model is
a list of ``(row, time, diff)`` plus ``upper``, ``since`` and the reader holds. Every answer of
the shard (snapshots, listen events, errors and the frontiers they carry, the state after a
reopen from S3) must equal the model's.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from shared.devstack.embedded import EmbeddedStack
from shared.errors import (
    InvalidUsageError,
    NotReadableYetError,
    SinceViolationError,
    UpperMismatchError,
)
from shared.frontier import Frontier
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.objectstore import ObjectStore
from shared.shard import Shard, StagedBatch
from shared.state import check_invariants, plan_since_merge

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}

# A model update: (("ok", k, v) | ("err", message), time, diff)
Key = tuple[Any, ...]
Update = tuple[Key, int, int]

keys = st.one_of(
    st.tuples(st.just("ok"), st.integers(0, 4), st.sampled_from(["a", "b"])),
    st.tuples(st.just("err"), st.sampled_from(["bad: k", "bad: v"])),
)
diffs = st.sampled_from([-2, -1, 1, 1, 2])


def to_shard_update(u: Update) -> tuple[Any, ...]:
    key, t, d = u
    if key[0] == "ok":
        return ({"k": key[1], "v": key[2]}, t, d)
    return (None, t, d, key[1])


def consolidated(updates: list[Update], pred: Any) -> dict[Key, int]:
    acc: Counter[Key] = Counter()
    for key, t, d in updates:
        if pred(t):
            acc[key] += d
    return {k: v for k, v in acc.items() if v != 0}


def table_to_model(rows: list[dict[str, Any]], with_time: bool = False) -> dict[Key, int]:
    out: dict[Key, int] = {}
    for r in rows:
        key: Key = ("err", r["_error"]) if r["_error"] is not None else ("ok", r["k"], r["v"])
        if with_time:
            key = (*key, r["_time"])
        assert key not in out, f"expected consolidated output, found {key} twice"
        assert r["_diff"] != 0, f"expected no zero diffs, found {r}"
        out[key] = r["_diff"]
    return out


class ShardModel(RuleBasedStateMachine):
    """The real shard (``self.sh``) against the model (``self.updates``, ``self.upper`` ...)."""

    store: ObjectStore  # set by the test function below

    @initialize(since=st.integers(0, 5))
    def create(self, since: int) -> None:
        self.sid = f"model-{uuid.uuid4().hex[:12]}"
        self.sh = Shard.create(self.store, self.sid, SCHEMA, since=since, auto_compact=False)
        self.writers: list[Shard] = []
        self.updates: list[Update] = []
        self.upper = since
        self.since = since
        self.holds: dict[str, int] = {}
        self.readers_registered = 0  # reader ids are never reused (see register_reader)
        self.committed: dict[str, tuple[int, int, list[Update]]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _data_keys(self) -> set[str]:
        return {k for k in self.sh.list_objects() if "/data/" in k}

    def _draw_append(self, data: st.DataObject) -> tuple[int, list[Update]]:
        new = self.upper + data.draw(st.integers(0, 4), label="width")
        if new == self.upper:
            return new, []
        times = st.integers(self.upper, new - 1)
        ups = data.draw(st.lists(st.tuples(keys, times, diffs), max_size=6), label="updates")
        return new, ups

    def _writer(self, i: int) -> Shard:
        while len(self.writers) <= i:
            self.writers.append(Shard.open(self.store, self.sid))
        return self.writers[i]

    def _commit_model(self, token: str, expected: int, new: int, ups: list[Update]) -> None:
        self.updates += ups
        self.upper = new
        self.committed[token] = (expected, new, ups)

    # -- appends ---------------------------------------------------------------------------
    @rule(data=st.data())
    def append_valid(self, data: st.DataObject) -> None:
        new, ups = self._draw_append(data)
        token = uuid.uuid4().hex
        state = self.sh.compare_and_append([to_shard_update(u) for u in ups], self.upper, new, token)
        assert state.upper == Frontier.at(new)
        rec = state.find_token(token)
        assert rec is not None and rec.expected_upper.time == self.upper and rec.new_upper.time == new
        self._commit_model(token, self.upper, new, ups)

    @rule(data=st.data(), delta=st.integers(-3, 3).filter(lambda d: d != 0))
    def append_with_wrong_expected_upper(self, data: st.DataObject, delta: int) -> None:
        expected = self.upper + delta
        if expected < 0:
            return
        new = expected + data.draw(st.integers(1, 3))
        ups: list[Update] = data.draw(st.lists(st.tuples(keys, st.integers(expected, new - 1), diffs), max_size=4))
        before_seqno = self.sh.refresh().seqno
        before_data = self._data_keys()
        with pytest.raises(UpperMismatchError) as err:
            self.sh.compare_and_append([to_shard_update(u) for u in ups], expected, new)
        assert err.value.current == Frontier.at(self.upper)
        assert err.value.expected == Frontier.at(expected)
        assert self.sh.refresh().seqno == before_seqno
        assert self._data_keys() == before_data, "a refused append must leave no data objects"

    @rule(data=st.data(), below=st.booleans())
    def append_with_times_outside_the_range(self, data: st.DataObject, below: bool) -> None:
        new = self.upper + data.draw(st.integers(1, 3))
        if below and self.upper > 0:
            bad = data.draw(st.integers(0, self.upper - 1))
        else:
            bad = data.draw(st.integers(new, new + 3))
        good: list[Update] = data.draw(st.lists(st.tuples(keys, st.integers(self.upper, new - 1), diffs), max_size=3))
        ups = good + [(("ok", 0, "a"), bad, 1)]
        before_seqno = self.sh.refresh().seqno
        before_data = self._data_keys()
        with pytest.raises(InvalidUsageError):
            self.sh.compare_and_append([to_shard_update(u) for u in ups], self.upper, new)
        assert self.sh.refresh().seqno == before_seqno
        assert self._data_keys() == before_data, "an invalid append must write nothing"

    @rule(data=st.data(), n_writers=st.integers(1, 3), mismatch=st.booleans())
    def append_staged_from_several_writers(self, data: st.DataObject, n_writers: int, mismatch: bool) -> None:
        new, ups = self._draw_append(data)
        if new == self.upper:
            new += 1
        shares: list[list[Update]] = [[] for _ in range(n_writers)]
        for u in ups:
            shares[data.draw(st.integers(0, n_writers - 1), label="writer")].append(u)
        # Each writer stages its share on its own handle; the handles cross "Kafka" as JSON.
        handles = [
            StagedBatch.from_json(json.loads(json.dumps(self._writer(i).stage([to_shard_update(u) for u in share]).to_json())))
            for i, share in enumerate(shares)
        ]
        token = uuid.uuid4().hex
        if mismatch and self.upper > 0:
            # Times stay within [expected, new): only the expected upper is wrong.
            with pytest.raises(UpperMismatchError) as err:
                self.sh.compare_and_append_staged(handles, self.upper - 1, new, token)
            assert err.value.current == Frontier.at(self.upper)
            staged_keys = {p.key for h in handles for p in h.parts}
            self.sh.delete_staged(handles)
            assert not staged_keys & self._data_keys()
            return
        state = self.sh.compare_and_append_staged(handles, self.upper, new, token)
        assert state.upper == Frontier.at(new)
        self._commit_model(token, self.upper, new, ups)

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def retry_with_the_same_token_is_not_applied_twice(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.committed)), label="token")
        expected, new, ups = self.committed[token]
        before = self.sh.refresh()
        state = self.sh.compare_and_append([to_shard_update(u) for u in ups], expected, new, token)
        after = self.sh.refresh()
        assert state.find_token(token) is not None
        assert after.upper == Frontier.at(self.upper)
        assert after.appends == before.appends
        assert after.batches == before.batches

    # -- compaction and gc -----------------------------------------------------------------
    @rule()
    def compact(self) -> None:
        before = self.sh.refresh()
        self.sh.compact()
        after = self.sh.refresh()
        assert len(after.batches) <= len(before.batches)

    @rule()
    def compact_below_since(self) -> None:
        self.sh.compact_below_since()
        state = self.sh.refresh()
        below = [b for b in state.batches if b.upper.less_equal(state.since)]
        assert len(below) <= 1

    @rule()
    def compact_since_moved(self) -> None:
        before = self.sh.refresh()
        plan = plan_since_merge(before)
        merged = self.sh.compact_since_moved()
        after = self.sh.refresh()
        assert merged == (plan is not None)
        if plan is not None:  # the run became one batch at since (none if it all cancelled)
            start, end = plan
            assert after.batches[:start] == before.batches[:start]
            if len(after.batches) == len(before.batches) - (end - start):
                assert after.batches[start:] == before.batches[end:]
            else:
                assert after.batches[start + 1 :] == before.batches[end:]
                assert after.batches[start].since == before.since
        else:
            assert after.batches == before.batches

    @rule()
    def gc_without_grace_keeps_everything_referenced(self) -> None:
        self.sh.gc(grace_ms=0)
        head = self.sh.refresh()
        assert self._data_keys() == head.referenced_keys()

    # -- readers and since -----------------------------------------------------------------
    @rule(kind=st.sampled_from(["critical", "leased"]))
    def register_reader(self, kind: str) -> None:
        # A fresh id: ``len(self.holds)`` falls back after a release and named a live reader,
        # whose re-registration keeps its downgraded hold, not the model's since.
        rid = f"r{self.readers_registered}-{kind}"
        self.readers_registered += 1
        state = self.sh.register_reader(rid, kind=kind, lease_ms=3_600_000)
        self.holds[rid] = self.since
        hold = state.reader(rid)
        assert hold is not None and hold.since == Frontier.at(self.since)

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def downgrade_since(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.holds)), label="reader")
        t = data.draw(st.integers(0, self.upper), label="new_since")
        self.sh.downgrade_since(rid, t)
        self.holds[rid] = max(self.holds[rid], t)
        self.since = max(self.since, min(self.holds.values()))

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def release_reader(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.holds)), label="reader")
        self.sh.expire_reader(rid)
        del self.holds[rid]
        if self.holds:
            self.since = max(self.since, min(self.holds.values()))

    # -- reads -----------------------------------------------------------------------------
    @precondition(lambda self: self.upper > self.since)
    @rule(data=st.data())
    def snapshot_at_a_valid_time(self, data: st.DataObject) -> None:
        as_of = data.draw(st.integers(self.since, self.upper - 1), label="as_of")
        got = table_to_model(self.sh.snapshot(as_of).to_pylist())
        assert got == consolidated(self.updates, lambda t: t <= as_of)

    @precondition(lambda self: self.since > 0)
    @rule(data=st.data())
    def snapshot_below_since_is_refused(self, data: st.DataObject) -> None:
        as_of = data.draw(st.integers(0, self.since - 1), label="as_of")
        with pytest.raises(SinceViolationError) as err:
            self.sh.snapshot(as_of)
        assert err.value.since == Frontier.at(self.since)

    @rule(ahead=st.integers(0, 3))
    def snapshot_at_or_beyond_upper_is_not_readable_yet(self, ahead: int) -> None:
        as_of = max(self.upper, self.since) + ahead
        with pytest.raises(NotReadableYetError) as err:
            self.sh.snapshot(as_of, timeout_s=0)
        assert err.value.upper == Frontier.at(self.upper)

    @precondition(lambda self: self.upper > self.since + 1)
    @rule(data=st.data())
    def listen_yields_the_changes_after_as_of(self, data: st.DataObject) -> None:
        as_of = data.draw(st.integers(self.since, self.upper - 2), label="as_of")
        event = next(self.sh.listen(as_of, timeout_s=0))
        assert event.lower == Frontier.at(as_of + 1) and event.upper == Frontier.at(self.upper)
        got = table_to_model(event.updates.to_pylist(), with_time=True)
        expected: Counter[Key] = Counter()
        for key, t, d in self.updates:
            if as_of < t < self.upper:
                expected[(*key, t)] += d
        assert got == {k: v for k, v in expected.items() if v != 0}

    # -- reopen ----------------------------------------------------------------------------
    @rule()
    def reopen_from_s3(self) -> None:
        self.sh = Shard.open(self.store, self.sid)
        self.check_frontiers()
        state = self.sh.refresh()
        assert {r.id: r.since.time for r in state.readers} == self.holds
        assert {r.token for r in state.recent} >= set(self.committed)
        if self.upper > self.since:
            got = table_to_model(self.sh.snapshot(self.upper - 1).to_pylist())
            assert got == consolidated(self.updates, lambda t: True)

    @invariant()
    def check_frontiers(self) -> None:
        state = self.sh.refresh()
        check_invariants(state)
        assert state.upper == Frontier.at(self.upper)
        assert state.since == Frontier.at(self.since)
        assert state.total_rows() >= 0


def test_shard_matches_the_naive_model(stack: EmbeddedStack) -> None:
    ShardModel.store = S3ObjectStore(
        S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing")
    )
    run_state_machine_as_test(
        ShardModel,
        settings=settings(
            max_examples=25,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            print_blob=True,
        ),
    )


def test_a_closed_shard_reads_at_the_last_time() -> None:
    """A snapshot as of the last time (2**64 - 1) of a closed shard holds every update: a
    peek there once failed on ``as_of + 1``, which is no time, and with it every controller
    tick that retired the peek."""
    from shared.frontier import MAX_TIME
    from shared.objectstore import MemoryObjectStore

    schema = {"type": "record", "name": "r", "fields": [{"name": "id", "type": "long"}]}
    shard = Shard.create(MemoryObjectStore(), "closed", schema)
    shard.compare_and_append([({"id": 1}, 3, 1), ({"id": 2}, 4, 1), ({"id": 1}, 5, -1)], 0, 10)
    shard.compare_and_append([({"id": 3}, MAX_TIME - 1, 2)], 10, None)
    got = shard.snapshot(MAX_TIME)
    assert sorted(zip(got["id"].to_pylist(), got["_diff"].to_pylist(), strict=True)) == [(2, 1), (3, 2)]
    got = shard.snapshot(4)
    assert sorted(zip(got["id"].to_pylist(), got["_diff"].to_pylist(), strict=True)) == [(1, 1), (2, 1)]
    # Nothing can follow the last time: listening there ends at once, on a closed shard as
    # on an open one (it once failed on as_of + 1).
    assert list(shard.listen(MAX_TIME, timeout_s=5)) == []
    open_shard = Shard.create(MemoryObjectStore(), "open", schema)
    assert list(open_shard.listen(MAX_TIME, timeout_s=5)) == []
    # A subscribe's first step after a snapshot there reads from the time after it: nothing.
    assert shard.updates_between(shard.refresh(), MAX_TIME + 1, Frontier.empty()).num_rows == 0
