"""The project's error hierarchy.

One root (:class:`ShardsinkError`), one root per layer, structured fields, and messages of the
form "expected X, found Y". *Determinate* failures (definitely not applied) and
*indeterminate* ones (the outcome is unknown: retry with the same idempotency token) are
different types. Third-party errors (botocore, confluent_kafka) are translated at the adapter
boundary with ``raise OurError(...) from e``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ShardsinkError(Exception):
    """Root of every error this project raises on purpose."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields
        for k, v in fields.items():
            setattr(self, k, v)


class UnknownIdError(ShardsinkError):
    """No collection, sink, shard or subscribe has this id, or it was dropped (the base of
    :class:`ShardNotFoundError`, :class:`ShardDroppedError` and the catalog's
    ``UnknownCollectionError`` / ``UnknownSinkError``)."""


# -- storage layer -------------------------------------------------------------------------


class StorageError(ShardsinkError):
    """Root of the shard storage layer's errors."""


class DeterminateError(StorageError):
    """The operation definitely did not take effect."""


class IndeterminateError(StorageError):
    """The operation may or may not have taken effect (e.g. a timeout after a PUT was sent).

    Retry with the same idempotency token: an append that landed is recognised and is not
    applied twice.
    """


class ObjectStoreError(DeterminateError):
    """The object store refused or failed a request; nothing was written by it."""


class ObjectNotFoundError(DeterminateError):
    """An object that was expected to exist does not."""


class PreconditionFailedError(DeterminateError):
    """A conditional write lost: the object exists already (``If-None-Match: *``)."""


class ConflictRetryError(DeterminateError):
    """The store answered 409 (concurrent conditional write): re-read and retry."""


class UpperMismatchError(DeterminateError):
    """compare_and_append's expected upper is not the shard's upper. ``current`` is the upper."""


class InvalidUsageError(DeterminateError):
    """The call breaks the API's contract (bad times, bad frontiers, bad schema...)."""


class ShardNotFoundError(DeterminateError, UnknownIdError):
    """No shard exists at the given id."""


class ShardExistsError(DeterminateError):
    """A shard with this id exists already with another definition."""


class ShardDroppedError(DeterminateError, UnknownIdError):
    """The shard has been dropped (its since and upper are the empty frontier)."""


class SchemaMismatchError(DeterminateError):
    """Rows or a schema do not match the shard's schema."""


class SinceViolationError(DeterminateError):
    """A read at a time below the shard's since (history compacted away)."""


class NotReadableYetError(DeterminateError):
    """A read at a time at or beyond the shard's upper, after waiting the stated timeout."""


class StagedBatchExpiredError(DeterminateError):
    """A staged batch is older than the safe window and may have been garbage collected."""


class ReaderExpiredError(DeterminateError):
    """A leased reader handle expired (not renewed in time) and no longer holds since."""


class FormatError(DeterminateError):
    """A stored object does not decode with the expected format version."""


# -- codecs and messages -------------------------------------------------------------------


class CodecError(ShardsinkError):
    """Root of encode/decode errors of messages and rows."""


class DecodeError(CodecError):
    """Bytes that do not decode: truncated, unknown fingerprint, wrong schema."""


class EncodeError(CodecError):
    """A value that does not fit the schema it is encoded with."""


class SchemaError(CodecError):
    """A schema is not acceptable: not valid Avro, not a record, a reserved field name, or a
    type with no Arrow/Parquet mapping (a non-nullable union, a recursive type)."""


class IncompatibleSchemaError(SchemaError):
    """A new row schema for a collection that some earlier version's rows cannot be read as
    (Avro's schema resolution, see :mod:`shared.schema_evolution`). ``field`` names the
    offending field (a path such as ``Order.items[].qty``), ``rule`` the rule it breaks,
    ``version`` the earlier version (0 = the first) whose rows would not read."""


class SchemaRegistryError(CodecError):
    """The schema registry could not be reached or answered something unusable (not a bad
    message: an unknown schema id is a DecodeError)."""


# -- Kafka adapters ------------------------------------------------------------------------


class KafkaAdapterError(ShardsinkError):
    """Root of Kafka adapter errors (translated from confluent_kafka)."""


class KafkaConfigError(KafkaAdapterError):
    """Client settings librdkafka or the adapter refuses (unknown option, missing bootstrap)."""


class UnknownTopicError(KafkaAdapterError):
    """A topic (or partition) the broker does not know."""


class KafkaUnavailableError(KafkaAdapterError):
    """The brokers cannot be reached or have no leader for a partition (transient: retry)."""


class KafkaTimeoutError(KafkaAdapterError):
    """A Kafka request or a bounded wait (a probe, a read of an offset range) did not finish."""


class KafkaDeliveryError(KafkaAdapterError):
    """A produced record was not acknowledged; the batch that produced it must fail and be
    retried (records acknowledged before the failure may be duplicated by the retry)."""


class KafkaDataLossError(KafkaAdapterError):
    """Records in an offset range that must be read are gone (deleted by retention)."""


# -- sink and controller -------------------------------------------------------------------


