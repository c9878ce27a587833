"""A collection's row schema (Avro) and its one mapping to Arrow.

A collection is created with an Avro *record* schema for its rows. This module validates it
(:func:`parse_row_schema`), maps it to an Arrow schema in exactly one place
(:func:`avro_to_arrow_schema`), and converts rows (Python dicts, as fastavro reads and writes
them) to and from Arrow tables (:func:`rows_to_arrow`, :func:`arrow_to_rows`).

The mapping (Avro -> Arrow):

============================================  ===========================================
Avro                                          Arrow
============================================  ===========================================
``null``                                      ``null``
``boolean``                                   ``bool``
``int``                                       ``int32``
``long``                                      ``int64``
``float`` / ``double``                        ``float32`` / ``float64``
``bytes`` / ``string``                        ``binary`` / ``string``
``enum``                                      ``string`` (the symbol)
``fixed`` (size n)                            ``fixed_size_binary(n)``
``int`` + ``date``                            ``date32``
``int`` + ``time-millis``                     ``time32[ms]``
``long`` + ``time-micros``                    ``time64[us]``
``long`` + ``timestamp-millis/micros/nanos``  ``timestamp[ms/us/ns, tz=UTC]``
``long`` + ``local-timestamp-millis/...``     ``timestamp[ms/us/ns]`` (no time zone)
``bytes``/``fixed`` + ``decimal(p, s)``       ``decimal128(p, s)`` (``decimal256`` if p > 38)
``string`` + ``uuid``                         ``string`` (canonical text form)
``["null", T]`` (either order)                ``T``, nullable
``array<T>``                                  ``list<item: T>``
``map<T>``                                    ``map<string, T>``
``record``                                    ``struct``
============================================  ===========================================

Every other logical type (``duration``, a ``uuid`` on ``fixed``) maps as its base type, which
holds it exactly. Values in Python are what :class:`~shared.codec.RowCodec` decodes: ``date``,
``time``, ``datetime`` (aware in UTC for ``timestamp-*``), ``Decimal``, ``uuid.UUID``, and the
``int`` nanoseconds for ``timestamp-nanos``/``local-timestamp-nanos`` (a ``datetime`` cannot
hold nanoseconds).

A field is nullable in Arrow iff its Avro type is ``null`` or a union with ``null``; every
other field is ``nullable=False`` and :func:`rows_to_arrow` rejects a null in it. A logical
type on the wrong base type is ignored, as the Avro specification says: the field maps as its
base type.

The mapping is an exact inverse: ``arrow_to_rows(rows_to_arrow(rows, s), s) == rows``, through
Parquet too, for every schema :func:`parse_row_schema` accepts and every value the codec
decodes (``tests/shared/test_avro_arrow_types.py`` proves it over generated schemas). What it cannot
map exactly is refused at ``collection create`` with a :class:`~shared.errors.SchemaError`
naming the field: unions of two or more non-null types, recursive records, records without
fields, ``fixed`` of size 0, the type ``null`` alone inside an array or a map (Parquet reads it
back corrupted), and a ``decimal`` with invalid parameters (fastavro does not ignore those as
the specification says: it reads the values as decimals the base type cannot hold). Values the
Avro encoding carries but the Arrow columns cannot hold (an ``int`` outside 32 bits, a decimal
with more digits than its precision, a time of day outside the day) are refused by the codec,
per row: see :func:`row_normaliser` and :meth:`shared.codec.RowCodec.canonical`.

The names ``_time``, ``_diff`` and ``_error`` are reserved for the shard's own columns and
may not be top-level fields of a row schema.

Pure: pyarrow and fastavro only, no I/O.
"""

from __future__ import annotations

import copy
import json
import uuid
from decimal import Decimal
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import fastavro
import pyarrow as pa

from shared.errors import EncodeError, SchemaError

__all__ = [
    "RESERVED_FIELDS",
    "arrow_to_rows",
    "avro_to_arrow_schema",
    "parse_row_schema",
    "row_normaliser",
    "rows_to_arrow",
]

#: Top-level column names the shard uses for itself; a row schema may not use them.
RESERVED_FIELDS: frozenset[str] = frozenset({"_time", "_diff", "_error"})

_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}

