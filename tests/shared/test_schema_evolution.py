"""Schema evolution (issue 16), the pure core: the compatibility check, the columnar reading of
old rows as the current schema (against fastavro's resolution, byte for byte), the shard's
schema versions (state format, snapshot, listen, compaction), the re-keying of a writer's
buffer, and the write decode's handling of rows of other schema versions.

In memory (``MemoryObjectStore``); the services against the real stack are in
``tests/services/test_schema_evolution_e2e.py``."""

from __future__ import annotations

import io
import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shared.avro_arrow import parse_row_schema, rows_to_arrow
from shared.avro_columns import ColumnCodec
from shared.codec import MARKER, RowCodec
from shared.errors import FormatError, IncompatibleSchemaError, SchemaError
from shared.frontier import Frontier
from shared.objectstore import MemoryObjectStore
from shared.schema_evolution import RULES, Resolver, check_evolution, incompatibilities
from shared.shard import DIFF, ERROR, SCHEMA_META_KEY, TIME, Shard, schema_view
from shared.state import SCHEMA_HISTORY_FORMAT_VERSION, STATE_FORMAT_VERSION, SchemaVersion, ShardState

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"


def rec(*fields: dict[str, Any], name: str = "Row") -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": list(fields)}


def f(name: str, t: Any, **kw: Any) -> dict[str, Any]:
    return {"name": name, "type": t, **kw}


ENUM = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}
ENUM_MORE = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN", "BLUE"], "default": "RED"}
ENUM_LESS_DEFAULT = {"type": "enum", "name": "Color", "symbols": ["RED"], "default": "RED"}
POINT = {"type": "record", "name": "Point", "fields": [f("x", "int")]}
POINT_Z = {"type": "record", "name": "Point", "fields": [f("x", "long"), f("z", "string", default="origin")]}

#: (name, earlier version, new version): every evolution the rules accept.
ACCEPTED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("add nullable with default null", rec(f("k", "long")), rec(f("k", "long"), f("note", ["null", "string"], default=None))),
    ("add with a default", rec(f("k", "long")), rec(f("k", "long"), f("n", "int", default=7), f("s", "string", default="x"))),
    ("add a record with a default", rec(f("k", "long")), rec(f("k", "long"), f("p", POINT, default={"x": 3}))),
    ("add an array and a map with defaults", rec(f("k", "long")),
     rec(f("k", "long"), f("xs", {"type": "array", "items": "double"}, default=[1.5]), f("m", {"type": "map", "values": "int"}, default={"b": 2, "a": 1}))),
    ("add nullable bytes and fixed", rec(f("k", "long")),
     rec(f("k", "long"), f("b", ["null", "bytes"], default=None), f("fx", ["null", {"type": "fixed", "name": "Two", "size": 2}], default=None))),
    ("add an enum with a default", rec(f("k", "long")), rec(f("k", "long"), f("c", ENUM, default="GREEN"))),
    ("remove a field that had a default", rec(f("k", "long"), f("gone", "string", default="")), rec(f("k", "long"))),
    ("make a field nullable", rec(f("k", "long"), f("s", "string")), rec(f("k", "long"), f("s", ["null", "string"]))),
    ("int to long", rec(f("n", "int")), rec(f("n", "long"))),
    ("int to float", rec(f("n", "int")), rec(f("n", "float"))),
    ("int to double", rec(f("n", "int")), rec(f("n", "double"))),
    ("long to float", rec(f("n", "long")), rec(f("n", "float"))),
    ("long to double", rec(f("n", "long")), rec(f("n", "double"))),
    ("float to double", rec(f("n", "float")), rec(f("n", "double"))),
    ("string to bytes", rec(f("s", "string")), rec(f("s", "bytes"))),
    ("nullable int to nullable long", rec(f("n", ["null", "int"])), rec(f("n", ["null", "long"]))),
    ("int to nullable long", rec(f("n", "int")), rec(f("n", ["null", "long"]))),
    ("enum symbol added", rec(f("c", ENUM)), rec(f("c", ENUM_MORE))),
    ("enum symbol removed with a default", rec(f("c", ENUM)), rec(f("c", ENUM_LESS_DEFAULT))),
    ("nested: a field added in a record, promoted in it", rec(f("p", POINT)), rec(f("p", POINT_Z))),
    ("nested: in array items and map values", rec(f("ps", {"type": "array", "items": POINT}), f("pm", {"type": "map", "values": "Point"})),
     rec(f("ps", {"type": "array", "items": POINT_Z}), f("pm", {"type": "map", "values": "Point"}))),
    ("nested: promotion in an array", rec(f("xs", {"type": "array", "items": "int"})), rec(f("xs", {"type": "array", "items": "double"}))),
    ("nested nullable record gains a field", rec(f("p", ["null", POINT], default=None)), rec(f("p", ["null", POINT_Z], default=None))),
    ("a field renamed with an alias", rec(f("old", "int")), rec(f("new", "long", aliases=["old"]))),
    ("the record renamed with an alias", rec(f("k", "long"), name="Row"), rec(f("k", "long"), name="Line") | {"aliases": ["Row"]}),
]

