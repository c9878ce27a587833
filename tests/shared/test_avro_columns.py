"""The vectorised codec (shared/avro_columns.py) is the per-row path, exactly, over every type.

The reference is the per-row path: ``RowCodec.decode`` then ``rows_to_arrow`` for decoding,
``arrow_to_rows`` then ``RowCodec.encode_body`` for encoding, plus the canonical bytes that
``tests/shared/test_avro_arrow_types.py`` computes independently with plain fastavro. The schemas and
values are that module's generators (every Avro type the mapping accepts, nested, with edge
values), plus arrays and maps of nullable items and long, skewed blocks, which those generators
do not make. Other spellings of the same values (split and negative-count blocks, over-long
varints, negative indices, booleans other than 1, repeated map keys) must decode to the same
rows; bad input (mutated bodies, random bytes, invalid UTF-8) must be bad exactly when the
per-row decoder refuses it. Speed is not tested here: ``python -m shared.avro_columns`` prints
it.
"""

from __future__ import annotations

import random
import struct
from decimal import Decimal
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.avro_arrow import arrow_to_rows, avro_to_arrow_schema, rows_to_arrow
from shared.avro_columns import ColumnCodec, Decoded
from shared.codec import MARKER, RowCodec
from shared.errors import CodecError, DecodeError, EncodeError
from tests.shared.test_avro_arrow_types import (
    TYPES,
    Ty,
    _canon_list,
    _canon_map,
    _canon_nullable,
    _dec_bytes,
    _plain_encode,
    _strip_logical,
    _through_parquet,
    leaf_types,
    record_of,
)

SETTINGS = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _cases(max_rows: int = 10) -> st.SearchStrategy[tuple[Ty, list[Any]]]:
    """A generated row schema (the reference test's generators) and up to ``max_rows`` values,
    so that rows with different shapes share one batch."""
    return record_of(TYPES, min_fields=1, max_fields=6).flatmap(
        lambda t: st.tuples(st.just(t), st.lists(t.values, min_size=1, max_size=max_rows))
    )


def _bits(arr: Any) -> Any:
    """``arr`` with every float (at any depth) viewed as its integer bits, so that ``equals``
    compares NaNs and -0.0 bit for bit."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    t = arr.type
    if pa.types.is_floating(t):
        return arr.view(pa.int32() if t.bit_width == 32 else pa.int64())
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(t):
        kids = [_bits(arr.field(i)) for i in range(t.num_fields)]
        fields = [t.field(i).with_type(k.type) for i, k in enumerate(kids)]
        return pa.StructArray.from_arrays(kids, fields=fields, mask=mask)
    if pa.types.is_map(t):
        items = _bits(arr.items)
        return pa.MapArray.from_arrays(arr.offsets, arr.keys, items, mask=mask)
    if pa.types.is_list(t):
        return pa.ListArray.from_arrays(arr.offsets, _bits(arr.values), mask=mask)
    return arr


def _layout(arr: Any) -> Any:
    """Everything of ``arr`` a reader can see, children under null slots included (Parquet
    refuses a null in a non-nullable child even under a null struct), floats as bits."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    t = arr.type
    valid = arr.is_valid().to_pylist()
    if pa.types.is_struct(t):
        return ("struct", valid, [_layout(arr.field(i)) for i in range(t.num_fields)])
    if pa.types.is_list(t) or pa.types.is_map(t):
        offsets = arr.offsets.to_pylist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        child = arr.values.slice(offsets[0], offsets[-1] - offsets[0]) if offsets else arr.values
        return ("list", valid, lengths, _layout(child))
    return ("leaf", _bits(arr).to_pylist())


