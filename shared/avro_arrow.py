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

A field is nullable in Arrow iff its Avro type is ``null`` or a union with ``null``; every
other field is ``nullable=False`` and :func:`rows_to_arrow` rejects a null in it. A logical
type on the wrong base type (or with invalid parameters) is ignored, as the Avro
specification says: the field maps as its base type. Unions of two or more non-null types
and recursive records have no Parquet representation and are rejected with
:class:`~shared.errors.SchemaError`.

The names ``_time``, ``_diff`` and ``_error`` are reserved for the shard's own columns and
may not be top-level fields of a row schema.

Pure: pyarrow and fastavro only, no I/O.
"""

from __future__ import annotations

import copy
import json
import uuid
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
            return self.primitive(kind, logical, avro)
        if kind == "record" or kind == "error":
            name = avro["name"]
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
                dec = _decimal_type(avro, max_precision=_fixed_max_precision(size))
                if dec is not None:
                    return dec
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
        if kind == "bytes" and logical == "decimal":
            dec = _decimal_type(avro, max_precision=76)
            if dec is not None:
                return dec
        return _PRIMITIVES[kind]


def _fixed_max_precision(size: int) -> int:
    """The largest decimal precision a two's complement of ``size`` bytes holds."""
    if size <= 0:
        return 0
    import math

    return math.floor(math.log10(2 ** (8 * size - 1) - 1))


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
    struct = _Mapper().data_type(parsed, parsed["name"])
    return pa.schema([struct.field(i) for i in range(struct.num_fields)])


# -- rows <-> Arrow ------------------------------------------------------------------------

_Conv = Callable[[Any], Any]


def _uuid_converter(avro: Any, named: dict[str, Any]) -> _Conv | None:
    """A function making a value Arrow-ready (``uuid.UUID`` -> str), or None if none needed.

    fastavro decodes a ``uuid`` logical type as :class:`uuid.UUID`, which Arrow's string
    conversion does not accept; nothing else needs converting.
    """
    if isinstance(avro, str):
        if avro in named:
            return _uuid_converter(named[avro], named)
        return None
    if isinstance(avro, list):
        convs = [c for c in (_uuid_converter(b, named) for b in avro) if c is not None]
        if not convs:
            return None
        conv = convs[0]  # at most one non-null branch (checked by the mapper)
        return lambda v: None if v is None else conv(v)
    if not isinstance(avro, dict):
        return None
    kind = avro.get("type")
    if kind == "string" and avro.get("logicalType") == "uuid":
        return lambda v: str(v) if isinstance(v, uuid.UUID) else v
    if kind in ("record", "error"):
        named[avro["name"]] = avro
        fconvs = {
            f["name"]: c
            for f in avro["fields"]
            if (c := _uuid_converter(f["type"], named)) is not None
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
        ic = _uuid_converter(avro["items"], named)
        if ic is None:
            return None
        return lambda v: v if v is None else [ic(x) for x in v]
    if kind == "map":
        vc = _uuid_converter(avro["values"], named)
        if vc is None:
            return None
        return lambda v: v if v is None else {k: vc(x) for k, x in dict(v).items()}
    if isinstance(kind, (dict, list, str)) and kind not in _PRIMITIVES:
        return _uuid_converter(kind, named)
    return None


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
) -> tuple[pa.Schema, frozenset[str], frozenset[str], _Conv | None]:
    """What rows_to_arrow needs of a schema, computed once per schema text."""
    parsed = _parse_any(key)
    arrow_schema = avro_to_arrow_schema(parsed)
    names = frozenset(arrow_schema.names)
    required = frozenset(f.name for f in arrow_schema if not f.nullable)
    return arrow_schema, names, required, _uuid_converter(parsed, {})


def rows_to_arrow(rows: Sequence[Mapping[str, Any]], schema: AvroSchema) -> pa.Table:
    """Rows (dicts, as fastavro reads them) -> an Arrow table of :func:`avro_to_arrow_schema`.

    A row must have exactly the schema's fields (a missing nullable field counts as null).
    Raises :class:`~shared.errors.EncodeError` for a row that does not fit: an unknown or
    missing field, a value of the wrong type or out of range, a null in a non-nullable field.
    """
    arrow_schema, names, required, conv = _compiled(_schema_key(schema))
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


def arrow_to_rows(table: pa.Table | pa.RecordBatch) -> list[dict[str, Any]]:
    """An Arrow table -> rows as Python dicts that fastavro encodes with the row schema.

    Maps become dicts, structs dicts, lists lists; timestamps come back as ``datetime`` (aware
    in UTC when the Arrow type has a time zone), decimals as ``Decimal``, uuids as ``str``.
    Every column is converted, including any ``_time``/``_diff``/``_error`` columns.
    """
    rows: list[dict[str, Any]] = table.to_pylist(maps_as_pydicts="strict")
    return rows
