"""Schema evolution of a collection's rows: which new row schemas are compatible, and how
rows written under an earlier version are read as the current one.

A collection's row schema may be altered while its sink runs. The shard keeps every version
with the first upper from which it holds (:class:`shared.state.SchemaVersion`); readers always
see one schema, the current one.

Compatibility (:func:`check_evolution`)
---------------------------------------
A new schema is accepted iff the rows of *every* earlier version can be read as it by Avro's
schema resolution, within these rules. A refusal is an
:class:`~shared.errors.IncompatibleSchemaError` naming the field (a path such as
``Order.items[].qty``), the rule (one of :data:`RULES`) and the earlier version.

Accepted:

- a field added with a default (a nullable field with default ``null`` included); rows of the
  earlier version read the default;
- a field removed that had a default (in the version that had it);
- a field made nullable (``T`` to ``["null", T]``);
- promotions: ``int`` to ``long``, ``float`` or ``double``; ``long`` to ``float`` or
  ``double``; ``float`` to ``double``; ``string`` to ``bytes`` (the values are cast; a long
  read as a float or double rounds, as Avro says);
- enum symbols added; an enum symbol removed when the new enum has a ``default`` (rows with the
  removed symbol read the default);
- a field, record, enum or fixed renamed with an ``aliases`` entry naming the old name.

Refused (the rule names): ``field-added-without-default``, ``field-removed-without-default``,
``default-does-not-fit`` (a default the field's type cannot hold as fastavro's resolution fills
it in: also a non-null ``bytes`` or ``fixed`` default, which fastavro fills in as the JSON text;
add such a field as nullable with default ``null``), ``type-changed`` (any other
change of type, ``bytes`` to ``string`` included: bytes need not be UTF-8, so an earlier row
might not read), ``logical-type-changed`` (a logical type, or a decimal's precision or scale,
added, removed or changed), ``null-no-longer-allowed`` (a nullable field made required),
``enum-symbol-removed-without-default``, ``name-changed`` (a record, enum or fixed renamed
without an alias), ``fixed-size-changed``. The check is a walk of the two schemas; which
primitive promotions exist is fastavro's decision (``fastavro._read_py.match_types``, what its
reader resolves), and the per-row reference of the reading is fastavro's resolution itself
(:class:`shared.codec.RowCodec` with the earlier versions).

Reading old rows as the current schema (:class:`Resolver`)
----------------------------------------------------------
Columnar, with Arrow: a table of rows in an earlier version's Arrow mapping (a Parquet part
written then, or message bodies decoded with that version) becomes a table of the current
mapping: missing columns (at any depth: inside structs, list items, map values) take their
default, promoted types are cast, removed columns are dropped, enum values the current enum
lacks take its default. The Arrow types drive it: a column whose type is already the current
one is passed through untouched, so parts written in the current schema cost nothing.

Invariant (proved by ``tests/shared/test_schema_evolution.py`` against fastavro): for a row ``r``
written under an accepted earlier version, the resolved Arrow row encodes
(:class:`shared.avro_columns.ColumnCodec`) to the same canonical bytes as fastavro's resolution
of ``r`` (:meth:`shared.codec.RowCodec.canonical` with the earlier version as a writer
schema). So a row read back from an old part and the same value arriving in any version give
the same correction key.

Pure: pyarrow and fastavro, plus the project's schema mapping and codecs; no I/O.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fastavro._read_py import match_types as _fastavro_match_types

from shared.avro_arrow import avro_to_arrow_schema, parse_row_schema, rows_to_arrow
from shared.errors import CodecError, IncompatibleSchemaError, SchemaMismatchError

__all__ = [
    "RULES",
    "Incompatibility",
    "Resolver",
    "check_evolution",
    "incompatibilities",
]

#: Rule name -> what it refuses (the ``rule`` of an IncompatibleSchemaError).
RULES: dict[str, str] = {
    "field-added-without-default": "a field the earlier version lacks needs a default for its rows",
    "field-removed-without-default": "a field may be removed only if it had a default",
    "default-does-not-fit": "a default must be a value of its field's type",
    "type-changed": "a type may change only by an Avro promotion (int->long/float/double, "
    "long->float/double, float->double, string->bytes)",
    "logical-type-changed": "a logical type (and a decimal's precision and scale) must stay as it is",
    "null-no-longer-allowed": "a nullable field cannot become required: earlier rows may hold null",
    "enum-symbol-removed-without-default": "an enum symbol may be removed only if the enum has a default",
    "name-changed": "a record, enum or fixed keeps its name (or names the old one in its aliases)",
    "fixed-size-changed": "a fixed keeps its size",
}

#: fastavro's decision whether a writer type reads as a reader type (its promotions).
match_types = cast(Callable[[Any, Any, Any], bool], _fastavro_match_types)

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_NAMED = frozenset({"record", "error", "enum", "fixed"})


@dataclass(frozen=True, slots=True)
class Incompatibility:
    """Why rows of a writer schema cannot be read as a reader schema, at one field."""

    field: str
    rule: str
    message: str


# -- the compatibility check -----------------------------------------------------------------


def check_evolution(versions: Sequence[Mapping[str, Any]], new: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``new`` as the next row schema after ``versions`` (oldest first) and return it
    normalised (:func:`~shared.avro_arrow.parse_row_schema`).

    Raises :class:`~shared.errors.IncompatibleSchemaError` (field, rule, version) for the first
    earlier version whose rows cannot be read as ``new``, and
    :class:`~shared.errors.SchemaError` when ``new`` is no acceptable row schema at all."""
    reader = parse_row_schema(new)
    for i, old in enumerate(versions):
        found = incompatibilities(old, reader)
        if found:
            first = found[0]
            raise IncompatibleSchemaError(
                f"expected a schema that rows of every earlier version can be read as, found "
                f"{first.message} at {first.field} (rule {first.rule}: {RULES[first.rule]}; "
                f"version {i} of {len(versions)} earlier)",
                field=first.field,
                rule=first.rule,
                version=i,
                problems=[{"field": p.field, "rule": p.rule} for p in found],
            )
    return reader


