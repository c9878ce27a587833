"""A shard's data objects: the Parquet part format, and the schema views it is read through.

A part (``shards/<shard_id>/data/<uuid>.parquet``, write-once) holds the row columns (nullable:
error rows have no row), then ``_time`` (uint64), ``_diff`` (int64) and ``_error`` (string,
null for ok rows) (:func:`part_schema`). Its Parquet metadata names the format version
(``shardsink.format``), the shard (``shardsink.shard``) and the row schema version it was
written in (``shardsink.schema``, the schema's fingerprint; a part without it was written
under the first version) (:func:`encode_part`).

A part is read back as any later version of the schema (:func:`conform_part`, through the
version's :class:`SchemaView`). Every part must read with plain :mod:`pyarrow.parquet`.

Pure: no I/O. :mod:`shared.shard` writes and reads the objects.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shared.avro_arrow import avro_to_arrow_schema, rows_to_arrow
from shared.codec import fingerprint
from shared.errors import InvalidUsageError, SchemaMismatchError
from shared.schema_evolution import Resolver

TIME = "_time"
DIFF = "_diff"
ERROR = "_error"
DATA_FORMAT_VERSION = "1"
#: Parquet metadata key of a part: the fingerprint (hex) of the row schema it was written in.
SCHEMA_META_KEY = b"shardsink.schema"

Updates: TypeAlias = pa.Table | Sequence[tuple[Any, ...]]


def part_schema(row_schema: pa.Schema) -> pa.Schema:
    """The Parquet schema of a data object: row columns (nullable: error rows have no row),
    then ``_time`` (uint64), ``_diff`` (int64), ``_error`` (string, null for ok rows)."""
    fields = [pa.field(f.name, f.type, nullable=True) for f in row_schema]
    fields += [
        pa.field(TIME, pa.uint64(), nullable=False),
        pa.field(DIFF, pa.int64(), nullable=False),
        pa.field(ERROR, pa.string(), nullable=True),
    ]
    return pa.schema(fields)


@dataclass(frozen=True, slots=True)
class SchemaView:
    """One row schema version and what the shard needs of it: its Arrow row and part schemas,
    its resolver (rows of earlier versions read as it) and its fingerprint (hex)."""

    schema: dict[str, Any]
    row_schema: pa.Schema
    part_schema: pa.Schema
    resolver: Resolver
    fingerprint: str

    @property
    def row_columns(self) -> list[str]:
        return list(self.row_schema.names)


def schema_view(schema: dict[str, Any]) -> SchemaView:
    """The (cached) view of a row schema."""
    return _schema_view(json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=64)
def _schema_view(key: str) -> SchemaView:
    schema = json.loads(key)
    rows = avro_to_arrow_schema(schema)
    return SchemaView(schema, rows, part_schema(rows), Resolver.of(schema), fingerprint(schema).hex())


def encode_part(
    table: pa.Table,
    *,
    shard_id: str,
    schema_fingerprint: str,
    dictionary: Sequence[str] | None = None,
) -> bytes:
    """The Parquet bytes of a data object of ``shard_id`` holding ``table``, in the part
    schema of the row schema version whose fingerprint (hex) is ``schema_fingerprint``:
    snappy, statistics on ``_time`` only, a dictionary on the columns worth one
    (``dictionary``, when the caller knows them: :func:`dictionary_columns` of the table it
    was sliced from)."""
    buf = io.BytesIO()
    meta = {
        b"shardsink.format": DATA_FORMAT_VERSION.encode(),
        b"shardsink.shard": shard_id.encode(),
        SCHEMA_META_KEY: schema_fingerprint.encode(),
    }
    pq.write_table(
        table.replace_schema_metadata(meta), buf, compression="snappy",
        use_dictionary=list(dictionary_columns(table) if dictionary is None else dictionary),
        write_statistics=[TIME],
    )
    return buf.getvalue()


def decode_part(data: bytes, *, dictionaries: bool = False) -> pa.Table:
    """A data object's Parquet bytes as a table (schema metadata kept).

    Through :class:`pyarrow.parquet.ParquetFile` rather than :func:`pyarrow.parquet.read_table`,
    whose dataset machinery costs more than the decoding of a part of 50k rows (20 parts of
    50k rows, 8.2 MB, on 8 threads: 102 -> 57 ms of CPU, 56 -> 29 ms of wall time).

    ``dictionaries``: the top-level string and binary columns that Parquet stored with a
    dictionary in every row group come back as Arrow dictionary arrays (Parquet's dictionary
    and indices, no value materialised; :func:`plain_schema` is the schema they stand for),
    for a merge, which groups rows by those indices and materialises only the rows it keeps
    (1M strings of 1,000 values in 20 parts: 20.6 ms of CPU to decode as strings, 6.2 as a
    dictionary)."""
    f = pq.ParquetFile(pa.BufferReader(data))
    if dictionaries:
        names = _stored_with_dictionary(f)
        if names:
            f = pq.ParquetFile(pa.BufferReader(data), metadata=f.metadata, read_dictionary=names)
    return f.read()


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t))


def _stored_with_dictionary(f: pq.ParquetFile) -> list[str]:
    """The top-level string and binary columns of ``f`` with a dictionary page in every row
    group."""
    md = f.metadata
    text = {field.name for field in f.schema_arrow if _is_text(field.type)}
    if not text or md.num_row_groups == 0:
        return []
    groups = [md.row_group(i) for i in range(md.num_row_groups)]
    paths = [groups[0].column(j).path_in_schema for j in range(md.num_columns)]
    return [p for j, p in enumerate(paths) if p in text and all(g.column(j).has_dictionary_page for g in groups)]


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with its dictionary-encoded fields as their value type (``schema`` itself
    when it has none)."""
    if not any(pa.types.is_dictionary(f.type) for f in schema):
        return schema
    fields = [f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema]
    return pa.schema(fields, metadata=schema.metadata)