#: (name, earlier, new, offending field, rule): refusals.
REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("added without a default", rec(f("k", "long")), rec(f("k", "long"), f("z", "long")), "Row.z", "field-added-without-default"),
    ("removed without a default", rec(f("k", "long"), f("v", "string")), rec(f("k", "long")), "Row.v", "field-removed-without-default"),
    ("long to int", rec(f("n", "long")), rec(f("n", "int")), "Row.n", "type-changed"),
    ("double to float", rec(f("n", "double")), rec(f("n", "float")), "Row.n", "type-changed"),
    ("int to string", rec(f("n", "int")), rec(f("n", "string")), "Row.n", "type-changed"),
    ("bytes to string", rec(f("b", "bytes")), rec(f("b", "string")), "Row.b", "type-changed"),
    ("string to enum", rec(f("s", "string")), rec(f("s", ENUM)), "Row.s", "type-changed"),
    ("nullable to required", rec(f("s", ["null", "string"])), rec(f("s", "string")), "Row.s", "null-no-longer-allowed"),
    ("enum symbol removed, no default", rec(f("c", ENUM)), rec(f("c", {"type": "enum", "name": "Color", "symbols": ["RED"]})), "Row.c", "enum-symbol-removed-without-default"),
    ("enum renamed", rec(f("c", ENUM)), rec(f("c", {**ENUM, "name": "Hue"})), "Row.c", "name-changed"),
    ("fixed resized", rec(f("x", {"type": "fixed", "name": "F", "size": 2})), rec(f("x", {"type": "fixed", "name": "F", "size": 3})), "Row.x", "fixed-size-changed"),
    ("date to long", rec(f("d", {"type": "int", "logicalType": "date"})), rec(f("d", "long")), "Row.d", "logical-type-changed"),
    ("decimal scale changed", rec(f("d", {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2})),
     rec(f("d", {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 3})), "Row.d", "logical-type-changed"),
    ("nested field added without a default", rec(f("ps", {"type": "array", "items": POINT})),
     rec(f("ps", {"type": "array", "items": {"type": "record", "name": "Point", "fields": [f("x", "int"), f("y", "int")]}})), "Row.ps[].y", "field-added-without-default"),
    ("a map's values narrowed", rec(f("m", {"type": "map", "values": "long"})), rec(f("m", {"type": "map", "values": "int"})), "Row.m{}", "type-changed"),
    ("a default the type cannot hold", rec(f("k", "long")), rec(f("k", "long"), f("n", "int", default=2**40)), "Row.n", "default-does-not-fit"),
    # fastavro fills a bytes or fixed default in as the JSON text, which no row codec encodes
    ("a bytes default", rec(f("k", "long")), rec(f("k", "long"), f("b", "bytes", default="ab")), "Row.b", "default-does-not-fit"),
]


# -- the compatibility check --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "old", "new"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_every_listed_evolution_is_accepted(name: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    assert incompatibilities(old, new) == []
    assert check_evolution([old], new) == parse_row_schema(new)


