"""Avro codecs for every topic and for a collection's rows.

Wire formats
------------
*Single-object encoding* (the default, from the Avro specification)::

    0xC3 0x01 | CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form,
                8 bytes little-endian | the schemaless Avro body

A reader knows the writer schema from the fingerprint alone, without a registry. A
:class:`Codec` has one *reader* schema (the current version) and a set of known *writer*
schemas by fingerprint (the current one and older versions); a body written with an older
version is resolved to the reader schema by fastavro's schema resolution.

*Confluent wire format* (when a schema registry is configured)::

    0x00 | 4-byte big-endian schema id | the schemaless Avro body

:meth:`Codec.decode` accepts both framings (the first byte tells them apart);
:meth:`Codec.encode` produces the one the codec was built for (``wire=``).

Times
-----
Times are unsigned 64-bit integers. In the schemas they are Avro ``long`` with
``"logicalType": "u64"``. Values ``>= 2**63`` are stored as their two's complement (``t -
2**64``), so every u64 fits; this module registers a fastavro logical reader and writer that
convert both ways, so shardsink code sees ``0 <= t < 2**64``. A plain Avro reader that does not
know the logical type sees the signed long, which is the same number for every time below
``2**63`` (all epoch-millisecond times). Encoding a time outside ``[0, 2**64)`` is an
:class:`~shared.errors.EncodeError`.

Unions
------
Values of a union of several records are ``(full_name, dict)`` tuples both ways (fastavro's
tuple notation, ``return_record_name``), e.g. ``("io.shardsink.v1.Peek", {...})``; a union of
``null`` and one type is the plain value or ``None``. :func:`tagged` and :func:`kind_of` spare
callers the namespace.

Rows
----
A collection's rows are single-object encoded with the collection's row schema
(:class:`RowCodec`), so that rows written before an ``AlterCollection`` still decode. The row
hash that partitions a desired topic is taken over the row's *schemaless body under the
current schema* (:meth:`RowCodec.partition_key`), the same for producer and write service,
whatever schema version a row was written with. Rows are encoded canonically (map keys sorted,
see :meth:`RowCodec.canonical`) so that equal rows have equal bytes, from the topic or from the
shard.

Errors
------
Bad bytes (truncated, trailing garbage, unknown fingerprint or schema id, a body that does not
match its schema, random bytes) raise :class:`~shared.errors.DecodeError` and never anything
else; a value that does not fit its schema raises :class:`~shared.errors.EncodeError`.

Pure: fastavro only, no I/O (the registry is an interface; an HTTP client lives in
``shared/io/schema_registry.py``).
"""

from __future__ import annotations

import datetime
import decimal
import io
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, Protocol

import fastavro
import fastavro.read
import fastavro.write
from fastavro.schema import to_parsing_canonical_form

from shared.avro_arrow import parse_row_schema, row_normaliser
from shared.errors import CodecError, DecodeError, EncodeError, SchemaError, SchemaRegistryError

__all__ = [
    "MARKER",
    "NAMESPACE",
    "SCHEMA_NAMES",
    "Codec",
    "InMemorySchemaRegistry",
    "RowCodec",
    "SchemaRegistry",
    "SchemaRegistryError",
    "canonical_form",
    "crc64_avro",
    "fingerprint",
    "kind_of",
    "load_schema",
    "message_codec",
    "schemas_dir",
    "tagged",
]

NAMESPACE = "io.shardsink.v1"
#: The two bytes that open a single-object encoded message.
MARKER = b"\xc3\x01"
_HEADER_LEN = len(MARKER) + 8
#: The byte that opens a Confluent wire-format message.
CONFLUENT_MAGIC = 0
_CONFLUENT_HEADER_LEN = 5

#: The message schemas, one per topic kind (files ``schemas/<name>.avsc``).
SCHEMA_NAMES: tuple[str, ...] = (
    "command",
    "response",
    "desired",
    "batch_description",
    "written_batch",
    "frontier_update",
    "subscribe_output",
)

_READ_OPTIONS: dict[str, Any] = {"return_record_name": True, "return_record_name_override": True}

Wire = Literal["single-object", "confluent"]


# -- u64 times -------------------------------------------------------------------------------

_TWO_64 = 1 << 64
_TWO_63 = 1 << 63