def incompatibilities(writer: Mapping[str, Any], reader: Mapping[str, Any]) -> list[Incompatibility]:
    """Every reason rows of ``writer`` cannot be read as ``reader`` (empty: compatible)."""
    w = parse_row_schema(writer)
    r = parse_row_schema(reader)
    walk = _Walk()
    walk.named(w, walk.w_named)
    walk.named(r, walk.r_named)
    walk.types(w, r, str(r["name"]).rsplit(".", 1)[-1])
    return walk.found


class _Walk:
    """The two schemas walked side by side, collecting incompatibilities."""

    def __init__(self) -> None:
        self.w_named: dict[str, Any] = {}
        self.r_named: dict[str, Any] = {}
        self.found: list[Incompatibility] = []

    def named(self, avro: Any, into: dict[str, Any]) -> None:
        """Record every named type defined in ``avro`` (full names, as parse_schema gives)."""
        if isinstance(avro, list):
            for b in avro:
                self.named(b, into)
        elif isinstance(avro, dict):
            kind = avro.get("type")
            if kind in _NAMED:
                into[avro["name"]] = avro
            if kind in ("record", "error"):
                for f in avro["fields"]:
                    self.named(f["type"], into)
            elif kind == "array":
                self.named(avro["items"], into)
            elif kind == "map":
                self.named(avro["values"], into)
            elif isinstance(kind, (dict, list)):
                self.named(kind, into)

    def fail(self, where: str, rule: str, message: str) -> None:
        self.found.append(Incompatibility(where, rule, message))

    def types(self, w: Any, r: Any, where: str) -> None:
        w_null, w_t = _split(_deref(w, self.w_named))
        r_null, r_t = _split(_deref(r, self.r_named))
        if w_null and not r_null:
            self.fail(where, "null-no-longer-allowed", f"{_show(w)} made required as {_show(r)}")
            return
        if w_t is None:  # the writer holds only nulls
            return
        if r_t is None:
            self.fail(where, "type-changed", f"{_show(w)} changed to null")
            return
        w_t, r_t = _deref(w_t, self.w_named), _deref(r_t, self.r_named)
        wk, rk = _kind(w_t), _kind(r_t)
        if wk in _PRIMITIVES and rk in _PRIMITIVES:
            self.primitive(w_t, r_t, wk, rk, where)
            return
        if wk != rk and not ({wk, rk} <= {"record", "error"}):
            self.fail(where, "type-changed", f"{_show(w_t)} changed to {_show(r_t)}")
            return
        if rk in ("record", "error", "enum", "fixed") and not _same_name(w_t, r_t):
            self.fail(where, "name-changed", f"{rk} {w_t['name']!r} renamed {r_t['name']!r} without an alias")
            return
        if rk in ("record", "error"):
            self.record(w_t, r_t, where)
        elif rk == "enum":
            removed = [s for s in w_t["symbols"] if s not in r_t["symbols"]]
            if removed and "default" not in r_t:
                self.fail(
                    where, "enum-symbol-removed-without-default",
                    f"enum symbols {removed} removed from {r_t['name']!r}, which has no default",
                )
        elif rk == "fixed":
            if int(w_t["size"]) != int(r_t["size"]):
                self.fail(where, "fixed-size-changed", f"fixed {r_t['name']!r} of size {w_t['size']} changed to {r_t['size']}")
            elif _logical(w_t) != _logical(r_t):
                self.fail(where, "logical-type-changed", f"{_show(w_t)} changed to {_show(r_t)}")
        elif rk == "array":
            self.types(w_t["items"], r_t["items"], f"{where}[]")
        elif rk == "map":
            self.types(w_t["values"], r_t["values"], f"{where}{{}}")

    def primitive(self, w_t: Any, r_t: Any, wk: str, rk: str, where: str) -> None:
        if _logical(w_t) != _logical(r_t):
            self.fail(where, "logical-type-changed", f"{_show(w_t)} changed to {_show(r_t)}")
            return
        if wk == rk:
            return
        if wk == "bytes" and rk == "string":
            self.fail(where, "type-changed", "bytes changed to string (bytes need not be UTF-8 text)")
            return
        if _logical(w_t) is not None or not match_types(wk, rk, {"writer": {}, "reader": {}}):
            self.fail(where, "type-changed", f"{_show(w_t)} changed to {_show(r_t)} (no Avro promotion)")

    def record(self, w: Mapping[str, Any], r: Mapping[str, Any], where: str) -> None:
        w_fields = {f["name"]: f for f in w["fields"]}
        used: set[str] = set()
        for rf in r["fields"]:
            at = f"{where}.{rf['name']}"
            wf = _writer_field(rf, w_fields)
            if wf is not None:
                used.add(wf["name"])
                self.types(wf["type"], rf["type"], at)
                continue
            if "default" not in rf:
                self.fail(at, "field-added-without-default", f"field {rf['name']!r} added without a default")
                continue
            try:
                default_array(rf["type"], rf["default"], self.r_named)
            except CodecError as e:
                self.fail(at, "default-does-not-fit", f"default {rf['default']!r} that {_show(rf['type'])} cannot hold ({e})")
        for name, wf in w_fields.items():
            if name not in used and "default" not in wf:
                self.fail(f"{where}.{name}", "field-removed-without-default", f"field {name!r} removed, which had no default")