@pytest.mark.parametrize(("name", "old", "new", "where", "rule"), REFUSED, ids=[c[0] for c in REFUSED])
def test_an_incompatible_schema_is_refused_naming_the_field_and_the_rule(
    name: str, old: dict[str, Any], new: dict[str, Any], where: str, rule: str
) -> None:
    try:
        check_evolution([old], new)
    except IncompatibleSchemaError as e:
        assert (e.field, e.rule, e.version) == (where, rule, 0)  # type: ignore[attr-defined]
        assert where in str(e) and rule in str(e)
        assert rule in RULES
    except SchemaError as e:  # pragma: no cover - the assertion below says what was raised
        pytest.fail(f"expected IncompatibleSchemaError, found {type(e).__name__}: {e}")
    else:
        pytest.fail("expected IncompatibleSchemaError, found the schema accepted")


def test_every_earlier_version_must_read_as_the_new_one() -> None:
    """v3 reads v2's rows (b is there) but not v1's (b has no default): refused, naming v1."""
    v1 = rec(f("a", "string"))
    v2 = rec(f("a", "string"), f("b", ["null", "int"], default=None))
    v3 = rec(f("a", "string"), f("b", ["null", "int"]))
    assert incompatibilities(v2, v3) == []
    with pytest.raises(IncompatibleSchemaError) as e:
        check_evolution([v1, v2], v3)
    assert (e.value.field, e.value.rule, e.value.version) == ("Row.b", "field-added-without-default", 0)  # type: ignore[attr-defined]


def test_a_schema_that_is_no_row_schema_is_a_schema_error_not_an_incompatibility() -> None:
    with pytest.raises(SchemaError) as e:
        check_evolution([rec(f("k", "long"))], {"type": "array", "items": "long"})
    assert not isinstance(e.value, IncompatibleSchemaError)


def test_promotions_are_the_ones_fastavro_resolves() -> None:
    """The check accepts a promotion iff fastavro's reader resolves it (bytes to string aside,
    refused on purpose): write a value with the old type and read it with the new one."""
    import fastavro

    values = {"int": 5, "long": 2**40, "float": 1.5, "double": 2.5, "string": "x", "bytes": b"x", "boolean": True}
    for w, v in values.items():
        for r in values:
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, fastavro.parse_schema(rec(f("v", w))), {"v": v})
            try:
                fastavro.schemaless_reader(io.BytesIO(buf.getvalue()), fastavro.parse_schema(rec(f("v", w))), fastavro.parse_schema(rec(f("v", r))))
                fastavro_reads = True
            except Exception:  # noqa: BLE001 - fastavro's SchemaResolutionError and friends
                fastavro_reads = False
            accepted = incompatibilities(rec(f("v", w)), rec(f("v", r))) == []
            assert accepted == (fastavro_reads and (w, r) != ("bytes", "string")), (w, r)


# -- reading old rows as the new schema: columnar == fastavro -------------------------------------


