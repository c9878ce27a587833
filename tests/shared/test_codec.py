"""Codecs of every topic and of rows: round trips, golden fixtures, fuzzing, interop with plain
fastavro, schema evolution and the Confluent framing (pure, no I/O)."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import fingerprint as fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.codec import (
    MARKER,
    NAMESPACE,
    SCHEMA_NAMES,
    Codec,
    InMemorySchemaRegistry,
    RowCodec,
    crc64_avro,
    fingerprint,
    kind_of,
    load_schema,
    message_codec,
    previous_schemas,
    tagged,
)
from shared.errors import CodecError, DecodeError, EncodeError, SchemaError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "avro"
ROW = b"\xc3\x01" + bytes(8) + b"\x02\x06abc"  # any bytes: rows are opaque to message codecs
BIG = 2**64 - 1  # the largest u64 time

# Every union branch of every schema, with edge values (u64 times >= 2**63, empty frontiers).
EXAMPLES: dict[str, list[Any]] = {
    "command": [
        {
            "command_id": "c1",
            "issued_at_ms": 1700000000000,
            "body": tagged(
                "CreateCollection",
                {
                    "collection_id": "orders",
                    "row_schema": '{"type":"record","name":"R","fields":[{"name":"k","type":"long"}]}',
                    "initial_since": 0,
                    "read_policy": tagged(
                        "Multiple",
                        {
                            "policies": [
                                tagged("ValidFrom", {"frontier": 5}),
                                tagged("LagWritesBy", {"lag": 1000, "granularity": None}),
                            ]
                        },
                    ),
                },
            ),
        },
        {
            "command_id": "c2",
            "issued_at_ms": None,
            "body": tagged(
                "CreateCollection",
                {
                    "collection_id": "x",
                    "row_schema": "{}",
                    "initial_since": BIG,
                    "read_policy": None,
                },
            ),
        },
        {
            "command_id": "c3",
            "issued_at_ms": None,
            "body": tagged("AlterCollection", {"collection_id": "x", "row_schema": "{}"}),
        },
        {
            "command_id": "c4",
            "issued_at_ms": None,
            "body": tagged("DropCollection", {"collection_id": "x"}),
        },
        {
            "command_id": "c5",
            "issued_at_ms": None,
            "body": tagged(
                "CreateSink",
                {
                    "sink_id": "s",
                    "collection_id": "x",
                    "desired_topic": "desired-x",
                    "as_of": None,
                    "read_only": True,
                    "options": {"kafka.security.protocol": "SASL_SSL"},
                    "adopt_shard": False,
                    "replace_contents": True,
                },
            ),
        },
        {"command_id": "c6", "issued_at_ms": None, "body": tagged("DropSink", {"sink_id": "s"})},
        {
            "command_id": "c7",
            "issued_at_ms": None,
            "body": tagged("AllowWrites", {"sink_ids": None}),
        },
        {
            "command_id": "c8",
            "issued_at_ms": None,
            "body": tagged("AllowWrites", {"sink_ids": ["a", "b"]}),
        },
        {
            "command_id": "c9",
            "issued_at_ms": None,
            "body": tagged(
                "Append",
                {
                    "collection_id": "x",
                    "updates": [
                        {"row": ROW, "time": 3, "diff": 1},
                        {"row": ROW, "time": 2**63, "diff": -2},
                    ],
                    "expected_upper": 3,
                    "new_upper": None,
                    "staged_parts": [],
                },
            ),
        },
        {
            "command_id": "c9s",
            "issued_at_ms": None,
            "body": tagged(
                "Append",
                {
                    "collection_id": "x",
                    "updates": [],
                    "expected_upper": None,
                    "new_upper": 9,
                    "staged_parts": ["shards/x/data/0123.parquet", "shards/x/data/4567.parquet"],
                },
            ),
        },
        {
            "command_id": "c10",
            "issued_at_ms": None,
            "body": tagged(
                "SetReadPolicy",
                {"collection_id": "x", "policy": tagged("ValidFrom", {"frontier": None})},
            ),
        },
        {
            "command_id": "c11",
            "issued_at_ms": None,
            "body": tagged(
                "Peek",
                {"collection_id": "x", "as_of": 7, "limit": 10, "max_inline_bytes": None},
            ),
        },
        {
            "command_id": "c12",
            "issued_at_ms": None,
            "body": tagged("CancelPeek", {"peek_command_id": "c11"}),
        },
        {
            "command_id": "c13",
            "issued_at_ms": None,
            "body": tagged(
                "Subscribe",
                {
                    "collection_id": "x",
                    "output_topic": "sub-x",
                    "as_of": 0,
                    "up_to": BIG,
                    "with_snapshot": False,
                },
            ),
        },
        {
            "command_id": "c14",
            "issued_at_ms": None,
            "body": tagged("CancelSubscribe", {"subscribe_command_id": "c13"}),
        },
    ],
    "response": [
        {
            "command_id": "c1",
            "emitted_at_ms": 1,
            "body": tagged("Ack", {"results": {"since": "0"}}),
        },
        {
            "command_id": "c11",
            "emitted_at_ms": None,
            "body": tagged(
                "Error",
                {
                    "kind": "ReadBeforeSince",
                    "message": "expected as_of >= since 10, found 3",
                    "fields": {"since": "10", "as_of": "3"},
                },
            ),
        },
        {
            "command_id": None,
            "emitted_at_ms": None,
            "body": tagged("FrontierUpper", {"collection_id": "x", "upper": 12}),
        },
        {
            "command_id": None,
            "emitted_at_ms": None,
            "body": tagged("FrontierUpper", {"collection_id": "x", "upper": None}),
        },
        {
            "command_id": "c11",
            "emitted_at_ms": None,
            "body": tagged(
                "PeekResult",
                {
                    "collection_id": "x",
                    "as_of": 7,
                    "result": tagged("InlineRows", {"rows": [{"row": ROW, "count": 2}]}),
                },
            ),
        },
        {
            "command_id": "c11",
            "emitted_at_ms": None,
            "body": tagged(
                "PeekResult",
                {
                    "collection_id": "x",
                    "as_of": BIG,
                    "result": tagged(
                        "StoredRows",
                        {
                            "bucket": "b",
                            "key": "peeks/c11.parquet",
                            "format": "parquet",
                            "row_count": 1000000,
                        },
                    ),
                },
            ),
        },
        {
            "command_id": "c12",
            "emitted_at_ms": None,
            "body": tagged("PeekCanceled", {"peek_command_id": "c11"}),
        },
    ],
    "desired": [
        {"message": tagged("Update", {"row": ROW, "time": 1700000000000, "diff": 1})},
        {"message": tagged("Update", {"row": b"", "time": BIG, "diff": -(2**63)})},
        {"message": tagged("Progress", {"partition": 3, "frontier": 1700000000001})},
        {"message": tagged("Progress", {"partition": 0, "frontier": None})},
    ],
    "batch_description": [
        {
            "sink_id": "s",
            "lower": 10,
            "upper": 20,
            "epoch": 2,
            "token": "2:10:ab",
            "append_worker": 1,
            "partition_count": 4,
            "minted_at_ms": 1700000000000,
            "appended": {"lower": 5, "parts": ["x/data/a-w0of4.parquet", "x/data/b-w3of4.parquet"], "schema_versions": 2},
        },
        {
            "sink_id": "s",
            "lower": 2**63 + 1,
            "upper": None,
            "epoch": 0,
            "token": "t",
            "append_worker": 0,
            "partition_count": 1,
            "minted_at_ms": 0,
            "appended": None,
        },
    ],
    "written_batch": [
        {
            "sink_id": "s",
            "desc_token": "2:10:ab",
            "epoch": 2,
            "lower": 10,
            "upper": 20,
            "writer_partition": 3,
            "partition_count": 4,
            "staged_batch": '{"keys": ["s/parts/abc.parquet"]}',
            "rows": 17,
            "empty": False,
            "written_at_ms": 1700000000000,
        },
        {
            "sink_id": "s",
            "desc_token": "t",
            "epoch": 0,
            "lower": 10,
            "upper": None,
            "writer_partition": 0,
            "partition_count": 1,
            "staged_batch": None,
            "rows": 0,
            "empty": True,
            "written_at_ms": 0,
        },
    ],
    "frontier_update": [
        {"shard_id": "x", "sink_id": "s", "upper": 20, "desc_token": "2:10:ab", "updated_at_ms": 5,
         "appended": {"lower": 10, "parts": ["x/data/a-w0of4.parquet"], "schema_versions": 1}},
        {"shard_id": "x", "sink_id": None, "upper": None, "desc_token": None, "updated_at_ms": 0, "appended": None},
        {"shard_id": "x", "sink_id": "s", "upper": 2**63 + 1, "desc_token": "t", "updated_at_ms": 0,
         "appended": {"lower": 2**63, "parts": [], "schema_versions": 3}},
    ],
    "subscribe_output": [
        {"subscribe_id": "c13", "time": 5, "progressed": False, "diff": 1, "row": ROW, "error": None},
        {"subscribe_id": "c13", "time": 5, "progressed": False, "diff": 1, "row": None,
         "error": "update at desired-orders/0@41: expected an int, found 2147483648"},
        {"subscribe_id": "c13", "time": 6, "progressed": True, "diff": None, "row": None, "error": None},
        {"subscribe_id": "c13", "time": None, "progressed": True, "diff": None, "row": None, "error": None},
    ],
}


def all_examples() -> list[tuple[str, Any]]:
    return [(name, v) for name in SCHEMA_NAMES for v in EXAMPLES[name]]


# -- JSON form of decoded values (bytes and union tuples) for the golden fixtures -------------


def to_json(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, tuple):
        return {"$record": v[0], "value": to_json(v[1])}
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_json(x) for x in v]
    return v


def from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$bytes"}:
            return bytes.fromhex(v["$bytes"])
        if set(v) == {"$record", "value"}:
            return (v["$record"], from_json(v["value"]))
        return {k: from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json(x) for x in v]
    return v


def version_of(name: str) -> int:
    """The current schema's version: 1 + its older versions under ``schemas/previous/``."""
    return 1 + len(previous_schemas(name))


