"""The write query's quarantine (the contract is in :mod:`services.write.service`'s
docstring, "Quarantine"): the supervisor's failure hook (:func:`on_write_failure`) counts the
failures of the same pending micro-batch on S3 and, after ``quarantine_after`` of them,
records its desired ranges in the sink's quarantine object; the restarted query reads them
back (:func:`load_quarantine`) and decodes their updates as error rows.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from services.runtime.checkpoints import checkpoint_path
from services.runtime.driver_state import CheckpointFiles, planned_offsets
from services.runtime.settings import ServiceSettings
from shared.catalog import SinkDef, add_sink_quarantine, count_sink_failure, sink_quarantine
from shared.kafka_offsets import offsets_from_json

log = logging.getLogger("shardsink.write")

#: Errors of the infrastructure or of the protocol: retried (with backoff), never quarantined.
_NOT_THE_INPUT = (
    "StorageError", "ObjectStoreError", "IndeterminateError", "PreconditionFailedError",
    "ConflictRetryError", "KafkaAdapterError", "KafkaUnavailableError", "KafkaTimeoutError",
    "KafkaDeliveryError", "KafkaDataLossError", "KafkaConfigError", "HistoryUnprovenError",
    "SinkProtocolError", "EndpointConnectionError", "ConnectionRefusedError", "MemoryError",
)


#: The note the write step adds to whatever it raises: the quarantine takes the partition from it.
_PARTITION_NOTE = re.compile(r"in writer partition (\d+) of write micro-batch (\d+)")


def load_quarantine(settings: ServiceSettings, sink: SinkDef) -> list[tuple[int, int, int, str]]:
    """``(partition, start, end, reason)`` of the sink's quarantined desired ranges."""
    return [
        (int(r["partition"]), int(r["start"]), int(r["end"]), str(r["reason"]))
        for r in sink_quarantine(settings.store(), sink.sink_id, sink.epoch)
        if r.get("topic") == sink.desired_topic
    ]


def is_input_failure(exc: Any) -> bool:
    """A failure raised by the write step's Python code that is not an infrastructure error."""
    text = str(exc)
    return "PythonException" in text and not any(name in text for name in _NOT_THE_INPUT)


def failure_reason(exc: Any) -> str:
    """The Python exception line of a failed query's error (``RuntimeError: ...``)."""
    text = str(exc)
    lines = [
        ln.strip() for ln in text.splitlines()
        if re.match(r"\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*:", ln)
        and not ln.strip().startswith(("org.", "java.", "scala.", "py4j.", "pyspark.errors"))
    ]
    return (lines[-1] if lines else (text.splitlines() or [""])[0])[:300]


def pending_batch(spark: Any, checkpoint: str) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """``(batch id, start offsets, end offsets)`` of the micro-batch a checkpoint planned and
    did not commit (Spark's offset log: ``offsets/<id>`` without ``commits/<id>``)."""
    files = CheckpointFiles(spark, checkpoint)
    planned, committed = files.ids("offsets"), files.ids("commits")
    if not planned or (committed and committed[-1] >= planned[-1]):
        return None
    last = planned[-1]
    start = (planned_offsets(files, last - 1) or {}) if last - 1 in planned else {}
    return last, start, planned_offsets(files, last) or {}


def on_write_failure(spark: Any, settings: ServiceSettings, sink: SinkDef, exc: Any) -> list[dict[str, Any]]:
    """The supervisor's failure hook of the write query: count failures of the same pending
    micro-batch (on S3, with the sink's quarantine record: the count survives a restart of
    the service) and, after ``quarantine_after`` of them, quarantine its desired ranges:
    those of the writer partitions the failure names (the write step notes its partition on
    what it raises), else all of the batch's. Returns the ranges quarantined now (empty when
    not yet, or not the input's fault)."""
    if settings.quarantine_after <= 0 or not is_input_failure(exc):
        return []
    pending = pending_batch(spark, checkpoint_path(settings, "write", sink))
    if pending is None:
        return []
    batch_id, start_json, end_json = pending
    reason = failure_reason(exc)
    store = settings.store()
    count = count_sink_failure(store, sink.sink_id, sink.epoch, batch_id, reason)
    if count < settings.quarantine_after:
        log.warning("write micro-batch %d failed %d time(s): %s", batch_id, count, reason, extra={"sink_id": sink.sink_id})
        return []
    start = offsets_from_json(start_json).get(sink.desired_topic, {})
    end = offsets_from_json(end_json).get(sink.desired_topic, {})
    named = {int(p) for p, b in _PARTITION_NOTE.findall(str(exc)) if int(b) == batch_id}
    ranges = [
        {"topic": sink.desired_topic, "partition": p, "start": start.get(p, 0), "end": e,
         "batch_id": batch_id, "failures": count, "reason": reason}
        for p, e in sorted(end.items())
        if e > start.get(p, 0) and (not named or p in named)
    ]
    if ranges:
        add_sink_quarantine(store, sink.sink_id, sink.epoch, ranges)
        log.error(
            "write micro-batch %d failed %d times on the same input: its desired ranges %s "
            "are quarantined to the error collection: %s", batch_id, count,
            [(r["partition"], r["start"], r["end"]) for r in ranges], reason,
            extra={"sink_id": sink.sink_id},
        )
    return ranges