def _writer_field(rf: Mapping[str, Any], w_fields: Mapping[str, Any]) -> Any:
    """The writer's field a reader field reads: same name, else one of its aliases (Avro)."""
    if rf["name"] in w_fields:
        return w_fields[rf["name"]]
    for alias in rf.get("aliases") or ():
        if alias in w_fields:
            return w_fields[alias]
    return None


def _same_name(w: Mapping[str, Any], r: Mapping[str, Any]) -> bool:
    """Avro's name rule for named types (fastavro's): the unqualified names are equal, or the
    reader's aliases name the writer (full or unqualified)."""
    wn, rn = str(w["name"]), str(r["name"])
    aliases = [str(a) for a in r.get("aliases") or ()]
    w_short = wn.rsplit(".", 1)[-1]
    return w_short == rn.rsplit(".", 1)[-1] or wn in aliases or w_short in aliases or any(
        a.rsplit(".", 1)[-1] == w_short for a in aliases
    )


def _split(t: Any) -> tuple[bool, Any]:
    """``(nullable, the non-null type or None)`` of a type; unions hold null and one type at
    most (:func:`~shared.avro_arrow.parse_row_schema` refuses others)."""
    if isinstance(t, list):
        rest = [b for b in t if b != "null"]
        return len(rest) < len(t), (rest[0] if rest else None)
    if t == "null" or (isinstance(t, dict) and t.get("type") == "null"):
        return True, None
    return False, t


