"""The write service's source: the Kafka source (``shardsink-kafka``) with the desired
topic's decode (:func:`services.sinkio.decode_partition`) run inside its ``read()``.

Each record then crosses from Python to the JVM once, already decoded, checked and routed to
its writer partition, instead of twice (the source's raw records, then a ``mapInArrow`` pass
in a second Python worker of the same task). Same options as ``shardsink-kafka``, plus
``shardsinkDecode`` (JSON: desired topic, row schema, writer partitions, quarantined ranges);
columns :data:`services.sinkio.ROUTED_DDL`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from services.sinkio import ROUTED_DDL, decode_partition
from shared.io.spark_kafka import KafkaDataSource, KafkaStreamReader, SourceOptions

DESIRED_SOURCE = "shardsink-desired"
DECODE_OPTION = "shardsinkDecode"


class DesiredStreamReader(KafkaStreamReader):
    def __init__(self, options: SourceOptions, decode: dict[str, Any]) -> None:
        super().__init__(options)
        self.decode = decode

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "decode": self.decode}

    def read(self, partition: Any) -> Iterator[pa.RecordBatch]:
        d = self.decode
        fn = decode_partition(
            d["desired_topic"], d["row_schema"], route_to=int(d["route_to"]),
            quarantine=[(int(p), int(s), int(e), str(r)) for p, s, e, r in d["quarantine"]],
        )
        return fn(iter(super().read(partition)))


class DesiredDataSource(KafkaDataSource):
    """``shardsink-desired``: a streaming reader only."""

    @classmethod
    def name(cls) -> str:
        return DESIRED_SOURCE

    def schema(self) -> str:
        return ROUTED_DDL

    def streamReader(self, schema: Any) -> DesiredStreamReader:
        low = {k.lower(): v for k, v in self.options.items()}
        return DesiredStreamReader(SourceOptions.parse(self.options), json.loads(low[DECODE_OPTION.lower()]))


def desired_source(
    desired_topic: str, row_schema_json: str, route_to: int, quarantine: list[tuple[int, int, int, str]] | None = None
) -> tuple[str, type[DesiredDataSource], dict[str, str]]:
    """The ``source`` argument of :func:`shared.io.spark_kafka.kafka_read_stream`."""
    decode = {"desired_topic": desired_topic, "row_schema": row_schema_json, "route_to": route_to,
              "quarantine": [list(q) for q in (quarantine or [])]}
    return DESIRED_SOURCE, DesiredDataSource, {DECODE_OPTION: json.dumps(decode)}
