"""Every Avro type a collection's schema accepts survives the sink's whole path exactly.

The property: for a generated record schema over every Avro type (primitives, every logical
type, enums, fixed, arrays, maps, nested records, nullable unions of these) and generated
values (edge values included), the bytes a producer writes decode (``RowCodec.decode``), go to
Arrow (``rows_to_arrow``), to Parquet as the shard writes it and back (read and cast to the
part schema, as the shard reads it), to rows again (``arrow_to_rows``) and encode
(``RowCodec.encode``) to the row's *canonical* bytes; the same bytes the sink makes of the
topic's row (``RowCodec.canonical``), so that the correction buffer's keys meet.

The canonical bytes are computed independently of the code under test: plain fastavro, with a
schema whose logical types are stripped, writes the generated (physical) value put in
canonical form by this test (map keys in UTF-8 order, uuids in lowercase, decimals in
fastavro's two's complement length). So equal bytes here mean the original value came back,
bit for bit, not only a value our own conversions agree with.
"""

from __future__ import annotations

import datetime as dt
import io
import itertools
import json
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.avro_arrow import arrow_to_rows, avro_to_arrow_schema, parse_row_schema, rows_to_arrow
from shared.codec import MARKER, RowCodec
from shared.errors import DecodeError, EncodeError, SchemaError

_names = itertools.count()


def _name(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


@dataclass(frozen=True)
class Ty:
    """A generated Avro type: its JSON, a strategy of physical values (what plain fastavro
    writes for the type with its logical type stripped) and the canonical form of such a value."""

    avro: Any
    values: st.SearchStrategy[Any]
    canon: Callable[[Any], Any] = lambda v: v
    union: bool = False
    bare_null: bool = False  # holds the type null alone somewhere (refused under arrays and maps)


def _ident(v: Any) -> Any:
    return v


def _ints(lo: int, hi: int, *extra: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, -1, *extra} & set(range(lo, hi + 1)) if hi - lo < 10 else
                   {e for e in (lo, hi, lo + 1, hi - 1, 0, 1, -1, *extra) if lo <= e <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
# Python's datetime range, in each unit (fastavro decodes timestamps as datetime)
MS_RANGE = (-62135596800000, 253402300799999)
US_RANGE = (MS_RANGE[0] * 1000, MS_RANGE[1] * 1000 + 999)
DATE_RANGE = (-719162, 2932896)


def _f32(v: float) -> float:
    result: float = struct.unpack("<f", struct.pack("<f", v))[0]
    return result


def _dec_bytes(unscaled: int, pad: int) -> bytes:
    """fastavro's bytes of an unscaled decimal (its length rule), with ``pad`` extra sign bytes
    (a producer may write those: a non-canonical encoding of the same value)."""
    n = (abs(unscaled).bit_length() + 8) // 8
    return unscaled.to_bytes(n + pad, "big", signed=True)


def _dec_canon(b: bytes) -> bytes:
    return _dec_bytes(int.from_bytes(b, "big", signed=True), 0)


def _decimal_bytes(precision: int, scale: int) -> Ty:
    bound = 10**precision - 1
    values = st.builds(_dec_bytes, _ints(-bound, bound), st.sampled_from([0, 0, 0, 1, 3]))
    avro = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    return Ty(avro, values, _dec_canon)


def _decimal_fixed(size: int, precision: int, scale: int) -> Ty:
    bound = 10**precision - 1
    values = _ints(-bound, bound).map(lambda u: u.to_bytes(size, "big", signed=True))
    avro = {
        "type": "fixed",
        "name": _name("Dec"),
        "size": size,
        "logicalType": "decimal",
        "precision": precision,
        "scale": scale,
    }
    return Ty(avro, values)


def _fixed_decimal_types() -> st.SearchStrategy[Ty]:
    def build(size: int, data: st.DataObject) -> Ty:
        import math

        max_p = math.floor(math.log10(2 ** (8 * size - 1) - 1))
        p = data.draw(st.integers(1, min(max_p, 76)))
        s = data.draw(st.integers(0, p))
        return _decimal_fixed(size, p, s)

    return st.builds(build, st.integers(1, 32), st.data())


def _uuid_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda u, upper: str(u).upper() if upper else str(u), st.uuids(), st.booleans()
    )


def _long_logical(logical: str, lo: int, hi: int) -> Ty:
    return Ty({"type": "long", "logicalType": logical}, _ints(lo, hi))


LEAVES: list[Callable[[], Ty] | st.SearchStrategy[Ty]] = []


def leaf_types() -> st.SearchStrategy[Ty]:
    fixed = st.integers(1, 20).map(
        lambda n: Ty({"type": "fixed", "name": _name("Fx"), "size": n}, st.binary(min_size=n, max_size=n))
    )
    enum = st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=5, unique=True).map(
        lambda syms: Ty({"type": "enum", "name": _name("En"), "symbols": syms}, st.sampled_from(syms))
    )
    dec_bytes = st.integers(1, 76).flatmap(lambda p: st.integers(0, p).map(lambda s: _decimal_bytes(p, s)))
    simple = [
        Ty("null", st.none(), bare_null=True),
        Ty("boolean", st.booleans()),
        Ty("int", _ints(*I32)),
        Ty("long", _ints(*I64)),
        Ty("float", st.floats(width=32), _f32),
        Ty("double", st.floats()),
        Ty("bytes", st.binary(max_size=20)),
        Ty("string", st.text(max_size=12)),
        Ty({"type": "int", "logicalType": "date"}, _ints(*DATE_RANGE)),
        Ty({"type": "int", "logicalType": "time-millis"}, _ints(0, 86_400_000 - 1)),
        Ty({"type": "long", "logicalType": "time-micros"}, _ints(0, 86_400_000_000 - 1)),
        _long_logical("timestamp-millis", *MS_RANGE),
        _long_logical("timestamp-micros", *US_RANGE),
        _long_logical("timestamp-nanos", *I64),
        _long_logical("local-timestamp-millis", *MS_RANGE),
        _long_logical("local-timestamp-micros", *US_RANGE),
        _long_logical("local-timestamp-nanos", *I64),
        Ty({"type": "string", "logicalType": "uuid"}, _uuid_text(), lambda s: str(uuid.UUID(s))),
    ]
    duration = st.just(None).map(
        lambda _: Ty(
            {"type": "fixed", "name": _name("Dur"), "size": 12, "logicalType": "duration"},
            st.binary(min_size=12, max_size=12),
        )
    )
    return st.one_of(st.sampled_from(simple), fixed, enum, dec_bytes, _fixed_decimal_types(), duration)