_LONG_LOGICAL: dict[str, pa.DataType] = {
    "time-micros": pa.time64("us"),
    "timestamp-millis": pa.timestamp("ms", tz="UTC"),
    "timestamp-micros": pa.timestamp("us", tz="UTC"),
    "timestamp-nanos": pa.timestamp("ns", tz="UTC"),
    "local-timestamp-millis": pa.timestamp("ms"),
    "local-timestamp-micros": pa.timestamp("us"),
    "local-timestamp-nanos": pa.timestamp("ns"),
}

_INT_LOGICAL: dict[str, pa.DataType] = {
    "date": pa.date32(),
    "time-millis": pa.time32("ms"),
}

AvroSchema = Mapping[str, Any] | str


# -- validation ----------------------------------------------------------------------------


def _load(schema: AvroSchema | Sequence[Any]) -> Any:
    """A JSON text or a JSON-like value -> a fresh JSON-like value (never aliases the input)."""
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as e:
            # A bare name such as "long" is valid Avro JSON only when quoted; try it as a name.
            if schema.strip() in _PRIMITIVES:
                return schema.strip()
            raise SchemaError(
                f"expected an Avro schema as JSON text, found invalid JSON ({e.msg} at {e.pos})"
            ) from e
    try:
        return json.loads(json.dumps(schema))
    except (TypeError, ValueError) as e:
        raise SchemaError(
            f"expected an Avro schema made of JSON values, found {type(schema).__name__} "
            f"that does not serialise as JSON ({e})"
        ) from e


def _parse_any(schema: AvroSchema | Sequence[Any]) -> Any:
    """Validate any Avro schema with fastavro; names come back fully qualified."""
    raw = _load(schema)
    try:
        return fastavro.parse_schema(copy.deepcopy(raw), _write_hint=False)
    except Exception as e:  # fastavro raises SchemaParseException, UnknownType, ValueError...
        raise SchemaError(f"expected a valid Avro schema, found one fastavro rejects: {e}") from e


def parse_row_schema(schema: AvroSchema) -> dict[str, Any]:
    """Validate a collection's row schema and return it normalised.

    Accepts the schema as a dict or as JSON text. It must be an Avro ``record``, valid for
    fastavro, with no top-level field named ``_time``, ``_diff`` or ``_error``, and mappable
    to Arrow (see the module docstring). The result is a plain JSON-serialisable dict with
    fully-qualified names (fastavro's parsed form without its private markers); parsing it
    again gives the same dict.

    Raises :class:`~shared.errors.SchemaError` with a message "expected X, found Y".
    """
    parsed = _parse_any(schema)
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        found = parsed.get("type") if isinstance(parsed, dict) else parsed
        raise SchemaError(
            f"expected an Avro record schema for a collection's rows, found type {found!r}",
            expected="record",
            actual=found,
        )
    names = [f["name"] for f in parsed["fields"]]
    reserved = sorted(set(names) & RESERVED_FIELDS)
    if reserved:
        raise SchemaError(
            f"expected row fields other than the reserved {sorted(RESERVED_FIELDS)}, "
            f"found {reserved}",
            reserved=reserved,
        )
    avro_to_arrow_schema(parsed)  # mappable, or SchemaError
    result: dict[str, Any] = json.loads(json.dumps(parsed))
    return result


# -- Avro -> Arrow types -------------------------------------------------------------------