def regenerate_fixtures() -> None:  # pragma: no cover - run by hand after a schema version bump
    """Writes the current version's fixture of every schema; older versions' fixtures stay as
    they are (the bytes an older writer produced)."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in SCHEMA_NAMES:
        value = EXAMPLES[name][0]
        v = version_of(name)
        (FIXTURES / f"{name}-v{v}.bin").write_bytes(message_codec(name).encode(value))
        (FIXTURES / f"{name}-v{v}.json").write_text(
            json.dumps(to_json(value), indent=1, sort_keys=True) + "\n"
        )


if os.environ.get("SHARDSINK_REGENERATE_FIXTURES") == "1":  # pragma: no cover
    regenerate_fixtures()


# -- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_schema_is_named_namespaced_and_documented(name: str) -> None:
    schema = load_schema(name)
    assert schema["namespace"] == NAMESPACE
    assert schema["type"] == "record"
    assert schema["doc"]

    def walk(s: Any) -> None:
        if isinstance(s, list):
            for b in s:
                walk(b)
        elif isinstance(s, dict):
            if s.get("type") == "record":
                assert s.get("doc"), s["name"]
                for f in s["fields"]:
                    assert f.get("doc"), f"{s['name']}.{f['name']} has no doc"
                    walk(f["type"])
            elif s.get("type") == "array":
                walk(s["items"])
            elif s.get("type") == "map":
                walk(s["values"])

    walk(schema)


def union_branches_used(v: Any, seen: set[str]) -> set[str]:
    """The record names of every union value in a decoded value."""
    if isinstance(v, tuple):
        seen.add(v[0].rsplit(".", 1)[-1])
        union_branches_used(v[1], seen)
    elif isinstance(v, dict):
        for x in v.values():
            union_branches_used(x, seen)
    elif isinstance(v, list):
        for x in v:
            union_branches_used(x, seen)
    return seen


def union_branches_declared(s: Any, declared: set[str]) -> set[str]:
    """The record names that are branches of unions of several records in a parsed schema."""
    if isinstance(s, list):
        records = [b for b in s if b != "null"]
        for b in records:
            if len(records) > 1:
                declared.add((b if isinstance(b, str) else b["name"]).rsplit(".", 1)[-1])
            union_branches_declared(b, declared)
    elif isinstance(s, dict):
        for f in s.get("fields", []):
            union_branches_declared(f["type"], declared)
        if s.get("type") == "array":
            union_branches_declared(s["items"], declared)
    return declared


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_schema_has_examples_for_every_union_branch(name: str) -> None:
    codec = message_codec(name)
    seen: set[str] = set()
    for example in EXAMPLES[name]:
        union_branches_used(codec.decode(codec.encode(example)), seen)
    assert union_branches_declared(codec._parsed, set()) <= seen


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), all_examples())
def test_every_message_round_trips(name: str, value: Any) -> None:
    codec = message_codec(name)
    data = codec.encode(value)
    assert data[:2] == MARKER
    assert data[2:10] == codec.fingerprint
    assert codec.decode(data) == value


def test_union_helpers_name_the_kind() -> None:
    codec = message_codec("command")
    decoded = codec.decode(codec.encode(EXAMPLES["command"][0]))
    assert kind_of(decoded["body"]) == "CreateCollection"
    assert decoded["body"][0] == f"{NAMESPACE}.CreateCollection"
    assert tagged(f"{NAMESPACE}.Peek", {})[0] == f"{NAMESPACE}.Peek"
    with pytest.raises(DecodeError):
        kind_of({"not": "a union"})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"message": tagged("Update", {"row": b"", "time": 2**64, "diff": 1})}, "u64"),
        ({"message": tagged("Update", {"row": b"", "time": -1, "diff": 1})}, "u64"),
        ({"message": tagged("Update", {"row": b"", "time": True, "diff": 1})}, "u64"),
        ({"message": tagged("Update", {"row": "text", "time": 1, "diff": 1})}, "does not encode"),
        ({"message": tagged("Update", {"row": b"", "time": 1})}, "does not encode"),
        (
            {"message": tagged("Update", {"row": b"", "time": 1, "diff": 1, "x": 1})},
            "does not encode",
        ),
        ({"message": tagged("Nope", {})}, "does not encode"),
        ({"message": tagged("Update", {"row": b"", "time": 1, "diff": 2**63})}, "does not encode"),
    ],
)
def test_values_that_do_not_fit_raise_encode_error(value: Any, message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        message_codec("desired").encode(value)


# -- golden fixtures -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_golden_fixture_decodes_to_its_json_and_encodes_to_its_bytes(name: str) -> None:
    v = version_of(name)
    data = (FIXTURES / f"{name}-v{v}.bin").read_bytes()
    expected = from_json(json.loads((FIXTURES / f"{name}-v{v}.json").read_text()))
    codec = message_codec(name)
    assert codec.decode(data) == expected
    assert codec.encode(expected) == data
    assert expected == EXAMPLES[name][0]


@pytest.mark.parametrize("name", [n for n in SCHEMA_NAMES if version_of(n) > 1])
def test_older_golden_fixtures_still_decode_with_the_new_fields_defaults(name: str) -> None:
    """Bytes an older writer put on a topic stay readable after a schema change: every field
    they had decodes as before, and each field added since takes its default."""
    current = {f["name"]: f for f in load_schema(name)["fields"]}
    for v in range(1, version_of(name)):
        data = (FIXTURES / f"{name}-v{v}.bin").read_bytes()
        old = from_json(json.loads((FIXTURES / f"{name}-v{v}.json").read_text()))
        decoded = message_codec(name).decode(data)
        assert {k: decoded[k] for k in old} == old
        assert {k: decoded[k] for k in decoded if k not in old} == {
            k: f["default"] for k, f in current.items() if k not in old
        }


def test_golden_fixtures_are_tiny() -> None:
    sizes = {p.name: p.stat().st_size for p in FIXTURES.glob("*.bin")}
    assert set(sizes) == {f"{n}-v{v}.bin" for n in SCHEMA_NAMES for v in range(1, version_of(n) + 1)}
    assert max(sizes.values()) < 512


# -- fingerprints and interop with plain fastavro ---------------------------------------------


def test_crc64_avro_matches_the_specification_and_fastavro() -> None:
    # The Avro specification's Java reference gives 0x7275d51a3f395c8f for the schema "int".
    assert crc64_avro(b'"int"') == 0x7275D51A3F395C8F
    for name in SCHEMA_NAMES:
        parsed = fastavro.parse_schema(load_schema(name))
        expected = fastavro_fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO")
        assert fingerprint(load_schema(name)).hex() == expected


def test_a_fingerprint_ignores_docs_and_logical_annotations() -> None:
    schema = load_schema("frontier_update")
    stripped = json.loads(json.dumps(schema).replace('"logicalType": "u64"', '"doc": "x"'))
    assert fingerprint(stripped) == fingerprint(schema)


@pytest.mark.parametrize(("name", "value"), all_examples())
def test_plain_fastavro_reads_our_body_and_we_read_a_plain_fastavro_body(
    name: str, value: Any
) -> None:
    schema = load_schema(name)
    plain = fastavro.parse_schema(copy.deepcopy(schema))
    ours = message_codec(name)
    # fastavro reads what we write
    data = ours.encode(value)
    read = fastavro.schemaless_reader(
        io.BytesIO(data[10:]),
        plain,
        None,
        return_record_name=True,
        return_record_name_override=True,
    )
    assert read == value
    # we read what fastavro writes (framed by hand with fastavro's own fingerprint)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, plain, value)
    fp = bytes.fromhex(fastavro_fingerprint(to_parsing_canonical_form(plain), "CRC-64-AVRO"))
    assert ours.decode(MARKER + fp + buf.getvalue()) == value
    assert MARKER + fp + buf.getvalue() == data


def test_times_at_or_above_2_63_are_twos_complement_longs_for_a_plain_reader() -> None:
    codec = message_codec("desired")
    data = codec.encode({"message": tagged("Progress", {"partition": 0, "frontier": 2**63 + 5})})
    # a reader that does not know the u64 logical type sees the signed long
    unaware = json.loads(
        json.dumps(load_schema("desired")).replace('"logicalType": "u64"', '"doc": "t"')
    )
    read = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), fastavro.parse_schema(unaware), None, return_record_name=True
    )
    assert read["message"][1]["frontier"] == 2**63 + 5 - 2**64
    assert codec.decode(data)["message"][1]["frontier"] == 2**63 + 5
    # and times below 2**63 are the same number for both readers
    small = codec.encode({"message": tagged("Progress", {"partition": 0, "frontier": 2**63 - 1})})
    read = fastavro.schemaless_reader(
        io.BytesIO(small[10:]), fastavro.parse_schema(unaware), None, return_record_name=True
    )
    assert read["message"][1]["frontier"] == 2**63 - 1


# -- bad bytes -------------------------------------------------------------------------------


def test_bad_bytes_raise_typed_decode_errors() -> None:
    codec = message_codec("desired")
    good = codec.encode(EXAMPLES["desired"][0])
    with pytest.raises(DecodeError, match="header of 10 bytes"):
        codec.decode(good[:7])
    with pytest.raises(DecodeError, match="do not decode"):
        codec.decode(good[:-1])
    with pytest.raises(DecodeError, match="trailing bytes"):
        codec.decode(good + b"\x00")
    with pytest.raises(DecodeError, match="fingerprint known") as info:
        codec.decode(message_codec("frontier_update").encode(EXAMPLES["frontier_update"][0]))
    assert info.value.fingerprint == message_codec("frontier_update").fingerprint.hex()
    with pytest.raises(DecodeError, match="starting with 0xC301"):
        codec.decode(b"")
    with pytest.raises(DecodeError, match="starting with 0xC301"):
        codec.decode(b"\x00\x00\x00\x00\x01\x02")  # Confluent framing without a registry
    with pytest.raises(DecodeError, match="expected bytes"):
        codec.decode("text")  # type: ignore[arg-type]


_SAMPLES = [(name, message_codec(name).encode(v)) for name, v in all_examples()]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(SCHEMA_NAMES), data=st.binary(max_size=200))
def test_random_bytes_only_ever_raise_decode_error(name: str, data: bytes) -> None:
    codec = message_codec(name)
    for candidate in (data, MARKER + codec.fingerprint + data):
        try:
            codec.decode(candidate)
        except DecodeError:
            pass


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    name, data = draw(st.sampled_from(_SAMPLES))
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            b[i] = draw(st.integers(0, 255))
        elif op == "insert":
            b.insert(i, draw(st.integers(0, 255)))
        elif op == "delete":
            del b[i]
        else:
            del b[i:]
    return name, bytes(b)


@settings(max_examples=600, deadline=None)
@given(mutated())
def test_mutated_messages_decode_or_raise_decode_error_only(case: tuple[str, bytes]) -> None:
    name, data = case
    codec = message_codec(name)
    try:
        value = codec.decode(data)
    except DecodeError as e:
        assert isinstance(e, CodecError)
        assert str(e).startswith("expected")
    else:
        # whatever decodes is a valid value of the schema: it encodes and decodes back to
        # itself (not necessarily to the same bytes: Avro readers accept over-long varints,
        # any non-zero boolean byte, and fastavro a negative union index)
        assert codec.decode(codec.encode(value)) == value


# -- schema evolution ------------------------------------------------------------------------

V1: dict[str, Any] = {
    "type": "record",
    "name": "Thing",
    "namespace": "test.evolve",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "time", "type": {"type": "long", "logicalType": "u64"}},
        {"name": "dropped", "type": "int"},
    ],
}
V2: dict[str, Any] = {
    "type": "record",
    "name": "Thing",
    "namespace": "test.evolve",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "time", "type": {"type": "long", "logicalType": "u64"}},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "count", "type": "long", "default": 1},
    ],
}


def test_an_older_writer_schema_resolves_to_the_current_reader_schema() -> None:
    old = Codec(V1).encode({"id": "a", "time": 2**64 - 2, "dropped": 9})
    new = Codec(V2, previous=[V1])
    assert new.decode(old) == {"id": "a", "time": 2**64 - 2, "note": None, "count": 1}
    assert new.decode(new.encode({"id": "b", "time": 1, "note": "n", "count": 2}))["note"] == "n"


def test_an_unregistered_older_schema_is_an_unknown_fingerprint() -> None:
    old = Codec(V1).encode({"id": "a", "time": 1, "dropped": 9})
    with pytest.raises(DecodeError, match="fingerprint"):
        Codec(V2).decode(old)


def test_an_incompatible_writer_schema_gives_decode_errors_not_crashes() -> None:
    incompatible = {
        "type": "record",
        "name": "Thing",
        "namespace": "test.evolve",
        "fields": [{"name": "id", "type": "int"}],
    }
    codec = Codec(V2, previous=[incompatible])
    with pytest.raises(DecodeError):
        codec.decode(Codec(incompatible).encode({"id": 3}))


def test_previous_schema_files_are_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shared.codec as codec_mod

    (tmp_path / "previous").mkdir()
    for name in SCHEMA_NAMES:
        (tmp_path / f"{name}.avsc").write_text(json.dumps(load_schema(name)))
    current = load_schema("frontier_update")
    v0 = copy.deepcopy(current)
    v0["fields"] = [f for f in v0["fields"] if f["name"] != "desc_token"]
    (tmp_path / "previous" / "frontier_update.v0.avsc").write_text(json.dumps(v0))
    monkeypatch.setenv("SHARDSINK_SCHEMAS_DIR", str(tmp_path))
    codec_mod.message_codec.cache_clear()
    try:
        codec = message_codec("frontier_update")
        old = Codec(v0).encode({"shard_id": "x", "sink_id": None, "upper": 4, "updated_at_ms": 1})
        assert codec.decode(old)["desc_token"] is None
    finally:
        monkeypatch.delenv("SHARDSINK_SCHEMAS_DIR")
        codec_mod.message_codec.cache_clear()


def test_unknown_schema_names_and_bad_schemas_raise_schema_error() -> None:
    with pytest.raises(SchemaError, match="expected a schema name"):
        load_schema("nope")
    with pytest.raises(SchemaError):
        Codec({"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]})


# -- Confluent wire format -------------------------------------------------------------------


def test_confluent_framing_is_magic_zero_schema_id_then_the_body() -> None:
    registry = InMemorySchemaRegistry()
    schema = load_schema("frontier_update")
    producer = Codec(schema, registry=registry, wire="confluent")
    value = EXAMPLES["frontier_update"][0]
    data = producer.encode(value)
    schema_id = registry.register("io.shardsink.v1.FrontierUpdate-value", schema)
    assert data[0] == 0
    assert int.from_bytes(data[1:5], "big") == schema_id
    assert data[5:] == producer.encode_body(value)
    assert producer.subject == "io.shardsink.v1.FrontierUpdate-value"
    # a consumer with the same registry decodes both framings
    consumer = Codec(schema, registry=registry)
    assert consumer.decode(data) == value
    assert consumer.decode(consumer.encode(value)) == value
    # a plain fastavro reader decodes the body after the 5-byte header
    plain = fastavro.parse_schema(copy.deepcopy(schema))
    assert fastavro.schemaless_reader(io.BytesIO(data[5:]), plain, None) == value


def test_confluent_messages_of_an_older_registered_schema_resolve() -> None:
    registry = InMemorySchemaRegistry()
    old = Codec(V1, registry=registry, wire="confluent").encode(
        {"id": "a", "time": 3, "dropped": 1}
    )
    assert Codec(V2, registry=registry).decode(old)["count"] == 1


def test_confluent_framing_errors_are_decode_errors() -> None:
    registry = InMemorySchemaRegistry()
    codec = Codec(V2, registry=registry)
    with pytest.raises(DecodeError, match="schema id known"):
        codec.decode(b"\x00\x00\x00\x00\x63\x02a\x02")
    with pytest.raises(DecodeError, match="header of 5 bytes"):
        codec.decode(b"\x00\x00\x01")
    other = registry.register(
        "other", {"type": "record", "name": "O", "fields": [{"name": "z", "type": "int"}]}
    )
    with pytest.raises(DecodeError):
        codec.decode(b"\x00" + other.to_bytes(4, "big") + b"\x02")


def test_confluent_encoding_needs_a_registry() -> None:
    with pytest.raises(ValueError, match="registry"):
        Codec(V2, wire="confluent")


# -- rows --------------------------------------------------------------------------------------

ROW_V1: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "test.rows",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "tags", "type": {"type": "map", "values": "string"}},
        {"name": "items", "type": {"type": "array", "items": {"type": "map", "values": "int"}}},
    ],
}
ROW_V2: dict[str, Any] = {
    **ROW_V1,
    "fields": [*ROW_V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}],
}


def test_rows_round_trip_and_plain_fastavro_reads_them() -> None:
    rc = RowCodec(ROW_V1)
    row = {"id": 1, "tags": {"b": "2", "a": "1"}, "items": [{"y": 1, "x": 2}]}
    data = rc.encode(row)
    assert data[:2] == MARKER and data[2:10] == fingerprint(ROW_V1)
    assert rc.decode(data) == row
    plain = fastavro.parse_schema(copy.deepcopy(ROW_V1))
    assert fastavro.schemaless_reader(io.BytesIO(data[10:]), plain, None) == row


def test_equal_rows_have_equal_bytes_whatever_their_map_key_order() -> None:
    rc = RowCodec(ROW_V1)
    a = {"id": 1, "tags": {"b": "2", "a": "1"}, "items": [{"y": 1, "x": 2}]}
    b = {"items": [{"x": 2, "y": 1}], "tags": {"a": "1", "b": "2"}, "id": 1}
    assert rc.encode(a) == rc.encode(b)
    assert rc.partition_key(rc.encode(a)) == rc.encode_body(b)


def test_a_row_written_with_an_older_schema_has_the_partition_key_of_the_current_one() -> None:
    old_bytes = RowCodec(ROW_V1).encode({"id": 7, "tags": {}, "items": []})
    rc = RowCodec(ROW_V2, previous=[ROW_V1])
    current = rc.encode({"id": 7, "tags": {}, "items": [], "note": None})
    assert old_bytes != current
    assert rc.partition_key(old_bytes) == rc.partition_key(current) == current[10:]
    assert rc.upgrade(old_bytes) == current
    assert rc.decode(old_bytes) == {"id": 7, "tags": {}, "items": [], "note": None}


def test_row_codec_validates_the_row_schema_and_rows() -> None:
    with pytest.raises(SchemaError, match="reserved"):
        RowCodec({"type": "record", "name": "R", "fields": [{"name": "_diff", "type": "long"}]})
    rc = RowCodec(ROW_V1)
    with pytest.raises(EncodeError):
        rc.encode({"id": "x", "tags": {}, "items": []})
    with pytest.raises(DecodeError):
        rc.decode(b"\xc3\x01" + bytes(8))