class ContractViolationError(ShardsinkError):
    """An update breaks the desired-topic contract (a time below its partition's progress)."""


class HistoryUnprovenError(ShardsinkError):
    """A sink's writer cannot prove it has seen the desired history behind its shard (the
    topic's oldest records are gone and no checkpoint covers them): it refuses to write, so
    it never retracts a row only because the row's insert aged out. An operator adopts the
    shard's contents as the baseline (``shardsink sink adopt``)."""


class SinkBaselineRequiredError(InvalidUsageError):
    """A sink was to be created on a collection that holds rows without saying what its
    desired topic holds: ``adopt_shard`` (``--adopt-shard``: the topic holds the changes from
    the collection's upper on, the rows stay as they are) or ``replace_contents``
    (``--replace-contents``: the topic is the whole truth, and the sink retracts the rows it
    does not hold). Nothing was written. Fields: ``sink_id``, ``collection_id``, ``rows`` (the
    rows the shard's state records, the count ``collection list`` shows), ``upper``."""

    sink_id: str
    collection_id: str
    rows: int
    upper: int | None


class CommandError(ShardsinkError):
    """A controller command was rejected; ``kind`` names the typed error in the response."""


class ControllerNotFoundError(ShardsinkError):
    """No controller to answer a command: none has claimed the catalog, or its commands or
    responses topic does not exist (found before anything is sent or created)."""


class SinkProtocolError(ShardsinkError):
    """A message or call breaks the mint / write / append protocol (shared.mint_state, shared.write_state, shared.append_state): two
    descriptions with the same lower and epoch, a read-back batch that leaves a gap, a report
    whose partition count disagrees with its description, an absorb while an append is in
    flight. A bug or a misconfiguration, never a race: races are handled, not raised."""


