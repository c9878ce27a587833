"""The source of the write service's shared query (``SHARDSINK_QUERIES=shared``): every member
sink's desired topic and ``descs``, planned as work units of ``(sink, writer partition)``.

Planning (the source runner, on the driver): a micro-batch's ranges are the Kafka source's
(:class:`shared.spark.fleet_source.FleetStreamReader`, members held back between
descriptions). The runner reads the batch's ``descs`` range itself (a few records) and routes
each description by its sink id; a unit is planned for each writer partition that has
something to do: news on its desired partition, a description of its sink, or a replay (below).
Idle sinks get no unit, so a hundred idle sinks cost no task. Units are packed into few tasks
(:func:`pack_units`), each carrying its sink's :class:`services.write.job.WriteJob`.

Execution (executors): a task reads its units' desired ranges together (one consumer, one
assignment: :mod:`shared.spark.kafka_ranges`) and decodes them together (one batch per
collection schema, :func:`services.sinkio.decode_units`: a decoder's fixed cost is most of a
unit's few records), then runs its units, the units of one sink one after the other and
different sinks' units side by side on a few threads (their time is mostly S3 round trips);
each unit runs the write step of :mod:`services.write.executor` on its own rows exactly as a
per-sink query does, with its state versioned by
the shared query's micro-batch ids under the sink's own folder. A unit that fails yields a
``fail`` row instead of failing the task: one sink's failure is that sink's alone. A unit that
succeeds produces its report to ``batches`` itself, after its state version is written, and its
thread goes on to its next unit; the task awaits its units' deliveries once, at its end, and a
delivered report's row says so (:data:`REPORTED`); the driver produces a report the unit could
not deliver.

Replays. A failed unit saved no state version, so the next unit of that writer partition
loads the version before it; its input must come again. The driver records, per failed unit,
where its desired range started and its descriptions, in the replay file
(:data:`REPLAY_FILE` beside the members file). ``latestOffset`` carries the file's content in
the micro-batch's offsets (the ``@replay`` annotation, logged with them: a re-run plans the
same work) and plans the replayed units with their input again (their desired range from its
old start); with nothing else to read, it makes a micro-batch for them every
:data:`RETRY_S`.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.streaming.datasource import ReadLimit

from services.sinkio import decode_partition, decode_units
from services.write.job import WriteJob, report_message
from services.write.source import _batch_id
from shared.codec import message_codec
from shared.errors import DecodeError, ShardsinkError
from shared.kafka_offsets import (
    ANNOTATION_PREFIX,
    Offsets,
    offsets_from_json,
    offsets_to_json,
    pending,
)
from shared.side_by_side import SideBySide
from shared.spark.fleet_source import FleetStreamReader, SinkRange, members_option
from shared.spark.kafka_connector import KafkaDataSource
from shared.spark.kafka_source import KafkaInputPartition, SourceOptions, read_range
from shared.spark.worker_heap import settle

log = logging.getLogger("shardsink.write")

#: One row per unit and kind: ``sink`` is the sink's key (``<sink>@<epoch>``).
SHARED_OUTPUT_DDL = "sink string, wp int, kind string, body string"
SHARED_OUTPUT_SCHEMA = pa.schema([pa.field("sink", pa.string()), pa.field("wp", pa.int32()),
                                  pa.field("kind", pa.string()), pa.field("body", pa.string())])
REPLAY_KEY = ANNOTATION_PREFIX + "replay"
RETRY_KEY = ANNOTATION_PREFIX + "retry"
REPLAY_FILE = "replay.json"
#: With replays pending and nothing else to read, a micro-batch retries them this often.
RETRY_S = 2.0
#: A sink that joins the query reads the sink's descriptions among this many records of each
#: ``descs`` partition before the micro-batch's start (a description minted while the writer
#: had not taken the sink yet: separate services follow the catalog each on its own clock).
JOIN_LOOKBACK = 10_000
#: A description weighs as much as this many records when units are packed into tasks (it
#: costs a read-back of the shard and a staged part).
DESCRIPTION_WEIGHT = 1_000
#: At most this many tasks per core in a micro-batch: a task costs a round trip to a Python
#: worker, its own Kafka read and decode, and a unit's time is mostly S3 and Kafka round trips,
#: which a task's threads overlap. Four per core ran a micro-batch of 100 sinks' units as four
#: rounds of tasks on each core: that fixed cost per micro-batch, with the write query busy most
#: of the time, held micro-batches at 1.2-2 s (freshness p50 3.5-4.9 s at 100 sinks); one per
#: core, 0.4-0.9 s (1.3-1.6 s). See BENCHMARKS.md, "nineteenth session".
TASKS_PER_CORE = 1
#: Each member's held desired records are admitted at least this long after its last
#: admission (a clock per member, :class:`shared.spark.fleet_source.FleetStreamReader`), and
#: every member's when they reach the micro-batch's record limit; between, a description admits
#: its own sink's (a micro-batch then plans units for the sinks with a description, not for
#: every sink whose desired topic moved). One clock for all had every member's admitted in one
#: micro-batch of about 200 units at 100 sinks every 20 s, a step that held the next ones back.
ADMIT_ALL_EVERY_S = 20.0
#: A task reads its units' desired ranges together, in waves of at most this many records.
PREFETCH_RECORDS = 200_000
#: Threads a task runs its sinks' units on (their time is mostly S3 and Kafka round trips).
UNIT_THREADS = 4
#: A unit's reports are produced by its thread as it ends, and delivered within this long
#: (awaited once for all the task's units, at its end); the driver produces those that were
#: not (after the micro-batch's tasks, as before).
REPORT_DELIVERY_S = 5.0
#: The kind of an output row whose report the executor produced (the driver keeps its metrics).
REPORTED = "reported"
#: Those threads, kept by the Python worker from one task to the next.
_UNIT_POOL = SideBySide(UNIT_THREADS, "write-units")
_RAW_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
                         ("partition", pa.int32()), ("offset", pa.int64())])


def replay_path(members_file: str) -> str:
    return os.path.join(os.path.dirname(members_file), REPLAY_FILE)


def read_replay(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def write_replay(path: str, replay: Mapping[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(replay, f, sort_keys=True)
    os.replace(tmp, path)


class WriteUnit:
    """One sink's writer partition's input of one micro-batch."""

    def __init__(self, key: str, wp: int, job: WriteJob, desired: KafkaInputPartition | None,
                 descs: Sequence[tuple[int, int, bytes]], quarantine: Sequence[tuple[int, int, int, str]],
                 offset: int = 0) -> None:
        self.key = key
        self.wp = wp
        #: where the desired partition's range starts in this micro-batch (its offsets so far)
        self.offset = offset
        self.job = job
        self.desired = desired
        #: the sink's descriptions ``(partition, offset, value)`` of ``descs``, in order
        self.descs = tuple(descs)
        self.quarantine = tuple(quarantine)

    @property
    def weight(self) -> int:
        d = self.desired
        return (0 if d is None else d.end - d.start) + DESCRIPTION_WEIGHT * len(self.descs) + 1


class UnitsPartition(InputPartition):
    """A task's units."""

    def __init__(self, units: Sequence[WriteUnit]) -> None:
        super().__init__(tuple((u.key, u.wp) for u in units))
        self.units = tuple(units)


