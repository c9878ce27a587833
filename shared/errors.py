"""The project's error hierarchy.

One root (:class:`ShardsinkError`), one root per layer, structured fields, and messages of the
form "expected X, found Y". *Determinate* failures (definitely not applied) and
*indeterminate* ones (the outcome is unknown: retry with the same idempotency token) are
different types. Third-party errors (botocore, confluent_kafka) are translated at the adapter
boundary with ``raise OurError(...) from e``.
"""

from __future__ import annotations

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


class CommandError(ShardsinkError):
    """A controller command was rejected; ``kind`` names the typed error in the response."""


class ControllerNotFoundError(ShardsinkError):
    """No controller to answer a command: none has claimed the catalog, or its commands or
    responses topic does not exist (found before anything is sent or created)."""


class SinkProtocolError(ShardsinkError):
    """A message or call breaks the mint / write / append protocol (shared.sink_state): two
    descriptions with the same lower and epoch, a read-back batch that leaves a gap, a report
    whose partition count disagrees with its description, an absorb while an append is in
    flight. A bug or a misconfiguration, never a race: races are handled, not raised."""


# -- the one error vocabulary ------------------------------------------------------------------

#: Every kind of error a user meets, by the name the CLI prints (``error: <kind>: ...``), with
#: the ``Error.kind`` the controller answers on ``responses`` for it and what it means. A
#: controller answer is printed under the same kind as the same failure found by the CLI
#: itself, whichever way (``--via``) a command went.
ERROR_KINDS: dict[str, tuple[str, str]] = {
    "UnknownIdError": ("IdentifierMissing", "no collection, sink or subscribe with this id, or it was dropped"),
    "IdReuseError": ("IdentifierReused", "the id exists or existed with another definition (ids are never reused)"),
    "SinceViolationError": ("ReadBeforeSince", "a read below the collection's since (history compacted away)"),
    "NotReadableYetError": ("NotReadableYet", "a read at or beyond the upper, still so after the peek timeout"),
    "UpperMismatchError": ("UpperMismatch", "an append whose expected upper is not the collection's upper"),
    "SchemaError": ("SchemaError", "a schema that is not an acceptable Avro record, or rows that do not match it"),
    "IncompatibleSchemaError": ("IncompatibleSchema", "a new row schema that an earlier version's rows cannot be read as (names the field and the rule)"),
    "DecodeError": ("DecodeError", "bytes that do not decode with the expected schema"),
    "InvalidUsageError": ("InvalidUsage", "a command or flag that breaks the contract (bad value, bad id, bad time)"),
    "InternalError": ("Internal", "a failure of the controller itself (its log says more)"),
    "EncodeError": ("", "an input line that does not parse or fit the row schema (CLI; names the line)"),
    "ContractViolationError": ("", "an update or progress at a time below the progress already sent"),
    "UnknownTopicError": ("", "a Kafka topic that does not exist"),
    "KafkaUnavailableError": ("", "the Kafka brokers cannot be reached (names the address)"),
    "KafkaTimeoutError": ("", "a Kafka request, or the wait for the controller's answer, timed out"),
    "KafkaConfigError": ("", "Kafka client settings librdkafka refuses"),
    "ObjectStoreError": ("", "the S3 endpoint or bucket cannot be reached or refused a request"),
    "CatalogNotFoundError": ("", "no catalog at this bucket and prefix (nothing was created)"),
    "ControllerNotFoundError": ("", "no controller serves this catalog, or not on these topics (nothing was sent)"),
}

#: A controller's ``Error.kind`` -> the CLI's kind.
KIND_OF_WIRE: dict[str, str] = {wire: kind for kind, (wire, _) in ERROR_KINDS.items() if wire}

_KIND_OF_CLASS = {
    "ShardExistsError": "IdReuseError",
    "SchemaMismatchError": "SchemaError",
    "CatalogError": "InvalidUsageError",
    "FencedError": "InternalError",
}


def kind_of(e: BaseException) -> str:
    """The kind (a key of :data:`ERROR_KINDS`, or the class name of an error outside the
    table) under which ``e`` is reported to a user."""
    if isinstance(e, CommandError):
        wire = str(getattr(e, "kind", "") or "")
        return KIND_OF_WIRE.get(wire, wire or "InternalError")
    mro = [cls.__name__ for cls in type(e).__mro__]
    for name in mro:
        if name in ERROR_KINDS:
            return name
    for name in mro:
        if name in _KIND_OF_CLASS:
            return _KIND_OF_CLASS[name]
    return type(e).__name__