def _value(t: Any, named: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """A random value of Avro type ``t`` (parsed), with the edge cases that matter for the
    promotions: 32-bit extremes, longs that floats round, NaN and signed zeros."""
    if isinstance(t, list):
        rest = [b for b in t if b != "null"]
        return None if (not rest or rng.random() < 0.3) else _value(rest[0], named, rng, depth)
    if isinstance(t, str):
        if t in named:
            return _value(named[t], named, rng, depth)
        if t == "int":
            return rng.choice([0, -1, 2**31 - 1, -(2**31), 16_777_217, rng.randrange(-(2**31), 2**31)])
        if t == "long":
            return rng.choice([0, 2**53 + 1, 2**63 - 1, -(2**63), 2**24 + 1, rng.randrange(-(2**63), 2**63)])
        if t == "float":
            return struct.unpack("<f", struct.pack("<f", rng.choice([0.5, -0.0, math.inf, math.nan, 3.4e38, rng.uniform(-1e6, 1e6)])))[0]
        if t == "double":
            return rng.choice([0.25, -0.0, -math.inf, math.nan, 1e308, rng.uniform(-1e9, 1e9)])
        if t == "string":
            return rng.choice(["", "a", "é", "日本", "x" * rng.randrange(20)])
        if t == "bytes":
            return rng.randbytes(rng.randrange(5))
        if t == "boolean":
            return rng.random() < 0.5
        raise AssertionError(t)
    kind = t["type"]
    if kind == "record":
        named[t["name"]] = t
        return {fd["name"]: _value(fd["type"], named, rng, depth + 1) for fd in t["fields"]}
    if kind == "enum":
        named[t["name"]] = t
        return rng.choice(t["symbols"])
    if kind == "fixed":
        named[t["name"]] = t
        return rng.randbytes(t["size"])
    if kind == "array":
        return [_value(t["items"], named, rng, depth + 1) for _ in range(rng.randrange(4 if depth < 2 else 1))]
    if kind == "map":
        return {rng.choice("abcdé"): _value(t["values"], named, rng, depth + 1) for _ in range(rng.randrange(4 if depth < 2 else 1))}
    return _value(kind, named, rng, depth)


def _rows(schema: dict[str, Any], n: int, seed: int) -> list[dict[str, Any]]:
    from shared.schema_evolution import _Walk

    rng = random.Random(seed)
    parsed = parse_row_schema(schema)
    named: dict[str, Any] = {}
    _Walk().named(parsed, named)
    return [_value(parsed, named, rng) for _ in range(n)]


@pytest.mark.parametrize(("name", "old", "new"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_columnar_resolution_gives_fastavros_canonical_rows(name: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Rows of the old version, read as the new one with Arrow (decoded by the old column
    codec, resolved, encoded by the new one), are byte for byte the canonical rows fastavro's
    resolution gives (RowCodec of the new schema with the old one as a writer schema): so a
    row from an old part and the same value arriving in any version have one key."""
    rows = _rows(old, 300, seed=len(name))
    old_codec, new_codec = RowCodec(old), RowCodec(new, previous=[old])
    produced = [old_codec.encode(r) for r in rows]
    reference = [new_codec.canonical(b) for b in produced]
    decoded = ColumnCodec(old).decode(pa.array(produced, pa.binary()), skip=10)
    assert decoded.ok.all(), decoded.errors
    resolved = Resolver.of(new_codec.schema).resolve(decoded.table)
    assert resolved.schema.names == [fd["name"] for fd in new_codec.schema["fields"]]
    bodies = ColumnCodec(new).encode(resolved).to_pylist()
    assert [MARKER + new_codec.fingerprint + b for b in bodies] == reference
    # From Arrow rows as the shard stores them (rows_to_arrow of the old version): the same.
    stored = rows_to_arrow([old_codec.decode(b) for b in produced], old_codec.schema)
    again = ColumnCodec(new).encode(Resolver.of(new_codec.schema).resolve(stored)).to_pylist()
    assert again == bodies


def test_a_removed_field_and_a_rounding_promotion_make_rows_equal() -> None:
    """Two rows that differ only in a removed field, or in longs a float cannot tell apart, are
    one row in the new schema: the same key, so they consolidate."""
    old = rec(f("n", "long"), f("gone", "string", default=""))
    new = rec(f("n", "float"))
    a, b = {"n": 2**40 + 1, "gone": "a"}, {"n": 2**40, "gone": "b"}
    codec = RowCodec(new, previous=[old])
    assert codec.canonical(RowCodec(old).encode(a)) == codec.canonical(RowCodec(old).encode(b))
    table = Resolver.of(codec.schema).resolve(rows_to_arrow([a, b], old))
    assert table["n"].to_pylist()[0] == table["n"].to_pylist()[1]


# -- the shard's schema versions -------------------------------------------------------------------

V1 = rec(f("k", "long"), f("n", "int"), f("c", ENUM))
V2 = rec(f("k", "long"), f("n", "int"), f("c", ENUM), f("note", ["null", "string"], default=None))
V3 = rec(f("k", "long"), f("n", "long"), f("c", ENUM_MORE), f("note", ["null", "string"], default=None))


def _shard(**kw: Any) -> Shard:
    return Shard.create(MemoryObjectStore(), "evo", V1, since=0, **kw)


def _rows_of(table: pa.Table) -> dict[tuple[Any, ...], int]:
    cols = [c for c in table.column_names if c not in (DIFF, TIME)]
    return {tuple(r[c] for c in cols): r[DIFF] for r in table.to_pylist()}


def test_alter_records_each_version_with_the_first_upper_from_which_it_holds() -> None:
    sh = _shard()
    sh.compare_and_append([({"k": 1, "n": 1, "c": "RED"}, 0, 1)], 0, 3)
    s2 = sh.alter_schema(V2)
    sh.compare_and_append(None, 3, 5)
    s3 = sh.alter_schema(V3)
    assert [v.from_upper for v in s3.versions] == [Frontier.minimum(), Frontier.at(3), Frontier.at(5)]
    assert [v.schema for v in s3.versions] == [parse_row_schema(s) for s in (V1, V2, V3)]
    assert s3.schema == parse_row_schema(V3) and s2.seqno < s3.seqno
    assert sh.alter_schema(V3).seqno == s3.seqno  # the current schema again: nothing written
    # a fresh handle decodes the history (format 2)
    again = Shard.open(sh.store, "evo").refresh()
    assert again.versions == s3.versions
    assert json.loads(sh.store.get(sh.state_key(again.seqno)))["format"] == SCHEMA_HISTORY_FORMAT_VERSION


def test_an_incompatible_alter_leaves_the_shard_unchanged() -> None:
    sh = _shard()
    before = sh.refresh()
    with pytest.raises(IncompatibleSchemaError) as e:
        sh.alter_schema(rec(f("k", "int"), f("n", "int"), f("c", ENUM)))
    assert (e.value.field, e.value.rule) == ("Row.k", "type-changed")  # type: ignore[attr-defined]
    after = Shard.open(sh.store, "evo").refresh()
    assert after.seqno == before.seqno and after.schema == before.schema and len(after.versions) == 1


def test_snapshot_listen_and_reads_before_the_alter_are_in_the_current_schema() -> None:
    sh = _shard()
    sh.compare_and_append([({"k": 1, "n": 10, "c": "RED"}, 0, 1), ({"k": 2, "n": 20, "c": "GREEN"}, 1, 1), (None, 1, 1, "bad")], 0, 2)
    sh.alter_schema(V2)
    sh.compare_and_append([({"k": 3, "n": 30, "c": "RED", "note": "v2"}, 2, 1)], 2, 3)
    sh.alter_schema(V3)
    # v3: retract the v1 row k=1 (its n promoted to long, note null by default)
    sh.compare_and_append([({"k": 1, "n": 10, "c": "RED", "note": None}, 3, -1), ({"k": 4, "n": 2**40, "c": "BLUE", "note": None}, 3, 1)], 3, 4)
    view = schema_view(sh.refresh().schema)
    early = sh.snapshot(0)  # a time before both alters: rows in the current schema
    assert early.schema.names == [*view.row_columns, ERROR, DIFF]
    assert early.schema.field("n").type == pa.int64()
    assert _rows_of(early) == {(1, 10, "RED", None, None): 1}
    assert _rows_of(sh.snapshot(3)) == {
        (2, 20, "GREEN", None, None): 1,
        (3, 30, "RED", "v2", None): 1,
        (4, 2**40, "BLUE", None, None): 1,
        (None, None, None, None, "bad"): 1,
    }
    events = list(sh.listen(0, timeout_s=0.0, stop=lambda: False, poll_s=0.01))
    assert events and all(e.updates.schema.names == view.part_schema.names for e in events)
    changes = {(r["k"], r[TIME], r[DIFF]) for e in events for r in e.updates.to_pylist() if r[ERROR] is None}
    assert changes == {(2, 1, 1), (3, 2, 1), (1, 3, -1), (4, 3, 1)}


def test_compaction_writes_merged_parts_in_the_current_schema() -> None:
    sh = _shard()
    sh.compare_and_append([({"k": 1, "n": 10, "c": "RED"}, 0, 1), (None, 0, 1, "bad")], 0, 1)
    sh.alter_schema(V3)
    sh.compare_and_append([({"k": 1, "n": 10, "c": "RED", "note": None}, 1, -1), ({"k": 2, "n": 5, "c": "BLUE", "note": "x"}, 1, 1)], 1, 2)
    sh.register_reader("r", kind="critical")
    sh.downgrade_since("r", 2)
    assert sh.compact_below_since()
    head = sh.refresh()
    (batch,) = head.batches
    (part,) = batch.parts
    table = pq.read_table(io.BytesIO(sh.store.get(part.key)))  # plain pyarrow, no shardsink code
    assert table.schema.field("n").type == pa.int64() and "note" in table.column_names
    assert table.schema.metadata[SCHEMA_META_KEY] == schema_view(head.schema).fingerprint.encode()
    assert {(r["k"], r["note"], r[ERROR], r[DIFF]) for r in table.to_pylist()} == {(2, "x", None, 1), (None, None, "bad", 1)}


def test_parts_name_the_schema_they_were_written_in() -> None:
    sh = _shard()
    sh.compare_and_append([({"k": 1, "n": 1, "c": "RED"}, 0, 1)], 0, 1)
    sh.alter_schema(V2)
    sh.compare_and_append([({"k": 2, "n": 2, "c": "RED", "note": "x"}, 1, 1)], 1, 2)
    keys = [b.parts[0].key for b in sh.refresh().batches]
    written = sh.read_parts_as_written(keys)
    assert [w for w, _ in written] == [parse_row_schema(V1), parse_row_schema(V2)]
    assert written[0][1].column_names == ["k", "n", "c", TIME, DIFF, ERROR]


def test_create_opens_a_shard_whose_schema_was_altered_given_any_of_its_versions() -> None:
    sh = _shard()
    sh.alter_schema(V2)
    assert Shard.create(sh.store, "evo", V1).refresh().schema == parse_row_schema(V2)


# -- the state format ------------------------------------------------------------------------------


def _altered_golden() -> ShardState:
    from dataclasses import replace

    from tests.state_fixture import SCHEMA, golden_state

    v2 = {**SCHEMA, "fields": [*SCHEMA["fields"], {"name": "note", "type": ["null", "string"], "default": None}]}
    base = golden_state()
    return replace(base, schema=parse_row_schema(v2),
                   schema_versions=(SchemaVersion(parse_row_schema(SCHEMA), Frontier.minimum()), SchemaVersion(parse_row_schema(v2), Frontier.at(20))))


def test_the_v2_golden_state_decodes_and_encodes_byte_stable() -> None:
    """An altered shard's state (format 2, with its schema versions); if this fails the format
    changed: bump it and add a fixture."""
    data = (FIXTURES / "v2.json").read_bytes()
    assert ShardState.decode(data) == _altered_golden()
    assert _altered_golden().encode() == data
    assert json.loads(data)["format"] == SCHEMA_HISTORY_FORMAT_VERSION == 2


def test_a_state_with_one_schema_stays_format_1_and_v1_states_decode() -> None:
    from tests.state_fixture import golden_state

    old = ShardState.decode((FIXTURES / "v1.json").read_bytes())
    assert old.versions == (SchemaVersion(old.schema, Frontier.minimum()),)
    assert json.loads(golden_state().encode())["format"] == STATE_FORMAT_VERSION == 1


@pytest.mark.parametrize("mutate", ["no versions", "one version", "last is not the schema"])
def test_a_format_2_state_without_a_consistent_history_is_a_format_error(mutate: str) -> None:
    d = json.loads((FIXTURES / "v2.json").read_bytes())
    if mutate == "no versions":
        del d["schema_versions"]
    elif mutate == "one version":
        d["schema_versions"] = d["schema_versions"][:1]
    else:
        d["schema_versions"][-1]["schema"] = d["schema_versions"][0]["schema"]
    with pytest.raises(FormatError):
        ShardState.decode(json.dumps(d).encode())


# -- the writer's buffer ---------------------------------------------------------------------------


def test_rekeying_makes_old_and_new_keys_of_one_row_meet() -> None:
    """A v1 insert buffered before the alter and the v3 retraction of the same row cancel once
    the buffer is re-keyed; rows that the new schema makes equal consolidate; staged batches
    are re-keyed too."""
    from shared.sink_messages import BatchDescription
    from shared.write_state import Stage, WriteState

    v1, v3 = RowCodec(V1), RowCodec(V3, previous=[V1])
    row = {"k": 1, "n": 10, "c": "RED"}
    ws = WriteState("s", 0, 1)
    ws.absorb_persist_snapshot(0, [], [])
    ws.absorb_desired_progress(0)
    ws.absorb_desired_updates([v1.encode(row), v1.encode({"k": 2, "n": 1, "c": "GREEN"})], [5, 5], [1, 1])
    desc = BatchDescription("s", Frontier.at(0), Frontier.at(10), 0, "tok", partition_count=1)
    upd = ws.correction.updates_before(10)
    ws.remember_staged(desc, ["part-1"], Stage(desc, 0, upd, ws.errors.updates_before(10)))

    def convert(keys: pa.Array) -> pa.Array:
        return pa.array([v3.canonical(k) for k in keys.to_pylist()], pa.binary())

    assert ws.rekey(v3.fingerprint, convert) == 4
    ws.absorb_desired_updates([v3.encode({**row, "note": None})], [5], [-1])
    left = ws.correction.contents().to_list()
    assert left == [(v3.encode({"k": 2, "n": 1, "c": "GREEN", "note": None}), 5, 1)]
    staged, _ = ws.take_staged("part-1")
    assert {k for k, _, _ in staged.to_list()} == {v3.canonical(v1.encode(row)), v3.encode({"k": 2, "n": 1, "c": "GREEN", "note": None})}
    restored = WriteState.from_checkpoint(ws.to_checkpoint())
    assert restored.key_schema == v3.fingerprint


# -- the write decode -----------------------------------------------------------------------------


def test_the_write_decode_leaves_rows_of_other_versions_to_the_write_step() -> None:
    """With ``route_to`` (the write service), a row of another schema version (older or newer
    than the decoder's, which is fixed when the query starts) is ``unresolved`` with its bytes,
    time and diff; without it, a ``bad`` record as before. A row of no single-object framing is
    bad either way."""
    from services.sinkio import KIND_BAD, KIND_UNRESOLVED, KIND_UPDATE, decode_partition
    from shared.desired import encode_update

    v1, v2 = RowCodec(V1), RowCodec(V2, previous=[V1])
    values = [
        encode_update(v1.encode({"k": 1, "n": 1, "c": "RED"}), 5, 1),
        encode_update(v2.encode({"k": 2, "n": 2, "c": "RED", "note": "x"}), 6, -1),
        encode_update(b"not a row", 7, 1),
    ]
    batch = pa.RecordBatch.from_pydict({
        "topic": ["d"] * 3, "partition": pa.array([0] * 3, pa.int32()), "offset": pa.array([0, 1, 2], pa.int64()),
        "value": pa.array(values, pa.binary()),
    })
    (write,) = list(decode_partition("d", json.dumps(V1), route_to=1)([batch]))
    assert write.column("kind").to_pylist() == [KIND_UPDATE, KIND_UNRESOLVED, KIND_BAD]
    assert write.column("row").to_pylist()[1] == v2.encode({"k": 2, "n": 2, "c": "RED", "note": "x"})
    assert write.column("time").to_pylist()[1] == 6 and write.column("diff").to_pylist()[1] == -1
    (plain,) = list(decode_partition("d", json.dumps(V1))([batch]))
    assert plain.column("kind").to_pylist() == [KIND_UPDATE, KIND_BAD, KIND_BAD]


def test_the_resolver_passes_tables_already_in_the_current_schema_through() -> None:
    plain = Resolver.of(parse_row_schema(V2))
    t2 = rows_to_arrow([{"k": 1, "n": 2, "c": "RED", "note": None}], V2)
    assert plain.is_current(t2.schema)
    out = plain.resolve(t2)
    assert all(out.column(n).chunks[0].buffers() == t2.column(n).chunks[0].buffers() for n in t2.column_names)
    # an enum with a default maps symbols, so a table of that schema is not taken as is
    assert not Resolver.of(parse_row_schema(V3)).is_current(rows_to_arrow([{"k": 1, "n": 2, "c": "RED", "note": None}], V3).schema)
