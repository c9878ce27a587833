"""The read API's snapshot in row order (issue 31): :func:`shared.shard_sort.consolidate_in_row_order`
sorts the rows and consolidates the neighbours where the snapshot used to consolidate by hash
(:func:`shared.shard_merge.consolidate`) and sort after. It holds the same updates as that
consolidation (floats by their bits: ``0.0`` and ``-0.0`` apart, equal NaNs together; error rows;
every flat type a row schema maps to), in row order as Arrow sorts the row columns, by each of
its ways: rows already in order, the sort then a comparison of neighbours (inserts only), the
hash first (retractions), and none for types Arrow cannot order (lists, maps, records), which
the snapshot consolidates by hash as before. Through the read API (``Collection.snapshot``), on
shards of every such schema, of two schema versions, with error rows, it equals the model.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared.shard_sort as shard_sort
from shared.io.client import Collection
from shared.objectstore import MemoryObjectStore
from shared.shard import Shard
from shared.shard_format import DIFF, ERROR, TIME, schema_view, updates_to_table
from shared.shard_merge import consolidate
from shared.shard_sort import consolidate_in_row_order
from tests.shared.test_shard_compaction_model import FLAT, NESTED, flat_rows, histories, nested_rows, record
from tests.shared.test_shard_merge_equivalence import contents, history_table


def positive(history: list[tuple[int, list[Any]]]) -> list[tuple[int, list[Any]]]:
    """The history with every diff made positive (inserts only: the sort's way)."""
    return [(w, [(u, t, abs(d)) for u, t, d in ups]) for w, ups in history]


def in_row_order(table: pa.Table, row_columns: list[str]) -> bool:
    """Whether a stable sort by the row columns (Arrow's, nulls last) leaves ``table`` as it is."""
    if table.num_rows < 2:
        return True
    idx = pc.sort_indices(table, [(c, "ascending") for c in row_columns]).to_numpy()
    return bool(np.array_equal(idx, np.arange(table.num_rows)))


def check_against_hash(table: pa.Table, row_columns: list[str], threads: int = 1) -> pa.Table:
    """The ordered consolidation holds the hash consolidation's updates, in its schema, in row order."""
    keys = [*row_columns, ERROR]
    got = consolidate_in_row_order(table, row_columns, threads=threads)
    assert got is not None
    want = consolidate(table, keys)
    assert got.column_names == [*keys, DIFF]
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert contents(got) == contents(want)
    assert in_row_order(got, row_columns)
    return got


# -- against the hash consolidation, on the model tests' histories ------------------------


@pytest.mark.parametrize("columns", [["k", "s", "x", "b", "f"], ["s", "b", "x", "f", "k"]],
                         ids=["long-first", "string-first"])
@pytest.mark.parametrize("inserts_only", [True, False], ids=["sorted-then-neighbours", "hash-first"])
def test_ordered_consolidation_holds_the_hash_consolidations_updates_in_row_order(
    inserts_only: bool, columns: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_sort, "_PARALLEL_ROWS", 1)  # the take on threads, on small tables too
    assert sorted(columns) == sorted(schema_view(FLAT).row_columns)

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(flat_rows), threads=st.sampled_from([1, 3]), cut=st.integers(0, 40))
    def check(history: list[tuple[int, list[Any]]], threads: int, cut: int) -> None:
        table, _ = history_table(FLAT, positive(history) if inserts_only else history)
        if 0 < cut < table.num_rows:  # two chunks, as parts read together are
            table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
        check_against_hash(table, columns, threads)

    check()