def _deref(t: Any, named: Mapping[str, Any]) -> Any:
    if isinstance(t, str) and t in named:
        return named[t]
    if isinstance(t, dict) and isinstance(t.get("type"), (dict, list)):
        return t["type"]
    if isinstance(t, dict) and isinstance(t.get("type"), str) and t["type"] in named:
        return named[t["type"]]
    return t


def _kind(t: Any) -> str:
    if isinstance(t, str):
        return t
    k = t.get("type")
    return str(k)


def _logical(t: Any) -> tuple[Any, ...] | None:
    if not isinstance(t, dict) or "logicalType" not in t:
        return None
    return (t.get("logicalType"), t.get("precision"), t.get("scale", 0 if t.get("logicalType") == "decimal" else None))


def _show(t: Any) -> str:
    if isinstance(t, dict):
        if t.get("type") in _NAMED:
            return f"{t['type']} {t['name']!r}"
        if "logicalType" in t:
            return f"{t['type']}({t['logicalType']})"
        return str(t.get("type"))
    if isinstance(t, list):
        return "[" + ", ".join(_show(b) for b in t) + "]"
    return str(t)


# -- defaults as Arrow values -------------------------------------------------------------------

_DEFAULT_RECORD = "io.shardsink.internal.DefaultValue"


def _standalone(t: Any, named: Mapping[str, Any], defined: set[str] | None = None) -> Any:
    """``t`` with every named type it references defined inline (once, at its first use), so
    that it is a complete schema on its own."""
    defined = set() if defined is None else defined
    if isinstance(t, str):
        if t in named and t not in defined:
            return _standalone(named[t], named, defined)
        return t
    if isinstance(t, list):
        return [_standalone(b, named, defined) for b in t]
    if not isinstance(t, dict):
        return t
    out = dict(t)
    kind = t.get("type")
    if kind in _NAMED:
        if t["name"] in defined:
            return t["name"]
        defined.add(t["name"])
    if kind in ("record", "error"):
        out["fields"] = [{**f, "type": _standalone(f["type"], named, defined)} for f in t["fields"]]
    elif kind == "array":
        out["items"] = _standalone(t["items"], named, defined)
    elif kind == "map":
        out["values"] = _standalone(t["values"], named, defined)
    elif isinstance(kind, (dict, list)) or (isinstance(kind, str) and kind in named):
        return _standalone(kind, named, defined)
    return out


def default_array(avro_type: Any, default: Any, named: Mapping[str, Any]) -> pa.Array:
    """A field's Avro ``default`` as an Arrow array of one element, of the Arrow type the field
    maps to: the value fastavro's resolution fills in (the default itself), encoded and decoded
    by the project's codec, so it is the value a resolved row holds.

    Raises :class:`~shared.errors.CodecError` when the type cannot hold the default."""
    return _default_array(json.dumps([_standalone(avro_type, named), default], sort_keys=True))


@lru_cache(maxsize=1024)
def _default_array(key: str) -> pa.Array:
    from shared.codec import RowCodec

    t, default = json.loads(key)
    wrapper = {"type": "record", "name": _DEFAULT_RECORD, "fields": [{"name": "v", "type": t}]}
    codec = RowCodec(wrapper)
    row = codec.decode(codec.encode({"v": copy.deepcopy(default)}))
    return rows_to_arrow([row], codec.schema).column("v").combine_chunks()


