"""Laws of the frontier type: a total order with the empty frontier as top, join/meet a lattice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.frontier import MAX_TIME, Frontier, meet_all

times = st.one_of(st.integers(0, 50), st.integers(0, MAX_TIME))
frontiers = st.one_of(times.map(Frontier.at), st.just(Frontier.empty()))


@given(frontiers)
def test_less_equal_is_reflexive(a: Frontier) -> None:
    assert a.less_equal(a)
    assert not a.less_than(a)


@given(frontiers, frontiers)
def test_less_equal_is_antisymmetric_and_total(a: Frontier, b: Frontier) -> None:
    assert a.less_equal(b) or b.less_equal(a)
    if a.less_equal(b) and b.less_equal(a):
        assert a == b


@given(frontiers, frontiers, frontiers)
def test_less_equal_is_transitive(a: Frontier, b: Frontier, c: Frontier) -> None:
    if a.less_equal(b) and b.less_equal(c):
        assert a.less_equal(c)


@given(frontiers)
def test_empty_is_top_and_minimum_is_bottom(a: Frontier) -> None:
    assert a.less_equal(Frontier.empty())
    assert Frontier.minimum().less_equal(a)
    assert a.join(Frontier.empty()).is_empty()
    assert a.meet(Frontier.empty()) == a
    assert a.meet(Frontier.minimum()) == Frontier.minimum()


@given(frontiers, frontiers)
def test_join_and_meet_are_commutative_bounds(a: Frontier, b: Frontier) -> None:
    assert a.join(b) == b.join(a)
    assert a.meet(b) == b.meet(a)
    assert a.less_equal(a.join(b)) and b.less_equal(a.join(b))
    assert a.meet(b).less_equal(a) and a.meet(b).less_equal(b)


@given(frontiers, frontiers, frontiers)
def test_join_and_meet_are_associative_and_absorb(a: Frontier, b: Frontier, c: Frontier) -> None:
    assert a.join(b.join(c)) == a.join(b).join(c)
    assert a.meet(b.meet(c)) == a.meet(b).meet(c)
    assert a.join(a.meet(b)) == a
    assert a.meet(a.join(b)) == a
    assert a.join(a) == a and a.meet(a) == a


@given(frontiers, frontiers, frontiers)
def test_lattice_is_distributive(a: Frontier, b: Frontier, c: Frontier) -> None:
    assert a.meet(b.join(c)) == a.meet(b).join(a.meet(c))


@given(frontiers, times)
def test_beyond_matches_order(f: Frontier, t: int) -> None:
    assert f.beyond(t) == (not f.is_empty() and f.less_equal(Frontier.at(t)))


@given(st.lists(frontiers, max_size=6))
def test_meet_all_is_the_least(fs: list[Frontier]) -> None:
    m = meet_all(fs, Frontier.empty())
    assert all(m.less_equal(f) for f in fs)
    assert m in fs or (not fs and m.is_empty())


@given(frontiers)
def test_json_round_trip(a: Frontier) -> None:
    assert Frontier.from_json(a.to_json()) == a


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "3", True])
def test_invalid_times_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a time"):
        Frontier.at(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Frontier.from_json(bad)