class _Mapper:
    """Walk one parsed Avro schema, resolving named types, building Arrow types."""

    def __init__(self) -> None:
        self.named: dict[str, Any] = {}
        self.expanding: list[str] = []

    def field_type(self, avro: Any, where: str) -> tuple[pa.DataType, bool]:
        """(arrow type, nullable) of an Avro type appearing at ``where``."""
        if isinstance(avro, list):
            branches = list(avro)
            non_null = [b for b in branches if b != "null"]
            if len(non_null) == len(branches):
                if len(branches) == 1:
                    return self.field_type(branches[0], where)
                raise SchemaError(
                    f"expected a union of null and one type at {where}, found a union of "
                    f"{len(branches)} non-null types (no Parquet mapping)",
                    where=where,
                )
            if len(non_null) == 0:
                return pa.null(), True
            if len(non_null) > 1:
                raise SchemaError(
                    f"expected a union of null and one type at {where}, found null and "
                    f"{len(non_null)} other types (no Parquet mapping)",
                    where=where,
                )
            t, _ = self.field_type(non_null[0], where)
            return t, True
        t = self.data_type(avro, where)
        return t, avro == "null" or t == pa.null()

    def data_type(self, avro: Any, where: str) -> pa.DataType:
        if isinstance(avro, str):
            if avro in _PRIMITIVES:
                return _PRIMITIVES[avro]
            if avro not in self.named:
                raise SchemaError(f"expected a known type name at {where}, found {avro!r}")
            if avro in self.expanding:
                raise SchemaError(
                    f"expected a non-recursive schema at {where}, found record {avro!r} "
                    "inside itself (no Arrow mapping)",
                    where=where,
                )
            return self.data_type(self.named[avro], where)
        if isinstance(avro, list):
            t, _ = self.field_type(avro, where)
            return t
        if not isinstance(avro, dict):
            raise SchemaError(f"expected an Avro type at {where}, found {avro!r}")
        kind = avro.get("type")
        logical = avro.get("logicalType")
        if kind in _PRIMITIVES:
            if kind == "bytes" and logical == "decimal":
                return _decimal_or_refuse(avro, 76, where)
            return self.primitive(kind, logical, avro)
        if kind == "record" or kind == "error":
            name = avro["name"]
            if not avro["fields"]:
                raise SchemaError(
                    f"expected a record with at least one field at {where}, found record "
                    f"{name!r} with none (Parquet cannot store an empty struct)",
                    where=where,
                )
            self.named[name] = avro
            self.expanding.append(name)
            try:
                fields = []
                for f in avro["fields"]:
                    t, nullable = self.field_type(f["type"], f"{where}.{f['name']}")
                    fields.append(pa.field(f["name"], t, nullable=nullable))
            finally:
                self.expanding.pop()
            return pa.struct(fields)
        if kind == "enum":
            self.named[avro["name"]] = avro
            return pa.string()
        if kind == "fixed":
            self.named[avro["name"]] = avro
            size = int(avro["size"])
            if logical == "decimal":
                return _decimal_or_refuse(avro, _fixed_max_precision(size), where)
            return pa.binary(size)
        if kind == "array":
            t, nullable = self.field_type(avro["items"], f"{where}[]")
            return pa.list_(pa.field("item", t, nullable=nullable))
        if kind == "map":
            t, nullable = self.field_type(avro["values"], f"{where}{{}}")
            return pa.map_(pa.string(), pa.field("value", t, nullable=nullable))
        if isinstance(kind, (dict, list)) or (isinstance(kind, str) and kind in self.named):
            return self.data_type(kind, where)
        raise SchemaError(f"expected an Avro type at {where}, found type {kind!r}")

    @staticmethod
    def primitive(kind: str, logical: Any, avro: Mapping[str, Any]) -> pa.DataType:
        if kind == "int" and logical in _INT_LOGICAL:
            return _INT_LOGICAL[logical]
        if kind == "long" and logical in _LONG_LOGICAL:
            return _LONG_LOGICAL[logical]
        return _PRIMITIVES[kind]


def _fixed_max_precision(size: int) -> int:
    """The largest decimal precision a two's complement of ``size`` bytes holds."""
    if size <= 0:
        return 0
    import math

    return math.floor(math.log10(2 ** (8 * size - 1) - 1))


def _decimal_or_refuse(avro: Mapping[str, Any], max_precision: int, where: str) -> pa.DataType:
    """The Arrow decimal of a ``decimal`` logical type, or SchemaError naming the field.

    The Avro specification says an invalid logical type is ignored, but fastavro does not
    ignore an invalid decimal: it reads (or fails to read) such a value as a ``Decimal``, which
    the base type's Arrow column cannot hold. Such a schema would be accepted and then stall
    the sink, so it is refused."""
    dec = _decimal_type(avro, max_precision=max_precision)
    if dec is None:
        bound = min(max_precision, 76)
        raise SchemaError(
            f"expected a decimal with an integer precision in 1..{bound} and a scale in "
            f"0..precision at {where}, found precision {avro.get('precision')!r} and scale "
            f"{avro.get('scale', 0)!r}",
            where=where,
        )
    return dec


def _decimal_type(avro: Mapping[str, Any], max_precision: int) -> pa.DataType | None:
    precision = avro.get("precision")
    scale = avro.get("scale", 0)
    if (
        not isinstance(precision, int)
        or isinstance(precision, bool)
        or not isinstance(scale, int)
        or isinstance(scale, bool)
        or not 0 < precision <= min(max_precision, 76)
        or not 0 <= scale <= precision
    ):
        return None  # invalid logical type: the base type applies (Avro spec)
    if precision <= 38:
        return pa.decimal128(precision, scale)
    return pa.decimal256(precision, scale)


