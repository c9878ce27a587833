"""The state object format: plain JSON, versioned, guarded by a golden fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.errors import FormatError
from shared.frontier import Frontier
from shared.state import STATE_FORMAT_VERSION, ShardState, check_invariants
from tests.state_fixture import golden_state

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "v1.json"


def test_golden_state_decodes_with_the_plain_json_codec() -> None:
    d = json.loads(GOLDEN.read_bytes())
    assert d["format"] == 1
    assert d["upper"] == 30 and d["since"] == 10
    assert [b["id"] for b in d["batches"]] == ["b1", "b2"]
    assert d["batches"][1]["parts"][0]["key"] == "shards/golden/data/b.parquet"
    assert d["readers"][0] == {"id": "controller", "kind": "critical", "since": 10, "lease_ms": 0, "expires_ms": None}


def test_golden_state_decodes_to_the_expected_value() -> None:
    state = ShardState.decode(GOLDEN.read_bytes())
    assert state == golden_state()
    check_invariants(state)


def test_encoding_is_byte_stable() -> None:
    """If this fails the format changed: bump STATE_FORMAT_VERSION and add a v2 fixture."""
    assert golden_state().encode() == GOLDEN.read_bytes()
    assert STATE_FORMAT_VERSION == 1


def test_empty_frontier_is_null() -> None:
    from dataclasses import replace

    closed = replace(golden_state(), upper=Frontier.empty())
    assert json.loads(closed.encode())["upper"] is None
    assert ShardState.decode(closed.encode()).upper.is_empty()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[1,2]",
        json.dumps({**json.loads(GOLDEN.read_bytes()), "format": 2}).encode(),
        json.dumps({"format": 1}).encode(),
        json.dumps({**json.loads(GOLDEN.read_bytes()), "upper": "x"}).encode(),
    ],
)
def test_bad_state_objects_raise_format_error(data: bytes) -> None:
    with pytest.raises(FormatError):
        ShardState.decode(data)


def test_since_never_passes_upper_and_follows_a_hold_beyond_it() -> None:
    from shared.state import CRITICAL, apply_append, apply_downgrade_since, apply_register_reader, initial_state

    s = initial_state("x", {"type": "record", "name": "R", "fields": []}, Frontier.at(0), 0, "t0")
    s = apply_append(s, None, Frontier.at(0), Frontier.at(10), "a1", 0)
    s = apply_register_reader(s, "ctl", CRITICAL, 0, 0, "t1")
    s = apply_downgrade_since(s, "ctl", Frontier.at(25), 0, "t2")
    assert s.since == Frontier.at(10) and s.reader("ctl").since == Frontier.at(25)  # type: ignore[union-attr]
    check_invariants(s)
    s = apply_append(s, None, Frontier.at(10), Frontier.at(20), "a2", 0)
    assert s.since == Frontier.at(20)
    s = apply_append(s, None, Frontier.at(20), Frontier.at(40), "a3", 0)
    assert s.since == Frontier.at(25)
    check_invariants(s)
