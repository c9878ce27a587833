"""The merge's consolidation equals the one it replaced (issue 31).

:func:`shared.shard_merge.consolidate` groups rows by one 64-bit hash (each row's first row of
equal hash found by a hash table built with numpy scatters, rows checked column by column
against that first row). The implementation before issue 31, a sort on every key column with
a Python fallback for the types Arrow cannot sort, is kept here as the reference
(``reference_consolidate``, as it was at 9cd4795). On the model tests' histories
(tests/shared/test_shard_compaction_model.py: flat rows with ``-0.0``, NaN, nulls, bytes,
booleans; nested rows with arrays and maps; error rows, retractions, multiplicities) and on
rows with floats inside lists, maps and records, :func:`merge_table` writes the same updates
as the reference (as a multiset: the order of the groups may differ), in the part schema,
whatever the threads, with a table of many slots or of two (every round places at most two
hashes: many rounds), and when every row's hash collides with others' (the exact fallback).
Strings read as Parquet's dictionaries (a merge's read) consolidate as their values, whatever
the chunks' dictionaries hold, and merge to the plain read's table.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared.shard_merge as shard_merge
from shared.frontier import Frontier
from shared.objectstore import MemoryObjectStore
from shared.shard_format import (
    DIFF,
    ERROR,
    SAMPLE_ROWS,
    TIME,
    encode_part,
    even_sample,
    plain_schema,
    schema_view,
    updates_to_table,
)
from shared.shard_merge import consolidate, merge_table
from shared.shard_read import read_parts
from tests.shared.test_shard_compaction_model import FLAT, NESTED, flat_rows, histories, nested_rows, record

# -- the reference: the consolidation before issue 31 -------------------------------------


def reference_consolidate(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Sort on the keys (floats by their bits, the most distinct key first), sum the diffs of
    equal neighbours; Arrow's hash aggregation, then Python, for keys Arrow cannot sort."""
    if table.num_rows == 0:
        return table.select([*keys, DIFF])
    out = _sorted(table, keys)
    if out is None:
        try:
            out = table.group_by(list(keys), use_threads=True).aggregate([(DIFF, "sum")])
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            out = _python(table, keys)
        else:
            out = out.rename_columns([*keys, DIFF])
        out = out.select([*keys, DIFF])
    out = out.cast(pa.schema([table.schema.field(n) for n in out.column_names]))
    return out.filter(pc.not_equal(out[DIFF], 0))


def reference_merge_table(table: pa.Table, since: Frontier, row_columns: Sequence[str], schema: pa.Schema) -> pa.Table:
    if since.time is not None and table.num_rows:
        advanced = pc.max_element_wise(table[TIME], pa.scalar(since.time, pa.uint64()))
        table = table.set_column(table.schema.get_field_index(TIME), TIME, advanced)
    table = reference_consolidate(table, [*row_columns, ERROR, TIME]).select(schema.names)
    return table if table.schema == schema else table.cast(schema)