# -- reading rows of an earlier version as the current one --------------------------------------


class Resolver:
    """Reads Arrow rows of any accepted earlier version as rows of ``schema`` (the current row
    schema): see the module docstring. Immutable; build it with :meth:`of` (cached)."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema: dict[str, Any] = parse_row_schema(schema)
        self.arrow_schema: pa.Schema = avro_to_arrow_schema(self.schema)
        # Every column nullable, as a part's row columns are (error rows hold no row).
        self._out_schema = pa.schema([f.with_nullable(True) for f in self.arrow_schema])
        walk = _Walk()
        walk.named(self.schema, walk.r_named)
        self._named = walk.r_named
        #: enums with a default map unknown symbols even where the Arrow types agree
        self._maps_enums = any(
            isinstance(t, dict) and t.get("type") == "enum" and "default" in t for t in self._named.values()
        )

    @staticmethod
    def of(schema: Mapping[str, Any]) -> Resolver:
        return _resolver(json.dumps(schema, sort_keys=True))

    def is_current(self, arrow_schema: pa.Schema) -> bool:
        """Whether rows with these columns need nothing done: every current row column is
        there with its current type (and no enum maps symbols)."""
        if self._maps_enums:
            return False
        for f in self.arrow_schema:
            i = arrow_schema.get_field_index(f.name)
            if i < 0 or arrow_schema.field(i).type != f.type:
                return False
        return True

    def resolve(self, table: pa.Table, *, null_where: pa.Array | None = None) -> pa.Table:
        """``table``'s row columns (an earlier version's mapping; other columns are ignored) as a
        table of exactly the current row columns. ``null_where``: rows (a boolean mask) whose
        added columns stay null instead of taking the default (error rows, which hold no row).

        Raises :class:`~shared.errors.SchemaMismatchError` for a column no accepted evolution
        produces (a type that does not resolve)."""
        n = table.num_rows
        columns: list[pa.Array | pa.ChunkedArray] = []
        where0 = str(self.schema["name"]).rsplit(".", 1)[-1]
        names = table.schema.names
        for af, f in zip(self.arrow_schema, self.schema["fields"], strict=True):
            source = _source_name(f, names)
            if source is None:
                col: pa.Array = self._default(f, af.type, n, f"{where0}.{f['name']}")
                if null_where is not None and n:
                    col = pc.if_else(null_where, pa.nulls(n, af.type), col)
                columns.append(col)
                continue
            c = table.column(source)
            if c.type == af.type and not self._maps_enums:
                columns.append(c)
                continue
            arr = c.combine_chunks() if c.num_chunks != 1 else c.chunk(0)
            columns.append(self._array(arr, f["type"], af.type, f"{where0}.{f['name']}"))
        return pa.Table.from_arrays(columns, schema=self._out_schema)

    def _default(self, f: Mapping[str, Any], t: pa.DataType, n: int, where: str) -> pa.Array:
        if "default" not in f:
            raise SchemaMismatchError(
                f"expected a column {where} or a default for it, found neither", field=where
            )
        if f["default"] is None:
            return pa.nulls(n, t)
        one = default_array(f["type"], f["default"], self._named)
        if one.type != t:
            one = one.cast(t)
        return one.take(pa.array(np.zeros(n, np.int64)))

    def _array(self, arr: pa.Array, avro: Any, target: pa.DataType, where: str) -> pa.Array:
        _, t = _split(_deref(avro, self._named))
        t = _deref(t, self._named)
        kind = _kind(t) if t is not None else "null"
        src = arr.type
        if kind == "enum" and "default" in t:
            arr = _map_enum(arr if src == target else arr.cast(target), t)
            return arr
        if src == target and not self._maps_enums:
            return arr
        if kind in ("record", "error") and pa.types.is_struct(target):
            if not pa.types.is_struct(src):
                raise _mismatch(where, src, target)
            names = [src.field(i).name for i in range(src.num_fields)]
            children: list[pa.Array] = []
            for tf, f in zip(target, t["fields"], strict=True):
                at = f"{where}.{f['name']}"
                source = _source_name(f, names)
                if source is None:
                    children.append(self._default(f, tf.type, len(arr), at))
                else:
                    children.append(self._array(arr.field(source), f["type"], tf.type, at))
            mask = arr.is_null() if arr.null_count else None
            return pa.StructArray.from_arrays(children, fields=list(target), mask=mask)
        if kind == "array" and pa.types.is_list(target):
            if not pa.types.is_list(src):
                raise _mismatch(where, src, target)
            offsets, lo, hi = _offsets(arr)
            values = self._array(arr.values.slice(lo, hi - lo), t["items"], target.value_type, f"{where}[]")
            mask = arr.is_null() if arr.null_count else None
            return pa.ListArray.from_arrays(offsets, values, type=target, mask=mask)
        if kind == "map" and pa.types.is_map(target):
            if not pa.types.is_map(src):
                raise _mismatch(where, src, target)
            offsets, lo, hi = _offsets(arr)
            items = self._array(arr.items.slice(lo, hi - lo), t["values"], target.item_type, f"{where}{{}}")
            mask = arr.is_null() if arr.null_count else None
            return pa.MapArray.from_arrays(offsets, arr.keys.slice(lo, hi - lo), items, type=target, mask=mask)
        if src == target:
            return arr
        return _promote(arr, target, where)


def _source_name(f: Mapping[str, Any], names: Sequence[str]) -> str | None:
    if f["name"] in names:
        return str(f["name"])
    for alias in f.get("aliases") or ():
        if alias in names:
            return str(alias)
    return None


def _offsets(arr: pa.Array) -> tuple[pa.Array, int, int]:
    """A list or map array's offsets rebased to 0, and the range of its values they cover."""
    offsets = arr.offsets
    lo, hi = offsets[0].as_py(), offsets[-1].as_py()
    if lo:
        offsets = pc.subtract(offsets, pa.scalar(lo, offsets.type))
    elif arr.offset:
        offsets = pa.concat_arrays([offsets])
    return offsets, lo, hi


