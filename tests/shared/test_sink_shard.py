"""``SHARDSINK_SINK_SHARD=i/n`` (:mod:`shared.sink_shard`): n instances split any set of
sinks with no overlap and no gap, by a hash every process computes alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.sink_shard import SinkShard, sink_hash


@given(st.lists(st.text(min_size=1, max_size=40), unique=True, max_size=60), st.integers(1, 7))
def test_n_instances_serve_every_sink_exactly_once(sinks: list[str], n: int) -> None:
    for sink in sinks:
        owners = [i for i in range(n) if SinkShard(i, n).owns(sink)]
        assert owners == [sink_hash(sink) % n]


def test_the_sinks_spread_over_the_instances() -> None:
    counts = [sum(SinkShard(i, 4).owns(f"sink-{k}") for k in range(1000)) for i in range(4)]
    assert sum(counts) == 1000 and min(counts) > 200, counts


def test_the_hash_is_the_same_in_another_process() -> None:
    """Python's own string hash is salted per process; instances must agree."""
    ids = [f"orders-{k}" for k in range(20)]
    code = f"from shared.sink_shard import sink_hash; print([sink_hash(s) for s in {ids!r}])"
    env = {"PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert other.stdout.strip() == str([sink_hash(s) for s in ids])


def test_parse() -> None:
    assert SinkShard.parse("") == SinkShard(0, 1)
    assert SinkShard.parse(" 2 / 4 ") == SinkShard(2, 4)
    assert str(SinkShard.parse("1/3")) == "1/3"
    assert all(SinkShard.parse("0/1").owns(s) for s in ("a", "b", ""))


@pytest.mark.parametrize("text", ["2", "a/b", "1/1", "3/2", "0/0", "-1/2", "1/2/3"])
def test_a_shard_that_is_not_i_of_n_is_refused_with_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"0 <= i < n|as i/n"):
        SinkShard.parse(text)