def conform_part(table: pa.Table, view: SchemaView) -> pa.Table:
    """A part's table (written in any accepted version of the schema) as a table of
    ``view``'s part schema: row columns resolved (added columns take their default, promoted
    types are cast, removed columns dropped; error rows keep null rows), then ``_time``,
    ``_diff``, ``_error``. A part written in ``view``'s schema costs a comparison."""
    target = view.part_schema
    if table.schema.equals(target):
        return table
    if view.resolver.is_current(table.schema):
        return table.select(target.names).cast(target)
    errors = None
    if ERROR in table.column_names and table[ERROR].null_count < table.num_rows:
        errors = table[ERROR].is_valid().combine_chunks()
    rows = view.resolver.resolve(table, null_where=errors)
    for name in (TIME, DIFF, ERROR):
        col = table[name] if name in table.column_names else pa.nulls(table.num_rows, target.field(name).type)
        rows = rows.append_column(name, col)
    return cast_rows(rows, target)


def cast_rows(table: pa.Table, target: pa.Schema) -> pa.Table:
    """``table.cast(target)``, where a record column's null rows (an error row has no row)
    first get placeholder values in the record's required fields: Arrow refuses to cast a
    null in a non-nullable field even under a null record. A null under a record that is
    there stays, and the cast refuses it."""
    for i, f in enumerate(target):
        if i < table.num_columns and _has_required(f.type) and table.column(i).null_count:
            col = table.column(i)
            filled = [_fill_required(c, f.type) for c in col.chunks]
            table = table.set_column(i, table.field(i), pa.chunked_array(filled, col.type))
    return table.cast(target)


def _has_required(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) and any(not f.nullable or _has_required(f.type) for f in t)


def _fill_required(arr: pa.Array, t: pa.DataType) -> pa.Array:
    if not arr.null_count or not isinstance(arr, pa.StructArray):
        return arr
    absent = arr.is_null()
    children = []
    for i, f in enumerate(t):
        c = arr.field(i)
        if not f.nullable and c.null_count:
            c = pc.if_else(absent, _placeholder(c.type).take(pa.array(np.zeros(len(c), np.int64))), c)
        children.append(_fill_required(c, f.type) if _has_required(f.type) else c)
    return pa.StructArray.from_arrays(children, fields=list(arr.type), mask=absent)