#: The promotions the compatibility check accepts, as Arrow casts (source, target).
_PROMOTIONS: frozenset[tuple[pa.DataType, pa.DataType]] = frozenset(
    {
        (pa.int32(), pa.int64()),
        (pa.int32(), pa.float32()),
        (pa.int32(), pa.float64()),
        (pa.int64(), pa.float32()),
        (pa.int64(), pa.float64()),
        (pa.float32(), pa.float64()),
        (pa.string(), pa.binary()),
    }
)


def _promote(arr: pa.Array, target: pa.DataType, where: str) -> pa.Array:
    if (arr.type, target) not in _PROMOTIONS:
        if pa.types.is_null(arr.type):
            return pa.nulls(len(arr), target)
        raise _mismatch(where, arr.type, target)
    if arr.type == pa.int64() and target == pa.float32():
        # As fastavro does it: the long becomes a Python float (a double), written as a float.
        arr = pc.cast(arr, pa.float64(), safe=False)
    return pc.cast(arr, target, safe=False)


def _map_enum(arr: pa.Array, enum: Mapping[str, Any]) -> pa.Array:
    """Symbols the enum does not have take its default (Avro's enum resolution)."""
    symbols = pa.array(enum["symbols"], pa.string())
    known = pc.is_in(arr, value_set=symbols)
    if arr.null_count == 0 and pc.all(known).as_py():
        return arr
    keep = pc.or_(known, arr.is_null())
    return pc.if_else(keep, arr, pa.scalar(enum["default"], pa.string()))


def _mismatch(where: str, src: pa.DataType, target: pa.DataType) -> SchemaMismatchError:
    return SchemaMismatchError(
        f"expected column {where} of type {target} or of a type that resolves to it, found {src}",
        field=where,
    )


@lru_cache(maxsize=64)
def _resolver(key: str) -> Resolver:
    return Resolver(json.loads(key))