def _same_table(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema
    assert got.num_rows == want.num_rows
    for name in want.schema.names:
        g, w = _bits(got.column(name)), _bits(want.column(name))
        assert g.equals(w), f"column {name!r}:\n{g}\n!=\n{w}"
        assert _layout(got.column(name)) == _layout(want.column(name)), f"column {name!r}"


def _reference(codec: RowCodec, bodies: list[bytes]) -> tuple[list[bool], pa.Table]:
    """The per-row verdicts on ``bodies`` and the table of the good ones."""
    header = MARKER + codec.fingerprint
    ok: list[bool] = []
    rows: list[dict[str, Any]] = []
    for body in bodies:
        try:
            row = codec.decode(header + body)
            rows_to_arrow([row], codec.schema)
        except CodecError:
            ok.append(False)
            continue
        ok.append(True)
        rows.append(row)
    return ok, rows_to_arrow(rows, codec.schema)


def _plain(ty: Ty) -> Any:
    return fastavro.parse_schema(_strip_logical(ty.avro))


# -- good input ----------------------------------------------------------------------------


@SETTINGS
@given(_cases())
def test_decode_and_encode_equal_the_per_row_path_for_every_accepted_type(
    case: tuple[Ty, list[Any]],
) -> None:
    ty, values = case
    codec, columns = RowCodec(ty.avro), ColumnCodec(ty.avro)
    plain = _plain(ty)
    bodies = [_plain_encode(plain, v) for v in values]
    canonical = [_plain_encode(plain, ty.canon(v)) for v in values]

    decoded = columns.decode(pa.array(bodies, pa.binary()))
    assert decoded.errors == {} and decoded.ok.tolist() == [True] * len(bodies)
    rows = [codec.decode(MARKER + codec.fingerprint + b) for b in bodies]
    want = rows_to_arrow(rows, codec.schema)
    assert columns.arrow_schema == avro_to_arrow_schema(ty.avro)
    _same_table(decoded.table, want)

    encoded = columns.encode(decoded.table).to_pylist()
    assert encoded == [codec.encode_body(r) for r in arrow_to_rows(want, codec.schema)]
    assert encoded == canonical
    # as the shard reads its Parquet parts back, and with the single-object header skipped
    assert columns.encode(_through_parquet(decoded.table)).to_pylist() == canonical
    framed = [MARKER + codec.fingerprint + b for b in bodies]
    _same_table(columns.decode(pa.array(framed, pa.large_binary()), skip=10).table, want)


@SETTINGS
@given(_cases(max_rows=6), st.data())
def test_encode_selects_columns_by_name_from_any_layout(
    case: tuple[Ty, list[Any]], data: st.DataObject
) -> None:
    ty, values = case
    codec, columns = RowCodec(ty.avro), ColumnCodec(ty.avro)
    plain = _plain(ty)
    table = columns.decode(pa.array([_plain_encode(plain, v) for v in values])).table
    start = data.draw(st.integers(0, table.num_rows))
    stop = data.draw(st.integers(start, table.num_rows))
    part = table.slice(start, stop - start)
    want = [codec.encode_body(r) for r in arrow_to_rows(part, codec.schema)]
    names = data.draw(st.permutations(part.schema.names))
    shuffled = part.select(names).append_column("_time", pa.array(range(part.num_rows), pa.int64()))
    chunked = pa.concat_tables([shuffled.slice(0, 1), shuffled.slice(1)])
    assert columns.encode(chunked).to_pylist() == want
    assert (
        columns.encode(shuffled.to_batches()[0] if shuffled.num_rows else shuffled).to_pylist()
        == want
    )


class _Choices:
    """The choices of an odd spelling: drawn by hypothesis, or from a seeded ``random``."""

    def __init__(self, data: st.DataObject | None = None, seed: int = 0) -> None:
        self.data, self.rng = data, random.Random(seed)

    def between(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi)) if self.data else self.rng.randint(lo, hi)

    def flip(self) -> bool:
        return self.between(0, 1) == 1

    def pick(self, options: list[int]) -> int:
        return options[self.between(0, len(options) - 1)]


def _odd_long(v: int, draw: _Choices) -> bytes:
    """A zig-zag varint of ``v``, sometimes over-long (zero groups; past 10 bytes too)."""
    minimal = _zz(v)
    extra = draw.pick([0, 0, 0, 1, 2, 12 - len(minimal)])
    if extra <= 0:
        return minimal
    return minimal[:-1] + bytes([minimal[-1] | 0x80]) + b"\x80" * (extra - 1) + b"\x00"


def _odd_blocks(items: list[bytes], draw: _Choices) -> bytes:
    """Items in blocks of random sizes, some with a negative count and their byte size."""
    out = b""
    while items:
        k = draw.between(1, len(items))
        block, items = b"".join(items[:k]), items[k:]
        if draw.flip():
            out += _odd_long(-k, draw) + _odd_long(len(block), draw) + block
        else:
            out += _odd_long(k, draw) + block
    return out + _odd_long(0, draw)


def _odd(avro: Any, value: Any, draw: _Choices) -> bytes:
    """A body of the (logical-free) schema ``avro`` that fastavro's reader decodes to
    ``value`` but that is not what a writer makes: over-long varints, split and negative-count
    blocks, negative union and enum indices, booleans other than 1, a map key written twice."""
    if isinstance(avro, list):
        i = (
            avro.index("null")
            if value is None
            else next(k for k, b in enumerate(avro) if b != "null")
        )
        index = i - len(avro) if draw.flip() else i  # Python's negative indexing
        return _odd_long(index, draw) + (b"" if value is None else _odd(avro[i], value, draw))
    kind = avro if isinstance(avro, str) else avro["type"]
    if kind == "null":
        return b""
    if kind == "boolean":
        return bytes([draw.between(1, 255) if value else 0])
    if kind in ("int", "long"):
        return _odd_long(value, draw)
    if kind in ("float", "double"):
        return struct.pack("<f" if kind == "float" else "<d", value)
    if kind in ("bytes", "string"):
        raw = value if isinstance(value, bytes) else value.encode()
        return _odd_long(len(raw), draw) + raw
    if kind == "fixed":
        return bytes(value)
    if kind == "enum":
        index = avro["symbols"].index(value)
        return _odd_long(index - len(avro["symbols"]) if draw.flip() else index, draw)
    if kind == "record":
        return b"".join(_odd(f["type"], value[f["name"]], draw) for f in avro["fields"])
    if kind == "array":
        return _odd_blocks([_odd(avro["items"], x, draw) for x in value], draw)
    assert kind == "map"
    entries = [
        _odd_long(len(k.encode()), draw) + k.encode() + _odd(avro["values"], v, draw)
        for k, v in value.items()
    ]
    if entries and draw.flip():  # an earlier entry of the same key: the last one wins
        entries.insert(0, entries[-1])
    return _odd_blocks(entries, draw)