def _read_u64(datum: int, writer_schema: Any = None, reader_schema: Any = None) -> int:
    return datum + _TWO_64 if datum < 0 else datum


def _write_u64(datum: Any, schema: Any = None) -> int:
    if isinstance(datum, bool) or not isinstance(datum, int) or not 0 <= datum < _TWO_64:
        raise ValueError(f"expected a u64 time in [0, 2**64), found {datum!r}")
    return datum - _TWO_64 if datum >= _TWO_63 else datum


def _register_u64() -> None:
    fastavro.read.LOGICAL_READERS["long-u64"] = _read_u64
    fastavro.write.LOGICAL_WRITERS["long-u64"] = _write_u64


_register_u64()


# -- strict logical types ----------------------------------------------------------------------
#
# fastavro's own readers of a few logical types accept bodies whose value the type forbids and
# return something else than what was written: a time-millis of -1 reads as 00:00:00.999, a
# decimal with more digits than its precision is rounded to the precision. A row read like that
# would re-encode to other bytes (and other values) than the topic carried. These readers are
# exact or raise (ValueError, which the codec turns into a DecodeError). The nanosecond
# timestamps, which fastavro leaves as plain longs, get writers that also take a ``datetime``
# (decoding keeps the long: a ``datetime`` cannot hold nanoseconds). A ``uuid`` string is
# written in its canonical form (lowercase, hyphenated), so that equal uuids are equal bytes.

_MS_PER_DAY = 86_400_000
_US_PER_DAY = 86_400_000_000
_EPOCH_UTC = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_EPOCH_NAIVE = datetime.datetime(1970, 1, 1)


def _time_of_day(micros: int) -> datetime.time:
    seconds, us = divmod(micros, 1_000_000)
    minutes, s = divmod(seconds, 60)
    h, m = divmod(minutes, 60)
    return datetime.time(h, m, s, us)


def _read_time_millis(datum: int, writer_schema: Any = None, reader_schema: Any = None) -> Any:
    if not 0 <= datum < _MS_PER_DAY:
        raise ValueError(f"expected a time-millis in [0, {_MS_PER_DAY}), found {datum}")
    return _time_of_day(datum * 1000)


def _read_time_micros(datum: int, writer_schema: Any = None, reader_schema: Any = None) -> Any:
    if not 0 <= datum < _US_PER_DAY:
        raise ValueError(f"expected a time-micros in [0, {_US_PER_DAY}), found {datum}")
    return _time_of_day(datum)


def _read_decimal(datum: bytes, writer_schema: Any = None, reader_schema: Any = None) -> Any:
    schema = writer_schema or {}
    precision, scale = schema["precision"], schema.get("scale", 0)
    unscaled = int.from_bytes(datum, "big", signed=True)
    if abs(unscaled) >= 10**precision:
        raise ValueError(
            f"expected a decimal of at most {precision} digits, found the unscaled value "
            f"{unscaled} ({len(str(abs(unscaled)))} digits)"
        )
    return decimal.Decimal(unscaled).scaleb(-scale, decimal.Context(prec=max(precision, 1)))


def _nanos_writer(aware: bool) -> Callable[[Any, Any], Any]:
    epoch = _EPOCH_UTC if aware else _EPOCH_NAIVE

    def write(datum: Any, schema: Any = None) -> Any:
        if isinstance(datum, datetime.datetime):
            if aware and datum.tzinfo is None:
                raise ValueError(f"expected an aware datetime for timestamp-nanos, found {datum!r}")
            delta = (datum if aware else datum.replace(tzinfo=None)) - epoch
            return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
        return datum

    return write


def _write_uuid(datum: Any, schema: Any = None) -> Any:
    if isinstance(datum, uuid.UUID):
        return str(datum)
    if isinstance(datum, str):
        return str(uuid.UUID(datum))  # ValueError for a string that is no uuid
    return datum


def _register_strict_logical_types() -> None:
    readers, writers = fastavro.read.LOGICAL_READERS, fastavro.write.LOGICAL_WRITERS
    readers["int-time-millis"] = _read_time_millis
    readers["long-time-micros"] = _read_time_micros
    readers["bytes-decimal"] = _read_decimal
    readers["fixed-decimal"] = _read_decimal
    writers["long-timestamp-nanos"] = _nanos_writer(aware=True)
    writers["long-local-timestamp-nanos"] = _nanos_writer(aware=False)
    writers["string-uuid"] = _write_uuid


