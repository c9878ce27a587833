"""The row schema's validation and its one Avro -> Arrow mapping (pure, no I/O)."""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shared.avro_arrow import (
    RESERVED_FIELDS,
    arrow_to_rows,
    avro_to_arrow_schema,
    parse_row_schema,
    rows_to_arrow,
)
from shared.errors import CodecError, EncodeError, SchemaError

UTC = dt.UTC

EVERYTHING: dict[str, Any] = {
    "type": "record",
    "name": "Everything",
    "namespace": "test.rows",
    "doc": "One field of every supported kind.",
    "fields": [
        {"name": "n", "type": "null"},
        {"name": "b", "type": "boolean"},
        {"name": "i", "type": "int"},
        {"name": "l", "type": "long"},
        {"name": "f", "type": "float"},
        {"name": "d", "type": "double"},
        {"name": "by", "type": "bytes"},
        {"name": "s", "type": "string"},
        {"name": "e", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}},
        {"name": "fx", "type": {"type": "fixed", "name": "Four", "size": 4}},
        {"name": "date", "type": {"type": "int", "logicalType": "date"}},
        {"name": "tms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "tus", "type": {"type": "long", "logicalType": "time-micros"}},
        {"name": "tsms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "tsus", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "ltsms", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
        {
            "name": "dec",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
        },
        {
            "name": "fdec",
            "type": {
                "type": "fixed",
                "name": "Money",
                "size": 8,
                "logicalType": "decimal",
                "precision": 18,
                "scale": 4,
            },
        },
        {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "opt", "type": ["null", "long"], "default": None},
        {"name": "opt_last", "type": ["string", "null"]},
        {"name": "arr", "type": {"type": "array", "items": "int"}},
        {"name": "arr_opt", "type": {"type": "array", "items": ["null", "string"]}},
        {"name": "m", "type": {"type": "map", "values": "double"}},
        {
            "name": "rec",
            "type": {
                "type": "record",
                "name": "Inner",
                "fields": [
                    {"name": "x", "type": "int"},
                    {"name": "y", "type": ["null", "string"]},
                ],
            },
        },
        {"name": "rec2", "type": ["null", "Inner"]},
        {"name": "color2", "type": "Color"},
    ],
}

EXPECTED_ARROW = pa.schema(
    [
        pa.field("n", pa.null(), nullable=True),
        pa.field("b", pa.bool_(), nullable=False),
        pa.field("i", pa.int32(), nullable=False),
        pa.field("l", pa.int64(), nullable=False),
        pa.field("f", pa.float32(), nullable=False),
        pa.field("d", pa.float64(), nullable=False),
        pa.field("by", pa.binary(), nullable=False),
        pa.field("s", pa.string(), nullable=False),
        pa.field("e", pa.string(), nullable=False),
        pa.field("fx", pa.binary(4), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("tms", pa.time32("ms"), nullable=False),
        pa.field("tus", pa.time64("us"), nullable=False),
        pa.field("tsms", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("tsus", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("ltsms", pa.timestamp("ms"), nullable=False),
        pa.field("dec", pa.decimal128(10, 2), nullable=False),
        pa.field("fdec", pa.decimal128(18, 4), nullable=False),
        pa.field("u", pa.string(), nullable=False),
        pa.field("opt", pa.int64(), nullable=True),
        pa.field("opt_last", pa.string(), nullable=True),
        pa.field("arr", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("arr_opt", pa.list_(pa.field("item", pa.string())), nullable=False),
        pa.field(
            "m",
            pa.map_(pa.string(), pa.field("value", pa.float64(), nullable=False)),
            nullable=False,
        ),
        pa.field(
            "rec",
            pa.struct([pa.field("x", pa.int32(), nullable=False), pa.field("y", pa.string())]),
            nullable=False,
        ),
        pa.field(
            "rec2",
            pa.struct([pa.field("x", pa.int32(), nullable=False), pa.field("y", pa.string())]),
            nullable=True,
        ),
        pa.field("color2", pa.string(), nullable=False),
    ]
)


def everything_row(k: int) -> dict[str, Any]:
    return {
        "n": None,
        "b": k % 2 == 0,
        "i": -k,
        "l": 2**40 + k,
        "f": 1.5,
        "d": k / 3,
        "by": bytes([k % 256, 0, 255]),
        "s": f"row-{k}-é",
        "e": "GREEN" if k % 2 else "RED",
        "fx": b"\x00\x01\x02" + bytes([k % 256]),
        "date": dt.date(2024, 2, 29),
        "tms": dt.time(12, 30, 15, 123000),
        "tus": dt.time(23, 59, 59, 999999),
        "tsms": dt.datetime(2024, 5, 1, 10, 0, 0, 123000, tzinfo=UTC),
        "tsus": dt.datetime(2024, 5, 1, 10, 0, 0, 123456, tzinfo=UTC),
        "ltsms": dt.datetime(2024, 5, 1, 10, 0, 0, 5000),
        "dec": Decimal("12345678.91"),
        "fdec": Decimal("-12345678901234.5678"),
        "u": uuid.UUID(int=k + 1),
        "opt": None if k % 2 else k,
        "opt_last": "x" if k % 3 else None,
        "arr": [1, 2, k],
        "arr_opt": ["a", None],
        "m": {"a": 1.0, "b": float(k)},
        "rec": {"x": k, "y": None},
        "rec2": None if k % 2 else {"x": 7, "y": "why"},
        "color2": "RED",
    }


def test_avro_types_map_to_the_documented_arrow_types_with_avro_nullability() -> None:
    assert avro_to_arrow_schema(EVERYTHING) == EXPECTED_ARROW
    got = avro_to_arrow_schema(EVERYTHING)
    for f in EXPECTED_ARROW:
        assert got.field(f.name).nullable == f.nullable, f.name
    # JSON text works the same as a dict
    assert avro_to_arrow_schema(json.dumps(EVERYTHING)) == EXPECTED_ARROW


def test_parse_row_schema_normalises_to_fully_qualified_names_and_is_idempotent() -> None:
    norm = parse_row_schema(EVERYTHING)
    assert norm["name"] == "test.rows.Everything"
    assert json.loads(json.dumps(norm)) == norm
    assert parse_row_schema(norm) == norm
    assert parse_row_schema(json.dumps(EVERYTHING)) == norm
    assert avro_to_arrow_schema(norm) == EXPECTED_ARROW
    # the input is not mutated
    assert EVERYTHING["name"] == "Everything"


@pytest.mark.parametrize("name", sorted(RESERVED_FIELDS))
def test_reserved_top_level_field_names_are_rejected(name: str) -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": name, "type": "long"}]}
    with pytest.raises(SchemaError, match=f"reserved.*found \\['{name}'\\]"):
        parse_row_schema(schema)


def test_reserved_names_are_allowed_inside_nested_records() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {
                "name": "inner",
                "type": {
                    "type": "record",
                    "name": "I",
                    "fields": [{"name": "_time", "type": "long"}],
                },
            }
        ],
    }
    assert parse_row_schema(schema)["fields"][0]["name"] == "inner"


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("long", "expected an Avro record schema.*found type 'long'"),
        ({"type": "array", "items": "long"}, "expected an Avro record.*found type 'array'"),
        ("{not json", "expected an Avro schema as JSON text"),
        ({"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]}, "fastavro"),
        ({"type": "record", "fields": []}, "fastavro"),
        (
            {"type": "record", "name": "R", "fields": [{"name": "a", "type": ["int", "string"]}]},
            "union of null and one type at .*R.a",
        ),
        (
            {
                "type": "record",
                "name": "R",
                "fields": [{"name": "a", "type": ["null", "int", "string"]}],
            },
            "found null and 2 other types",
        ),
        (
            {
                "type": "record",
                "name": "Node",
                "fields": [
                    {"name": "v", "type": "int"},
                    {"name": "next", "type": ["null", "Node"]},
                ],
            },
            "non-recursive",
        ),
    ],
)
def test_unacceptable_schemas_raise_schema_error(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message) as info:
        parse_row_schema(schema)
    assert isinstance(info.value, CodecError)


def test_a_logical_type_on_the_wrong_base_type_maps_as_the_base_type() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {"name": "a", "type": {"type": "string", "logicalType": "date"}},
            {"name": "b", "type": {"type": "long", "logicalType": "no-such-type"}},
            {"name": "c", "type": {"type": "int", "logicalType": "timestamp-millis"}},
        ],
    }
    assert avro_to_arrow_schema(schema).types == [pa.string(), pa.int64(), pa.int32()]


def test_large_decimals_map_to_decimal256() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {
                "name": "a",
                "type": {"type": "bytes", "logicalType": "decimal", "precision": 50, "scale": 3},
            }
        ],
    }
    assert avro_to_arrow_schema(schema).field("a").type == pa.decimal256(50, 3)