def _placeholder(t: pa.DataType) -> pa.Array:
    """One value of type ``t`` (zero, empty, or a record of such values)."""
    if isinstance(t, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(t, _placeholder(t.storage_type))
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays([_placeholder(f.type) for f in t], fields=list(t))
    if pa.types.is_fixed_size_binary(t):
        return pa.array([b"\0" * t.byte_width], t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.array([""], t)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.array([b""], t)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        return pa.array([[]], t)
    if pa.types.is_boolean(t):
        return pa.array([False], t)
    return pa.array([0], t)


def updates_to_table(updates: Updates, view: SchemaView) -> pa.Table:
    """Updates as a table in ``view``'s part schema.

    Accepts an Arrow table with the row columns, ``_time`` and ``_diff`` (``_error``
    optional), or a sequence of ``(row_dict, time, diff)`` / ``(None, time, diff, error)``.
    """
    target = view.part_schema
    if isinstance(updates, pa.Table):
        table = updates
    else:
        rows, times, diffs, errors = [], [], [], []
        for u in updates:
            if len(u) not in (3, 4):
                raise InvalidUsageError(f"expected (row, time, diff[, error]), found {u!r}")
            row, t, d = u[0], u[1], u[2]
            err = u[3] if len(u) == 4 else None
            rows.append(row)
            times.append(t)
            diffs.append(d)
            errors.append(err)
        ok_rows = [r for r in rows if r is not None]
        if ok_rows:
            body = rows_to_arrow(ok_rows, view.schema)
            if len(ok_rows) != len(rows):
                # Interleave null rows for the error entries.
                idx, taken = [], 0
                for r in rows:
                    idx.append(taken if r is not None else None)
                    taken += r is not None
                body = body.take(pa.array(idx, type=pa.int64()))
        else:
            body = pa.table({f.name: pa.nulls(len(rows), f.type) for f in view.row_schema})
        try:
            table = body.append_column(TIME, pa.array(times, pa.uint64()))
        except (pa.ArrowInvalid, OverflowError, TypeError) as e:
            raise InvalidUsageError(f"expected times in [0, 2**64), found: {e}") from e
        table = table.append_column(DIFF, pa.array(diffs, pa.int64()))
        table = table.append_column(ERROR, pa.array(errors, pa.string()))
    if ERROR not in table.column_names:
        table = table.append_column(ERROR, pa.nulls(table.num_rows, pa.string()))
    missing = [n for n in target.names if n not in table.column_names]
    if missing:
        raise SchemaMismatchError(
            f"expected columns {target.names}, found {table.column_names} (missing {missing})"
        )
    table = table.select(target.names)
    try:
        return cast_rows(table, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaMismatchError(f"expected updates castable to {target}, found: {e}") from e


#: Rows of a column sampled to judge how often its values repeat (whether its Parquet chunks
#: use a dictionary).
SAMPLE_ROWS = 4096


def even_sample(col: pa.ChunkedArray, k: int) -> pa.ChunkedArray:
    """Up to ``k`` values of ``col`` at evenly spaced rows, taken chunk by chunk: a take on a
    chunked array concatenates its chunks first (a merge's table is one chunk per part read,
    and that copy of every column cost more than the rest of the sampling)."""
    n = len(col)
    if n <= k:
        return col
    idx = np.linspace(0, n - 1, k).astype(np.int64)
    offsets = np.cumsum([0, *(len(c) for c in col.chunks)])
    which = np.searchsorted(offsets, idx, side="right") - 1
    chunks = [col.chunk(int(c)).take(pa.array(idx[which == c] - offsets[c])) for c in np.unique(which)]
    return pa.chunked_array(chunks, type=col.type)


def dictionary_columns(table: pa.Table) -> list[str]:
    """The Parquet leaf columns of ``table`` worth a dictionary: those of a flat column whose
    values repeat (at most half as many distinct values as rows in an even sample of up to
    4096 rows), and every leaf of a nested column (Parquet's default).

    Parquet's writer tries a dictionary on every column and falls back to plain encoding once
    the dictionary page outgrows its limit; on a column of mostly distinct values (ids,
    amounts) that attempt costs about as much as the rest of the encoding, makes the part
    larger and its decoding slower (measured on 1M rows of (long id, string of 1,000 values,
    double): encoding 0.117 -> 0.060 CPU-s, 10.3 -> 8.2 MB)."""
    out: list[str] = []
    nested = [f.name for f in table.schema if pa.types.is_nested(f.type)]
    if nested:
        out += [c for c in _leaf_paths(table.schema) if c.split(".", 1)[0] in nested]
    for f in table.schema:
        if pa.types.is_nested(f.type) or pa.types.is_boolean(f.type):
            continue
        col = even_sample(table[f.name], SAMPLE_ROWS)
        try:
            repeats = len(col) == 0 or pc.count_distinct(col, mode="all").as_py() * 2 <= len(col)
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            repeats = True  # a type Arrow cannot count: Parquet's default
        if repeats:
            out.append(f.name)
    return out


_LEAF_PATHS: dict[pa.Schema, list[str]] = {}


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """Parquet leaf column paths of an Arrow schema (``s.a``, ``l.list.element``, ...)."""
    paths = _LEAF_PATHS.get(schema)
    if paths is None:
        buf = io.BytesIO()
        pq.write_table(schema.empty_table(), buf)
        meta = pq.read_metadata(io.BytesIO(buf.getvalue()))
        paths = _LEAF_PATHS[schema] = [meta.schema.column(i).path for i in range(len(meta.schema))]
    return paths