def _bitwise(col: pa.ChunkedArray) -> pa.ChunkedArray:
    t = col.type
    if pa.types.is_floating(t):
        it = {16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[t.bit_width]
        return pa.chunked_array([c.view(it) for c in col.chunks], type=it)
    return col


def _most_distinct_first(keys: pa.Table) -> list[str]:
    if keys.num_columns < 2 or keys.num_rows < 2:
        return list(keys.column_names)
    distinct: dict[str, int] = {}
    for name in keys.column_names:
        try:
            distinct[name] = pc.count_distinct(even_sample(keys[name], SAMPLE_ROWS), mode="all").as_py()
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            distinct[name] = 0
    return sorted(keys.column_names, key=lambda c: -distinct[c])


def _sorted(table: pa.Table, keys: Sequence[str]) -> pa.Table | None:
    names = [f"k{i}" for i in range(len(keys))]
    try:
        sk = pa.table([_bitwise(table[k]) for k in keys], names=names)
        names = _most_distinct_first(sk)
        idx = pc.sort_indices(sk, [(n, "ascending") for n in names])
        n = table.num_rows
        same: Any = None
        for name in names if n > 1 else []:
            c = sk[name].combine_chunks().take(idx)
            a, b = c.slice(1), c.slice(0, n - 1)
            eq = pc.equal(a, b)
            if eq.null_count:
                eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
            same = eq if same is None else pc.and_(same, eq)
            if not pc.any(same).as_py():
                return table.select([*keys, DIFF])
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
        return None
    if same is None:
        return table.select([*keys, DIFF])
    starts = np.flatnonzero(np.concatenate([[True], ~same.to_numpy(zero_copy_only=False)]))
    order = idx.to_numpy()
    sums = np.add.reduceat(table[DIFF].to_numpy()[order], starts)
    out = table.select(list(keys)).take(pa.array(order[starts]))
    return out.append_column(DIFF, pa.array(sums, pa.int64()))


def _python(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    sums: dict[str, int] = {}
    first: dict[str, dict[str, Any]] = {}
    for row, d in zip(table.select(list(keys)).to_pylist(), table[DIFF].to_pylist(), strict=True):
        k = json.dumps(row, sort_keys=True, default=repr)
        sums[k] = sums.get(k, 0) + d
        first.setdefault(k, row)
    return pa.Table.from_pylist([{**first[k], DIFF: v} for k, v in sums.items()],
                                schema=table.select([*keys, DIFF]).schema)


# -- comparison ---------------------------------------------------------------------------


def canon(v: Any) -> Any:
    """A hashable value equal iff the encoded values are (floats by their bits; a map's
    entries in their order, as its bytes have them)."""
    if isinstance(v, float):
        return ("f", struct.pack(">d", v))
    if isinstance(v, dict):
        return ("r", tuple(sorted((k, canon(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return ("l", tuple(canon(x) for x in v))
    return v


def contents(table: pa.Table) -> dict[Any, int]:
    """The updates of a consolidated table: ``{(every column but _diff, canonical): diff}``;
    fails on a repeated row or a zero diff."""
    cols = [c for c in table.column_names if c != DIFF]
    out: dict[Any, int] = {}
    for r in table.to_pylist():
        key = tuple(canon(r[c]) for c in cols)
        assert key not in out, f"expected consolidated output, found {r} twice"
        assert r[DIFF] != 0, f"expected no zero diffs, found {r}"
        out[key] = r[DIFF]
    return out


def history_table(schema: dict[str, Any], history: list[tuple[int, list[Any]]]) -> tuple[pa.Table, int]:
    """Every update of a model test's history (batch i covers ``[upper, upper + width)``) as
    one table in the part schema, and the final upper."""
    updates: list[tuple[Any, ...]] = []
    upper = 0
    for width, ups in history:
        for (row, err), dt, d in ups:
            updates.append((row, upper + dt, d) if err is None else (None, upper + dt, d, err))
        upper += width
    return updates_to_table(updates, schema_view(schema)), upper


nan = math.nan
DEEP = record(
    "Deep",
    k="long",
    xs={"type": "array", "items": "double"},
    m={"type": "map", "values": "double"},
    # (nullable fields: an error row's null record does not cast to a record with a required
    # field, in updates_to_table, whatever the merge)
    r=record("Inner", a=["null", "double"], s=["null", "string"]),
)
deep_rows = st.fixed_dictionaries(
    {
        "k": st.integers(0, 1),
        "xs": st.sampled_from([[], [0.0], [-0.0], [nan], [0.0, nan], [nan, 0.0]]),
        "m": st.sampled_from([{}, {"a": 0.0}, {"a": -0.0}, {"a": nan}, {"a": 1.0, "b": 1.0}]),
        "r": st.fixed_dictionaries({"a": st.sampled_from([0.0, -0.0, nan, None]), "s": st.sampled_from([None, "x"])}),
    }
)
CASES = [(FLAT, flat_rows), (NESTED, nested_rows), (DEEP, deep_rows)]
IDS = ["flat", "nested", "floats-in-lists-maps-records"]


def check_equal(table: pa.Table, since: int, schema: dict[str, Any], threads: int) -> None:
    view = schema_view(schema)
    got = merge_table(table, Frontier.at(since), view.row_columns, view.part_schema, threads=threads)
    want = reference_merge_table(table, Frontier.at(since), view.row_columns, view.part_schema)
    assert got.schema.equals(view.part_schema), got.schema
    assert contents(got) == contents(want)


# -- the properties -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "slot_bits,parallel_rows", [(62, 1 << 15), (62, 1), (1, 1)],
    ids=["wide-table", "wide-table-threaded-steps", "two-slot-table-threaded-steps"],
)
@pytest.mark.parametrize("schema,rows", CASES, ids=IDS)
def test_merge_writes_the_updates_the_previous_merge_wrote(
    schema: dict[str, Any], rows: Any, slot_bits: int, parallel_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_merge, "_SLOT_BITS", slot_bits)
    monkeypatch.setattr(shard_merge, "_PARALLEL_ROWS", parallel_rows)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(rows), since=st.integers(0, 40), threads=st.sampled_from([1, 3]))
    def check(history: list[tuple[int, list[Any]]], since: int, threads: int) -> None:
        table, upper = history_table(schema, history)
        check_equal(table, min(since, upper), schema, threads)

    check()


@pytest.mark.parametrize("schema,rows", CASES, ids=IDS)
def test_rows_whose_hashes_collide_are_consolidated_exactly(
    schema: dict[str, Any], rows: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row's hash cut to its top 2 bits: nearly every run mixes rows that differ, and
    those runs take the exact fallback."""
    real = shard_merge._row_hash

    def coarse(columns: Any, n: int, ex: Any, threads: int) -> tuple[np.ndarray, np.ndarray]:
        h, tmp = real(columns, n, ex, threads)
        h &= np.uint64(0xC000000000000000)
        return h, tmp

    monkeypatch.setattr(shard_merge, "_row_hash", coarse)
    monkeypatch.setattr(shard_merge, "_PARALLEL_ROWS", 1)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(history=histories(rows), since=st.integers(0, 40))
    def check(history: list[tuple[int, list[Any]]], since: int) -> None:
        table, upper = history_table(schema, history)
        check_equal(table, min(since, upper), schema, 2)

    check()


def churn(rows: int, parts: int, seed: int) -> pa.Table:
    """``parts`` parts of ``rows`` rows (id, name, amount): 70 % new rows, 30 % retractions of
    rows inserted by earlier parts, part i at time i (the issue's workload, smaller)."""
    rng = np.random.default_rng(seed)
    names = np.array([f"name-{i}" for i in range(50)], dtype=object)
    live = np.empty(0, np.int64)
    tables = []
    for i in range(parts):
        k = int(rows * 0.3) if live.size else 0
        new = rng.integers(0, 2**40, rows - k)
        pick = rng.choice(live.size, size=k, replace=False) if k else np.empty(0, np.int64)
        ids = np.concatenate([new, live[pick]])
        diffs = np.concatenate([np.ones(rows - k, np.int64), -np.ones(k, np.int64)])
        live = np.concatenate([np.delete(live, pick), new])
        perm = rng.permutation(rows)
        ids, diffs = ids[perm], diffs[perm]
        tables.append(pa.table({
            "id": ids, "name": pa.array(names[ids % 50].tolist()), "amount": (ids % 977) * 0.5,
            TIME: pa.array(np.full(rows, i, np.uint64)), DIFF: diffs, ERROR: pa.nulls(rows, pa.string()),
        }))
    return pa.concat_tables(tables)


CHURN = {"type": "record", "name": "Churn", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"}, {"name": "amount", "type": "double"}]}


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_large_merge_with_retractions_equals_the_reference(threads: int) -> None:
    """80k rows in 8 parts (the hash and the take shared by the threads): retractions cancel
    across parts once times are advanced; before since they stay apart."""
    view = schema_view(CHURN)
    table = churn(10_000, 8, seed=threads).select(view.part_schema.names).cast(view.part_schema)
    for since in (8, 3):
        check_equal(table, since, CHURN, threads)
    merged = merge_table(table, Frontier.at(8), view.row_columns, view.part_schema, threads=threads)
    assert merged.num_rows == 80_000 - 2 * 7 * 3_000
    assert set(merged[DIFF].to_pylist()) == {1} and set(merged[TIME].to_pylist()) == {8}


def test_rows_all_distinct_come_back_in_their_order() -> None:
    """No two rows equal (after times are advanced): the input, as it was, less zero diffs."""
    view = schema_view(CHURN)
    n = 50_000
    table = pa.table({
        "id": pa.array(np.arange(n)[::-1], pa.int64()), "name": pa.array(["a"] * n), "amount": pa.array([0.5] * n),
        TIME: pa.array(np.arange(n), pa.uint64()), DIFF: pa.array([1] * (n - 1) + [0], pa.int64()),
        ERROR: pa.nulls(n, pa.string()),
    }).select(view.part_schema.names).cast(view.part_schema)
    got = consolidate(table, [*view.row_columns, ERROR, TIME])
    assert got["id"].to_pylist() == list(range(n - 1, 0, -1))
    assert got.num_rows == n - 1


def test_consolidation_keeps_each_groups_first_row_and_the_order_of_first_rows() -> None:
    t = pa.table({
        "x": pa.array([2.0, -0.0, 2.0, 0.0, None, -0.0, None], pa.float64()),
        DIFF: pa.array([1, 1, 1, 1, 1, -1, 2], pa.int64()),
    })
    got = consolidate(t, ["x"], threads=1)
    assert [canon(v) for v in got["x"].to_pylist()] == [canon(2.0), canon(0.0), None]
    assert got[DIFF].to_pylist() == [2, 1, 3]


@pytest.mark.parametrize("slot_bits", [62, 3, 1])
@pytest.mark.parametrize("distinct", [1, 7, 5_000, 40_000])
def test_each_rows_representative_is_the_first_row_of_its_hash(
    slot_bits: int, distinct: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash table of the consolidation (:func:`shared.shard_merge._first_rows`), by
    rounds of any width: every row maps to the first row whose hash equals its own."""
    monkeypatch.setattr(shard_merge, "_SLOT_BITS", slot_bits)
    rng = np.random.default_rng(distinct)
    n = 2_000 if slot_bits == 1 else 50_000
    values = rng.integers(0, 2**64, distinct, dtype=np.uint64, endpoint=False)
    values[: min(2, distinct)] = [0, 2**63][: min(2, distinct)]  # top bits alone tell these apart
    h = values[rng.integers(0, distinct, n)]
    first: dict[int, int] = {}
    want = np.array([first.setdefault(int(x), i) for i, x in enumerate(h.tolist())])
    got = shard_merge._first_rows(h.copy(), np.empty(n, np.uint64))
    assert got.dtype == np.int32
    assert np.array_equal(got, want)


# -- strings read as Parquet's dictionaries (a merge's read) -------------------------------

texts = st.sampled_from(["", "a", "b", "ab", None])


@st.composite
def dictionary_arrays(draw: Any) -> tuple[list[str | None], pa.ChunkedArray]:
    """Values, and the same values as a chunked dictionary array whose chunks each have their
    own dictionary: entries repeated, unused, or null, and null rows held either by a null
    index or by an index to a null entry."""
    values = draw(st.lists(texts, min_size=1, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=3)))
    chunks = []
    for a, b in zip([0, *cuts], [*cuts, len(values)], strict=True):
        part = values[a:b]
        extra = draw(st.lists(texts, max_size=3))
        distinct = sorted({v for v in part if v is not None} | set(extra), key=lambda v: (v is None, v or ""))
        entries = draw(st.permutations(distinct))
        entries = [*entries, *draw(st.lists(st.sampled_from(entries), max_size=2))] if entries else entries
        indices: list[int | None] = []
        for v in part:
            at = [i for i, e in enumerate(entries) if e == v]
            indices.append(draw(st.sampled_from(at)) if at and (v is not None or draw(st.booleans())) else None)
        chunks.append(pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(entries, pa.string())))
    return values, pa.chunked_array(chunks, type=pa.dictionary(pa.int32(), pa.string()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(column=dictionary_arrays(), data=st.data())
def test_dictionary_encoded_keys_consolidate_as_their_values(
    column: tuple[list[str | None], pa.ChunkedArray], data: st.DataObject
) -> None:
    """A key column read as Parquet's dictionaries groups by its values, whatever the chunks'
    dictionaries hold; the groups are the plain column's, in the same order."""
    values, dictionary = column
    n = len(values)
    ks = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    ds = data.draw(st.lists(st.sampled_from([-1, 1, 2]), min_size=n, max_size=n))
    encoded = pa.table({"s": dictionary, "k": pa.array(ks, pa.int64()), DIFF: pa.array(ds, pa.int64())})
    plain = pa.table({"s": pa.array(values, pa.string()), "k": pa.array(ks, pa.int64()),
                      DIFF: pa.array(ds, pa.int64())})
    assert encoded.cast(plain_schema(encoded.schema)).equals(plain)
    want = consolidate(plain, ["s", "k"], threads=1)
    got = consolidate(encoded, ["s", "k"], threads=1)
    assert got.schema.field("s").type == dictionary.type
    assert got.cast(plain.schema).equals(want)
    assert contents(want) == contents(reference_consolidate(plain, ["s", "k"]))
    # merge_table: the part schema's plain strings, materialised for the rows kept.
    schema = pa.schema([pa.field("s", pa.string()), pa.field("k", pa.int64()), pa.field(DIFF, pa.int64())])
    merged = shard_merge._consolidate(encoded, ["s", "k"], 2, plain=True)
    assert merged.schema.equals(schema)
    assert merged.equals(want)


def _part(view: Any, ids: range, names: list[str | None], errors: list[str | None]) -> bytes:
    n = len(ids)
    table = pa.table({
        "id": pa.array(list(ids), pa.int64()), "name": pa.array(names, pa.string()),
        "amount": pa.array([i * 0.5 for i in ids], pa.float64()), TIME: pa.array(list(range(n)), pa.uint64()),
        DIFF: pa.array([1] * n, pa.int64()), ERROR: pa.array(errors, pa.string()),
    }).select(view.part_schema.names).cast(view.part_schema)
    return encode_part(table, shard_id="dict", schema_fingerprint=view.fingerprint)


def test_a_merges_read_keeps_parquets_dictionaries_and_merges_the_same_rows() -> None:
    """Parts whose strings Parquet stored with a dictionary (few names, error messages) and a
    part whose names it stored plain (every name distinct): read as dictionaries where every
    part stored them so, the rows equal the plain read's, and the merge writes the same table
    in the part schema."""
    view = schema_view(CHURN)
    store = MemoryObjectStore()
    few = [None if i % 7 == 0 else f"n{i % 3}" for i in range(300)]
    store.put("a", _part(view, range(300), few, ["bad" if i % 7 == 0 else None for i in range(300)]))
    store.put("b", _part(view, range(150, 450), [f"name-{i}" for i in range(300)], [None] * 300))
    store.put("c", _part(view, range(0, 300), few, [None] * 300))
    for keys in (["a"], ["a", "c"], ["a", "b", "c"]):
        plain = read_parts(store, keys, view, threads=2)
        coded = read_parts(store, keys, view, threads=2, dictionaries=True)
        assert plain.schema.equals(view.part_schema)
        assert plain_schema(coded.schema).equals(view.part_schema)
        assert coded.cast(view.part_schema).equals(plain)
        # Names plain as soon as one part stored them plain; error messages encoded in every part.
        assert pa.types.is_dictionary(coded.schema.field("name").type) == ("b" not in keys)
        assert pa.types.is_dictionary(coded.schema.field(ERROR).type)
        for since in (0, 500):
            got = merge_table(coded, Frontier.at(since), view.row_columns, view.part_schema)
            want = merge_table(plain, Frontier.at(since), view.row_columns, view.part_schema)
            assert got.schema.equals(view.part_schema)
            assert got.equals(want)
            assert contents(got) == contents(reference_merge_table(plain, Frontier.at(since), view.row_columns,
                                                                   view.part_schema))