def _canon_list(t: Ty) -> Callable[[Any], Any]:
    return lambda v: [t.canon(x) for x in v]


def _canon_map(t: Ty) -> Callable[[Any], Any]:
    return lambda v: {k: t.canon(v[k]) for k in sorted(v, key=lambda k: k.encode("utf-8"))}


def _canon_nullable(t: Ty) -> Callable[[Any], Any]:
    return lambda v: None if v is None else t.canon(v)


def _canon_record(fields: list[tuple[str, Ty]]) -> Callable[[Any], Any]:
    return lambda v: {n: t.canon(v[n]) for n, t in fields}


def record_of(children: st.SearchStrategy[Ty], min_fields: int = 1, max_fields: int = 4) -> st.SearchStrategy[Ty]:
    def build(tys: list[Ty]) -> Ty:
        fields = [(f"f{i}", t) for i, t in enumerate(tys)]
        avro = {
            "type": "record",
            "name": _name("Rec"),
            "fields": [{"name": n, "type": t.avro} for n, t in fields],
        }
        values = st.fixed_dictionaries({n: t.values for n, t in fields})
        return Ty(avro, values, _canon_record(fields), bare_null=any(t.bare_null for t in tys))

    return st.lists(children, min_size=min_fields, max_size=max_fields).map(build)


def _extend(children: st.SearchStrategy[Ty]) -> st.SearchStrategy[Ty]:
    plain = children.filter(lambda t: not t.union)
    repeatable = plain.filter(lambda t: not t.bare_null)
    array = repeatable.map(lambda t: Ty({"type": "array", "items": t.avro}, st.lists(t.values, max_size=3), _canon_list(t)))
    # Maps: keys in any order (a producer's dict order), canonical order is by UTF-8 bytes.
    map_ = repeatable.map(
        lambda t: Ty(
            {"type": "map", "values": t.avro},
            st.dictionaries(st.text(max_size=4), t.values, max_size=3),
            _canon_map(t),
        )
    )
    nullable = st.tuples(plain.filter(lambda t: t.avro != "null"), st.booleans()).map(
        lambda tb: Ty(
            ["null", tb[0].avro] if tb[1] else [tb[0].avro, "null"],
            st.one_of(st.none(), tb[0].values),
            _canon_nullable(tb[0]),
            union=True,
            bare_null=tb[0].bare_null,
        )
    )
    return st.one_of(array, map_, nullable, record_of(children))


TYPES = st.recursive(leaf_types(), _extend, max_leaves=8)


def _strip_logical(avro: Any) -> Any:
    """The schema as a plain Avro writer without logical types sees it (same canonical form)."""
    if isinstance(avro, list):
        return [_strip_logical(b) for b in avro]
    if isinstance(avro, dict):
        return {k: _strip_logical(v) for k, v in avro.items() if k != "logicalType"}
    return avro