@pytest.mark.parametrize("schema,rows", [(NESTED, nested_rows)], ids=["lists-and-maps"])
def test_types_arrow_cannot_order_are_left_to_the_hash(schema: dict[str, Any], rows: Any) -> None:
    view = schema_view(schema)

    @settings(max_examples=10, deadline=None)
    @given(history=histories(rows))
    def check(history: list[tuple[int, list[Any]]]) -> None:
        table, _ = history_table(schema, history)
        assert consolidate_in_row_order(table, view.row_columns) is None

    check()


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def test_floats_are_rows_by_their_bits_and_the_order_is_arrows() -> None:
    """Rows that differ only in a float's bits (``0.0`` / ``-0.0``, NaN payloads), interleaved:
    Arrow orders them as equal, and they are different rows."""
    nan_a, nan_b = _float(0x7FF8000000000000), _float(0x7FF8000000000001)
    xs = [0.0, -0.0, 0.0, nan_a, nan_b, nan_a, 1.5, -0.0, None]
    names = ["b", "b", "b", "c", "c", "c", "z", "a", None]
    table = updates_to_table([({"x": x, "s": s}, 0, 1) for x, s in zip(xs, names, strict=True)],
                             schema_view(record("F", x=["null", "double"], s=["null", "string"])))
    got = check_against_hash(table, ["x", "s"])
    bits = [None if x is None else struct.pack("<d", x) for x in got["x"].to_pylist()]
    assert list(zip(bits, got["s"].to_pylist(), got[DIFF].to_pylist(), strict=True)) == [
        # Arrow's order (0.0 and -0.0 as equal, then s; 1.5; NaNs; null), then the bits
        (struct.pack("<d", -0.0), "a", 1),
        (struct.pack("<d", 0.0), "b", 2),
        (struct.pack("<d", -0.0), "b", 1),
        (struct.pack("<d", 1.5), "z", 1),
        (struct.pack("<d", nan_a), "c", 2),
        (struct.pack("<d", nan_b), "c", 1),
        (None, None, 1),
    ]


