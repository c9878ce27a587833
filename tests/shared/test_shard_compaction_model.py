"""Compaction keeps every readable snapshot: a model check of the vectorised merge (issue 13).

The shard's merge consolidates with Arrow (sort on the row columns and time, sum the diffs of
equal neighbours, drop zeros; :func:`shared.shard.consolidate`). These tests hold it to a
naive model (a Counter of ``(row, error)`` over the updates at or before a time), on row types
that sort (longs, nullable strings, doubles with ``-0.0`` and NaN, bytes, booleans) and on
nested ones that take the fallback (arrays, maps), with retractions, multiplicities, error
rows and since moving: the snapshot at every readable time is the same before and after
``compact_below_since`` (or the controller's ``compact_since_moved``) and ``compact``, and
equals the model. ``plan_since_merge`` keeps the rewrites of a row logarithmic however often
since moves.
"""

from __future__ import annotations

import math
import struct
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyarrow.parquet as pq

from shared.frontier import Frontier
from shared.objectstore import MemoryObjectStore
from shared.shard import DIFF, ERROR, TIME, Shard, consolidate
from shared.state import SINCE_MERGE_RATIO, BatchMeta, Part, ShardState, check_invariants, plan_since_merge

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


def run_history(schema: dict[str, Any], history: list[tuple[int, list[Any]]], since_moves: list[int],
                full: bool = True) -> None:
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
        if full:
            sh.compact_below_since()
        else:
            sh.compact_since_moved()
        sh.compact()
        state = sh.refresh()
        check_invariants(state)
        after = {t: observed(sh.snapshot(t), cols) for t in range(since, upper)}
        assert after == before
        # Compacted parts hold consolidated updates with times advanced to the since they
        # were merged at (after a full collapse: every batch below since, at since).
        for b in state.batches:
            part = sh.read_parts([p.key for p in b.parts])
            if b.upper.less_equal(state.since) and part.num_rows:
                assert min(part[TIME].to_pylist()) >= (since if full else b.since.time)


@pytest.mark.parametrize("full", [True, False], ids=["full-collapse", "since-moved"])
@pytest.mark.parametrize("schema,rows", [(FLAT, flat_rows), (NESTED, nested_rows)], ids=["flat", "nested"])
def test_compaction_keeps_every_readable_snapshot_equal_to_the_model(schema: dict[str, Any], rows: Any, full: bool) -> None:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(rows), since_moves=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def check(history: list[tuple[int, list[Any]]], since_moves: list[int]) -> None:
        run_history(schema, history, since_moves, full)

    check()


def _state(weights: list[int], since: int | None) -> ShardState:
    """A shard state with one batch per weight, batch i covering ``[i, i + 1)``."""
    batches = tuple(
        BatchMeta(id=uuid.uuid4().hex, lower=Frontier.at(i), upper=Frontier.at(i + 1), since=Frontier.at(0),
                  parts=(Part(key=f"p{i}", rows=w, bytes=w),), rows=w)
        for i, w in enumerate(weights)
    )
    return ShardState(shard_id="s", seqno=1, schema=FLAT, upper=Frontier.at(len(weights)),
                      since=Frontier.empty() if since is None else Frontier.at(since), batches=batches)


def test_plan_since_merge_takes_the_longest_balanced_run_ending_at_the_newest_batch_below_since() -> None:
    assert SINCE_MERGE_RATIO == 4
    # Batches below since: the first 3 (their uppers 1, 2, 3 are at or below 3).
    assert plan_since_merge(_state([800, 200, 100, 5], since=3)) == (0, 3), "800 <= 4 * 300"
    assert plan_since_merge(_state([2000, 200, 100, 5], since=3)) == (1, 3), "2000 > 4 * 300: left alone"
    assert plan_since_merge(_state([800, 200], since=2)) == (0, 2)
    # A newer batch that is small does not pull in a heavy one; a heavy newer one not a small one.
    assert plan_since_merge(_state([1000, 10], since=2)) is None
    assert plan_since_merge(_state([10, 1000], since=2)) is None
    # One batch below since, none, or a closed shard: nothing to merge.
    assert plan_since_merge(_state([5, 5, 5], since=1)) is None
    assert plan_since_merge(_state([5, 5], since=0)) is None
    assert plan_since_merge(_state([5, 5], since=None)) is None
    # Light older batches join a balanced run; the run stops before one that would outweigh it.
    assert plan_since_merge(_state([1, 1, 1000, 300], since=4)) == (0, 4)
    assert plan_since_merge(_state([9000, 1, 1000, 300], since=4)) == (1, 4), "9000 > 4 * 1301"


def _rows_written(store: MemoryObjectStore) -> int:
    return sum(pq.read_metadata(pa.BufferReader(store.get(o.key))).num_rows
               for o in store.list("shards/") if o.key.endswith(".parquet"))


@pytest.mark.parametrize("appends", [64, 256])
def test_since_moving_at_every_append_rewrites_each_row_a_logarithmic_number_of_times(appends: int) -> None:
    """The controller's merge when since moves, with since one behind the upper after every
    append (a sink's hold): every row is written once by its append, then rewritten at most
    ``log_{1 + 1/ratio}(appends)`` times by the since merges and the tiered compaction
    together (each moves it into a batch 1 + 1/ratio times as heavy, at least). Merging every
    batch below since at every move rewrote each row about appends / 2 times."""
    store = MemoryObjectStore()
    sh = Shard.create(store, "log", FLAT)
    sh.register_reader("ctl", kind="critical")
    model: Counter[int] = Counter()
    for t in range(appends):
        ups = [({"k": t * 10 + i, "s": None, "x": 0.0, "b": b"", "f": True}, t, 1) for i in range(10)]
        sh.compare_and_append(ups, t, t + 1)
        model.update(t * 10 + i for i in range(10))
        sh.downgrade_since("ctl", t)
        plan = plan_since_merge(sh.refresh())
        if plan is not None:
            w = [b.weight for b in sh.refresh().batches[plan[0]:plan[1]]]
            assert max(w) <= SINCE_MERGE_RATIO * (sum(w) - max(w)), w
        sh.compact_since_moved()
        sh.compact()
    appended = appends * 10
    rewrites = (_rows_written(store) - appended) / appended
    bound = math.log(appends) / math.log(1 + 1 / SINCE_MERGE_RATIO)
    assert rewrites <= bound, f"expected at most {bound:.1f} rewrites per row, found {rewrites:.1f}"
    snap = sh.snapshot(appends - 1)
    assert Counter(dict(zip(snap["k"].to_pylist(), snap[DIFF].to_pylist(), strict=True))) == model


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