def _plain_encode(parsed: Any, value: Any) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, value)
    return buf.getvalue()


def _through_parquet(table: pa.Table) -> pa.Table:
    """As the shard writes a part and reads it back (shared/shard.py)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="snappy")
    return pq.read_table(io.BytesIO(buf.getvalue())).cast(table.schema)


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return v != v
    if isinstance(v, dict):
        return any(_has_nan(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_nan(x) for x in v)
    return False


def _row_schemas() -> st.SearchStrategy[tuple[Ty, list[Any]]]:
    return record_of(TYPES, min_fields=1, max_fields=6).flatmap(
        lambda t: st.tuples(st.just(t), st.lists(t.values, min_size=1, max_size=4))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_row_schemas())
def test_every_accepted_type_survives_decode_arrow_parquet_arrow_encode_exactly(case: tuple[Ty, list[Any]]) -> None:
    ty, values = case
    schema = ty.avro
    parse_row_schema(schema)  # collection create accepts it
    codec = RowCodec(schema)
    plain = fastavro.parse_schema(_strip_logical(schema))
    header = MARKER + codec.fingerprint

    produced = [header + _plain_encode(plain, v) for v in values]
    expected = [header + _plain_encode(plain, ty.canon(v)) for v in values]

    rows = [codec.decode(b) for b in produced]
    table = rows_to_arrow(rows, codec.schema)
    assert table.schema == avro_to_arrow_schema(schema)
    back = arrow_to_rows(_through_parquet(table), codec.schema)

    for b, row, got, want in zip(produced, rows, back, expected, strict=True):
        # the shard's row encodes to the canonical bytes of the value the producer wrote ...
        assert codec.encode(got) == want
        # ... which are the bytes the sink makes of the topic's row: the buffer's keys meet
        assert codec.canonical(b) == want
        assert codec.canonical(want) == want
        # the read-back row is the decoded row (NaN aside: compared by bytes above)
        assert codec.encode(row) == want
        if not _has_nan(row):
            assert got == row


# -- schemas that cannot be mapped exactly are refused at create ----------------------------


def _one_field(t: Any) -> dict[str, Any]:
    return {"type": "record", "name": "R", "fields": [{"name": "a", "type": t}]}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (_one_field({"type": "bytes", "logicalType": "decimal"}), "decimal .* at R.a, found precision None"),
        (_one_field({"type": "bytes", "logicalType": "decimal", "precision": 0}), "decimal .*1..76 .* at R.a"),
        (_one_field({"type": "bytes", "logicalType": "decimal", "precision": 77}), "found precision 77"),
        (
            _one_field({"type": "array", "items": {"type": "record", "name": "E", "fields": []}}),
            "at least one field at R.a\\[\\], found record 'E'",
        ),
        ({"type": "record", "name": "R", "fields": []}, "at least one field at R"),
        (_one_field({"type": "fixed", "name": "Z", "size": 0}), "fixed of at least 1 byte at R.a, found size 0"),
        (_one_field({"type": "array", "items": "null"}), "null alone inside an array or map at R.a\\[\\]"),
        (
            _one_field({"type": "map", "values": {"type": "record", "name": "N", "fields": [{"name": "n", "type": "null"}]}}),
            "inside an array or map at R.a\\{\\}.n",
        ),
    ],
)
def test_schemas_with_no_exact_mapping_are_refused_naming_the_field(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        parse_row_schema(schema)


# -- values the schema's encoding carries but the collection cannot hold -------------------

RANGES = {
    "type": "record",
    "name": "Ranges",
    "fields": [
        {"name": "i", "type": "int"},
        {"name": "opt", "type": ["null", {"type": "array", "items": "int"}]},
        {"name": "e", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}},
        {"name": "tm", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "tu", "type": {"type": "long", "logicalType": "time-micros"}},
        {"name": "d", "type": {"type": "int", "logicalType": "date"}},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "dec", "type": {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 2}},
        {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "m", "type": {"type": "map", "values": "int"}},
    ],
}


def _widen(avro: Any) -> Any:
    """int as long: the same bytes on the wire, so a plain writer puts any 64-bit value there."""
    if avro == "int":
        return "long"
    if isinstance(avro, list):
        return [_widen(b) for b in avro]
    if isinstance(avro, dict):
        return {k: _widen(v) if k in ("type", "items", "values", "fields") else v for k, v in avro.items()}
    return avro


PLAIN_RANGES = fastavro.parse_schema(_widen(_strip_logical(RANGES)))
GOOD = {
    "i": 1,
    "opt": [1, 2],
    "e": "GREEN",
    "tm": 0,
    "tu": 0,
    "d": 0,
    "ts": 0,
    "dec": _dec_bytes(9999, 0),
    "u": str(uuid.UUID(int=5)),
    "m": {"b": 1, "a": 2},
}


def _produced(**changes: Any) -> bytes:
    return MARKER + RowCodec(RANGES).fingerprint + _plain_encode(PLAIN_RANGES, {**GOOD, **changes})


def test_a_good_row_decodes_and_is_canonicalised() -> None:
    codec = RowCodec(RANGES)
    row = codec.decode(_produced())
    assert row["dec"] == Decimal("99.99") and row["tm"] == dt.time(0) and list(row["m"]) == ["a", "b"]  # canonical order
    canonical = codec.canonical(_produced())
    assert canonical == _produced(m={"a": 2, "b": 1})  # map keys in UTF-8 order
    assert codec.canonical(_produced(u=str(uuid.UUID(int=5)).upper())) == canonical


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"i": 2**31}, "int in \\[-2\\*\\*31, 2\\*\\*31\\) at Ranges.i, found 2147483648"),
        ({"i": -(2**31) - 1}, "at Ranges.i, found -2147483649"),
        ({"opt": [0, 2**40]}, "at Ranges.opt\\[\\], found 1099511627776"),
        ({"m": {"k": 2**33}}, "at Ranges.m\\{\\}, found 8589934592"),
        ({"tm": -1}, "time-millis in \\[0, 86400000\\), found -1"),
        ({"tm": 86_400_000}, "time-millis in \\[0, 86400000\\), found 86400000"),
        ({"tu": -1}, "time-micros in \\[0, 86400000000\\), found -1"),
        ({"d": 2932897}, "year 10000 is out of range"),
        ({"ts": 2**62}, "OverflowError"),
        ({"dec": _dec_bytes(10000, 0)}, "decimal of at most 4 digits, found the unscaled value 10000"),
        ({"u": "not-a-uuid"}, "badly formed hexadecimal UUID"),
    ],
)
def test_a_value_out_of_the_fields_range_is_a_decode_error_naming_it(changes: dict[str, Any], message: str) -> None:
    codec = RowCodec(RANGES)
    data = _produced(**changes)
    with pytest.raises(DecodeError, match=message):
        codec.decode(data)
    with pytest.raises(DecodeError, match=message):
        codec.canonical(data)


def test_an_enum_index_out_of_range_is_a_decode_error() -> None:
    codec = RowCodec(RANGES)
    good = _produced()
    body = bytearray(good[10:])
    # i=1 -> 02, opt: union index 1 (02), block of 2 (04), 02 04, end 00; then the enum index
    assert bytes(body[:6]) == b"\x02\x02\x04\x02\x04\x00" and body[6] == 0x02
    body[6] = 0x04  # index 2 of a 2-symbol enum
    with pytest.raises(DecodeError, match="IndexError"):
        codec.decode(good[:10] + bytes(body))


def test_encoding_a_value_the_collection_cannot_hold_is_an_encode_error() -> None:
    codec = RowCodec(RANGES)
    row = codec.decode(_produced())
    with pytest.raises(EncodeError, match="at Ranges.i, found 2147483648"):
        codec.encode({**row, "i": 2**31})
    with pytest.raises(EncodeError, match="decimal of at most 4 digits"):
        codec.encode({**row, "dec": Decimal("100.00")})


def test_nanosecond_timestamps_read_as_ints_and_also_encode_from_datetimes() -> None:
    nanos = [("a", "timestamp-nanos"), ("b", "local-timestamp-nanos")]
    schema = {
        "type": "record",
        "name": "N",
        "fields": [{"name": n, "type": {"type": "long", "logicalType": lt}} for n, lt in nanos],
    }
    codec = RowCodec(schema)
    ints = codec.encode({"a": 1_500, "b": -1})
    assert codec.decode(ints) == {"a": 1_500, "b": -1}
    when = dt.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
    from_dt = codec.encode({"a": when, "b": when.replace(tzinfo=None)})
    ns = 1_704_164_645_000_006_000
    assert codec.decode(from_dt) == {"a": ns, "b": ns}
    back = arrow_to_rows(rows_to_arrow([codec.decode(from_dt)], codec.schema), codec.schema)
    assert back == [{"a": ns, "b": ns}] and codec.encode(back[0]) == from_dt


def test_the_read_back_of_a_map_and_a_uuid_is_what_decoding_gives() -> None:
    codec = RowCodec(RANGES)
    row = codec.decode(_produced())
    (back,) = arrow_to_rows(_through_parquet(rows_to_arrow([row], codec.schema)), codec.schema)
    assert back == row and isinstance(back["u"], uuid.UUID) and isinstance(back["m"], dict)
    # map entries are stored in canonical order in the shard, too
    assert list(back["m"]) == ["a", "b"]
    assert json.dumps(back, default=str)  # a plain dict of plain values