@SETTINGS
@given(_cases(max_rows=6), st.data())
def test_every_spelling_the_per_row_decoder_accepts_decodes_to_the_same_row(
    case: tuple[Ty, list[Any]], data: st.DataObject
) -> None:
    ty, values = case
    codec, columns = RowCodec(ty.avro), ColumnCodec(ty.avro)
    plain = _plain(ty)
    odd = [_odd(_strip_logical(ty.avro), v, _Choices(data)) for v in values]
    decoded = _agree(codec, columns, odd)
    assert decoded.ok.all()
    canonical = [_plain_encode(plain, ty.canon(v)) for v in values]
    _same_table(decoded.table, columns.decode(pa.array(canonical)).table)
    assert columns.encode(decoded.table).to_pylist() == canonical


# -- bad input -----------------------------------------------------------------------------


def _mutate(body: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "append", "insert", "random", "set"]))
    n = len(body)
    if kind == "truncate":
        return body[: data.draw(st.integers(0, max(n - 1, 0)))]
    if kind == "flip" and n:
        i, bit = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, 7))
        return body[:i] + bytes([body[i] ^ (1 << bit)]) + body[i + 1 :]
    if kind == "set" and n:
        i = data.draw(st.integers(0, n - 1))
        byte = data.draw(st.sampled_from([0x00, 0x01, 0x03, 0x7F, 0x80, 0xFF, 0xC3, 0xED]))
        return body[:i] + bytes([byte]) + body[i + 1 :]
    if kind == "insert":
        i = data.draw(st.integers(0, n))
        return body[:i] + data.draw(st.binary(min_size=1, max_size=3)) + body[i:]
    if kind == "random":
        return data.draw(st.binary(max_size=40))
    return body + data.draw(st.binary(min_size=1, max_size=4))


def _agree(codec: RowCodec, columns: ColumnCodec, bodies: list[bytes]) -> Decoded:
    ok, want = _reference(codec, bodies)
    decoded = columns.decode(pa.array(bodies, pa.binary()))
    assert decoded.ok.tolist() == ok
    assert sorted(decoded.errors) == [i for i, good in enumerate(ok) if not good]
    assert all(isinstance(why, str) and why for why in decoded.errors.values())
    _same_table(decoded.table, want)
    return decoded


@SETTINGS
@given(_cases(max_rows=6), st.data())
def test_mutated_bodies_are_bad_exactly_when_the_per_row_decoder_refuses_them(
    case: tuple[Ty, list[Any]], data: st.DataObject
) -> None:
    ty, values = case
    codec, columns = RowCodec(ty.avro), ColumnCodec(ty.avro)
    plain = _plain(ty)
    bodies = [_plain_encode(plain, v) for v in values]
    mutated = [_mutate(b, data) if data.draw(st.booleans()) else b for b in bodies]
    decoded = _agree(codec, columns, mutated)
    # what does decode re-encodes to the canonical bytes of what the per-row path decodes
    good = [b for b, ok in zip(mutated, decoded.ok.tolist(), strict=True) if ok]
    header = MARKER + codec.fingerprint
    assert columns.encode(decoded.table).to_pylist() == [
        codec.encode_body(codec.decode(header + b)) for b in good
    ]