def test_rows_round_trip_through_arrow_and_parquet_and_reencode_with_fastavro() -> None:
    rows = [everything_row(k) for k in range(5)]
    table = rows_to_arrow(rows, EVERYTHING)
    assert table.schema == EXPECTED_ARROW
    assert table.num_rows == 5

    buf = io.BytesIO()
    pq.write_table(table, buf)
    back = pq.read_table(io.BytesIO(buf.getvalue()))
    assert back.schema == EXPECTED_ARROW

    out = arrow_to_rows(back)
    expected = [dict(r, u=str(r["u"])) for r in rows]
    assert out == expected

    # what comes back encodes with the same Avro schema and decodes to the same values
    parsed = fastavro.parse_schema(EVERYTHING)
    for r in out:
        b = io.BytesIO()
        fastavro.schemaless_writer(b, parsed, r)
        decoded = fastavro.schemaless_reader(io.BytesIO(b.getvalue()), parsed, parsed)
        assert dict(decoded, u=str(decoded["u"])) == r


def test_rows_decoded_by_fastavro_convert_to_arrow() -> None:
    parsed = fastavro.parse_schema(EVERYTHING)
    decoded = []
    for k in range(3):
        b = io.BytesIO()
        fastavro.schemaless_writer(b, parsed, everything_row(k))
        decoded.append(fastavro.schemaless_reader(io.BytesIO(b.getvalue()), parsed, parsed))
    assert isinstance(decoded[0]["u"], uuid.UUID)
    table = rows_to_arrow(decoded, EVERYTHING)
    assert table.column("u").to_pylist() == [str(uuid.UUID(int=k + 1)) for k in range(3)]