FLAT_TYPES = record(
    "Types",
    ts={"type": "long", "logicalType": "timestamp-micros"},
    d={"type": "int", "logicalType": "date"},
    t={"type": "int", "logicalType": "time-millis"},
    dec={"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2},
    fx={"type": "fixed", "name": "Fx", "size": 2},
    b="boolean",
    f=["null", "float"],
    i="int",
    by="bytes",
)


def _types_row(k: int) -> dict[str, Any]:
    epoch = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    return {
        "ts": epoch + dt.timedelta(seconds=k % 3), "d": dt.date(2026, 1, 1 + k % 2),
        "t": dt.time(0, 0, k % 2), "dec": decimal.Decimal(k % 3) / 4, "fx": bytes([k % 2, 0]),
        "b": bool(k % 2), "f": [None, -0.0, 0.0, math.nan][k % 4], "i": -(k % 3), "by": b"\x00" * (k % 2),
    }


@pytest.mark.parametrize("diffs", [(1, 2), (1, -1, 2)], ids=["inserts-only", "with-retractions"])
def test_every_flat_type_of_a_row_schema(diffs: tuple[int, ...]) -> None:
    view = schema_view(FLAT_TYPES)
    rng = np.random.default_rng(5)
    updates = [(_types_row(int(k)), 0, int(rng.choice(diffs))) for k in rng.integers(0, 40, 300)]
    updates += [(None, 0, 1, "bad: x"), (None, 0, 1, "bad: x"), (None, 0, 1, "bad: a")]
    got = check_against_hash(updates_to_table(updates, view), view.row_columns)
    errors = got.filter(pc.is_valid(got[ERROR]))
    assert list(zip(errors[ERROR].to_pylist(), errors[DIFF].to_pylist(), strict=True)) == [("bad: a", 1), ("bad: x", 2)]


def test_rows_already_in_order_come_back_as_they_are_less_zero_diffs() -> None:
    view = schema_view(record("R", id="long", s="string"))
    rows = updates_to_table([({"id": i, "s": f"s{i}"}, i, d) for i, d in [(1, 1), (2, 0), (5, 2), (9, 1)]], view)
    got = consolidate_in_row_order(rows, view.row_columns)
    assert got is not None and got.to_pylist() == [
        {"id": 1, "s": "s1", ERROR: None, DIFF: 1}, {"id": 5, "s": "s5", ERROR: None, DIFF: 2},
        {"id": 9, "s": "s9", ERROR: None, DIFF: 1},
    ]
    # Increasing but for one repeated id: the general way, which sums the equal rows.
    rows = updates_to_table([({"id": i, "s": "x"}, 0, 1) for i in (1, 2, 2, 3)], view)
    got = consolidate_in_row_order(rows, view.row_columns)
    assert got is not None and got.select(["id", DIFF]).to_pylist() == [
        {"id": 1, DIFF: 1}, {"id": 2, DIFF: 2}, {"id": 3, DIFF: 1},
    ]


# -- through the read API -----------------------------------------------------------------


@pytest.mark.parametrize("schema,rows", [(FLAT, flat_rows), (NESTED, nested_rows)], ids=["flat", "lists-and-maps"])
def test_the_read_apis_snapshot_holds_the_shards_contents_in_row_order(schema: dict[str, Any], rows: Any) -> None:
    """``Collection.snapshot`` against ``Shard.snapshot`` (the hash consolidation, which the
    model tests pin to the model) at every time of a history with retractions and error rows."""
    view = schema_view(schema)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(rows))
    def check(history: list[tuple[int, list[Any]]]) -> None:
        store = MemoryObjectStore()
        shard = Shard.create(store, "sorted-api", schema)
        upper = 0
        for width, ups in history:
            batch = [(row, upper + t, d) if err is None else (None, upper + t, d, err) for (row, err), t, d in ups]
            shard.compare_and_append(batch, upper, upper + width)
            upper += width
        coll = Collection(Shard.open(store, "sorted-api"))
        for as_of in range(upper):
            want = shard.snapshot(as_of)
            got = coll.snapshot(as_of, include_errors=True)
            assert contents(got) == contents(want)
            ok = coll.snapshot(as_of)
            assert ok.column_names == [*view.row_columns, DIFF]
            assert contents(ok) == contents(want.filter(pc.is_null(want[ERROR])).select(ok.column_names))
            if schema is FLAT:
                assert in_row_order(ok, view.row_columns)
        assert contents(coll.snapshot()) == contents(coll.snapshot(upper - 1))  # default: the latest time

    check()


def test_a_snapshot_across_schema_versions_is_in_row_order() -> None:
    v1 = record("V", id="long", label="string")
    v2 = {**v1, "fields": [*v1["fields"], {"name": "score", "type": "double", "default": -0.0}]}
    store = MemoryObjectStore()
    shard = Shard.create(store, "sorted-versions", v1)
    shard.compare_and_append([({"id": i, "label": f"n{i % 3}"}, 0, 1) for i in (5, 3, 9, 3)], 0, 1)
    shard.alter_schema(v2)
    shard.compare_and_append([({"id": 3, "label": "n0", "score": -0.0}, 1, -1), ({"id": 1, "label": "n1", "score": 0.0}, 1, 1),
                              ({"id": 9, "label": "n0", "score": -0.0}, 1, 1)], 1, 2)
    got = Collection(Shard.open(store, "sorted-versions")).snapshot(1)
    # id 3 was inserted twice under v1 (its score the default, -0.0) and retracted once under
    # v2; id 1's score 0.0 is not the default's -0.0.
    assert got.column_names == ["id", "label", "score", DIFF] and TIME not in got.column_names
    assert [(r["id"], r["label"], struct.pack("<d", r["score"]), r[DIFF]) for r in got.to_pylist()] == [
        (1, "n1", struct.pack("<d", 0.0), 1),
        (3, "n0", struct.pack("<d", -0.0), 1),
        (5, "n2", struct.pack("<d", -0.0), 1),
        (9, "n0", struct.pack("<d", -0.0), 2),
    ]
