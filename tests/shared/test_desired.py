"""The desired-topic contract: the row hash and the desired frontier (pure, no I/O)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.desired import ContractViolation, DesiredFrontierTracker, row_partition
from shared.frontier import Frontier

# -- the row hash ----------------------------------------------------------------------------


def test_row_partition_is_a_fixed_function_of_the_bytes() -> None:
    # Golden values: a change here re-partitions every desired topic in existence.
    assert [row_partition(b"", 8), row_partition(b"abc", 8), row_partition(b"abc", 7)] == [4, 1, 2]
    assert [row_partition(bytes([i]), 16) for i in range(8)] == GOLDEN_16
    digest = hashlib.blake2b(b"abc", digest_size=8).digest()
    assert row_partition(b"abc", 1000) == int.from_bytes(digest, "big") % 1000


GOLDEN_16 = [8, 13, 2, 14, 14, 1, 14, 13]


def test_row_partition_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from shared.desired import row_partition;"
        "print([row_partition(bytes([i]), 16) for i in range(8)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=str(Path(__file__).resolve().parents[2]),
    ).stdout
    assert out.strip() == str(GOLDEN_16)


def test_row_partition_spreads_rows_over_every_partition() -> None:
    counts = Counter(row_partition(f"row-{i}".encode(), 8) for i in range(8000))
    assert set(counts) == set(range(8))
    assert all(800 <= c <= 1200 for c in counts.values()), counts


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_row_partition_needs_a_positive_partition_count(n: object) -> None:
    with pytest.raises(ValueError, match="expected a partition count >= 1"):
        row_partition(b"x", n)  # type: ignore[arg-type]


# -- the desired frontier --------------------------------------------------------------------


def test_a_silent_partition_holds_the_frontier_at_the_minimum() -> None:
    t = DesiredFrontierTracker(3)
    assert t.frontier() == Frontier.minimum()
    assert t.observe_progress(0, Frontier.at(10)) == Frontier.minimum()
    assert t.observe_progress(2, Frontier.at(7)) == Frontier.minimum()
    assert t.observe_progress(1, Frontier.at(20)) == Frontier.at(7)
    assert t.observe_progress(2, Frontier.empty()) == Frontier.at(10)
    assert t.observe_progress(0, Frontier.empty()) == Frontier.at(20)
    assert t.observe_progress(1, Frontier.empty()) == Frontier.empty()


def test_a_lower_progress_statement_is_ignored() -> None:
    t = DesiredFrontierTracker(1)
    t.observe_progress(0, Frontier.at(10))
    assert t.observe_progress(0, Frontier.at(4)) == Frontier.at(10)
    assert t.progress(0) == Frontier.at(10)


def test_updates_below_their_partitions_progress_are_counted_violations() -> None:
    t = DesiredFrontierTracker(2)
    t.observe_progress(0, Frontier.at(10))
    assert t.observe_update(0, 10) is None
    assert t.observe_update(1, 0) is None  # partition 1 said nothing yet
    v = t.observe_update(0, 9)
    assert v == ContractViolation(partition=0, time=9, frontier=Frontier.at(10))
    assert v.message() == (
        "expected updates in partition 0 at times beyond its progress {10}, "
        "found an update at time 9"
    )
    t.observe_progress(1, Frontier.empty())
    closed = t.observe_update(1, 2**64 - 1)
    assert closed is not None and closed.frontier.is_empty()
    assert "{}" in closed.message()
    assert t.violations == 2


def test_new_partitions_start_at_the_current_frontier() -> None:
    t = DesiredFrontierTracker(2)
    t.observe_progress(0, Frontier.at(5))
    t.grow(3)  # before every partition has spoken: the frontier is the minimum
    assert t.progress(2) == Frontier.minimum()
    t.observe_progress(1, Frontier.at(8))
    t.observe_progress(2, Frontier.at(6))
    assert t.frontier() == Frontier.at(5)
    t.grow(5)
    assert t.partitions == 5
    assert [t.progress(p) for p in (3, 4)] == [Frontier.at(5)] * 2
    assert t.frontier() == Frontier.at(5)
    # a progress statement or an update on an unknown partition grows the tracker
    assert t.observe_update(9, 4) == ContractViolation(9, 4, Frontier.at(5))
    assert t.partitions == 10
    t.grow(3)  # Kafka never removes partitions
    assert t.partitions == 10


@pytest.mark.parametrize("bad", [-1, True, "0"])
def test_partition_numbers_are_checked(bad: object) -> None:
    t = DesiredFrontierTracker(1)
    with pytest.raises(ValueError, match="expected a partition number"):
        t.observe_update(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a partition count"):
        DesiredFrontierTracker(0)


frontiers = st.one_of(
    st.integers(0, 50).map(Frontier.at), st.just(Frontier.empty()), st.just(Frontier.at(2**64 - 1))
)
events = st.lists(
    st.one_of(
        st.tuples(st.just("progress"), st.integers(0, 5), frontiers),
        st.tuples(st.just("update"), st.integers(0, 5), st.integers(0, 60)),
        st.tuples(st.just("grow"), st.integers(1, 8), st.none()),
    ),
    max_size=60,
)


def least(fs: list[Frontier]) -> Frontier:
    out = fs[0]
    for f in fs[1:]:
        out = out.meet(f)
    return out


@settings(max_examples=300, deadline=None)
@given(initial=st.integers(1, 4), evs=events)
def test_any_interleaving_gives_the_least_of_the_latest_and_never_regresses(
    initial: int, evs: list[tuple[str, int, object]]
) -> None:
    t = DesiredFrontierTracker(initial)
    # reference model: per partition the join of what it said; new partitions inherit the
    # frontier at the moment they appear
    model: list[Frontier] = [Frontier.minimum()] * initial
    violations = 0
    previous = t.frontier()
    for kind, p, arg in evs:
        if kind == "grow" or p >= len(model):
            n = p if kind == "grow" else p + 1
            if n > len(model):
                model.extend([least(model)] * (n - len(model)))
        if kind == "progress":
            assert isinstance(arg, Frontier)
            model[p] = model[p].join(arg)
            t.observe_progress(p, arg)
        elif kind == "update":
            assert isinstance(arg, int)
            v = t.observe_update(p, arg)
            expected_violation = not model[p].beyond(arg)
            violations += expected_violation
            assert (v is not None) == expected_violation
            if v is not None:
                assert v.frontier == model[p] and v.time == arg and v.partition == p
        else:
            t.grow(p)
        assert t.partitions == len(model)
        assert t.frontier() == least(model)
        assert previous.less_equal(t.frontier())  # never regresses
        previous = t.frontier()
    assert t.violations == violations


@settings(max_examples=200, deadline=None)
@given(
    statements=st.lists(st.tuples(st.integers(0, 3), frontiers), max_size=30),
    seed=st.randoms(use_true_random=False),
)
def test_the_order_of_progress_statements_does_not_change_the_result(
    statements: list[tuple[int, Frontier]], seed: object
) -> None:
    a = DesiredFrontierTracker(4)
    for p, f in statements:
        a.observe_progress(p, f)
    shuffled = list(statements)
    seed.shuffle(shuffled)  # type: ignore[attr-defined]
    b = DesiredFrontierTracker(4)
    for p, f in shuffled:
        b.observe_progress(p, f)
    assert a.frontier() == b.frontier()
    assert [a.progress(p) for p in range(4)] == [b.progress(p) for p in range(4)]


# -- the messages ------------------------------------------------------------------------------

from shared.codec import message_codec, tagged
from shared.desired import (
    DesiredProgress,
    DesiredUpdate,
    _fast_update,
    decode_desired,
    encode_progress,
    encode_update,
)
from shared.errors import DecodeError


def generic(data: bytes) -> DesiredUpdate | DesiredProgress:
    """decode_desired without its fast path."""
    kind, body = message_codec("desired").decode(data)["message"]
    if kind.endswith("Update"):
        return DesiredUpdate(body["row"], body["time"], body["diff"])
    if body["partition"] < 0:
        raise DecodeError("negative partition")
    return DesiredProgress(body["partition"], Frontier(body["frontier"]))


@pytest.mark.parametrize(
    "message",
    [
        DesiredUpdate(b"\xc3\x01row", 5, 1),
        DesiredUpdate(b"", 0, -1),
        DesiredUpdate(b"x" * 300, 2**64 - 1, -(2**63)),
        DesiredUpdate(b"r", 2**63, 2**63 - 1),
        DesiredProgress(3, Frontier.at(9)),
        DesiredProgress(0, Frontier.empty()),
    ],
)
def test_desired_messages_round_trip(message: DesiredUpdate | DesiredProgress) -> None:
    if isinstance(message, DesiredUpdate):
        data = encode_update(message.row, message.time, message.diff)
        assert _fast_update(data) == message
    else:
        data = encode_progress(message.partition, message.frontier)
        assert _fast_update(data) is None
    assert decode_desired(data) == message == generic(data)


def test_a_negative_progress_partition_is_a_decode_error() -> None:
    data = message_codec("desired").encode(
        {"message": tagged("Progress", {"partition": -1, "frontier": 3})}
    )
    with pytest.raises(DecodeError, match="partition >= 0, found -1"):
        decode_desired(data)


_VALID = [
    encode_update(b"\xc3\x01" + bytes(8) + b"\x02abc", 1_700_000_000_000, 1),
    encode_update(b"", 2**64 - 1, -5),
    encode_progress(1, Frontier.at(7)),
]


@st.composite
def desired_bytes(draw: st.DrawFn) -> bytes:
    base = bytearray(draw(st.sampled_from(_VALID)))
    if draw(st.booleans()):
        return bytes(base[:10]) + draw(st.binary(max_size=40))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(base) - 1))
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        if op == "set":
            base[i] = draw(st.integers(0, 255))
        elif op == "insert":
            base.insert(i, draw(st.integers(0, 255)))
        elif len(base) > 1:
            del base[i]
    return bytes(base)


@settings(max_examples=800, deadline=None)
@given(desired_bytes())
def test_the_fast_path_agrees_with_the_generic_reader_on_any_bytes(data: bytes) -> None:
    fast = _fast_update(data)
    try:
        expected = generic(data)
    except DecodeError:
        assert fast is None
        with pytest.raises(DecodeError):
            decode_desired(data)
        return
    if fast is not None:
        assert fast == expected
    assert decode_desired(data) == expected