_TEXTS = {
    "type": "record",
    "name": "Texts",
    "fields": [
        {"name": "s", "type": "string"},
        {"name": "a", "type": {"type": "array", "items": "string"}},
        {"name": "m", "type": {"type": "map", "values": ["null", "string"]}},
        {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
    ],
}
_FRAGMENTS = st.sampled_from(
    [
        b"a",
        b"\xc3\xa9",
        b"\xe2\x82\xac",
        b"\xf0\x9f\x98\x80",
        b"\xed\xa0\x80",
        b"\xc0\xaf",
        b"\xf4\x90\x80\x80",
        b"\x80",
        b"\xc3",
        b"\xef\xbf\xbe",
        b"\x00",
        b"-",
        b"F",
    ]
)
_TEXT_BYTES = st.lists(_FRAGMENTS, max_size=5).map(b"".join) | st.binary(max_size=6)
_UUIDS = (
    st.sampled_from(
        [
            b"12345678-1234-5678-1234-567812345678",
            b"12345678-ABCD-5678-1234-567812345678",
            b"{12345678-1234-5678-1234-567812345678}",
            b"12345678123456781234567812345678",
            b"urn:uuid:12345678-1234-5678-1234-567812345678",
            b"12345678-1234-5678-1234-56781234567g",
            b"1234-5678-1234-5678-1234-5678-12345678",
            b"\xc3\xa9" * 18,
        ]
    )
    | _TEXT_BYTES
)


def _blob(b: bytes) -> bytes:
    return _zz(len(b)) + b


def _block(items: list[bytes]) -> bytes:
    return (_zz(len(items)) + b"".join(items) if items else b"") + b"\x00"


def _texts_body(s: bytes, a: list[bytes], m: list[tuple[bytes, bytes | None]], u: bytes) -> bytes:
    """A body of ``_TEXTS`` written by hand, so that any bytes can stand for text."""
    entries = [_blob(k) + (b"\x00" if v is None else b"\x02" + _blob(v)) for k, v in m]
    return _blob(s) + _block([_blob(x) for x in a]) + _block(entries) + _blob(u)


def _zz(v: int) -> bytes:
    n = ((v << 1) ^ (v >> 63)) & (2**64 - 1)
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@SETTINGS
@given(
    st.lists(
        st.tuples(
            _TEXT_BYTES,
            st.lists(_TEXT_BYTES, max_size=3),
            st.lists(st.tuples(_TEXT_BYTES, st.none() | _TEXT_BYTES), max_size=3),
            _UUIDS,
        ),
        min_size=1,
        max_size=8,
    )
)
def test_text_is_refused_exactly_when_python_refuses_its_utf8_and_uuids_agree(
    rows: list[tuple[bytes, list[bytes], list[tuple[bytes, bytes | None]], bytes]],
) -> None:
    codec, columns = RowCodec(_TEXTS), ColumnCodec(_TEXTS)
    bodies = [_texts_body(*r) for r in rows]
    decoded = _agree(codec, columns, bodies)
    good = [b for b, ok in zip(bodies, decoded.ok.tolist(), strict=True) if ok]
    header = MARKER + codec.fingerprint
    assert columns.encode(decoded.table).to_pylist() == [
        codec.encode_body(codec.decode(header + b)) for b in good
    ]


def _cycled(items: list[Any], n: int) -> list[Any]:
    return [items[i % len(items)] for i in range(n)]


def _some_long(values: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Short lists, or long ones (33 to 70 items) made by cycling a few generated items."""
    long = st.tuples(st.lists(values, min_size=1, max_size=3), st.integers(33, 70))
    return st.lists(values, max_size=3) | long.map(lambda xn: _cycled(*xn))


def _repeated(item: Ty, nullable: bool, null_first: bool, as_map: bool) -> Ty:
    if nullable and item.avro != "null":
        branches = ["null", item.avro] if null_first else [item.avro, "null"]
        item = Ty(branches, st.none() | item.values, _canon_nullable(item), union=True)
    if as_map:
        entries = _some_long(item.values).map(
            lambda vs: {f"{'é' if i % 3 else 'k'}{(i * 7919) % 1000}": v for i, v in enumerate(vs)}
        )
        return Ty({"type": "map", "values": item.avro}, entries, _canon_map(item))
    return Ty({"type": "array", "items": item.avro}, _some_long(item.values), _canon_list(item))


def _long_cases() -> st.SearchStrategy[tuple[Ty, list[Any]]]:
    """Records with arrays and maps of any item type (nullable items too), some with blocks of
    33 to 70 items: the block decoding's fast paths (fixed-width runs, varint ends, skips,
    plain Python skips of a few long blocks) and its fallbacks."""
    items = TYPES.filter(lambda t: not t.union and not t.bare_null)
    repeated = st.builds(_repeated, items, st.booleans(), st.booleans(), st.booleans())
    fields = st.one_of(repeated, repeated, leaf_types().filter(lambda t: not t.bare_null))
    return record_of(fields, min_fields=1, max_fields=3).flatmap(
        lambda t: st.tuples(st.just(t), st.lists(t.values, min_size=1, max_size=6))
    )


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_long_cases(), st.data())
def test_long_and_skewed_arrays_and_maps_decode_as_the_per_row_path(
    case: tuple[Ty, list[Any]], data: st.DataObject
) -> None:
    ty, values = case
    codec, columns = RowCodec(ty.avro), ColumnCodec(ty.avro)
    plain = _plain(ty)
    canonical = [_plain_encode(plain, ty.canon(v)) for v in values]
    decoded = _agree(codec, columns, canonical)
    assert columns.encode(decoded.table).to_pylist() == canonical
    odd = [_odd(_strip_logical(ty.avro), v, _Choices(data)) for v in values]
    _same_table(_agree(codec, columns, odd).table, decoded.table)
    mutated = [_mutate(b, data) if data.draw(st.booleans()) else b for b in odd]
    _agree(codec, columns, mutated)


# -- named cases ---------------------------------------------------------------------------


def _schema(*types: Any) -> dict[str, Any]:
    return {
        "type": "record",
        "name": "R",
        "fields": [{"name": f"f{i}", "type": t} for i, t in enumerate(types)],
    }


def _check(schema: dict[str, Any], bodies: list[bytes]) -> Decoded:
    """Decode with both paths (they must agree) and re-encode the good rows both ways."""
    codec, columns = RowCodec(schema), ColumnCodec(schema)
    decoded = _agree(codec, columns, bodies)
    want = [codec.encode_body(r) for r in arrow_to_rows(decoded.table, codec.schema)]
    assert columns.encode(decoded.table).to_pylist() == want
    return decoded


def test_an_int_outside_32_bits_is_a_bad_row_naming_the_field() -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "n", "type": "int"}]}
    decoded = _check(schema, [_zz(2**31), _zz(2**31 - 1), _zz(-(2**31)), _zz(-(2**31) - 1)])
    assert decoded.ok.tolist() == [False, True, True, False]
    assert decoded.errors[0] == "expected an int in 32 bits at field 'n', found 2147483648"
    assert decoded.table.column("n").to_pylist() == [2**31 - 1, -(2**31)]


def test_an_enum_index_out_of_range_is_bad_and_a_negative_one_counts_from_the_end() -> None:
    enum = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN", "BLUE"]}
    decoded = _check(_schema(enum), [_zz(1), _zz(3), _zz(-1), _zz(-3), _zz(-4)])
    # fastavro indexes the symbols list with Python's negative indexing
    assert decoded.ok.tolist() == [True, False, True, True, False]
    assert decoded.table.column("f0").to_pylist() == ["GREEN", "BLUE", "RED"]
    assert "enum index in [0, 3) at field 'f0', found 3" in decoded.errors[1]


def test_a_union_index_out_of_range_is_bad() -> None:
    decoded = _check(
        _schema(["null", "long"]), [b"\x00", b"\x02\x04", b"\x04\x02", b"\x01\x04", b"\x03"]
    )
    assert decoded.ok.tolist() == [True, True, False, True, True]
    assert decoded.table.column("f0").to_pylist() == [None, 2, 2, None]


def test_a_split_unsorted_map_decodes_and_encodes_to_the_sorted_single_block() -> None:
    schema = _schema({"type": "map", "values": "int"}, "boolean")
    first = _zz(2) + _zz(1) + b"c" + _zz(1) + _zz(1) + b"a" + _zz(2)
    second_entries = _zz(1) + b"b" + _zz(3) + _zz(1) + b"a" + _zz(4)  # "a" again: last wins
    second = _zz(-2) + _zz(len(second_entries)) + second_entries  # negative count and size
    body = first + second + b"\x00" + b"\x07"  # a boolean byte other than 1 is true
    canonical = _zz(3) + _zz(1) + b"a" + _zz(4) + _zz(1) + b"b" + _zz(3) + _zz(1) + b"c" + _zz(1)
    decoded = _check(schema, [body, b"\x00\x00"])
    assert decoded.table.column("f0").to_pylist() == [[("a", 4), ("b", 3), ("c", 1)], []]
    assert decoded.table.column("f1").to_pylist() == [True, False]
    assert ColumnCodec(schema).encode(decoded.table).to_pylist() == [
        canonical + b"\x00" + b"\x01",
        b"\x00\x00",
    ]


def test_empty_arrays_and_maps_and_nulls_in_nullable_nested_fields() -> None:
    inner = {"type": "record", "name": "In", "fields": [{"name": "x", "type": ["null", "long"]}]}
    schema = _schema(
        {"type": "array", "items": ["null", inner]},
        ["null", {"type": "map", "values": {"type": "array", "items": "int"}}],
        [{"type": "array", "items": "string"}, "null"],
    )
    codec = RowCodec(schema)
    rows = [
        {"f0": [], "f1": {}, "f2": []},
        {"f0": [None, {"x": None}, {"x": 5}], "f1": None, "f2": None},
        {"f0": [{"x": 1}], "f1": {"k": [], "j": [1, 2]}, "f2": ["a", ""]},
    ]
    bodies = [codec.encode_body(r) for r in rows]
    decoded = _check(schema, bodies)
    assert decoded.table.to_pylist() == [
        {"f0": [], "f1": [], "f2": []},
        {"f0": [None, {"x": None}, {"x": 5}], "f1": None, "f2": None},
        {"f0": [{"x": 1}], "f1": [("j", [1, 2]), ("k", [])], "f2": ["a", ""]},
    ]
    assert ColumnCodec(schema).encode(decoded.table).to_pylist() == bodies


def test_nanosecond_timestamps_decimal256_and_durations_round_trip() -> None:
    schema = _schema(
        {"type": "long", "logicalType": "timestamp-nanos"},
        {"type": "long", "logicalType": "local-timestamp-nanos"},
        {"type": "bytes", "logicalType": "decimal", "precision": 76, "scale": 10},
        {"type": "fixed", "name": "D", "size": 40, "logicalType": "decimal", "precision": 76},
        {"type": "fixed", "name": "Dur", "size": 12, "logicalType": "duration"},
    )
    big = 10**76 - 1
    plain = fastavro.parse_schema(_strip_logical(schema))
    values = [
        {
            "f0": 2**63 - 1,
            "f1": -(2**63),
            "f2": _dec_bytes(big, 0),
            "f3": big.to_bytes(40, "big", signed=True),
            "f4": bytes(range(12)),
        },
        {
            "f0": -1,
            "f1": 0,
            "f2": _dec_bytes(-big, 3),
            "f3": (-big).to_bytes(40, "big", signed=True),
            "f4": b"\xff" * 12,
        },
        {"f0": 0, "f1": 1, "f2": b"", "f3": bytes(40), "f4": bytes(12)},
    ]
    decoded = _check(schema, [_plain_encode(plain, v) for v in values])
    assert decoded.ok.all()
    assert decoded.table.schema.field("f2").type == pa.decimal256(76, 10)
    assert decoded.table.column("f0").cast(pa.int64()).to_pylist() == [2**63 - 1, -1, 0]
    assert decoded.table.column("f3").to_pylist() == [Decimal(big), Decimal(-big), Decimal(0)]
    assert decoded.table.column("f4").to_pylist()[0] == bytes(range(12))
    too_many_digits = dict(values[2], f2=_dec_bytes(10**76, 0))
    assert not _check(schema, [_plain_encode(plain, too_many_digits)]).ok.any()


def test_truncated_trailing_null_and_short_bodies_are_bad() -> None:
    schema = _schema("long", "string", "double")
    codec, columns = RowCodec(schema), ColumnCodec(schema)
    good = codec.encode_body({"f0": 300, "f1": "héllo", "f2": -0.0})
    _check(schema, [good, good[:-1], good + b"\x00", good[:3], b""])
    framed = [
        codec.encode(codec.decode(codec.encode({"f0": 1, "f1": "", "f2": 1.5}))),
        None,
        b"\xc3",
    ]
    decoded = columns.decode(pa.array(framed, pa.binary()), skip=10)
    assert decoded.ok.tolist() == [True, False, False]
    assert decoded.errors[1] == "expected a row's bytes, found null"
    assert decoded.errors[2] == "expected at least 10 bytes, found 1"
    trailing = columns.decode(pa.array([good + b"\x00"]))
    assert trailing.errors == {
        0: "expected the body to end after its last field, found 1 trailing bytes"
    }


def test_rare_spellings_are_left_to_the_per_row_decoder() -> None:
    schema = _schema(
        "long", {"type": "string", "logicalType": "uuid"}, {"type": "array", "items": "int"}
    )
    text = b"{12345678-1234-5678-1234-567812345678}"
    long_zero = b"\x80" * 10 + b"\x00"  # 11 bytes: fastavro keeps reading
    bodies = [
        _zz(5) + _zz(len(text)) + text + b"\x00",
        long_zero + _zz(36) + b"12345678-1234-5678-1234-567812345678" + b"\x00",
        _zz(1) + _zz(36) + b"12345678-1234-5678-1234-56781234567X" + b"\x00",
        _zz(1)
        + _zz(36)
        + b"12345678-1234-5678-1234-567812345678"
        + _zz(-(2**63))
        + _zz(0)
        + b"\x00",
    ]
    decoded = _check(schema, bodies)
    assert decoded.table.column("f1").to_pylist()[0] == "12345678-1234-5678-1234-567812345678"


def test_float32_nans_are_quieted_both_ways_as_through_python_floats() -> None:
    schema = _schema("float", "double")
    bodies = [
        struct.pack("<IQ", bits, 0x7FF0000000000001)
        for bits in (0x7F800001, 0xFFA00000, 0x80000000)
    ]
    decoded = _check(schema, bodies)
    got = decoded.table.column("f0").combine_chunks().view(pa.uint32()).to_pylist()
    assert got == [0x7FC00001, 0xFFE00000, 0x80000000]
    assert (
        decoded.table.column("f1").combine_chunks().view(pa.uint64()).to_pylist()[0]
        == 0x7FF0000000000001
    )
    signalling = pa.table(
        {"f0": pa.array(np.array([0x7F800001], np.uint32)).view(pa.float32()), "f1": [0.0]}
    )
    want = RowCodec(schema).encode_body(arrow_to_rows(signalling, schema)[0])
    assert (
        ColumnCodec(schema).encode(signalling).to_pylist()
        == [want]
        == [b"\x01\x00\xc0\x7f" + bytes(8)]
    )


def test_single_branch_unions_and_null_fields() -> None:
    schema = _schema(
        ["long"], ["null"], "null", ["null", {"type": "fixed", "name": "F", "size": 2}]
    )
    decoded = _check(schema, [b"\x00\x02\x00\x02ab", b"\x01\x04\x01\x00", b"\x02\x02\x00\x00"])
    assert decoded.ok.tolist() == [True, True, False]
    assert decoded.table.to_pylist() == [
        {"f0": 1, "f1": None, "f2": None, "f3": b"ab"},
        {"f0": 2, "f1": None, "f2": None, "f3": None},
    ]


def test_a_u64_above_2_63_is_bad_because_an_int64_column_cannot_hold_it() -> None:
    schema = _schema({"type": "long", "logicalType": "u64"})
    codec, columns = RowCodec(schema), ColumnCodec(schema)
    # the per-row decoder accepts it (as 2**64 - 1), but rows_to_arrow refuses the value
    assert codec.decode(MARKER + codec.fingerprint + _zz(-1)) == {"f0": 2**64 - 1}
    with pytest.raises(EncodeError):
        rows_to_arrow([{"f0": 2**64 - 1}], codec.schema)
    decoded = _check(schema, [_zz(-1), _zz(7)])
    assert decoded.ok.tolist() == [False, True]
    with pytest.raises(EncodeError, match="found -1"):
        columns.encode(pa.table({"f0": pa.array([-1], pa.int64())}))


# -- encoding tables the per-row path refuses or bends -------------------------------------


def _encode_both(schema: dict[str, Any], table: pa.Table) -> tuple[Any, Any]:
    """(reference result or its exception type, ours or our exception type)."""
    codec = RowCodec(schema)
    try:
        want: Any = [codec.encode_body(r) for r in arrow_to_rows(table, codec.schema)]
    except Exception as e:  # arrow_to_rows raises KeyError, OverflowError, ValueError
        want = type(e)
    try:
        got: Any = ColumnCodec(schema).encode(table).to_pylist()
    except EncodeError as e:
        got = type(e)
    return want, got


@pytest.mark.parametrize(
    ("schema", "column", "outcome"),
    [
        # a null boolean in a non-nullable field is written as false by fastavro
        (_schema("boolean"), pa.array([True, None]), [b"\x01", b"\x00"]),
        (_schema("long"), pa.array([1, None]), EncodeError),
        (
            _schema({"type": "map", "values": "int"}),
            pa.array([[("a", 1), ("a", 2)]], pa.map_(pa.string(), pa.int32())),
            EncodeError,
        ),
        (
            _schema({"type": "int", "logicalType": "time-millis"}),
            pa.array([86_400_000 * 3 + 5, -1, 2**31 - 1], pa.int32()).cast(pa.time32("ms")),
            None,
        ),
        (
            _schema({"type": "long", "logicalType": "time-micros"}),
            pa.array([-1, 86_400_000_000 + 2], pa.int64()).cast(pa.time64("us")),
            None,
        ),
        (
            _schema({"type": "long", "logicalType": "time-micros"}),
            pa.array([2**62], pa.int64()).cast(pa.time64("us")),
            EncodeError,
        ),
        (
            _schema({"type": "long", "logicalType": "timestamp-millis"}),
            pa.array([253_402_300_800_000], pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
            EncodeError,
        ),
        (
            _schema({"type": "int", "logicalType": "date"}),
            pa.array([-719_163], pa.int32()).cast(pa.date32()),
            EncodeError,
        ),
        (
            _schema({"type": "enum", "name": "E", "symbols": ["A"]}),
            pa.array(["A", "B"]),
            EncodeError,
        ),
        (
            _schema({"type": "string", "logicalType": "uuid"}),
            pa.array(
                ["12345678-ABCD-5678-1234-567812345678", "{12345678123456781234567812345678}"]
            ),
            None,
        ),
        (_schema({"type": "string", "logicalType": "uuid"}), pa.array(["not a uuid"]), EncodeError),
        (
            _schema({"type": "bytes", "logicalType": "decimal", "precision": 2}),
            pa.array([Decimal(100)], pa.decimal128(3, 0)).cast(pa.decimal128(2, 0), safe=False),
            EncodeError,
        ),
        (
            _schema({"type": "record", "name": "Q", "fields": [{"name": "b", "type": "boolean"}]}),
            pa.array([{"b": None}], pa.struct([pa.field("b", pa.bool_(), nullable=False)])),
            [b"\x00"],
        ),
    ],
)
def test_encode_refuses_and_bends_values_as_the_per_row_path_does(
    schema: dict[str, Any], column: pa.Array, outcome: Any
) -> None:
    table = pa.table({"f0": column})
    want, got = _encode_both(schema, table)
    if outcome is EncodeError:
        assert want is not None and not isinstance(want, list)
        assert got is EncodeError
    else:
        assert got == want
        if outcome is not None:
            assert got == outcome


def test_named_types_used_twice_decode_and_encode() -> None:
    point = {
        "type": "record",
        "name": "Point",
        "namespace": "geo",
        "fields": [{"name": "x", "type": "int"}, {"name": "y", "type": "int"}],
    }
    color = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}
    hash_ = {"type": "fixed", "name": "Hash", "size": 3}
    schema = _schema(
        point,
        "geo.Point",
        {"type": "array", "items": "geo.Point"},
        color,
        "Color",
        hash_,
        {"type": "map", "values": "Hash"},
        {"type": "array", "items": "long"},
        ["null", "geo.Point"],
    )
    codec = RowCodec(schema)
    rows = [
        {
            "f0": {"x": 1, "y": 2},
            "f1": {"x": 3, "y": 4},
            "f2": [{"x": 5, "y": 6}],
            "f3": "RED",
            "f4": "GREEN",
            "f5": b"abc",
            "f6": {"k": b"xyz"},
            "f7": [1, 2],
            "f8": None,
        },
        {
            "f0": {"x": -1, "y": 0},
            "f1": {"x": 0, "y": 0},
            "f2": [],
            "f3": "GREEN",
            "f4": "RED",
            "f5": b"\x00\x00\x00",
            "f6": {},
            "f7": [],
            "f8": {"x": 7, "y": 8},
        },
    ]
    bodies = [codec.encode_body(r) for r in rows]
    decoded = _check(schema, bodies)
    assert decoded.ok.all() and decoded.table.column("f8").to_pylist() == [None, {"x": 7, "y": 8}]
    assert ColumnCodec(schema).encode(decoded.table).to_pylist() == bodies


def test_inputs_the_codec_does_not_take_are_refused_plainly() -> None:
    schema = _schema("long", ["long"])
    columns = ColumnCodec(schema)
    with pytest.raises(ValueError, match="skip >= 0"):
        columns.decode(pa.array([b"\x02\x00\x02"]), skip=-1)
    with pytest.raises(DecodeError, match="expected a binary array of bodies, found string"):
        columns.decode(pa.array(["x"]))
    chunked = pa.chunked_array([[b"\x02\x00\x02"], [b"\x04\x00\x04"]])
    assert columns.decode(chunked).table.to_pylist() == [{"f0": 1, "f1": 1}, {"f0": 2, "f1": 2}]
    with pytest.raises(EncodeError, match="expected a column 'f1' in the table"):
        columns.encode(pa.table({"f0": [1]}))
    with pytest.raises(EncodeError, match="expected column 'f1' of type int64, found string"):
        columns.encode(pa.table({"f0": [1], "f1": ["x"]}))
    # a union of one type holds no null: the per-row writer refuses None there
    table = pa.table({"f0": [1], "f1": pa.array([None], pa.int64())})
    with pytest.raises(EncodeError, match="non-nullable field 'f1'"):
        columns.encode(table)
    with pytest.raises(EncodeError):
        RowCodec(schema).encode_body(arrow_to_rows(table, schema)[0])
    assert (
        columns.encode(
            pa.table({"f0": pa.array([], pa.int64()), "f1": pa.array([], pa.int64())})
        ).to_pylist()
        == []
    )
    empty = columns.decode(pa.array([], pa.binary()))
    assert empty.table.num_rows == 0 and empty.ok.tolist() == [] and empty.errors == {}


def test_buffers_beyond_2_gib_cut_text_with_64_bit_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.avro_columns as avro_columns

    schema = _schema("string", {"type": "map", "values": "bytes"}, "long")
    codec, columns = RowCodec(schema), ColumnCodec(schema)
    rows = [{"f0": "é" * i, "f1": {str(i): b"x" * i}, "f2": i} for i in range(5)]
    bodies = [codec.encode_body(r) for r in rows]
    want = columns.decode(pa.array(bodies)).table
    monkeypatch.setattr(avro_columns, "_MAX_OFFSET", 8)  # as if the buffer were beyond 2 GiB
    _same_table(columns.decode(pa.array(bodies)).table, want)
    uuids = ColumnCodec(_schema({"type": "string", "logicalType": "uuid"}))
    table = pa.table({"f0": ["12345678-1234-5678-1234-567812345678"]})
    with pytest.raises(EncodeError, match="smaller batches"):
        uuids.encode(table)


_LONG_ITEMS: list[tuple[Any, Any]] = [
    ("long", lambda i: i * 1_000_003 - 50_000_000),
    ("int", lambda i: i - 40),
    ({"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}, lambda i: "ABC"[i % 3]),
    ("float", lambda i: i / 7),
    ("boolean", lambda i: i % 3 == 0),
    ({"type": "fixed", "name": "F", "size": 3}, lambda i: bytes([i % 256, 1, 2])),
    (
        {
            "type": "record",
            "name": "P",
            "fields": [{"name": "x", "type": "float"}, {"name": "y", "type": "double"}],
        },
        lambda i: {"x": 1.5, "y": -i / 3},
    ),
    ("string", lambda i: "é" * (i % 4) + str(i)),
    (["null", "string"], lambda i: None if i % 5 == 0 else f"s{i}"),
    (
        {
            "type": "record",
            "name": "Q",
            "fields": [{"name": "s", "type": "string"}, {"name": "n", "type": ["long", "null"]}],
        },
        lambda i: {"s": str(i), "n": None if i % 2 else i},
    ),
    ({"type": "array", "items": "int"}, lambda i: list(range(i % 4))),
    ({"type": "map", "values": "long"}, lambda i: {str(k): k for k in range(i % 3)}),
]


@pytest.mark.parametrize(
    ("item", "value"), _LONG_ITEMS, ids=[str(i) for i in range(len(_LONG_ITEMS))]
)
def test_long_skewed_blocks_and_their_truncations_agree_with_the_per_row_path(
    item: Any, value: Any
) -> None:
    again = item["name"] if isinstance(item, dict) and "name" in item else item
    schema = _schema({"type": "array", "items": item}, {"type": "map", "values": again}, "long")
    codec = RowCodec(schema)
    rows = [
        {"f0": [value(i) for i in range(n)], "f1": {f"k{i}": value(i) for i in range(m)}, "f2": n}
        for n, m in [(80, 0), (2, 40), (0, 0), (45, 45), (1, 1)]
    ]
    good = [codec.encode_body(r) for r in rows]
    bad: list[bytes] = []
    for body in good[:1] + good[3:4]:
        for cut in range(1, len(body), max(1, len(body) // 40)):
            bad.append(body[:cut])
            bad.append(body[:cut] + bytes([body[cut] ^ 0x80]) + body[cut + 1 :])
            bad.append(body[:cut] + b"\xff" + body[cut + 1 :])
    decoded = _check(schema, good + bad)
    assert decoded.ok[: len(good)].all()
    # the same rows in split, negative-count blocks, over-long varints...: the same table
    plain = _inline(_strip_logical(codec.schema), {})
    for seed in range(3):
        physical = [codec.decode(MARKER + codec.fingerprint + b) for b in good]
        physical = [arrow_to_rows(rows_to_arrow([r], codec.schema))[0] for r in physical]
        odd = [_odd(plain, _physical(plain, r), _Choices(seed=seed)) for r in physical]
        _same_table(_check(schema, odd).table, decoded.table.slice(0, len(good)))


def _physical(avro: Any, value: Any) -> Any:
    """A decoded value as plain fastavro writes it for the schema without logical types
    (enough for the item types of the long-block test: floats, enums, records, maps...)."""
    if isinstance(avro, list):
        branch = next(b for b in avro if b != "null")
        return None if value is None else _physical(branch, value)
    if isinstance(avro, dict) and avro["type"] == "record":
        return {f["name"]: _physical(f["type"], value[f["name"]]) for f in avro["fields"]}
    if isinstance(avro, dict) and avro["type"] == "array":
        return [_physical(avro["items"], x) for x in value]
    if isinstance(avro, dict) and avro["type"] == "map":
        return {k: _physical(avro["values"], v) for k, v in value.items()}
    return value


def _inline(avro: Any, named: dict[str, Any]) -> Any:
    """The schema with every use of a named type replaced by its definition (for ``_odd``)."""
    if isinstance(avro, str):
        return named.get(avro, avro)
    if isinstance(avro, list):
        return [_inline(b, named) for b in avro]
    out = dict(avro)
    if "fields" in out:
        out["fields"] = [dict(f, type=_inline(f["type"], named)) for f in out["fields"]]
    for key in ("items", "values"):
        if key in out:
            out[key] = _inline(out[key], named)
    if "name" in out:
        named[out["name"]] = out
    return out
