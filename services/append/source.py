"""The append service's source: the Kafka source (``shardsink-kafka``) over ``descs`` and
``batches``, whose admission control holds ``descs`` back until reports arrive.

A description alone asks nothing of the appender but to remember it: the appender acts when
the writers' reports come, and every report's description was on ``descs`` before the report
(a writer reads the description before it stages and reports). Yet each trigger that finds a
new description would run a micro-batch for it alone, one per description, as many as the
micro-batches that append (about 40 ms of CPU each on this project's 2-core machines). So
``latestOffset`` admits the records of ``descs`` together with news on ``batches`` (a micro-batch
absorbs its descriptions before its reports), or at least every :data:`ADMIT_EVERY_S`: a
description that no report follows (its writers are down, or it only moves the shard's upper
to its lower) still reaches the appender within that time. Holding only ever delays records.

Same options as ``shardsink-kafka``, plus ``shardsinkHeldTopic`` (the topic held back).
"""

from __future__ import annotations

import time
from typing import Any

from shared.io.spark_kafka import (
    KafkaDataSource,
    KafkaStreamReader,
    SourceOptions,
    held_back,
    news_beside,
    offsets_from_json,
    offsets_to_json,
)

APPEND_SOURCE = "shardsink-append"
HOLD_OPTION = "shardsinkHeldTopic"
#: Without reports, the descriptions are admitted at least this often.
ADMIT_EVERY_S = 1.0


class AppendStreamReader(KafkaStreamReader):
    def __init__(self, options: SourceOptions, held: str) -> None:
        super().__init__(options)
        self.held = held
        self._admitted = float("-inf")

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "held": self.held, "_admitted": float("-inf")}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        end_json = super().latestOffset(start, limit)
        now = time.monotonic()
        s, end = offsets_from_json(start), offsets_from_json(end_json)
        if now - self._admitted >= ADMIT_EVERY_S or news_beside(s, end, self.held):
            self._admitted = now
            return end_json
        return offsets_to_json(held_back(s, end, self.held))


class AppendDataSource(KafkaDataSource):
    """``shardsink-append``: a streaming reader only."""

    @classmethod
    def name(cls) -> str:
        return APPEND_SOURCE

    def streamReader(self, schema: Any) -> AppendStreamReader:
        low = {k.lower(): v for k, v in self.options.items()}
        return AppendStreamReader(SourceOptions.parse(self.options), str(low[HOLD_OPTION.lower()]))


def append_source(descs_topic: str) -> tuple[str, type[AppendDataSource], dict[str, str]]:
    """The ``source`` argument of :func:`shared.io.spark_kafka.kafka_read_stream`."""
    return APPEND_SOURCE, AppendDataSource, {HOLD_OPTION: descs_topic}
