"""The Kafka source for Spark Structured Streaming, without the ``spark-sql-kafka`` jar.

Built on PySpark's Python Data Source API (``pyspark.sql.datasource``) over confluent-kafka:
:class:`KafkaStreamReader` is the reader of the ``shardsink-kafka`` data source
(:mod:`shared.spark.kafka_connector`, which registers it, with the sink of
:mod:`shared.spark.kafka_sink`); its offset arithmetic is :mod:`shared.kafka_offsets`.

Options: ``bootstrap``; ``topics`` (comma list) or ``topic``; ``startingOffsets``
(``earliest`` (default), ``latest`` or JSON ``{"topic": {"0": 12, "1": -2}}`` where -2 means
earliest and -1 latest; partitions the JSON leaves out start at the earliest offset);
``maxRecordsPerTrigger`` (admission control: Spark 4.2+ calls ``latestOffset(start, limit)``
with ``ReadMaxRows``, shared among partitions in proportion to their backlog; ``availableNow``
triggers are supported and stop at the ends seen when the query started);
``failOnDataLoss`` (default true: records of a planned range deleted by retention fail the
batch); ``recordsPerArrowBatch`` (default 20000); ``kafka.<librdkafka option>`` passed through
(SASL/TLS: see :mod:`shared.io.kafka`).

``historyGapTopics`` (comma list): for these topics the source says when history is missing
instead of failing or skipping silently. A fresh query starts them at offset 0 (not at the
low watermark), and every micro-batch compares its start offsets with the partitions' low
watermarks: offsets ``[start, low)`` that retention deleted are skipped, and the partition's
range begins with one marker record (``value`` null, ``offset`` = the first lost offset, header
``shardsink-history-gap`` = ``"<from>-<to>"``). The write service uses it to prove, or refuse
to assume, that it saw the whole desired history (retention safety).
``skipValuePrefixes`` (``topic=hex`` pairs, comma list): records of ``topic`` whose value
starts with those bytes are dropped inside ``read()``, on the executor, before they become
rows (their offsets still count as read). The mint service uses it to drop desired updates
(it needs only progress statements) without shipping them through Spark.
``waitForRecordsMs`` (default 0): a ``latestOffset`` that finds nothing to read waits up to
this long for a record on the partitions whose records may make a micro-batch (at the ends
it just found, :meth:`shared.io.kafka.OffsetProbe.await_records`: a fetch the broker holds
until a record arrives), then looks again, and waits on for the rest of that time while the
look still finds nothing to read. A micro-batch then starts a few milliseconds after
the record that calls for it instead of at the next trigger (on average half a trigger
interval later, plus a look), and an idle query looks once per wait instead of once per
trigger. Spark's trigger loop goes on at once after a look that took longer than its
interval, so the trigger interval then only bounds how often micro-batches start back to
back. No wait at an ``availableNow`` trigger.
``simulatedLowWatermarksFile`` (tests only): a JSON file ``{topic: {partition: offset}}``
read at every micro-batch; the source treats those offsets as the partitions' low watermarks
(as if retention had deleted the records below them), because the embedded broker (Tansu)
rejects DeleteRecords.

Offsets in the checkpoint are JSON ``{topic: {partition: next_offset}}`` (keys starting with
``@`` are annotations of sources built on this one, not topics). latestOffset re-reads the
topics' partitions (a topic's list is kept :data:`PARTITIONS_TTL_S`; a topic listed but not
yet created is looked up every time), so partitions and topics that appear later are picked
up, starting at offset 0. Ends are found with
:class:`shared.io.kafka.OffsetProbe` (correct on Tansu, whose ListOffsets under-reports).
A micro-batch's non-empty topic-partition ranges are packed into tasks of at least
``minRecordsPerTask`` records (default 10000; at most one task per range, each range whole in
one task): a task costs a Python worker round trip whatever it reads, so a micro-batch of a
few control messages is one task, and a catch-up is one task per partition. ``read()``
``assign()``s each partition at ``start`` and returns exactly the records with offsets in
``[start, end)`` as pyarrow RecordBatches, range after range, so a replayed micro-batch reads
the same records.

Columns: ``key binary, value binary, topic string, partition int, offset long,
timestamp timestamp, headers array<struct<key string, value binary>>`` (``headers`` is null
for a record without headers; ``timestamp`` is null when the broker gives none).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from shared.errors import (
    KafkaAdapterError,
    KafkaConfigError,
    KafkaDataLossError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    UnknownTopicError,
)
from shared.io.kafka import KafkaSettings, OffsetProbe, consumer_pool_key, new_consumer, translate
from shared.kafka_offsets import (
    Offsets,
    advance,
    cap,
    offsets_from_json,
    offsets_to_json,
    pending,
)
from shared.spark.consumer_pool import close_pooled_consumers as close_pooled_consumers  # the pool's, re-exported
from shared.spark.consumer_pool import give_back, take_pooled
from shared.spark.consumer_pool import pooled_consumers as pooled_consumers
from shared.spark.kafka_common import HEADER_TYPE, bool_option, int_option
from shared.spark.worker_heap import settle

KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("headers", HEADER_TYPE),
    ]
)


#: How long a streaming source keeps a topic's partition list before it looks it up again:
#: partitions added to a topic are read from their first offset within this time.
PARTITIONS_TTL_S = 5.0
#: While the brokers cannot be reached, ``latestOffset`` looks again this often at most.
UNREACHABLE_PAUSE_S = 0.5


def _parse_starting(value: str) -> str | Offsets:
    v = value.strip()
    if v.lower() in ("earliest", "latest"):
        return v.lower()
    try:
        return offsets_from_json(json.loads(v))
    except json.JSONDecodeError as e:
        raise KafkaConfigError(
            f"expected startingOffsets 'earliest', 'latest' or JSON, found {value!r}"
        ) from e


@dataclass(frozen=True, slots=True)
class SourceOptions:
    settings: KafkaSettings
    topics: tuple[str, ...]
    starting: str | Offsets = "earliest"
    max_records_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    records_per_arrow_batch: int = 20_000
    timeout_s: float = 60.0
    history_gap_topics: tuple[str, ...] = ()
    simulated_low_watermarks_file: str | None = None
    skip_value_prefixes: tuple[tuple[str, bytes], ...] = ()
    #: A micro-batch's ranges are packed into tasks of at least this many records (one task per
    #: topic-partition at most): a task costs a Python worker round trip whatever it reads.
    min_records_per_task: int = 10_000
    #: ``latestOffset`` that finds nothing to read waits up to this long for a record (0: answers
    #: at once); see the module docstring.
    wait_for_records_ms: int = 0

    @staticmethod
    def parse(options: Mapping[str, str]) -> SourceOptions:
        opts = {k: v for k, v in options.items()}
        low = {k.lower(): v for k, v in opts.items()}
        raw = low.get("topics") or low.get("topic") or low.get("subscribe") or ""
        topics = tuple(t.strip() for t in str(raw).split(",") if t.strip())
        if not topics:
            raise KafkaConfigError(
                "expected option 'topics' (comma list) or 'topic', found none among "
                f"{sorted(opts)}"
            )
        return SourceOptions(
            settings=KafkaSettings.from_options(opts),
            topics=topics,
            starting=_parse_starting(str(low.get("startingoffsets", "earliest"))),
            max_records_per_trigger=int_option(low, "maxrecordspertrigger", None)
            or int_option(low, "maxoffsetspertrigger", None),
            fail_on_data_loss=bool_option(low, "failondataloss", True),
            records_per_arrow_batch=int_option(low, "recordsperarrowbatch", 20_000) or 20_000,
            timeout_s=float(low.get("timeoutseconds", 60.0)),
            history_gap_topics=tuple(
                t.strip() for t in str(low.get("historygaptopics", "")).split(",") if t.strip()
            ),
            simulated_low_watermarks_file=low.get("simulatedlowwatermarksfile") or None,
            skip_value_prefixes=_parse_prefixes(str(low.get("skipvalueprefixes", ""))),
            min_records_per_task=int_option(low, "minrecordspertask", 10_000) or 10_000,
            wait_for_records_ms=int_option(low, "waitforrecordsms", 0, least=0) or 0,
        )

    def skip_prefix(self, topic: str) -> bytes | None:
        for t, prefix in self.skip_value_prefixes:
            if t == topic:
                return prefix
        return None


def _parse_prefixes(raw: str) -> tuple[tuple[str, bytes], ...]:
    out = []
    for item in raw.split(","):
        if not item.strip():
            continue
        topic, sep, hexed = item.strip().rpartition("=")
        try:
            prefix = bytes.fromhex(hexed)
        except ValueError:
            prefix = b""
        if not sep or not topic or not prefix:
            raise KafkaConfigError(
                f"expected option 'skipValuePrefixes' as comma-separated topic=hex pairs, found {item!r}"
            )
        out.append((topic, prefix))
    return tuple(out)


class KafkaInputPartition(InputPartition):
    """One topic-partition's offset range ``[start, end)`` of a micro-batch."""

    def __init__(
        self, topic: str, partition: int, start: int, end: int, lost_from: int | None = None
    ) -> None:
        super().__init__((topic, partition, start, end, lost_from))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end
        #: offsets ``[lost_from, start)`` were deleted by retention (historyGapTopics only)
        self.lost_from = lost_from


