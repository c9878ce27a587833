"""The correction buffer against a naive model (a Counter of (key, time) -> diff).

Small chunk and stage sizes make the property tests exercise flushes, chunk splits, merges of
cancelled chunks and coalescing on tiny inputs.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.correction import (
    ConsolidatedUpdates,
    Correction,
    decode_tuple_row,
    encode_tuple_row,
)
from shared.errors import InvalidUsageError
from shared.frontier import Frontier


class Model:
    """The naive reference: every update kept, consolidated on read."""

    def __init__(self) -> None:
        self.updates: Counter[tuple[bytes, int]] = Counter()
        self.since = 0

    def insert(self, ups: list[tuple[bytes, int, int]], sign: int) -> None:
        for k, t, d in ups:
            self.updates[(k, t)] += sign * d

    def updates_before(self, upper: int | None) -> list[tuple[bytes, int, int]]:
        acc: Counter[tuple[bytes, int]] = Counter()
        for (k, t), d in self.updates.items():
            acc[(k, max(t, self.since))] += d
        return sorted(
            (k, t, d) for (k, t), d in acc.items() if d != 0 and (upper is None or t < upper)
        )


keys_st = st.binary(min_size=0, max_size=3).map(lambda b: b"k" + b)
update_st = st.tuples(
    st.sampled_from([b"a", b"b", b"c", b"d", b"e"]) | keys_st,
    st.integers(0, 12),
    st.integers(-3, 3),
)
batch_st = st.lists(update_st, max_size=12)


class CorrectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf = Correction(chunk_target=4, min_stage=3, stage_fraction=0.5)
        self.model = Model()

    @rule(ups=batch_st)
    def insert(self, ups: list[tuple[bytes, int, int]]) -> None:
        self.buf.insert_updates(ups)
        self.model.insert(ups, +1)

    @rule(ups=batch_st)
    def insert_negated(self, ups: list[tuple[bytes, int, int]]) -> None:
        self.buf.insert_negated_updates(ups)
        self.model.insert(ups, -1)

    @rule(ups=batch_st)
    def insert_then_negate_same(self, ups: list[tuple[bytes, int, int]]) -> None:
        # The self-correcting loop's common case: what was written comes back negated.
        self.buf.insert_updates(ups)
        self.buf.insert_negated_updates(ups)

    @rule(t=st.integers(0, 14))
    def advance_since(self, t: int) -> None:
        self.buf.advance_since(t)
        self.model.since = max(self.model.since, t)

    @rule(upper=st.integers(0, 16) | st.none())
    def take(self, upper: int | None) -> None:
        got = self.buf.updates_before(upper).to_list()
        assert got == self.model.updates_before(upper)

    @precondition(lambda self: self.buf.size() > 0)
    @rule()
    def consolidate(self) -> None:
        self.buf.consolidate()
        assert self.buf.size() == len(self.model.updates_before(None))

    @invariant()
    def chunks_are_sorted_disjoint_and_consolidated(self) -> None:
        self.buf.check_invariants()


TestCorrectionMachine = CorrectionMachine.TestCase
TestCorrectionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("ins"), batch_st),
            st.tuples(st.just("neg"), batch_st),
            st.tuples(st.just("adv"), st.integers(0, 14)),
            st.tuples(st.just("take"), st.integers(0, 16)),
        ),
        max_size=30,
    ),
    chunk_target=st.integers(2, 9),
    min_stage=st.integers(1, 20),
)
def test_any_sequence_matches_the_model(
    ops: list[tuple[str, object]], chunk_target: int, min_stage: int
) -> None:
    buf = Correction(chunk_target=chunk_target, min_stage=min_stage, stage_fraction=0.25)
    model = Model()
    for op, arg in ops:
        if op == "ins":
            buf.insert_updates(arg)  # type: ignore[arg-type]
            model.insert(arg, +1)  # type: ignore[arg-type]
        elif op == "neg":
            buf.insert_negated_updates(arg)  # type: ignore[arg-type]
            model.insert(arg, -1)  # type: ignore[arg-type]
        elif op == "adv":
            buf.advance_since(arg)  # type: ignore[arg-type]
            model.since = max(model.since, arg)  # type: ignore[call-overload]
        else:
            assert buf.updates_before(arg).to_list() == model.updates_before(arg)  # type: ignore[arg-type]
    assert buf.contents().to_list() == model.updates_before(None)
    buf.check_invariants()


def test_desired_minus_its_own_read_back_is_empty() -> None:
    buf = Correction(chunk_target=16, min_stage=8)
    rows = [f"row-{i}".encode() for i in range(500)]
    buf.insert(rows, np.arange(500, dtype=np.uint64) % 7, 1)
    buf.advance_since(7)
    buf.insert_negated(rows, 6, 1)
    assert buf.updates_before(Frontier.empty()).is_empty()
    assert buf.size() == 0


def test_updates_before_leaves_the_updates_in_place() -> None:
    buf = Correction()
    buf.insert_updates([(b"x", 1, 1), (b"y", 5, 2)])
    first = buf.updates_before(3).to_list()
    assert first == [(b"x", 1, 1)]
    assert buf.updates_before(3).to_list() == first
    assert buf.updates_before(Frontier.at(6)).to_list() == [(b"x", 1, 1), (b"y", 5, 2)]


def test_advance_since_merges_times_and_cancels() -> None:
    buf = Correction()
    buf.insert_updates([(b"x", 1, 1), (b"x", 2, 1), (b"y", 9, 1)])
    buf.insert_negated_updates([(b"x", 3, 2)])
    buf.consolidate()
    assert buf.size() == 4
    buf.advance_since(3)
    assert buf.updates_before(None).to_list() == [(b"y", 9, 1)]
    buf.advance_since(2)  # regressions are ignored
    assert buf.since == 3


def test_empty_since_clears_the_buffer() -> None:
    buf = Correction()
    buf.insert_updates([(b"x", 1, 1)])
    buf.advance_since(Frontier.empty())
    assert buf.size() == 0 and buf.updates_before(None).is_empty()


def test_columnar_inputs_arrow_and_numpy() -> None:
    buf = Correction()
    keys = pa.array(["a", "b", "a"], type=pa.string())
    buf.insert(keys, np.array([1, 1, 1], dtype=np.int64), np.array([1, 1, 1]))
    buf.insert_negated(pa.chunked_array([pa.array([b"b"], pa.large_binary())]), 1)
    got = buf.updates_before(2)
    assert isinstance(got, ConsolidatedUpdates)
    assert got.to_list() == [(b"a", 1, 2)]
    table = got.to_table()
    assert table.column_names == ["key", "time", "diff"]
    assert table.schema.field("time").type == pa.uint64()


def test_times_up_to_u64_max() -> None:
    buf = Correction()
    top = 2**64 - 1
    buf.insert_updates([(b"x", top, 1), (b"y", 2**63, 1)])
    assert buf.updates_before(None).to_list() == [(b"x", top, 1), (b"y", 2**63, 1)]
    assert buf.updates_before(top).to_list() == [(b"y", 2**63, 1)]


@pytest.mark.parametrize(
    "keys,times,diffs",
    [
        ([b"a"], [-1], [1]),
        ([b"a"], [2**64], [1]),
        ([b"a", b"b"], [1], [1]),
        ([b"a"], [1], [1.5]),
        (pa.array([None], pa.binary()), [1], [1]),
        ([1, 2], [1, 1], [1, 1]),
    ],
)
def test_bad_inputs_are_typed_errors(keys: object, times: object, diffs: object) -> None:
    buf = Correction()
    with pytest.raises(InvalidUsageError, match="expected"):
        buf.insert(keys, times, diffs)  # type: ignore[arg-type]
    assert buf.size() == 0


def test_eager_consolidation_bounds_the_buffer_during_hydration() -> None:
    """Inserting a collection and then its (equal) read-back never holds much more than the
    collection: the stage is flushed at a fraction of the buffer's size."""
    buf = Correction(chunk_target=64, min_stage=32, stage_fraction=0.125)
    n = 4000
    rows = [f"r{i:05d}".encode() for i in np.random.default_rng(1).permutation(n)]
    peak = 0
    for a in range(0, n, 50):
        buf.insert(rows[a : a + 50], 0, 1)
        peak = max(peak, buf.size())
    for a in range(0, n, 50):
        buf.insert_negated(rows[a : a + 50], 0, 1)
        peak = max(peak, buf.size())
    assert peak <= n * 1.125 + 50
    buf.consolidate()
    assert buf.size() == 0
    assert buf.bytes() == 0


def test_tuple_rows_round_trip() -> None:
    row = (1, "a", None, 2.5, b"\x00", True)
    key = encode_tuple_row(row)
    assert decode_tuple_row(key) == row
    assert encode_tuple_row((1, "a", None, 2.5, b"\x00", True)) == key
    with pytest.raises(InvalidUsageError):
        encode_tuple_row([1, 2])  # type: ignore[arg-type]