def pack_units(units: Sequence[WriteUnit], min_weight: int, parallelism: int) -> list[UnitsPartition]:
    """Few tasks: ``ceil(weight / min_weight)`` of them, at least ``parallelism`` (when there
    are that many units), at most one per unit and :data:`TASKS_PER_CORE` per core; the heaviest units first into the lightest
    task, and a sink's units together in a task where they fit (a task runs different sinks
    side by side, one sink's units one after the other)."""
    if not units:
        return []
    total = sum(u.weight for u in units)
    tasks = max(1, min(len(units), TASKS_PER_CORE * parallelism, max(parallelism, -(-total // max(1, min_weight)))))
    # A sink's units go together when they weigh no more than a task's share: they run one
    # after the other on one thread, and the second finds the shard's head the first read.
    share = total / tasks
    by_sink: dict[str, list[WriteUnit]] = {}
    for u in units:
        by_sink.setdefault(u.key, []).append(u)
    items: list[list[WriteUnit]] = []
    for group in by_sink.values():
        if sum(u.weight for u in group) <= share:
            items.append(group)
        else:
            items.extend([u] for u in group)
    bins: list[list[WriteUnit]] = [[] for _ in range(tasks)]
    sizes = [0] * tasks
    for item in sorted(items, key=lambda g: (-sum(u.weight for u in g), g[0].key, g[0].wp)):
        i = sizes.index(min(sizes))
        bins[i].extend(item)
        sizes[i] += sum(u.weight for u in item)
    return [UnitsPartition(sorted(b, key=lambda u: (u.key, u.wp))) for b in bins if b]


class WriteFleetReader(FleetStreamReader):
    """The shared write query's reader (module docstring)."""

    hold = True
    values_only = True
    #: Each member's held records are admitted at least this long after its last admission (a
    #: description admits its own sink's at once).
    admit_every_s = ADMIT_ALL_EVERY_S

    def __init__(self, options: SourceOptions, members_file: str, settings: Any, parallelism: int) -> None:
        super().__init__(options, members_file)
        #: the services' settings (:class:`services.runtime.settings.ServiceSettings`)
        self.settings = settings
        self.parallelism = parallelism
        self._retry_at = 0.0
        #: the ``descs`` ranges the last :meth:`_descriptions` read, decoded: a micro-batch's
        #: ``latestOffset`` (:meth:`admitted_on_news`) and ``partitions`` read the same ones
        self._read_descs: dict[tuple[str, int, int, int, bool], list[tuple[str, int, bytes]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "settings": self.settings, "parallelism": self.parallelism, "_retry_at": 0.0,
                "_read_descs": {}}

    def admitted_on_news(self, start: Offsets, end: Offsets) -> set[str] | None:
        """The members with a description among the new ``descs`` records: their held records
        come with it (the others stay held: a micro-batch plans no unit for them)."""
        topic = self.settings.descs_topic
        ranges = [KafkaInputPartition(topic, p, start.get(topic, {}).get(p, o), o)
                  for p, o in sorted(end.get(topic, {}).items()) if o > start.get(topic, {}).get(p, o)]
        if not ranges:
            return set()  # news on another control topic: nothing of the members
        members = self.members()
        try:
            descs = self._descriptions(ranges, members)
        except ShardsinkError:
            return None  # unreadable now (or lost: partitions() raises it): admit every member
        by_id = {str(m["sink_id"]): k for k, m in members.items()}
        return {by_id[sid] for sid in descs if sid in by_id}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        end = super().latestOffset(start, limit)
        replay = read_replay(replay_path(self.members_file))
        members = self.members()
        replay = {k: v for k, v in replay.items() if k in members}
        if not replay:
            return end
        end = {**end, REPLAY_KEY: replay}
        if pending(offsets_from_json(start), offsets_from_json(end)) or start.get(REPLAY_KEY) != replay:
            return end
        now = time.monotonic()
        if now >= self._retry_at:
            self._retry_at = now + RETRY_S
            return {**end, RETRY_KEY: int(start.get(RETRY_KEY, 0)) + 1}
        return dict(start)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        replay: dict[str, dict[str, Any]] = dict(end.get(REPLAY_KEY) or {})
        s = offsets_from_json(start)
        # A replayed writer partition's desired range starts where its failed unit's did.
        for key, by_wp in replay.items():
            for wp_text, r in by_wp.items():
                if r.get("from") is not None:
                    cur = s.setdefault(key, {})
                    cur[int(wp_text)] = min(int(r["from"]), cur.get(int(wp_text), int(r["from"])))
        ranges = self.input_ranges(offsets_to_json(s), end)
        members = self.members()
        control = [r for r in ranges if not isinstance(r, SinkRange)]
        descs = self._descriptions(control, members)
        joined = {str(m["sink_id"]): m for k, m in members.items() if k not in s}
        if joined:
            # New to this query: its recent descriptions too (module docstring, JOIN_LOOKBACK).
            before = self._lookback(offsets_from_json(start), joined)
            for sid, found in before.items():
                descs[sid] = found + descs.get(sid, [])
        desired: dict[tuple[str, int], KafkaInputPartition] = {
            (r.key, r.partition): r for r in ranges if isinstance(r, SinkRange)
        }
        units: list[WriteUnit] = []
        for key, m in sorted(members.items()):
            n = self._count(m)
            if n <= 0:
                continue
            new = descs.get(str(m["sink_id"]), [])
            wps = set(range(n)) if new else set()
            wps |= {wp for (k, wp) in desired if k == key}
            wps |= {int(wp) for wp in replay.get(key, {})}
            if not wps:
                continue
            job = self._job(key, m, n)
            quarantine = [(int(q[0]), int(q[1]), int(q[2]), str(q[3])) for q in m.get("quarantine", [])]
            for wp in sorted(wps):
                again = [(int(p), int(o), base64.b64decode(v)) for p, o, v in replay.get(key, {}).get(str(wp), {}).get("descs", [])]
                units.append(WriteUnit(key, wp, job, desired.get((key, wp)), again + new, quarantine,
                                       offset=s.get(key, {}).get(wp, 0)))
        return pack_units(units, self.options.min_records_per_task, self.parallelism)

    def _count(self, m: Mapping[str, Any]) -> int:
        return len(self._parts(str(m["desired_topic"])))

    def _job(self, key: str, m: Mapping[str, Any], partitions: int) -> WriteJob:
        from services.runtime.fleet import sink_state_dir
        from shared.catalog import SinkDef

        sink = SinkDef(**{f: m[f] for f in ("sink_id", "desired_topic", "collection_id", "as_of", "read_only",
                                            "dropped", "epoch", "adopt_shard", "replace_contents") if f in m})
        return WriteJob(sink, self.settings, partitions, str(m["row_schema"]), self.settings.descs_topic,
                        sink_state_dir(self.settings, "write", sink))

    def _descriptions(self, control: Sequence[KafkaInputPartition], members: Mapping[str, Any],
                      fail_on_data_loss: bool = True) -> dict[str, list[tuple[int, int, bytes]]]:
        """The micro-batch's descriptions by sink id (read here: a few records; a range the
        last call read is not read again)."""
        wanted = {str(m["sink_id"]) for m in members.values()}
        codec = message_codec("batch_description")
        out: dict[str, list[tuple[int, int, bytes]]] = {}
        read: dict[tuple[str, int, int, int, bool], list[tuple[str, int, bytes]]] = {}
        for r in control:
            key = (r.topic, r.partition, r.start, r.end, fail_on_data_loss)
            found = self._read_descs.get(key)
            if found is None:
                found = []
                for b in read_range(self.options.settings, r.topic, r.partition, r.start, r.end, values_only=True,
                                    fail_on_data_loss=fail_on_data_loss):
                    for off, value in zip(b.column("offset").to_pylist(), b.column("value").to_pylist(), strict=True):
                        try:
                            found.append((str(codec.decode(value or b"")["sink_id"]), int(off), value))
                        except (DecodeError, ShardsinkError, KeyError, TypeError):
                            continue  # every writer skips it
            read[key] = found
            for sid, off, value in found:
                if sid in wanted:
                    out.setdefault(sid, []).append((r.partition, off, value))
        self._read_descs = read
        return out

    def _lookback(self, start: Offsets, joined: Mapping[str, Any]) -> dict[str, list[tuple[int, int, bytes]]]:
        topic = self.settings.descs_topic
        parts = start.get(topic) or {p: 0 for p in self._parts(topic)}
        lows = self._p().watermarks([(topic, p) for p in parts], earliest=True) if parts else {}
        ranges = []
        for p, e in sorted(parts.items()):
            lo = max(lows.get((topic, p), 0), e - JOIN_LOOKBACK)
            if e > lo:
                ranges.append(KafkaInputPartition(topic, p, lo, e))
        return self._descriptions(ranges, {k: m for k, m in joined.items()}, fail_on_data_loss=False)

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        settle()
        assert isinstance(partition, UnitsPartition)
        batch_id = _batch_id()

        def run(units: list[WriteUnit], inputs: Mapping[int, Any]) -> list[_Output]:
            return [o for u in units for o in self._start_unit(u, batch_id, inputs[id(u)], decoded.get(id(u)))]

        out: list[_Output] = []
        for wave in _waves(partition.units):
            inputs = self._prefetch(wave)
            decoded = _decode_together(wave, inputs)
            groups: dict[str, list[WriteUnit]] = {}
            for u in wave:
                groups.setdefault(u.key, []).append(u)
            results = _UNIT_POOL.map(lambda g: run(g, inputs), list(groups.values()))
            out.extend(o for r in results for o in r)
        # The reports went out as their units ended; their deliveries are awaited once, here,
        # so that a unit's thread goes on to its next unit instead of waiting for the broker.
        return iter([o.settled() for o in out])

    def _prefetch(self, units: Sequence[WriteUnit]) -> dict[int, list[pa.RecordBatch] | Exception]:
        """The units' desired ranges, read together (:func:`shared.spark.kafka_ranges.read_ranges`:
        one assignment and shared fetches instead of one of each per unit); per unit its records
        (after a history-gap marker where its state is missing, :func:`_unproven_without_state`)
        or the error of its range alone."""
        from shared.spark.kafka_ranges import Range, read_ranges
        from shared.spark.kafka_source import _arrow_schema, _with_gap_marker

        o = self.options
        got: dict[int, list[pa.RecordBatch] | Exception] = {}
        wanted: list[tuple[WriteUnit, Range, list[pa.RecordBatch]]] = []
        for u in units:
            try:
                d = _unproven_without_state(u)
            except Exception as e:  # noqa: BLE001 - the unit's failure row says it
                got[id(u)] = e
                continue
            if d is None:
                got[id(u)] = []
                continue
            head = [next(iter(_with_gap_marker(o, d, d.lost_from, self.values_only)))] if d.lost_from is not None else []
            wanted.append((u, Range(d.topic, d.partition, d.start, d.end), head))
        read = read_ranges(o.settings, [r for _, r, _ in wanted], schema=_arrow_schema(), batch_size=o.records_per_arrow_batch,
                           fail_on_data_loss=o.fail_on_data_loss, timeout_s=o.timeout_s,
                           skip_prefixes={t: p for t in {r.topic for _, r, _ in wanted} if (p := o.skip_prefix(t)) is not None},
                           values_only=self.values_only)
        for (u, _, head), batches in zip(wanted, read, strict=True):
            got[id(u)] = batches if isinstance(batches, Exception) else head + batches
        return got

    def _run_unit(self, u: WriteUnit, batch_id: int, got: list[pa.RecordBatch] | Exception,
                  decoded: pa.RecordBatch | None = None) -> list[pa.RecordBatch]:
        """Unit ``u``'s write step on its input ``got`` (decoded already: ``decoded``): its
        output rows, once its reports' deliveries are known."""
        return [o.settled() for o in self._start_unit(u, batch_id, got, decoded)]

    def _start_unit(self, u: WriteUnit, batch_id: int, got: list[pa.RecordBatch] | Exception,
                    decoded: pa.RecordBatch | None = None) -> list[_Output]:
        """Unit ``u``'s write step, its reports produced but their deliveries not awaited."""
        job = u.job
        try:
            if isinstance(got, Exception):
                raise got
            if decoded is None:
                fn = decode_partition(job.sink.desired_topic, job.schema_json, route_to=job.partitions, executor=False,
                                      quarantine=list(u.quarantine), only_wp=u.wp)
                decoded_input: Iterator[pa.RecordBatch] = fn(_unit_input(u, got))
            else:
                decoded_input = iter([decoded])
            from services.write.executor import run_write_step  # executors only (see source.py)

            out = list(run_write_step(job, u.wp, batch_id, decoded_input))
        except Exception as e:  # noqa: BLE001 - a unit's failure is its sink's alone
            _discard_version(u, batch_id)
            body = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "trace": traceback.format_exc()[-4000:],
                "from": None if u.desired is None else (u.desired.lost_from if u.desired.lost_from is not None else u.desired.start),
                "end": None if u.desired is None else u.desired.end,
                "descs": [[p, o, base64.b64encode(v).decode()] for p, o, v in u.descs],
            }
            row = {"sink": u.key, "wp": u.wp, "kind": "fail", "body": json.dumps(body)}
            return [_Output(pa.RecordBatch.from_pylist([row], schema=SHARED_OUTPUT_SCHEMA))]
        return [_send_reports(job, b, u.key) for b in out if b.num_rows]


def _unit_input(u: WriteUnit, got: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A unit's raw input: its desired records, then its sink's descriptions."""
    return itertools.chain(got, [_control_batch(u.job.descs_topic, u.descs)] if u.descs else [])


def _decode_together(wave: Sequence[WriteUnit], inputs: Mapping[int, Any]) -> dict[int, pa.RecordBatch]:
    """The inputs of a wave's units decoded as one batch per collection schema and writer
    partition count (:func:`services.sinkio.decode_units`; a decoder's fixed cost is most of a
    unit's few records), by unit id. A unit under quarantine, or whose input failed, decodes
    its own (:meth:`WriteFleetReader._run_unit`), as does every unit of a group whose decode
    together fails: its failure is then its own."""
    groups: dict[tuple[str | None, int], list[WriteUnit]] = {}
    for u in wave:
        if not u.quarantine and not isinstance(inputs[id(u)], Exception):
            groups.setdefault((u.job.schema_json, u.job.partitions), []).append(u)
    out: dict[int, pa.RecordBatch] = {}
    for (schema_json, partitions), units in groups.items():
        if len(units) < 2 or {u.job.descs_topic for u in units} & {u.job.sink.desired_topic for u in units}:
            continue
        try:
            got = decode_units([(u.job.sink.desired_topic, list(_unit_input(u, inputs[id(u)])), u.wp) for u in units],
                               schema_json, partitions)
        except Exception:  # noqa: BLE001 - each unit decodes its own then
            log.warning("decoding %d units together failed; each decodes its own", len(units), exc_info=True)
            continue
        out.update((id(u), b) for u, b in zip(units, got, strict=True))
    return out


def _waves(units: Sequence[WriteUnit]) -> list[list[WriteUnit]]:
    """A task's units in waves whose desired ranges together hold at most
    :data:`PREFETCH_RECORDS` records (a unit above it is a wave alone): a wave's input is read
    at once and held until its units ran."""
    from shared.spark.kafka_ranges import split_waves

    return list(split_waves(units, lambda u: 0 if u.desired is None else u.desired.end - u.desired.start,
                            PREFETCH_RECORDS))


def _discard_version(u: WriteUnit, batch_id: int) -> None:
    """A failed unit's writer partition keeps no version of this micro-batch (one an earlier
    attempt of the batch wrote before the driver's step failed would hold the input the replay
    gives again: absorbed twice)."""
    from shared.spark.state_files import WriterStateFiles

    try:
        WriterStateFiles(u.job.checkpoint, u.job.settings.s3).discard(u.wp, batch_id)
    except Exception as e:  # noqa: BLE001 - the failure row below still holds the unit
        traceback.print_exc()
        print(f"shardsink-write: could not discard version {batch_id} of writer partition {u.wp} of {u.key}: {e}",
              file=sys.stderr)


def _unproven_without_state(u: WriteUnit) -> KafkaInputPartition | None:
    """The unit's desired range; for a writer partition without any state version whose range
    starts past offset 0 (its state folder was lost while the query's offsets went on), the
    range with ``[0, start)`` marked lost: the writer cannot prove it saw that history and
    refuses to write until an operator adopts the shard (never a retraction of rows it did not
    see), as a per-sink query that lost its checkpoint does."""
    from shared.spark.state_files import WriterStateFiles

    d = u.desired
    if d is not None and d.lost_from is not None:
        return d
    start = d.start if d is not None else u.offset
    if start <= 0:
        return d
    if WriterStateFiles(u.job.checkpoint, u.job.settings.s3).versions(u.wp):
        return d
    topic = u.job.sink.desired_topic
    return KafkaInputPartition(topic, u.wp, start, d.end if d is not None else start, lost_from=0)


def _control_batch(topic: str, descs: Sequence[tuple[int, int, bytes]]) -> pa.RecordBatch:
    """The sink's descriptions as records of the source's shape (values and offsets only)."""
    from shared.spark.kafka_source import _arrow_schema

    schema = _arrow_schema()
    n = len(descs)
    cols: dict[str, pa.Array] = {}
    for f in schema:
        if f.name == "topic":
            cols[f.name] = pa.array([topic] * n, f.type)
        elif f.name == "partition":
            cols[f.name] = pa.array([p for p, _, _ in descs], f.type)
        elif f.name == "offset":
            cols[f.name] = pa.array([o for _, o, _ in descs], f.type)
        elif f.name == "value":
            cols[f.name] = pa.array([v for _, _, v in descs], f.type)
        else:
            cols[f.name] = pa.nulls(n, f.type)
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


class _ReportProducer:
    """The Python worker's producer of reports (one per Kafka settings, shared by its tasks'
    unit threads)."""

    _lock = threading.Lock()
    _by_kafka: ClassVar[dict[Any, Any]] = {}

    @classmethod
    def of(cls, kafka: Any) -> Any:
        from services.sinkio import ControlProducer

        with cls._lock:
            p = cls._by_kafka.get(kafka)
            if p is None:
                p = cls._by_kafka[kafka] = ControlProducer.create(kafka, "write-units")
            return p


class _Output:
    """A unit's output rows, and the deliveries of the reports among them that its executor
    produced (None: not produced here; the row stays a ``report`` for the driver)."""

    def __init__(self, rows: pa.RecordBatch, key: str | None = None, producer: Any = None,
                 deliveries: Sequence[Any] = ()) -> None:
        self.rows = rows
        self.key = key
        self.producer = producer
        self.deliveries = list(deliveries)

    def settled(self) -> pa.RecordBatch:
        """The rows (with the sink's key, when made here) once each delivery is known: a report
        the broker acknowledged is :data:`REPORTED`, one still pending or failed stays a
        ``report``."""
        b = self.rows
        if self.producer is not None:
            self.producer.settle([d for d in self.deliveries if d is not None])
            kinds = b.column(1).to_pylist()
            out = [REPORTED if d is not None and d.ok else k for k, d in zip(kinds, self.deliveries, strict=True)]
            if out != kinds:
                b = pa.RecordBatch.from_arrays([b.column(0), pa.array(out, pa.string()), b.column(2)], schema=b.schema)
        return b if self.key is None else _with_sink(b, self.key)


def _send_reports(job: WriteJob, b: pa.RecordBatch, key: str | None = None) -> _Output:
    """A unit's output with its reports produced here, as the unit ends (:data:`REPORTED` once
    delivered, :meth:`_Output.settled`): the sink's append need not wait for the other units
    of the task and the micro-batch. A report not delivered within :data:`REPORT_DELIVERY_S`
    stays a ``report`` row, which the driver produces before the micro-batch commits, as
    before. A report produced here by an attempt whose micro-batch then fails is one more
    report of the partition for its description: the appender takes one per partition per
    description, as from a racing replica or a driver's flush before a failed commit
    (:mod:`services.write.service`, "Recovery")."""
    kinds = b.column(1).to_pylist()
    if "report" not in kinds:
        return _Output(b, key)
    try:
        producer = _ReportProducer.of(job.settings.kafka)
    except Exception as e:  # noqa: BLE001 - the driver produces them
        log.warning("could not make the executor's report producer (the driver produces the reports): %s", e)
        return _Output(b, key)
    sink = job.sink.sink_id.encode()
    sent = [producer.send_tracked(job.settings.batches_topic, report_message(body), sink, REPORT_DELIVERY_S)
            if k == "report" else None for k, body in zip(kinds, b.column(2).to_pylist(), strict=True)]
    return _Output(b, key, producer, sent)


def _produce_reports(job: WriteJob, b: pa.RecordBatch) -> pa.RecordBatch:
    """A unit's output with its reports produced and their deliveries awaited
    (:func:`_send_reports`)."""
    return _send_reports(job, b).settled()


def _with_sink(b: pa.RecordBatch, key: str) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([key] * b.num_rows, pa.string()), *b.columns], schema=SHARED_OUTPUT_SCHEMA)


class WriteFleetDataSource(KafkaDataSource):
    """``shardsink-write-shared``: the shared write query's source; a subclass made by
    :func:`shared_write_source` carries the services' settings."""

    settings: ClassVar[Any] = None
    parallelism: ClassVar[int] = 2

    @classmethod
    def name(cls) -> str:
        return "shardsink-write-shared"

    def schema(self) -> str:  # type: ignore[override]
        return SHARED_OUTPUT_DDL

    def streamReader(self, schema: Any) -> WriteFleetReader:
        return WriteFleetReader(SourceOptions.parse(self.options), members_option(self.options), self.settings, self.parallelism)


def shared_write_source(settings: Any, members_file: str, parallelism: int) -> tuple[str, type[WriteFleetDataSource], dict[str, str]]:
    from shared.spark.fleet_source import MEMBERS_OPTION

    cls = type("WriteFleetSource", (WriteFleetDataSource,), {"settings": settings, "parallelism": parallelism})
    return WriteFleetDataSource.name(), cls, {MEMBERS_OPTION: members_file}

