"""shardsink: a changing collection kept on S3 as a versioned, self-correcting shard.

The public Python API::

    import shardsink

    orders = shardsink.open_collection("orders")   # S3 settings from the environment
    table = orders.snapshot(as_of=41)               # pyarrow.Table: row columns + _diff
    with orders.subscribe(as_of=41, up_to=100) as sub:
        for event in sub:                           # shardsink.Change / ErrorRow / Progress
            ...

    shardsink.register_spark_source(spark)         # spark.read.format("shardsink").load("orders")
    df = shardsink.read_collection(spark, "orders", as_of=41)

Errors are typed and grouped by cause under :class:`ShardsinkError`; the ones a reader meets
are :class:`ShardNotFoundError`, :class:`ShardDroppedError`, :class:`SinceViolationError`,
:class:`NotReadableYetError` and :class:`ReaderExpiredError`.

This package is the stable surface: the implementation lives in ``shared`` (the pure core
and its I/O adapters) and ``services`` (mint, write, append, controller), whose modules may
move. The read API (``open_collection``, ``Change``, ``ErrorRow``, ``Progress``, ``Collection``,
``Subscription``) and the Spark reader (``register_spark_source``, ``read_collection``) are
imported on first use, so ``import shardsink`` stays light (the CLI
imports this package on every start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.catalog import (
    CatalogError,
    FencedError,
    IdReuseError,
    UnknownCollectionError,
    UnknownSinkError,
)
from shared.errors import (
    CodecError,
    CommandError,
    ConflictRetryError,
    ContractViolationError,
    ControllerNotFoundError,
    DecodeError,
    DeterminateError,
    EncodeError,
    FormatError,
    HistoryUnprovenError,
    IncompatibleSchemaError,
    IndeterminateError,
    InvalidUsageError,
    KafkaAdapterError,
    KafkaConfigError,
    KafkaDataLossError,
    KafkaDeliveryError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    NotReadableYetError,
    ObjectNotFoundError,
    ObjectStoreError,
    PreconditionFailedError,
    ReaderExpiredError,
    SchemaError,
    SchemaMismatchError,
    SchemaRegistryError,
    ShardDroppedError,
    ShardExistsError,
    ShardNotFoundError,
    ShardsinkError,
    SinceViolationError,
    SinkBaselineRequiredError,
    SinkProtocolError,
    StagedBatchExpiredError,
    StorageError,
    UnknownTopicError,
    UnknownIdError,
    UpperMismatchError,
)

if TYPE_CHECKING:
    from shared.io.client import Change, Collection, ErrorRow, Progress, Subscription, open_collection
    from shared.spark.shardsink_source import read_collection
    from shared.spark.shardsink_source import register_shardsink_source as register_spark_source

#: Names served lazily from ``shared.io.client`` (it imports boto3 and pyarrow).
_CLIENT = ("Change", "Collection", "ErrorRow", "Progress", "Subscription", "open_collection")
#: Names served lazily from ``shared.spark.shardsink_source`` (it imports pyspark).
_SPARK = {"read_collection": "read_collection", "register_spark_source": "register_shardsink_source"}

__all__ = [
    "Change",
    "Collection",
    "ErrorRow",
    "Progress",
    "Subscription",
    "open_collection",
    "read_collection",
    "register_spark_source",
    "CatalogError",
    "CodecError",
    "CommandError",
    "ConflictRetryError",
    "ContractViolationError",
    "ControllerNotFoundError",
    "DecodeError",
    "DeterminateError",
    "EncodeError",
    "FencedError",
    "FormatError",
    "HistoryUnprovenError",
    "IdReuseError",
    "IncompatibleSchemaError",
    "IndeterminateError",
    "InvalidUsageError",
    "KafkaAdapterError",
    "KafkaConfigError",
    "KafkaDataLossError",
    "KafkaDeliveryError",
    "KafkaTimeoutError",
    "KafkaUnavailableError",
    "NotReadableYetError",
    "ObjectNotFoundError",
    "ObjectStoreError",
    "PreconditionFailedError",
    "ReaderExpiredError",
    "SchemaError",
    "SchemaMismatchError",
    "SchemaRegistryError",
    "ShardDroppedError",
    "ShardExistsError",
    "ShardNotFoundError",
    "ShardsinkError",
    "SinceViolationError",
    "SinkBaselineRequiredError",
    "SinkProtocolError",
    "StagedBatchExpiredError",
    "StorageError",
    "UnknownCollectionError",
    "UnknownIdError",
    "UnknownSinkError",
    "UnknownTopicError",
    "UpperMismatchError",
]


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from shared.io import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    if name in _SPARK:
        from shared.spark import shardsink_source as spark_shardsink

        value = getattr(spark_shardsink, _SPARK[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardsink' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