def avro_to_arrow_schema(schema: AvroSchema) -> pa.Schema:
    """The Arrow schema of a row record schema (see the mapping in the module docstring).

    Accepts the raw or the normalised schema (dict or JSON text). Field order is kept.
    """
    parsed = _parse_any(schema)
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        found = parsed.get("type") if isinstance(parsed, dict) else parsed
        raise SchemaError(f"expected an Avro record schema, found type {found!r}")
    where = str(parsed["name"]).rsplit(".", 1)[-1]
    struct = _Mapper().data_type(parsed, where)
    for f in struct:
        _check_parquet_storable(f.type, f"{where}.{f.name}", repeated=False)
    return pa.schema([struct.field(i) for i in range(struct.num_fields)])


def _check_parquet_storable(t: pa.DataType, where: str, repeated: bool) -> None:
    """Refuse the Arrow types Parquet cannot store and read back exactly.

    A ``fixed`` of size 0 has no Parquet type (FIXED_LEN_BYTE_ARRAY needs a length), and a
    ``null``-only type inside an array or a map reads back as a corrupt column (pyarrow
    26 loses the repeated nulls' count). Both would be accepted by ``collection create`` and
    then stall the sink at its first write, so they are refused with the field's path."""
    if pa.types.is_fixed_size_binary(t) and t.byte_width == 0:
        raise SchemaError(
            f"expected a fixed of at least 1 byte at {where}, found size 0 (no Parquet type)",
            where=where,
        )
    if pa.types.is_null(t) and repeated:
        raise SchemaError(
            f"expected a type other than null alone inside an array or map at {where}, found "
            "null (Parquet does not read repeated null columns back exactly)",
            where=where,
        )
    if pa.types.is_struct(t):
        for f in t:
            _check_parquet_storable(f.type, f"{where}.{f.name}", repeated)
    elif pa.types.is_map(t):
        _check_parquet_storable(t.item_type, f"{where}{{}}", True)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        _check_parquet_storable(t.value_type, f"{where}[]", True)


# -- rows <-> Arrow ------------------------------------------------------------------------

_Conv = Callable[[Any], Any]

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1

#: What a compiled value walker does: make a row Arrow-ready, make an Arrow row what fastavro
#: decodes, or check and canonicalise a row for the Avro codec.
_Mode = str  # "to_arrow" | "to_avro" | "normalise"


def _sorted_map(v: Mapping[str, Any], inner: _Conv | None) -> dict[str, Any]:
    keys = sorted(v, key=lambda k: k.encode("utf-8") if isinstance(k, str) else str(k).encode())
    if inner is None:
        return {k: v[k] for k in keys}
    return {k: inner(v[k]) for k in keys}


