"""Compaction keeps every readable snapshot: a model check of the vectorised merge (issue 13).

The shard's merge consolidates with Arrow (sort on the row columns and time, sum the diffs of
equal neighbours, drop zeros; :func:`shared.shard.consolidate`). These tests hold it to a
naive model (a Counter of ``(row, error)`` over the updates at or before a time), on row types
that sort (longs, nullable strings, doubles with ``-0.0`` and NaN, bytes, booleans) and on
nested ones that take the fallback (arrays, maps), with retractions, multiplicities, error
rows and since moving: the snapshot at every readable time is the same before and after
``compact_below_since`` and ``compact``, and equals the model.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.objectstore import MemoryObjectStore
from shared.shard import DIFF, ERROR, TIME, Shard, consolidate
from shared.state import check_invariants

def record(name: str, **fields: Any) -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": [{"name": n, "type": t} for n, t in fields.items()]}


FLAT = record("Flat", k="long", s=["null", "string"], x="double", b="bytes", f="boolean")
NESTED = record("Nested", k="long", xs={"type": "array", "items": "long"}, m={"type": "map", "values": "string"})

flat_rows = st.fixed_dictionaries(
    {
        "k": st.integers(0, 2),
        "s": st.sampled_from([None, "a", "b"]),
        "x": st.sampled_from([0.0, -0.0, 1.5, math.nan]),
        "b": st.sampled_from([b"", b"\x00"]),
        "f": st.booleans(),
    }
)
nested_rows = st.fixed_dictionaries(
    {
        "k": st.integers(0, 2),
        "xs": st.sampled_from([[], [1], [1, 2]]),
        "m": st.sampled_from([{}, {"a": "1"}]),
    }
)
errors = st.sampled_from(["bad: k", "bad: x"])
diffs = st.sampled_from([-2, -1, 1, 1, 3])


def canon(v: Any) -> Any:
    """A hashable value that is equal iff the encoded bytes are (floats by their bits)."""
    if isinstance(v, float):
        return ("f", struct.pack(">d", v))
    if isinstance(v, dict):
        return tuple(sorted((k, canon(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(canon(x) for x in v)
    return v


def row_key(row: dict[str, Any] | None, error: str | None, cols: list[str]) -> Any:
    if error is not None:
        return ("err", error)
    assert row is not None
    return ("ok", tuple(canon(row[c]) for c in cols))


def model(updates: list[tuple[Any, int, int]], as_of: int) -> dict[Any, int]:
    acc: Counter[Any] = Counter()
    for key, t, d in updates:
        if t <= as_of:
            acc[key] += d
    return {k: v for k, v in acc.items() if v != 0}


def observed(table: pa.Table, cols: list[str]) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for r in table.to_pylist():
        err = r[ERROR]
        row = None if err is not None else {c: (dict(r[c]) if isinstance(r[c], list) and c == "m" else r[c])
                                            for c in cols}
        key = row_key(row, err, cols)
        assert key not in out, f"expected consolidated output, found {key} twice"
        assert r[DIFF] != 0, f"expected no zero diffs, found {r}"
        out[key] = r[DIFF]
    return out


@st.composite
def histories(draw: st.DrawFn, rows: st.SearchStrategy[dict[str, Any]]) -> list[tuple[int, list[Any]]]:
    """Appends as (width, updates): each batch covers [upper, upper + width)."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        width = draw(st.integers(1, 3))
        ups = draw(
            st.lists(
                st.tuples(st.one_of(rows.map(lambda r: (r, None)), errors.map(lambda e: (None, e))),
                          st.integers(0, width - 1), diffs),
                max_size=8,
            )
        )
        out.append((width, ups))
    return out


def run_history(schema: dict[str, Any], history: list[tuple[int, list[Any]]], since_moves: list[int]) -> None:
    sh = Shard.create(MemoryObjectStore(), "c", schema)
    cols = sh.row_columns
    updates: list[tuple[Any, int, int]] = []
    upper = 0
    for width, ups in history:
        batch = []
        for (row, err), dt, d in ups:
            t = upper + dt
            batch.append((row, t, d) if err is None else (None, t, d, err))
            updates.append((row_key(row, err, cols), t, d))
        sh.compare_and_append(batch, upper, upper + width)
        upper += width
    sh.register_reader("r", kind="critical")
    since = 0
    for move in since_moves:
        since = min(upper - 1, since + move)
        sh.downgrade_since("r", since)
        before = {t: observed(sh.snapshot(t), cols) for t in range(since, upper)}
        for t, got in before.items():
            assert got == model(updates, t), f"snapshot at {t} before compaction"
        sh.compact_below_since()
        sh.compact()
        state = sh.refresh()
        check_invariants(state)
        after = {t: observed(sh.snapshot(t), cols) for t in range(since, upper)}
        assert after == before
        # Compacted parts hold consolidated updates with times advanced to since.
        for b in state.batches:
            part = sh.read_parts([p.key for p in b.parts])
            if b.upper.less_equal(state.since) and part.num_rows:
                assert min(part[TIME].to_pylist()) >= since


@pytest.mark.parametrize("schema,rows", [(FLAT, flat_rows), (NESTED, nested_rows)], ids=["flat", "nested"])
def test_compaction_keeps_every_readable_snapshot_equal_to_the_model(schema: dict[str, Any], rows: Any) -> None:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(rows), since_moves=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def check(history: list[tuple[int, list[Any]]], since_moves: list[int]) -> None:
        run_history(schema, history, since_moves)

    check()


def test_consolidate_sums_bitwise_equal_rows_and_drops_zeros() -> None:
    t = pa.table(
        {
            "x": pa.array([0.0, -0.0, math.nan, math.nan, 1.0, 1.0, None, None], pa.float64()),
            ERROR: pa.array([None] * 6 + ["e", "e"], pa.string()),
            DIFF: pa.array([1, 1, 2, -1, 1, -1, 1, 1], pa.int64()),
        }
    )
    got = {(canon(r["x"]), r[ERROR]): r[DIFF] for r in consolidate(t, ["x", ERROR]).to_pylist()}
    assert got == {(canon(0.0), None): 1, (canon(-0.0), None): 1, (canon(math.nan), None): 1, (None, "e"): 2}
