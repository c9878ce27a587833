"""What the write query's driver hands its executors, and what they hand back: the
:class:`WriteJob` a writer partition's task runs (pickled to the executors inside the write
source, :mod:`services.write.source`) and the rows of the step's output
(:data:`OUTPUT_DDL`), the one shape the executor step (:mod:`services.write.executor`), the
source and the driver (:mod:`services.write.driver`) share."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from services.runtime.settings import ServiceSettings
from shared.catalog import SinkDef

#: One row per writer partition per micro-batch: reports to produce, refusals, statistics.
OUTPUT_DDL = "wp int, kind string, body string"
OUTPUT_SCHEMA = pa.schema([pa.field("wp", pa.int32()), pa.field("kind", pa.string()), pa.field("body", pa.string())])


def report_message(body: str) -> bytes:
    """The ``batches`` message of a ``report`` row's body (the executor that produces it and
    the driver that produces what the executor could not encode it the same way)."""
    import json

    from shared.codec import message_codec
    from shared.sink_messages import BatchReport

    return message_codec("written_batch").encode(BatchReport.from_dict(json.loads(body)).to_dict())


@dataclass(frozen=True)
class WriteJob:
    """What a writer partition's task needs (pickled to the executors)."""

    sink: SinkDef
    settings: ServiceSettings
    partitions: int
    schema_json: str
    descs_topic: str
    #: The query's checkpoint: the writer partitions' state versions live under it.
    checkpoint: str