def _walker(avro: Any, named: dict[str, Any], where: str, mode: _Mode) -> _Conv | None:
    """A function applied to the value of ``avro`` at ``where``, or None where nothing is to do.

    ``to_arrow``: uuid objects to their text, map keys sorted (Arrow keeps entry order, so the
    shard's map entries are in canonical order too). ``to_avro``: uuid text to ``uuid.UUID``, as
    fastavro decodes it. ``normalise``: map keys sorted, and every ``int`` checked to be in 32
    bits and every decimal to fit its precision and scale (a ValueError naming the field
    otherwise), since fastavro encodes and decodes such values but the collection's Arrow
    columns cannot hold them.
    """
    if isinstance(avro, str):
        if avro in named:
            return _walker(named[avro], named, where, mode)
        if avro == "int" and mode == "normalise":
            return _int_checker(where)
        return None
    if isinstance(avro, list):
        non_null = [b for b in avro if b != "null"]
        if len(non_null) != 1:
            return None  # null alone (or a union the mapper refuses)
        conv = _walker(non_null[0], named, where, mode)
        if conv is None:
            return None
        return lambda v: None if v is None else conv(v)
    if not isinstance(avro, dict):
        return None
    kind = avro.get("type")
    logical = avro.get("logicalType")
    if kind == "string" and logical == "uuid":
        if mode == "to_arrow":
            return lambda v: str(v) if isinstance(v, uuid.UUID) else v
        if mode == "to_avro":
            return lambda v: uuid.UUID(v) if isinstance(v, str) else v
        return None
    if kind == "int" and mode == "normalise":
        return _int_checker(where)
    if logical == "decimal" and kind in ("bytes", "fixed") and mode == "normalise":
        if kind == "fixed":
            named[avro["name"]] = avro
        return _decimal_checker(avro, where)
    if kind in ("record", "error"):
        named[avro["name"]] = avro
        fconvs = {
            f["name"]: c
            for f in avro["fields"]
            if (c := _walker(f["type"], named, f"{where}.{f['name']}", mode)) is not None
        }
        if not fconvs:
            return None

        def conv_record(v: Any) -> Any:
            if not isinstance(v, Mapping):
                return v
            out = dict(v)
            for k, c in fconvs.items():
                if k in out:
                    out[k] = c(out[k])
            return out

        return conv_record
    if kind in ("enum", "fixed"):
        named[avro["name"]] = avro
        return None
    if kind == "array":
        ic = _walker(avro["items"], named, f"{where}[]", mode)
        if ic is None:
            return None
        return lambda v: [ic(x) for x in v] if isinstance(v, list) else v
    if kind == "map":
        vc = _walker(avro["values"], named, f"{where}{{}}", mode)
        if mode == "to_avro":
            if vc is None:
                return None
            return lambda v: {k: vc(x) for k, x in v.items()} if isinstance(v, Mapping) else v
        return lambda v: _sorted_map(v, vc) if isinstance(v, Mapping) else v
    if isinstance(kind, (dict, list)) or (isinstance(kind, str) and kind not in _PRIMITIVES):
        return _walker(kind, named, where, mode)
    return None


def _int_checker(where: str) -> _Conv:
    def check(v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and not _INT_MIN <= v <= _INT_MAX:
            raise ValueError(
                f"expected an int in [-2**31, 2**31) at {where}, found {v} (out of range)"
            )
        return v

    return check


def _decimal_checker(avro: Mapping[str, Any], where: str) -> _Conv:
    precision, scale = avro.get("precision"), avro.get("scale", 0)

    def check(v: Any) -> Any:
        if not isinstance(v, Decimal):
            return v  # fastavro says what else it does not accept
        if not v.is_finite():
            raise ValueError(f"expected a finite decimal at {where}, found {v}")
        _, digits, exponent = v.as_tuple()
        assert isinstance(exponent, int)
        if exponent + scale < 0:
            raise ValueError(
                f"expected a decimal with at most {scale} digits after the point at {where}, "
                f"found {v}"
            )
        if len(digits) + exponent + scale > precision and any(digits):
            raise ValueError(
                f"expected a decimal of at most {precision} digits (scale {scale}) at {where}, "
                f"found {v}"
            )
        return v

    return check


def row_normaliser(schema: AvroSchema) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """A function that checks a row (dict) for the values the collection cannot hold and puts it
    in canonical form (map keys in order of their UTF-8 bytes).

    It raises ValueError naming the field for an ``int`` outside 32 bits or a decimal with
    more digits than its precision or scale: Avro's encoding carries such values, the Arrow
    columns do not. The codec (:class:`~shared.codec.RowCodec`) runs it on every row it encodes
    or decodes."""
    conv = _compiled(_schema_key(schema))[4]
    if conv is None:
        return dict
    return conv


def _check_non_nullable(array: pa.Array, field: pa.Field, where: str) -> None:
    """Raise EncodeError if a non-nullable field (at any depth) holds a null."""
    if not field.nullable and array.null_count > 0:
        raise EncodeError(
            f"expected a value in non-nullable field {where}, found null "
            f"({array.null_count} row(s))",
            field=where,
        )
    t = field.type
    if pa.types.is_struct(t):
        valid = array.filter(array.is_valid()) if array.null_count else array
        for i in range(t.num_fields):
            child = t.field(i)
            _check_non_nullable(valid.field(i), child, f"{where}.{child.name}")
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        _check_non_nullable(array.flatten(), t.value_field, f"{where}[]")
    elif pa.types.is_map(t):
        _check_non_nullable(array.items, t.item_field, f"{where}{{}}")


def _schema_key(schema: AvroSchema) -> str:
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"expected an Avro schema made of JSON values, found: {e}") from e