# -- the one error vocabulary ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """One kind of error a user meets (a row of :data:`ERROR_KINDS`).

    ``wire``: the ``Error.kind`` the controller answers on ``responses`` for it;
    ``meaning``: what it means; ``classes``: the names of the exception classes reported
    under this kind (every error class of this module and of :mod:`shared.catalog` is in
    exactly one row, ``tests/shared/test_error_kinds.py``).
    """

    wire: str
    meaning: str
    classes: tuple[str, ...]


#: Every kind of error a user meets, by the name the CLI prints (``error: <kind>: ...``), with
#: the ``Error.kind`` the controller answers on ``responses`` for it, what it means and the
#: exception classes reported under it: the one mapping from an exception to its kind (the
#: CLI's :func:`kind_of` and the controller's :func:`wire_kind` both read it). A controller
#: answer is printed under the same kind as the same failure found by the CLI itself,
#: whichever way (``--via``) a command went. Several kinds share the wire kinds
#: ``InvalidUsage`` and ``Internal``: an answer of one reads back as the first kind of the
#: table with it (:data:`KIND_OF_WIRE`).
ERROR_KINDS: dict[str, ErrorKind] = {
    "UnknownIdError": ErrorKind(
        "IdentifierMissing", "no collection, sink or subscribe with this id, or it was dropped",
        ("UnknownIdError", "ShardNotFoundError", "ShardDroppedError", "UnknownCollectionError", "UnknownSinkError")),
    "IdReuseError": ErrorKind(
        "IdentifierReused", "the id exists or existed with another definition (ids are never reused)",
        ("IdReuseError", "ShardExistsError")),
    "SinceViolationError": ErrorKind(
        "ReadBeforeSince", "a read below the collection's since (history compacted away)", ("SinceViolationError",)),
    "NotReadableYetError": ErrorKind(
        "NotReadableYet", "a read at or beyond the upper, still so after the peek timeout", ("NotReadableYetError",)),
    "UpperMismatchError": ErrorKind(
        "UpperMismatch", "an append whose expected upper is not the collection's upper", ("UpperMismatchError",)),
    "SchemaError": ErrorKind(
        "SchemaError", "a schema that is not an acceptable Avro record, or rows that do not match it",
        ("SchemaError", "SchemaMismatchError")),
    "IncompatibleSchemaError": ErrorKind(
        "IncompatibleSchema", "a new row schema that an earlier version's rows cannot be read as (names the field and the rule)",
        ("IncompatibleSchemaError",)),
    "DecodeError": ErrorKind("DecodeError", "bytes that do not decode with the expected schema", ("DecodeError",)),
    "InvalidUsageError": ErrorKind(
        "InvalidUsage", "a command or flag that breaks the contract (bad value, bad id, bad time)",
        ("InvalidUsageError", "CatalogError", "ValueError")),
    "SinkBaselineRequiredError": ErrorKind(
        "SinkBaselineRequired",
        "a sink on a collection that holds rows must say what its topic holds (--adopt-shard or --replace-contents)",
        ("SinkBaselineRequiredError",)),
    "InternalError": ErrorKind(
        "Internal", "a failure of the controller itself (its log says more)",
        # A CommandError is reported under the kind its answer names; without one, here.
        ("FencedError", "CommandError")),
    "EncodeError": ErrorKind(
        "InvalidUsage", "an input line that does not parse or fit the row schema (CLI; names the line)", ("EncodeError",)),
    "CodecError": ErrorKind("InvalidUsage", "a message or row that does not encode or decode", ("CodecError",)),
    "SchemaRegistryError": ErrorKind(
        "InvalidUsage", "the schema registry cannot be reached or answered something unusable", ("SchemaRegistryError",)),
    "CatalogNotFoundError": ErrorKind(
        "InvalidUsage", "no catalog at this bucket and prefix (nothing was created)", ("CatalogNotFoundError",)),
    "ContractViolationError": ErrorKind(
        "Internal", "an update or progress at a time below the progress already sent", ("ContractViolationError",)),
    "UnknownTopicError": ErrorKind("Internal", "a Kafka topic that does not exist", ("UnknownTopicError",)),
    "KafkaUnavailableError": ErrorKind(
        "Internal", "the Kafka brokers cannot be reached (names the address)", ("KafkaUnavailableError",)),
    "KafkaTimeoutError": ErrorKind(
        "Internal", "a Kafka request, or the wait for the controller's answer, timed out", ("KafkaTimeoutError",)),
    "KafkaConfigError": ErrorKind("Internal", "Kafka client settings librdkafka refuses", ("KafkaConfigError",)),
    "KafkaDeliveryError": ErrorKind(
        "Internal", "produced records were not acknowledged (some may have landed)", ("KafkaDeliveryError",)),
    "KafkaDataLossError": ErrorKind(
        "Internal", "records that must be read are gone (deleted by retention)", ("KafkaDataLossError",)),
    "KafkaAdapterError": ErrorKind("Internal", "a Kafka client failure", ("KafkaAdapterError",)),
    "ObjectStoreError": ErrorKind(
        "Internal", "the S3 endpoint or bucket cannot be reached or refused a request", ("ObjectStoreError",)),
    "ObjectNotFoundError": ErrorKind("Internal", "an object expected on S3 is not there", ("ObjectNotFoundError",)),
    "PreconditionFailedError": ErrorKind(
        "Internal", "a conditional write lost: the object exists already", ("PreconditionFailedError",)),
    "ConflictRetryError": ErrorKind(
        "Internal", "a concurrent conditional write on S3: read again and retry", ("ConflictRetryError",)),
    "IndeterminateError": ErrorKind(
        "Internal", "an outcome unknown (retry with the same token: it is applied once)", ("IndeterminateError",)),
    "StagedBatchExpiredError": ErrorKind(
        "Internal", "a staged batch older than the safe window (it may have been collected)", ("StagedBatchExpiredError",)),
    "ReaderExpiredError": ErrorKind(
        "Internal", "a leased reader hold expired (not renewed in time)", ("ReaderExpiredError",)),
    "FormatError": ErrorKind("Internal", "a stored object of an unknown format version", ("FormatError",)),
    "DeterminateError": ErrorKind("Internal", "a storage operation that did not take effect", ("DeterminateError",)),
    "StorageError": ErrorKind("Internal", "a shard storage failure", ("StorageError",)),
    "HistoryUnprovenError": ErrorKind(
        "Internal", "a sink that cannot prove it saw the desired history behind its shard (shardsink sink adopt)",
        ("HistoryUnprovenError",)),
    "SinkProtocolError": ErrorKind(
        "Internal", "a message or call that breaks the mint / write / append protocol (a bug or a misconfiguration)",
        ("SinkProtocolError",)),
    "ControllerNotFoundError": ErrorKind(
        "Internal", "no controller serves this catalog, or not on these topics (nothing was sent)",
        ("ControllerNotFoundError",)),
    "ShardsinkError": ErrorKind("Internal", "a failure of this project", ("ShardsinkError",)),
}

#: A controller's ``Error.kind`` -> the CLI's kind: the first kind of :data:`ERROR_KINDS`
#: answered under it.
KIND_OF_WIRE: dict[str, str] = {row.wire: kind for kind, row in reversed(ERROR_KINDS.items())}

#: An exception class's name -> its kind (a key of :data:`ERROR_KINDS`), from the table's rows.
KIND_OF_CLASS: dict[str, str] = {cls: kind for kind, row in ERROR_KINDS.items() for cls in row.classes}


def kind_of(e: BaseException) -> str:
    """The kind (a key of :data:`ERROR_KINDS`, or the class name of an exception outside the
    table) under which ``e`` is reported to a user: its class's row, else the row of its
    nearest listed base class. A :class:`CommandError` (a controller's answer) is reported
    under the kind of the wire kind it carries."""
    if isinstance(e, CommandError):
        wire = str(getattr(e, "kind", "") or "")
        return KIND_OF_WIRE.get(wire, wire or "InternalError")
    for cls in type(e).__mro__:
        kind = KIND_OF_CLASS.get(cls.__name__)
        if kind is not None:
            return kind
    return type(e).__name__


def wire_kind(e: BaseException) -> str:
    """The ``Error.kind`` the controller answers for ``e`` (see schemas/response.avsc): the
    wire kind of its kind (:func:`kind_of`); ``Internal`` for an exception outside the table."""
    row = ERROR_KINDS.get(kind_of(e))
    return row.wire if row is not None else "Internal"