class KafkaRangesPartition(InputPartition):
    """Several topic-partitions' ranges read one after the other by one task."""

    def __init__(self, ranges: Sequence[KafkaInputPartition]) -> None:
        super().__init__(tuple(r.value for r in ranges))
        self.ranges = tuple(ranges)


def pack_ranges(ranges: Sequence[KafkaInputPartition], min_records: int) -> list[InputPartition]:
    """Tasks for a micro-batch's ranges: ``ceil(records / min_records)`` of them (at least one,
    at most one per range), each range whole in one task, the largest ranges first into the
    emptiest task (so tasks are about even). A single range stays a plain partition."""
    if len(ranges) <= 1:
        return list(ranges)
    total = sum(r.end - r.start for r in ranges)
    tasks = max(1, min(len(ranges), -(-total // max(1, min_records))))
    if tasks == len(ranges):
        return list(ranges)
    bins: list[list[KafkaInputPartition]] = [[] for _ in range(tasks)]
    sizes = [0] * tasks
    for r in sorted(ranges, key=lambda r: (-(r.end - r.start), r.topic, r.partition)):
        i = sizes.index(min(sizes))
        bins[i].append(r)
        sizes[i] += r.end - r.start
    out: list[InputPartition] = []
    for b in bins:
        b.sort(key=lambda r: (r.topic, r.partition))
        out.append(b[0] if len(b) == 1 else KafkaRangesPartition(b))
    return out


#: The module Spark runs a stream reader's driver-side methods in (one process per source).
_SOURCE_RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"


def exit_if_spark_stopped_the_runner() -> None:
    """Called from :meth:`KafkaStreamReader.stop`. The JVM stops a source's runner process by
    closing its socket: the runner, waiting for the next call, reads EOF, calls ``stop()``,
    then reports the EOF as a failure over the socket that is gone, and prints the resulting
    ``BrokenPipeError`` traceback (three chained tracebacks) on the service's stderr, at each
    stop of a query that finds it waiting (a dropped or re-created sink, a restart). There is
    nobody left to report to and nothing left to read: in that case, and only then (EOF in
    flight, in that runner), the process ends here, quietly. Any other failure is reported
    as Spark reports it."""
    if sys.exc_info()[0] is not EOFError:
        return
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) != _SOURCE_RUNNER:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side: ``initialOffset``, ``latestOffset``, ``partitions``, ``commit`` run in one
    long-lived Python process per query, so the probe and its cache live on ``self``.
    Executor side: ``read`` runs on an unpickled copy without the probe."""

    #: Read only values and offsets (keys, timestamps and headers null): see :func:`read_range`.
    values_only = False
    #: A wait for records goes in slices of this long, :meth:`wait_ended` asked between them (None: one wait).
    wait_slice_s: float | None = None

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._probe: OffsetProbe | None = None
        self._target: Offsets | None = None  # availableNow: do not read beyond this
        self._latest: Offsets | None = None
        self._partitions: dict[str, tuple[float, list[int]]] = {}
        self._unreachable: KafkaAdapterError | None = None  # the error of the last look, if it failed

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_probe": None, "_target": None, "_latest": None, "_partitions": {}, "_unreachable": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- driver side -------------------------------------------------------------------------
    def _p(self) -> OffsetProbe:
        if self._probe is None:
            self._probe = OffsetProbe(self.options.settings, self.options.timeout_s)
        return self._probe

    def _parts(self, topic: str) -> list[int]:
        """The partitions of ``topic``, looked up again once :data:`PARTITIONS_TTL_S` passed
        (a metadata request per topic at every trigger of every query was about a tenth of
        the source runners' CPU); none while the topic does not exist (picked up once it
        does)."""
        now = time.monotonic()
        known = self._partitions.get(topic)
        if known is not None and now - known[0] < PARTITIONS_TTL_S:
            return known[1]
        try:
            parts = self._p().partitions_of(topic)
        except UnknownTopicError:
            self._partitions.pop(topic, None)
            return []
        self._partitions[topic] = (now, parts)
        return parts

    def _tps(self, topics: Iterable[str]) -> list[tuple[str, int]]:
        """Every partition of ``topics`` (:meth:`_parts`), as ``(topic, partition)``. When
        several topics' lists are due, one metadata request for the cluster's topics renews
        them all (a shared source reads a topic per sink: at 100 sinks, one request per topic
        every :data:`PARTITIONS_TTL_S` was 20 metadata requests a second per source)."""
        topics = list(topics)
        now = time.monotonic()
        due = [t for t in dict.fromkeys(topics)
               if (known := self._partitions.get(t)) is None or now - known[0] >= PARTITIONS_TTL_S]
        if len(due) > 1:
            found = self._p().partitions_of_many(due)
            for t in due:
                if t in found:
                    self._partitions[t] = (now, found[t])
                else:
                    self._partitions.pop(t, None)  # not created yet: looked up again next time
            return [(t, p) for t in topics for p in (self._partitions[t][1] if t in self._partitions else [])]
        return [(t, p) for t in topics for p in self._parts(t)]

    def latest_ends(self) -> Offsets:
        """The true end of every partition of every topic."""
        tps = self._tps(self.options.topics)
        ends = self._p().ends(tps)
        out: Offsets = {t: {} for t in self.options.topics}
        for (t, p), e in ends.items():
            out[t][p] = e
        return out

    def initialOffset(self) -> dict[str, Any]:
        starting = self.options.starting
        if starting == "latest":
            return offsets_to_json(self.latest_ends())
        earliest: Offsets = {}
        for t in self.options.topics:
            parts = self._parts(t)
            if t in self.options.history_gap_topics:
                earliest[t] = {p: 0 for p in parts}  # lost history shows in the first batch
                continue
            wm = self._p().watermarks([(t, p) for p in parts], earliest=True)
            earliest[t] = {p: wm[(t, p)] for p in parts}
        if starting == "earliest":
            return offsets_to_json(earliest)
        assert isinstance(starting, dict)
        latest = self.latest_ends() if any(v == -1 for ps in starting.values() for v in ps.values()) else {}
        out: Offsets = {t: dict(ps) for t, ps in earliest.items()}
        for t, ps in starting.items():
            for p, v in ps.items():
                if v == -2:
                    v = earliest.get(t, {}).get(p, 0)
                elif v == -1:
                    v = latest.get(t, {}).get(p, 0)
                elif v < 0:
                    raise KafkaConfigError(
                        f"expected an offset >= 0, -1 (latest) or -2 (earliest) for {t}/{p}, "
                        f"found {v}"
                    )
                out.setdefault(t, {})[p] = v
        return offsets_to_json(out)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.latest_ends()

    def low_watermarks(self) -> Offsets:
        """The first available offset of every partition of the history-gap topics (with the
        simulated ones of ``simulatedLowWatermarksFile`` where higher)."""
        out: Offsets = {}
        topics = self.options.history_gap_topics
        if not topics:
            return out
        tps = self._tps(topics)
        for (t, p), o in self._p().watermarks(tps, earliest=True).items():
            out.setdefault(t, {})[p] = o
        path = self.options.simulated_low_watermarks_file
        if path and os.path.exists(path):
            with open(path) as f:
                sim = json.load(f)
            for t, ps in sim.items():
                for p, o in ps.items():
                    cur = out.setdefault(t, {})
                    cur[int(p)] = max(int(o), cur.get(int(p), 0))
        return out

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next micro-batch; ``start`` (none) while the brokers cannot be reached:
        a network partition holds the query instead of failing it (a restart costs far more)."""
        s = offsets_from_json(start)
        try:
            end = self.next_end(s, limit)
            budget, t0 = self.wait_budget(), time.perf_counter()  # (a test may freeze time.monotonic)
            # A record that ends a wait may still make no micro-batch (one a holding reader
            # holds back): the look after it waits on, within the same budget. The wait goes
            # in slices; between them a change that is not a record ends it too.
            while not pending(s, end):
                left = budget - (time.perf_counter() - t0)
                if left <= 0:
                    break
                wait = left if self.wait_slice_s is None else min(left, self.wait_slice_s)
                if self._p().await_records(self.watched(), wait) or self.wait_ended():
                    end = self.next_end(s, limit)  # the probe's ends take what the wait's fetch saw
        except (KafkaUnavailableError, KafkaTimeoutError) as e:
            if self._unreachable is None:
                print(f"shardsink-kafka: brokers unreachable, no micro-batch until they answer: {e}", file=sys.stderr)
            self._unreachable = e
            time.sleep(UNREACHABLE_PAUSE_S)
            return offsets_to_json(s)
        self._unreachable = None
        return offsets_to_json(end)

    def next_end(self, s: Offsets, limit: ReadLimit) -> Offsets:
        """The end of the next micro-batch from ``s`` (``s`` itself: no micro-batch yet)."""
        return self._end(s, limit)

    def wait_budget(self) -> float:
        """How long ``latestOffset`` may wait for a record when it finds nothing to read."""
        if self._target is not None:
            return 0.0  # availableNow: the query stops at its target instead
        return self.options.wait_for_records_ms / 1000.0

    def wait_ended(self) -> bool:
        """Whether something other than a record calls for a new look during a wait for
        records (this reader: nothing)."""
        return False

    def watched(self) -> dict[tuple[str, int], int]:
        """The partitions whose next record makes a micro-batch, at the ends last seen."""
        return {(t, p): e for t, ps in (self._latest or {}).items() for p, e in ps.items()}

    def _end(self, s: Offsets, limit: ReadLimit) -> Offsets:
        """The end of the next micro-batch from ``s``: every record there is (up to the
        availableNow target), capped by ``limit``."""
        if self.options.history_gap_topics:
            # Lost offsets are no records: admission control counts from the low watermark.
            lows = self.low_watermarks()
            s = {
                t: {p: max(o, lows.get(t, {}).get(p, 0)) for p, o in ps.items()}
                for t, ps in s.items()
            }
        latest = self.latest_ends()
        if self._target is not None:
            target = self._target
            latest = {
                t: {p: min(e, target[t][p]) for p, e in ps.items() if p in target.get(t, {})}
                for t, ps in latest.items()
            }
        self._latest = latest
        end = advance(s, latest)
        if isinstance(limit, ReadMaxRows):
            end = cap(s, end, int(limit.max_rows))
        return end

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return offsets_to_json(self._latest) if self._latest is not None else None

    def input_ranges(self, start: dict[str, Any], end: dict[str, Any]) -> list[KafkaInputPartition]:
        """The ranges ``[start, end)`` of every partition; on a history-gap topic, offsets below
        the low watermark are marked lost (``lost_from``) instead of read."""
        ranges = pending(offsets_from_json(start), offsets_from_json(end))
        if not self.options.history_gap_topics:
            return [KafkaInputPartition(t, p, s, e) for t, p, s, e in ranges]
        lows = self.low_watermarks()
        parts = []
        for t, p, s, e in ranges:
            low = lows.get(t, {}).get(p, 0)
            if s < low:
                parts.append(KafkaInputPartition(t, p, min(low, e), e, lost_from=s))
            else:
                parts.append(KafkaInputPartition(t, p, s, e))
        return parts

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return pack_ranges(self.input_ranges(start, end), self.options.min_records_per_task)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # Spark keeps the offsets in its checkpoint; nothing to commit to Kafka

    def stop(self) -> None:
        p, self._probe = self._probe, None
        if p is not None:
            p.close()
        exit_if_spark_stopped_the_runner()

    # -- executor side -----------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        settle()
        if isinstance(partition, KafkaRangesPartition):
            from shared.spark.kafka_ranges import read_in_waves

            return read_in_waves(self.options, partition.ranges, self.values_only, self._read_one, _arrow_schema())
        assert isinstance(partition, KafkaInputPartition)
        return self._read_one(partition)

    def _read_one(self, partition: KafkaInputPartition) -> Iterator[pa.RecordBatch]:
        o = self.options
        lost_from = getattr(partition, "lost_from", None)
        if lost_from is not None:
            return _with_gap_marker(o, partition, lost_from, self.values_only)
        return read_range(
            o.settings,
            partition.topic,
            partition.partition,
            partition.start,
            partition.end,
            batch_size=o.records_per_arrow_batch,
            fail_on_data_loss=o.fail_on_data_loss,
            timeout_s=o.timeout_s,
            skip_prefix=o.skip_prefix(partition.topic),
            values_only=self.values_only,
        )


HISTORY_GAP_HEADER = "shardsink-history-gap"


def _with_gap_marker(
    o: SourceOptions, partition: KafkaInputPartition, lost_from: int, values_only: bool = False
) -> Iterator[pa.RecordBatch]:
    """The marker record of lost offsets ``[lost_from, partition.start)``, then the range."""
    schema = _arrow_schema()
    marker = {"key": f"{lost_from}-{partition.start}".encode()}
    yield pa.RecordBatch.from_pylist(
        [
            {
                "key": None,
                "value": None,
                "topic": partition.topic,
                "partition": partition.partition,
                "offset": lost_from,
                "timestamp": None,
                "headers": [{"key": HISTORY_GAP_HEADER, "value": marker["key"]}],
            }
        ],
        schema=schema,
    )
    if partition.end > partition.start:
        yield from read_range(
            o.settings,
            partition.topic,
            partition.partition,
            partition.start,
            partition.end,
            batch_size=o.records_per_arrow_batch,
            fail_on_data_loss=o.fail_on_data_loss,
            timeout_s=o.timeout_s,
            skip_prefix=o.skip_prefix(partition.topic),
            values_only=values_only,
        )


def _arrow_schema() -> pa.Schema:
    return to_arrow_schema(KAFKA_SCHEMA, timezone="UTC")


def read_range(
    settings: KafkaSettings,
    topic: str,
    partition: int,
    start: int,
    end: int,
    *,
    batch_size: int = 20_000,
    fail_on_data_loss: bool = True,
    timeout_s: float = 60.0,
    skip_prefix: bytes | None = None,
    values_only: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Exactly the records of ``topic``/``partition`` with offsets in ``[start, end)``, as
    RecordBatches of the source schema. Offsets may have gaps (compaction, transaction
    markers); the range ends at the first record at or beyond ``end`` or at end-of-partition
    beyond ``end - 1``. Raises :class:`KafkaTimeoutError` when nothing arrives for
    ``timeout_s`` and :class:`KafkaDataLossError` when ``start`` was deleted (unless
    ``fail_on_data_loss`` is false: then it reads from the first available record). With
``skip_prefix``, records whose value starts with it are left out. With ``values_only``, the
``key``, ``timestamp`` and ``headers`` columns are null (a reader that needs only values and
offsets saves a third of the per-record work)."""
    if end <= start:
        return
    schema = _arrow_schema()
    htype = schema.field("headers").type
    tstype = schema.field("timestamp").type
    extra = {
        "enable.partition.eof": "true",
        "auto.offset.reset": "error" if fail_on_data_loss else "earliest",
        "fetch.wait.max.ms": "5",  # a re-assigned consumer waits out the fetch in flight
        "queued.min.messages": str(max(batch_size, 100_000)),
    }
    pool_key = consumer_pool_key(settings, extra)
    consumer, known = take_pooled(pool_key) or (new_consumer(settings, **extra), set())
    pooled = False

    def build(keys: list[Any], vals: list[Any], offs: list[int], tss: list[Any],
              hdrs: list[Any], any_headers: bool) -> pa.RecordBatch:
        n = len(offs)
        if values_only:
            return pa.RecordBatch.from_arrays(
                [pa.nulls(n, pa.binary()), pa.array(vals, pa.binary()), pa.array([topic] * n, pa.string()),
                 pa.array(np.full(n, partition, dtype=np.int32)), pa.array(offs, pa.int64()),
                 pa.nulls(n, tstype), pa.nulls(n, htype)],
                schema=schema,
            )
        ts = pc.multiply(pa.array(tss, pa.int64()), 1000).cast(tstype)
        if any_headers:
            headers = pa.array(
                [None if h is None else [{"key": k, "value": v} for k, v in h] for h in hdrs],
                htype,
            )
        else:
            headers = pa.nulls(n, htype)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(keys, pa.binary()),
                pa.array(vals, pa.binary()),
                pa.array([topic] * n, pa.string()),
                pa.array(np.full(n, partition, dtype=np.int32)),
                pa.array(offs, pa.int64()),
                ts,
                headers,
            ],
            schema=schema,
        )

    try:
        if topic not in known:
            # The topic's metadata first (a round trip of about a millisecond): a consumer
            # assigned a partition of a topic it does not know yet waits up to a second for it.
            try:
                consumer.list_topics(topic, timeout=timeout_s)
            except KafkaException as e:
                raise translate(e, f"reading the metadata of {topic}") from e
            known.add(topic)
        consumer.assign([TopicPartition(topic, partition, start)])
        keys: list[Any] = []
        vals: list[Any] = []
        offs: list[int] = []
        tss: list[Any] = []
        hdrs: list[Any] = []
        any_headers = False
        done = False
        idle_since = time.monotonic()
        next_off = start
        while not done:
            # consume() waits until it has num_messages or the timeout passed: ask for no more
            # than the range still holds, so a range without gaps returns as soon as it is there.
            want = max(1, min(batch_size, 10_000, end - next_off))
            msgs = consumer.consume(num_messages=want, timeout=0.05)
            if not msgs:
                if time.monotonic() - idle_since > timeout_s:
                    raise KafkaTimeoutError(
                        f"expected records up to offset {end} of {topic}/{partition} within "
                        f"{timeout_s}s, found the last at {offs[-1] if offs else start - 1}",
                        topic=topic, partition=partition,
                    )
                continue
            idle_since = time.monotonic()
            for m in msgs:
                err = m.error()
                if err is not None:
                    code = err.code()
                    if code == KafkaError._PARTITION_EOF:
                        if int(m.offset() or 0) >= end:
                            done = True
                            break
                        continue
                    if code == KafkaError._AUTO_OFFSET_RESET or code == KafkaError.OFFSET_OUT_OF_RANGE:
                        raise KafkaDataLossError(
                            f"expected offsets [{start}, {end}) of {topic}/{partition} to be "
                            f"readable, found them deleted ({err.str()})",
                            topic=topic, partition=partition, start=start, end=end,
                        )
                    raise translate(KafkaException(err), f"reading {topic}/{partition}")
                off = int(m.offset() or 0)
                if off < next_off and fail_on_data_loss:
                    continue  # fetched for an earlier assignment, or again: read once, from start on
                if off >= end:
                    done = True
                    break
                next_off = off + 1
                val = m.value()
                if skip_prefix is not None and val is not None and val.startswith(skip_prefix):
                    continue  # (the end of the range is checked after the loop)
                vals.append(val)
                offs.append(off)
                if not values_only:
                    keys.append(m.key())
                    tt, t = m.timestamp()
                    tss.append(t if tt else None)
                    h = m.headers()
                    if h is not None:
                        any_headers = True
                    hdrs.append(h)
                if off == end - 1:
                    done = True
                    break
            if next_off >= end:  # the range's last record was read (skipped or kept)
                done = True
            if len(offs) >= batch_size or (done and offs):
                yield build(keys, vals, offs, tss, hdrs, any_headers)
                keys, vals, offs, tss, hdrs = [], [], [], [], []
                any_headers = False
        # Read to the end: the consumer (connected, with the metadata of the topics it read)
        # serves a next range, of any topic and partition, in this process.
        consumer.unassign()  # stops fetching and drops what was prefetched beyond ``end``
        pooled = give_back(pool_key, consumer, known)
    finally:
        if not pooled:
            consumer.close()


#: Without news beside it, a :class:`shared.spark.holding_source.HoldingStreamReader`'s held
#: topic is admitted at least this often.
ADMIT_EVERY_S = 1.0
