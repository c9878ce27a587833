"""The append service's source: the Kafka source (``shardsink-kafka``) over ``descs`` and
``batches``, whose admission control holds ``descs`` back until reports arrive.

A description alone asks nothing of the appender but to remember it: the appender acts when
the writers' reports come, and every report's description was on ``descs`` before the report
(a writer reads the description before it stages and reports). Yet each trigger that finds a
new description would run a micro-batch for it alone, one per description, as many as the
micro-batches that append (about 40 ms of CPU each on this project's 2-core machines). So
``latestOffset`` admits the records of ``descs`` together with news on ``batches`` (a micro-batch
absorbs its descriptions before its reports), or at least every
:data:`shared.spark.kafka_source.ADMIT_EVERY_S` (:class:`shared.spark.holding_source.HoldingStreamReader`): a
description that no report follows (its writers are down, or it only moves the shard's upper
to its lower) still reaches the appender within that time. Holding only ever delays records.

Same options as ``shardsink-kafka``, plus ``shardsinkHeldTopic`` (the topic held back).
"""

from __future__ import annotations

from typing import Any

from shared.spark.holding_source import HoldingStreamReader
from shared.spark.kafka_source import SourceOptions
from shared.spark.kafka_connector import KafkaDataSource

APPEND_SOURCE = "shardsink-append"
HOLD_OPTION = "shardsinkHeldTopic"


class AppendDataSource(KafkaDataSource):
    """``shardsink-append``: a streaming reader only."""

    @classmethod
    def name(cls) -> str:
        return APPEND_SOURCE

    def streamReader(self, schema: Any) -> HoldingStreamReader:
        low = {k.lower(): v for k, v in self.options.items()}
        return HoldingStreamReader(SourceOptions.parse(self.options), held=str(low[HOLD_OPTION.lower()]))


def append_source(descs_topic: str) -> tuple[str, type[AppendDataSource], dict[str, str]]:
    """The ``source`` argument of :func:`shared.spark.kafka_connector.kafka_read_stream`."""
    return APPEND_SOURCE, AppendDataSource, {HOLD_OPTION: descs_topic}