_register_strict_logical_types()


# -- fingerprints ----------------------------------------------------------------------------

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The Avro specification's 64-bit Rabin fingerprint ("CRC-64-AVRO") of ``data``."""
    fp = _CRC64_EMPTY
    for b in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ b) & 0xFF]
    return fp


def canonical_form(schema: Any) -> str:
    """The Parsing Canonical Form of a schema (dict, list or JSON text)."""
    try:
        parsed = fastavro.parse_schema(_as_json_value(schema), _write_hint=False)
        return str(to_parsing_canonical_form(parsed))
    except CodecError:
        raise
    except Exception as e:
        raise SchemaError(f"expected a valid Avro schema, found one fastavro rejects: {e}") from e


def fingerprint(schema: Any) -> bytes:
    """The 8-byte little-endian CRC-64-AVRO fingerprint of the schema's canonical form, as
    it appears in a single-object encoded message."""
    return crc64_avro(canonical_form(schema).encode("utf-8")).to_bytes(8, "little")


def _as_json_value(schema: Any) -> Any:
    if isinstance(schema, str):
        s = schema.strip()
        if s.startswith(("{", "[", '"')):
            try:
                return json.loads(s)
            except json.JSONDecodeError as e:
                raise SchemaError(f"expected an Avro schema as JSON text, found {e}") from e
        return s  # a bare type name such as long
    return json.loads(json.dumps(schema))


# -- unions ------------------------------------------------------------------------------------