SIMPLE = {
    "type": "record",
    "name": "S",
    "fields": [
        {"name": "k", "type": "long"},
        {"name": "v", "type": ["null", "string"]},
        {
            "name": "r",
            "type": [
                "null",
                {"type": "record", "name": "I", "fields": [{"name": "x", "type": "int"}]},
            ],
        },
        {"name": "a", "type": {"type": "array", "items": "long"}, "default": []},
    ],
}


def test_a_missing_nullable_field_is_null() -> None:
    table = rows_to_arrow([{"k": 1, "a": []}], SIMPLE)
    assert arrow_to_rows(table) == [{"k": 1, "v": None, "r": None, "a": []}]


def test_an_empty_row_list_gives_an_empty_table_of_the_schema() -> None:
    table = rows_to_arrow([], SIMPLE)
    assert table.num_rows == 0
    assert table.schema == avro_to_arrow_schema(SIMPLE)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"k": None, "a": []}, "non-nullable field k, found null"),
        ({"v": "x", "a": []}, "non-nullable fields.*found \\['k'\\] missing"),
        ({"k": 1, "a": [], "zzz": 1}, "found unknown \\['zzz'\\]"),
        ({"k": "one", "a": []}, "does not convert"),
        ({"k": 2**63, "a": []}, "does not convert"),
        ({"k": 1, "a": [1, None]}, "non-nullable field a\\[\\], found null"),
        ({"k": 1, "a": [], "r": {"x": None}}, "non-nullable field r.x, found null"),
        ([("k", 1)], "expected row 0 to be a mapping"),
    ],
)
def test_rows_that_do_not_fit_raise_encode_error(row: Any, message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        rows_to_arrow([row], SIMPLE)


def test_a_null_struct_does_not_count_as_a_null_in_its_non_nullable_children() -> None:
    table = rows_to_arrow([{"k": 1, "a": [], "r": None}, {"k": 2, "a": [], "r": {"x": 3}}], SIMPLE)
    assert table.column("r").to_pylist() == [None, {"x": 3}]
