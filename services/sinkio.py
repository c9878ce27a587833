"""I/O shared by the three sink services: the executor-side decode of Kafka micro-batches,
and the driver-side encode/produce of control messages (descs, batches, frontiers).

Decoding happens in the executors, one Spark task per Kafka partition (``mapInArrow``), so a
desired topic with N partitions is decoded by N parallel tasks; the driver receives compact
Arrow columns. Control topics are tiny; their raw values pass through and are decoded on the
driver.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

KIND_UPDATE = "update"
KIND_PROGRESS = "progress"
KIND_BAD = "bad"
KIND_CONTROL = "control"
#: History lost to retention (write service): ``frontier`` = first lost offset, ``time`` = the
#: first offset still available (see ``historyGapTopics`` in shared.io.spark_kafka).
KIND_GAP = "gap"

DECODED_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("kind", pa.string()),
        pa.field("row", pa.binary()),
        pa.field("time", pa.int64()),  # u64 as two's complement (Spark has no unsigned long)
        pa.field("diff", pa.int64()),
        pa.field("frontier", pa.int64()),  # null with frontier_closed: the empty frontier
        pa.field("frontier_closed", pa.bool_()),
        pa.field("error", pa.string()),
        pa.field("value", pa.binary()),
    ]
)

DECODED_DDL = (
    "topic string, partition int, offset long, kind string, row binary, time long, diff long, "
    "frontier long, frontier_closed boolean, error string, value binary"
)


def _signed(t: int) -> int:
    return t - 2**64 if t >= 2**63 else t


def decode_partition(
    desired_topic: str,
    row_schema_json: str | None = None,
    *,
    progress_only: bool = False,
    route_to: int | None = None,
    quarantine: list[tuple[int, int, int, str]] | None = None,
    executor: bool = True,
    only_wp: int | None = None,
) -> Any:
    """A ``mapInArrow`` function decoding desired messages of ``desired_topic``.

    With ``row_schema_json`` (the collection's row schema), each update's row is also checked
    against the schema and re-encoded canonically with its current version
    (``RowCodec.canonical``); a row that does not decode, or holds a value the collection
    cannot hold (an ``int`` beyond 32 bits, an enum index out of range, a decimal beyond its
    precision), becomes a ``bad`` record that keeps its time and diff and names its source
    offset and the reason, so the error lands in the error collection at its time.

    With ``progress_only`` (the mint service), updates are dropped without being decoded: a
    message framed with the current desired schema whose union index byte (right after the
    10-byte single-object header) is 0 is an update. Everything else is decoded as usual.

    With ``route_to`` (the write service: its number of writer partitions), every output row
    starts with ``wp``, the writer partition it goes to: a desired record goes to its topic
    partition, a control record (description) is copied to every partition (to ``only_wp``
    alone when the input is that partition's: the write source reads the control range once
    per writer partition), and a history-gap marker of the source becomes a ``gap`` record
    (input with ``headers``). Nulls stay nulls (a ``time`` or ``diff`` a record does not have).

    ``quarantine``: ``(partition, start, end, reason)`` ranges of the desired topic whose
    updates become ``bad`` records at their own time and diff (the write service's quarantine
    of a micro-batch that kept failing); the error names the offset, the reason and the row.

    ``executor``: the function runs in a Spark worker (it settles the worker's heap first,
    :mod:`shared.io.worker_heap`); False when it runs on the driver.
    """

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import json

        from shared.codec import MARKER, RowCodec, message_codec
        from shared.desired import DesiredProgress, decode_desired
        from shared.errors import DecodeError
        if executor:
            from shared.io.worker_heap import settle

            settle()
        row_codec = RowCodec(json.loads(row_schema_json)) if row_schema_json else None
        update_prefix = MARKER + message_codec("desired").fingerprint + b"\x00"
        out_schema = ROUTED_SCHEMA if route_to is not None else DECODED_SCHEMA

        for rb in batches:
            topics = rb.column("topic").to_pylist()
            parts = rb.column("partition").to_pylist()
            offs = rb.column("offset").to_pylist()
            vals = rb.column("value").to_pylist()
            heads = rb.column("headers") if "headers" in rb.schema.names else None
            cols: dict[str, list[Any]] = {f.name: [] for f in out_schema}
            for i, (topic, part, off, val) in enumerate(zip(topics, parts, offs, vals, strict=True)):
                row = tm = diff = fr = err = raw = None
                closed = False
                if topic != desired_topic:
                    kind, raw = KIND_CONTROL, val
                elif val is None and heads is not None and _gap(heads[i].as_py()) is not None:
                    kind = KIND_GAP
                    fr, tm = _gap(heads[i].as_py())  # type: ignore[misc]
                elif progress_only and val is not None and val[:11] == update_prefix:
                    continue
                else:
                    try:
                        msg = decode_desired(val if val is not None else b"")
                    except DecodeError as e:
                        kind, err = KIND_BAD, f"undecodable desired message at {topic}/{part}@{off}: {e}"
                    else:
                        if isinstance(msg, DesiredProgress):
                            kind = KIND_PROGRESS
                            closed = msg.frontier.is_empty()
                            fr = None if closed else _signed(msg.frontier.time or 0)
                        else:
                            kind, row, tm, diff = KIND_UPDATE, msg.row, _signed(msg.time), msg.diff
                            if row_codec is not None:
                                try:
                                    # Decoded, checked for values the shard cannot hold (an
                                    # int beyond 32 bits...) and re-encoded canonically: the
                                    # same bytes the shard's read-back encodes to.
                                    row = row_codec.canonical(msg.row)
                                except DecodeError as e:
                                    kind, row = KIND_BAD, None
                                    err = f"row does not match the collection schema at {topic}/{part}@{off}: {e}"
                            if kind == KIND_UPDATE and quarantine:
                                why = next((q[3] for q in quarantine if q[0] == part and q[1] <= off < q[2]), None)
                                if why is not None:
                                    kind, err = KIND_BAD, _quarantined(topic, part, off, why, row, row_codec)
                                    row = None
                copies: list[int | None] = [None]
                if route_to is not None:
                    if kind == KIND_CONTROL:
                        copies = list(range(route_to)) if only_wp is None else [only_wp]
                    else:
                        copies = [part]
                for wp in copies:
                    if wp is not None:
                        cols["wp"].append(wp)
                    for name, v in (
                        ("topic", topic), ("partition", part), ("offset", off), ("kind", kind),
                        ("row", row), ("time", tm), ("diff", diff), ("frontier", fr),
                        ("frontier_closed", closed), ("error", err), ("value", raw),
                    ):
                        cols[name].append(v)
            yield pa.RecordBatch.from_pydict(cols, schema=out_schema)

    return fn


ROUTED_SCHEMA = pa.schema([pa.field("wp", pa.int32()), *DECODED_SCHEMA])
ROUTED_DDL = "wp int, " + DECODED_DDL


def _quarantined(topic: str, part: int, off: int, why: str, row: bytes | None, codec: Any) -> str:
    import json

    shown = "?"
    if row is not None and codec is not None:
        try:
            shown = json.dumps(codec.decode(row), default=str, sort_keys=True)[:2000]
        except Exception:  # noqa: BLE001 - the error row is written whatever the row holds
            shown = row.hex()[:2000]
    return f"quarantined at {topic}/{part}@{off} after repeated write failures ({why}): row {shown}"


def _gap(headers: Any) -> tuple[int, int] | None:
    """``(first lost offset, first available offset)`` of a source's history-gap marker."""
    from shared.io.spark_kafka import HISTORY_GAP_HEADER

    for h in headers or ():
        if h["key"] == HISTORY_GAP_HEADER:
            lo, hi = bytes(h["value"]).decode().split("-")
            return int(lo), int(hi)
    return None


def collect_decoded(
    df: Any,
    desired_topic: str | None,
    *,
    row_schema_json: str | None = None,
    progress_only: bool = False,
    on_driver: bool = False,
) -> pa.Table:
    """Decode a micro-batch DataFrame of the Kafka source and bring it to the driver, sorted
    by (topic, partition, offset) so that per-partition order is kept.

    ``on_driver``: bring the raw records and decode them here (for inputs of a few control
    messages: no Python UDF pass on the executors, one task fewer per record batch); else
    decode on the executors (``mapInArrow``)."""
    src = df.select("topic", "partition", "offset", "value")
    if on_driver and row_schema_json is None:
        return decode_on_driver(src.toArrow(), desired_topic, progress_only=progress_only)
    else:
        fn = decode_partition(desired_topic or "\0none", row_schema_json, progress_only=progress_only)
        table = src.mapInArrow(fn, DECODED_DDL).toArrow()
    if table.num_rows:
        table = table.sort_by([("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")])
    return table


def read_planned_batch(
    files: Any, batch_id: int, kafka: Any, skip_prefixes: Mapping[str, bytes] | None = None
) -> pa.Table | None:
    """The records of micro-batch ``batch_id`` of a query reading ``shardsink-kafka``, read on
    the driver straight from Kafka by the offsets Spark logged for the batch and the one before
    it (``files``: the query's :class:`services.driver_state.CheckpointFiles`), without running
    a Spark job: for the control messages of mint and append, a job (planning, a task, a Python
    worker round trip) costs 100-400 ms for a handful of records, a pooled consumer's read a few
    milliseconds. The source reads exactly these ranges too, so the records are the same.
    Columns ``topic, partition, offset, value``; ``skip_prefixes`` as the source's
    ``skipValuePrefixes``. None when the log does not hold both offsets (the first batch of a
    checkpoint starts at the source's initial offsets, which Spark does not log): read the
    batch's DataFrame then."""
    from services.driver_state import planned_offsets
    from shared.io.spark_kafka import offsets_from_json, pending, read_range

    end = planned_offsets(files, batch_id)
    start = planned_offsets(files, batch_id - 1) if batch_id > 0 else None
    if end is None or start is None:
        return None
    skip = skip_prefixes or {}
    batches = [
        b.select(["topic", "partition", "offset", "value"])
        for t, p, lo, hi in pending(offsets_from_json(start), offsets_from_json(end))
        for b in read_range(kafka, t, p, lo, hi, skip_prefix=skip.get(t))
    ]
    if not batches:
        return pa.table({"topic": pa.array([], pa.string()), "partition": pa.array([], pa.int32()),
                         "offset": pa.array([], pa.int64()), "value": pa.array([], pa.binary())})
    return pa.Table.from_batches(batches)


def decode_on_driver(
    raw: pa.Table, desired_topic: str | None, *, progress_only: bool = False
) -> pa.Table:
    """:func:`decode_partition` run on the driver over a few raw records, sorted by (topic,
    partition, offset)."""
    fn = decode_partition(desired_topic or "\0none", None, progress_only=progress_only, executor=False)
    table = pa.Table.from_batches(list(fn(iter(raw.to_batches()))), schema=DECODED_SCHEMA)
    if table.num_rows:
        table = table.sort_by([("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")])
    return table


def u64(v: int | None) -> int | None:
    return None if v is None else v & (2**64 - 1)


class ControlProducer:
    """Produces control messages (descs, batches, frontiers) from a driver; :meth:`flush` is
    called before the micro-batch that decided them commits, and raises if any failed."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self._errors: list[Any] = []

    @staticmethod
    def create(kafka_settings: Any, client_id: str) -> ControlProducer:
        from confluent_kafka import Producer

        from services.common import faults_from_env

        import logging

        # librdkafka's own log lines go through Python logging (delivered on poll/flush) rather
        # than straight to stderr, so a producer outliving its broker does not spam the console.
        conf = kafka_settings.config(
            **{
                "enable.idempotence": True,
                "client.id": client_id,
                "linger.ms": 2,
                "logger": logging.getLogger("shardsink.kafka.client"),
            }
        )
        faults = faults_from_env()  # test only (SHARDSINK_FAULTS): injected delivery errors
        producer = Producer(conf)
        return ControlProducer(faults.wrap_producer(producer) if faults is not None else producer)

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(err)

    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, on_delivery=self._on_delivery)
                return
            except BufferError:
                self.producer.poll(0.05)

    def flush(self, timeout_s: float = 30.0) -> None:
        from shared.errors import KafkaAdapterError

        deadline = time.monotonic() + timeout_s
        while self.producer.flush(0.5) > 0:
            if time.monotonic() > deadline:
                raise KafkaAdapterError(f"expected control messages delivered within {timeout_s}s, found some pending")
        if self._errors:
            errs, self._errors = self._errors, []
            raise KafkaAdapterError(f"expected control messages delivered, found errors: {errs[:3]}")