@lru_cache(maxsize=256)
def _compiled(
    key: str,
) -> tuple[pa.Schema, frozenset[str], frozenset[str], _Conv | None, _Conv | None, _Conv | None]:
    """What the conversions need of a schema, computed once per schema text: the Arrow
    schema, its field names, its non-nullable names, and the walkers to Arrow, for the codec
    and to Avro."""
    parsed = _parse_any(key)
    arrow_schema = avro_to_arrow_schema(parsed)
    names = frozenset(arrow_schema.names)
    required = frozenset(f.name for f in arrow_schema if not f.nullable)
    where = str(parsed["name"]).rsplit(".", 1)[-1]
    return (
        arrow_schema,
        names,
        required,
        _walker(parsed, {}, where, "to_arrow"),
        _walker(parsed, {}, where, "normalise"),
        _walker(parsed, {}, where, "to_avro"),
    )


def rows_to_arrow(rows: Sequence[Mapping[str, Any]], schema: AvroSchema) -> pa.Table:
    """Rows (dicts, as fastavro reads them) -> an Arrow table of :func:`avro_to_arrow_schema`.

    A row must have exactly the schema's fields (a missing nullable field counts as null).
    Raises :class:`~shared.errors.EncodeError` for a row that does not fit: an unknown or
    missing field, a value of the wrong type or out of range, a null in a non-nullable field.
    """
    arrow_schema, names, required, conv, _, _ = _compiled(_schema_key(schema))
    prepared: list[Any] = []
    for i, row in enumerate(rows):
        if type(row) is not dict and not isinstance(row, Mapping):
            raise EncodeError(
                f"expected row {i} to be a mapping of field names to values, "
                f"found {type(row).__name__}",
                index=i,
            )
        keys = set(row)
        if not keys <= names:
            raise EncodeError(
                f"expected row {i} to have fields from {sorted(names)}, found unknown "
                f"{sorted(map(str, keys - names))}",
                index=i,
            )
        if not required <= keys:
            raise EncodeError(
                f"expected row {i} to have the non-nullable fields {sorted(required)}, "
                f"found {sorted(required - keys)} missing",
                index=i,
            )
        prepared.append(conv(row) if conv is not None else row)
    try:
        table = pa.Table.from_pylist(prepared, schema=arrow_schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        raise EncodeError(
            f"expected rows matching the Arrow schema {arrow_schema}, found a value that "
            f"does not convert: {e}"
        ) from e
    for name in arrow_schema.names:
        field = arrow_schema.field(name)
        column = table.column(name)
        for chunk in column.chunks:
            _check_non_nullable(chunk, field, name)
    return table


def _without_nanos(t: pa.DataType) -> pa.DataType:
    """``t`` with every nanosecond timestamp (at any depth) as ``int64``."""
    if pa.types.is_timestamp(t) and t.unit == "ns":
        return pa.int64()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_without_nanos(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(t.key_field, t.item_field.with_type(_without_nanos(t.item_type)))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_without_nanos(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_without_nanos(t.value_type)))
    return t


def arrow_to_rows(
    table: pa.Table | pa.RecordBatch, schema: AvroSchema | None = None
) -> list[dict[str, Any]]:
    """An Arrow table -> rows as Python dicts, the inverse of :func:`rows_to_arrow`.

    With the collection's row ``schema``, each row is what :meth:`shared.codec.RowCodec.decode`
    gives for it (uuids as ``uuid.UUID``), so ``RowCodec.encode`` of it gives the canonical
    bytes of the row as it came from the topic: the read-back of a shard is an exact inverse of
    its staging (proved by ``tests/shared/test_avro_arrow_types.py``). Without ``schema``, uuids stay
    text (which encodes to the same bytes).

    Maps become dicts, structs dicts, lists lists; timestamps in ms or us come back as
    ``datetime`` (aware in UTC when the Arrow type has a time zone), nanosecond timestamps as
    the ``int`` nanoseconds (a ``datetime`` cannot hold them; fastavro decodes them as ints),
    decimals as ``Decimal``. Columns that are no field of ``schema`` (such as ``_time``,
    ``_diff`` and ``_error``) are converted the same way, without the schema.
    """
    target = pa.schema([f.with_type(_without_nanos(f.type)) for f in table.schema])
    if target != table.schema:
        table = table.cast(target)
    rows: list[dict[str, Any]] = table.to_pylist(maps_as_pydicts="strict")
    if schema is not None:
        conv = _compiled(_schema_key(schema))[5]
        if conv is not None:
            rows = [conv(r) for r in rows]
    return rows