def tagged(kind: str, value: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A union value of record ``kind`` (short or full name) in fastavro's tuple notation."""
    full = kind if "." in kind else f"{NAMESPACE}.{kind}"
    return (full, dict(value))


def kind_of(value: Any) -> str:
    """The short record name of a decoded union value ``(full_name, dict)``."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return value[0].rsplit(".", 1)[-1]
    raise DecodeError(f"expected a (record_name, value) union value, found {type(value).__name__}")


# -- registry interface ----------------------------------------------------------------------


class SchemaRegistry(Protocol):
    """What the codec needs of a Confluent-compatible schema registry."""

    def register(self, subject: str, schema: Mapping[str, Any]) -> int:
        """Register ``schema`` under ``subject`` (idempotent) and return its id."""
        ...

    def get_schema(self, schema_id: int) -> dict[str, Any] | None:
        """The schema with this id, or None when the registry has no such id.

        Raises :class:`SchemaRegistryError` when the registry cannot be asked."""
        ...


class InMemorySchemaRegistry:
    """A registry in a dict: for unit tests and single-process use."""

    def __init__(self) -> None:
        self._by_id: dict[int, dict[str, Any]] = {}
        self._ids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def register(self, subject: str, schema: Mapping[str, Any]) -> int:
        canon = canonical_form(schema)
        with self._lock:
            for (_, c), i in self._ids.items():
                if c == canon:  # the registry gives one id per schema, across subjects
                    self._ids[(subject, canon)] = i
                    return i
            i = len(self._by_id) + 1
            self._by_id[i] = json.loads(json.dumps(schema))
            self._ids[(subject, canon)] = i
            return i

    def get_schema(self, schema_id: int) -> dict[str, Any] | None:
        with self._lock:
            s = self._by_id.get(schema_id)
            return None if s is None else json.loads(json.dumps(s))


# -- the codec -------------------------------------------------------------------------------


class _Writer:
    """A known writer schema and how to read its bodies into the reader schema."""

    __slots__ = ("parsed", "reader")

    def __init__(self, parsed: Any, reader: Any) -> None:
        self.parsed = parsed
        self.reader = reader  # None when the writer schema is the reader schema


class Codec:
    """Encode and decode one message type.

    ``schema`` is the reader (current) schema, also used to encode. ``previous`` are older
    versions whose messages must still decode: they are resolved to ``schema``. With a
    ``registry`` (and a ``subject``, default ``<record full name>-value``; pass
    ``<topic>-value`` for Confluent's TopicNameStrategy), Confluent framed
    messages decode too, and ``wire="confluent"`` makes :meth:`encode` produce them.
    """

    def __init__(
        self,
        schema: Any,
        *,
        previous: Iterable[Any] = (),
        registry: SchemaRegistry | None = None,
        subject: str | None = None,
        wire: Wire = "single-object",
    ) -> None:
        raw = _as_json_value(schema)
        try:
            self._parsed = fastavro.parse_schema(raw)
        except Exception as e:
            raise SchemaError(
                f"expected a valid Avro schema, found one fastavro rejects: {e}"
            ) from e
        self.schema: dict[str, Any] | Any = raw
        self.fingerprint: bytes = fingerprint(raw)
        self._header = MARKER + self.fingerprint
        self._writers: dict[bytes, _Writer] = {self.fingerprint: _Writer(self._parsed, None)}
        for old in previous:
            self.add_writer_schema(old)
        if wire not in ("single-object", "confluent"):
            raise ValueError(f"expected wire 'single-object' or 'confluent', found {wire!r}")
        if wire == "confluent" and registry is None:
            raise ValueError("expected a schema registry for wire='confluent', found none")
        self.wire: Wire = wire
        self._registry = registry
        name = self._parsed.get("name") if isinstance(self._parsed, dict) else None
        self.subject = subject or f"{name or 'schema'}-value"  # the record's full name
        self._registry_ids: dict[int, _Writer] = {}
        self._own_registry_id: int | None = None

    # -- writer schemas ----------------------------------------------------------------
    def add_writer_schema(self, schema: Any) -> bytes:
        """Make messages written with ``schema`` decodable; returns its fingerprint."""
        raw = _as_json_value(schema)
        fp = fingerprint(raw)
        if fp not in self._writers:
            self._writers[fp] = self._writer_for(raw)
        return fp

    def _writer_for(self, raw: Any) -> _Writer:
        try:
            parsed = fastavro.parse_schema(raw)
        except Exception as e:
            raise SchemaError(f"expected a valid Avro writer schema, found: {e}") from e
        return _Writer(parsed, self._parsed)

    def knows(self, fp: bytes) -> bool:
        return fp in self._writers

    # -- encoding ----------------------------------------------------------------------
    def encode_body(self, value: Any) -> bytes:
        """The schemaless Avro body of ``value`` (no framing)."""
        buf = io.BytesIO()
        try:
            fastavro.schemaless_writer(buf, self._parsed, value, strict_allow_default=True)
        except Exception as e:
            raise EncodeError(
                f"expected a value matching schema {self.subject!r}, found one that does not "
                f"encode: {e}"
            ) from e
        return buf.getvalue()

    def encode(self, value: Any) -> bytes:
        """Single-object encoding of ``value`` (Confluent framing when ``wire='confluent'``)."""
        body = self.encode_body(value)
        if self.wire == "confluent":
            return bytes([CONFLUENT_MAGIC]) + self._confluent_id().to_bytes(4, "big") + body
        return self._header + body

    def _confluent_id(self) -> int:
        if self._own_registry_id is None:
            assert self._registry is not None
            i = self._registry.register(self.subject, self.schema)
            self._own_registry_id = i
            self._registry_ids[i] = _Writer(self._parsed, None)
        return self._own_registry_id

    # -- decoding ----------------------------------------------------------------------
    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """Decode a single-object (or, with a registry, Confluent) framed message.

        Raises :class:`DecodeError` for anything that is not a complete, valid message of a
        known writer schema."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes, found {type(data).__name__}")
        data = bytes(data)
        if data[:2] == MARKER:
            if len(data) < _HEADER_LEN:
                raise DecodeError(
                    f"expected a single-object header of {_HEADER_LEN} bytes, found "
                    f"{len(data)} bytes",
                    expected=_HEADER_LEN,
                    actual=len(data),
                )
            fp = data[2:_HEADER_LEN]
            writer = self._writers.get(fp)
            if writer is None:
                raise DecodeError(
                    f"expected a writer schema fingerprint known to {self.subject!r}, found "
                    f"{fp.hex()}",
                    fingerprint=fp.hex(),
                )
            return self._read(data, _HEADER_LEN, writer)
        if data[:1] == b"\x00" and self._registry is not None:
            if len(data) < _CONFLUENT_HEADER_LEN:
                raise DecodeError(
                    f"expected a Confluent header of 5 bytes, found {len(data)} bytes"
                )
            schema_id = int.from_bytes(data[1:5], "big")
            return self._read(data, _CONFLUENT_HEADER_LEN, self._registry_writer(schema_id))
        head = data[:2].hex() or "nothing"
        framings = "0xC301 (single-object)" + (" or 0x00 (Confluent)" if self._registry else "")
        raise DecodeError(
            f"expected a message starting with {framings}, found {head}",
            expected=framings,
            actual=head,
        )

    def _registry_writer(self, schema_id: int) -> _Writer:
        writer = self._registry_ids.get(schema_id)
        if writer is not None:
            return writer
        assert self._registry is not None
        schema = self._registry.get_schema(schema_id)
        if schema is None:
            raise DecodeError(
                f"expected a schema id known to the registry, found {schema_id}",
                schema_id=schema_id,
            )
        try:
            fp = fingerprint(schema)
            writer = self._writers.get(fp) or self._writer_for(_as_json_value(schema))
        except CodecError as e:
            raise DecodeError(
                f"expected a valid writer schema for id {schema_id}, found: {e}",
                schema_id=schema_id,
            ) from e
        self._registry_ids[schema_id] = writer
        return writer

    def decode_body(self, body: bytes, writer_schema: Any = None) -> Any:
        """Decode a schemaless body written with ``writer_schema`` (default: the reader)."""
        if writer_schema is None:
            writer = self._writers[self.fingerprint]
        else:
            fp = fingerprint(writer_schema)
            writer = self._writers.get(fp) or self._writer_for(_as_json_value(writer_schema))
        return self._read(bytes(body), 0, writer)

    def _read(self, data: bytes, start: int, writer: _Writer) -> Any:
        fo = io.BytesIO(data)
        fo.seek(start)
        try:
            value = fastavro.schemaless_reader(fo, writer.parsed, writer.reader, **_READ_OPTIONS)
        except Exception as e:  # fastavro raises EOFError, ValueError, UnicodeDecodeError...
            why = str(e)
            if isinstance(e, IndexError):
                why = "an enum symbol or union branch index beyond the schema's"
            raise DecodeError(
                f"expected a body matching {self.subject!r}, found bytes that do not decode "
                f"({type(e).__name__}: {why})",
                cause=type(e).__name__,
            ) from e
        end = fo.tell()
        if end != len(data):
            raise DecodeError(
                f"expected the body to end at byte {len(data)}, found it ends at {end} "
                f"({len(data) - end} trailing bytes)",
                expected=len(data),
                actual=end,
            )
        return value

    def writer_fingerprint(self, data: bytes) -> bytes | None:
        """The fingerprint in a single-object header, or None when ``data`` has none."""
        if len(data) >= _HEADER_LEN and data[:2] == MARKER:
            return bytes(data[2:_HEADER_LEN])
        return None


# -- rows of a collection --------------------------------------------------------------------


class RowCodec:
    """Single-object encoding of a collection's rows with its row schema.

    ``schema`` is the current row schema (validated by :func:`parse_row_schema`),
    ``previous`` the collection's older row schemas. Rows are dicts (fastavro's shape).
    """

    def __init__(self, schema: Any, *, previous: Iterable[Any] = ()) -> None:
        self.schema = parse_row_schema(schema)
        self.codec = Codec(self.schema, previous=[parse_row_schema(p) for p in previous])
        self.fingerprint = self.codec.fingerprint
        self._normalise = row_normaliser(self.schema)

    def _normalised(self, row: Mapping[str, Any]) -> Any:
        try:
            return self._normalise(row)
        except ValueError as e:
            raise EncodeError(f"expected a row that fits {self.codec.subject!r}, found: {e}") from e

    def encode(self, row: Mapping[str, Any]) -> bytes:
        """The row in its canonical single-object encoding (see :meth:`canonical`).

        Raises EncodeError for a row that does not fit the schema, including a value the
        Avro type encodes but the collection cannot hold (an ``int`` outside 32 bits, a
        decimal with more digits than its precision)."""
        return self.codec.encode(self._normalised(row))

    def encode_body(self, row: Mapping[str, Any]) -> bytes:
        """The row's canonical schemaless body under the current schema (the partition key)."""
        return self.codec.encode_body(self._normalised(row))

    def decode(self, row_bytes: bytes) -> dict[str, Any]:
        """A single-object encoded row (any known version) as a dict of the current schema.

        Raises DecodeError for bytes that do not decode and for a value the collection cannot
        hold (see :meth:`encode`); the message names the field."""
        value = self.codec.decode(row_bytes)
        if not isinstance(value, dict):  # pragma: no cover - a record schema decodes to a dict
            raise DecodeError(f"expected a record, found {type(value).__name__}")
        try:
            checked: dict[str, Any] = self._normalise(value)
        except ValueError as e:
            raise DecodeError(
                f"expected a row that fits {self.codec.subject!r}, found: {e}", cause="range"
            ) from e
        return checked

    def canonical(self, row_bytes: bytes) -> bytes:
        """The canonical single-object encoding of the row that ``row_bytes`` encode.

        *Canonical* means: the current schema's fingerprint, then the body fastavro writes for
        the decoded value, with map keys in order of their UTF-8 bytes (one block per array
        and map, minimal varints, booleans as 0/1, uuids in lowercase text, decimals as
        fastavro writes them, a duplicate map key resolved as decoding resolves it: the last
        one wins). It is a function of the row's *value*: whatever bytes a producer wrote for
        a value (an older schema version, over-long varints, unsorted or split map blocks),
        and whether the value comes from the topic or from the shard's Arrow columns
        (``RowCodec.encode(arrow_to_rows(table, schema)[i])``), the bytes are the same, so
        that the correction buffer's keys meet.

        Raises DecodeError for bytes that do not decode or hold a value the collection cannot
        hold."""
        value = self.decode(row_bytes)
        try:
            return self.codec.encode(value)
        except EncodeError as e:  # pragma: no cover - a decoded, checked value encodes
            raise DecodeError(f"expected a row that encodes again, found: {e}") from e

    def partition_key(self, row_bytes: bytes) -> bytes:
        """The bytes the row hash is taken over: the canonical body under the current schema.

        Fast path (the row was written with the current schema): the bytes after the header,
        which are the canonical body when ``row_bytes`` is canonical (what :meth:`encode` and
        :meth:`canonical` give; the sink canonicalises every row it decodes). Otherwise the
        row is decoded (resolving the old schema) and re-encoded."""
        if self.codec.writer_fingerprint(row_bytes) == self.fingerprint:
            return bytes(row_bytes[_HEADER_LEN:])
        return self.codec.encode_body(self.decode(row_bytes))

    def upgrade(self, row_bytes: bytes) -> bytes:
        """The row in its canonical encoding under the current schema (:meth:`canonical`)."""
        return self.canonical(row_bytes)


# -- the project's message schemas -----------------------------------------------------------


def schemas_dir() -> Path:
    """Where the ``.avsc`` files are: ``$SHARDSINK_SCHEMAS_DIR`` or the repository's
    ``schemas/``."""
    env = os.environ.get("SHARDSINK_SCHEMAS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "schemas"


def load_schema(name: str) -> dict[str, Any]:
    """The current schema ``schemas/<name>.avsc`` as a dict."""
    if name not in SCHEMA_NAMES:
        raise SchemaError(f"expected a schema name in {list(SCHEMA_NAMES)}, found {name!r}")
    path = schemas_dir() / f"{name}.avsc"
    try:
        loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SchemaError(f"expected a readable Avro schema file at {path}, found: {e}") from e
    return loaded


def previous_schemas(name: str) -> list[dict[str, Any]]:
    """Older versions ``schemas/previous/<name>.v<N>.avsc``, oldest first."""
    folder = schemas_dir() / "previous"
    if not folder.is_dir():
        return []
    found = []
    for p in folder.glob(f"{name}.v*.avsc"):
        try:
            version = int(p.name[len(name) + 2 : -len(".avsc")])
        except ValueError:
            continue
        found.append((version, json.loads(p.read_text(encoding="utf-8"))))
    return [s for _, s in sorted(found, key=lambda vs: vs[0])]


@cache
def message_codec(name: str) -> Codec:
    """The codec of one topic's messages (current schema plus its previous versions)."""
    return Codec(load_schema(name), previous=previous_schemas(name))
