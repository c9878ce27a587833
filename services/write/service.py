"""The write service: keeps the correction buffer ``desired - shard`` per writer partition and
stages the difference for each batch description. It never appends.

Contract (the seeds' write operator, with Kafka making order and completeness explicit):

- inputs: the sink's desired topic (updates and progress, partitioned by row hash) and
  ``descs`` (batch descriptions). The shard is read back at every micro-batch that holds or
  receives a description, before it is decided, so ``frontiers`` is not read: an upper
  advance alone would cost a micro-batch that decides nothing (the next description, minted
  only after mint saw that upper, triggers the read-back it needs);
- state: one :class:`shared.sink_state.WriteState` per writer partition (= desired topic
  partition), kept **on the executors** and checkpointed with the source offsets: the task
  that processes a partition in micro-batch N loads the partition's newest state version
  written before N and writes version N under the query's checkpoint; Spark's commit of batch
  N makes it live (:mod:`shared.spark.state_files`, Spark's state store protocol in files the
  task handles itself). Desired updates go in positively; the shard's own contents (a
  snapshot at the partition's first start, then each appended range) go in negated, routed by
  the same row hash;
- for a description whose lower equals the persist frontier and whose upper is at or below
  the partition's desired frontier, the partition stages its consolidated updates before
  ``upper`` as data objects (named ``...-w<p>of<n>.parquet``), and reports on ``batches``
  (also when there is nothing to write);
- bad input (undecodable messages, rows that do not match the schema or whose writer schema is
  no version of the collection, updates below their partition's progress) becomes error rows
  at their time, in the shard's error collection;
- schema evolution: the collection's row schema may be altered while the sink runs. The step
  follows the shard's schema versions live (no restart): buffered keys are re-keyed to the
  current schema when it changes, desired rows of every version are resolved to it, shard
  parts are read as it, and the staged parts are written in it (see :class:`_Context`). An
  alter alone writes nothing.

Where the work runs. Executors, one task per writer partition with input, in one stage and
one Python worker: the write source's ``read()`` (:mod:`services.write.source`) reads the
partition's desired range and the micro-batch's control range, decodes them, and runs the
write step on them (:func:`write_step`): absorbs the desired updates, reads the shard back,
consolidates, decides and stages Parquet objects to S3. Only the step's output (a report and
statistics per partition) enters the JVM: the updates never do, so no Arrow-to-rows-to-Arrow
conversion is paid per update. A partition's own staged objects come back from its state
when they are appended (no read, no re-encode); only objects written by others (a racing
replica, the controller's ``Append``, compaction) are read and routed. The driver sees only
the reports (one small row per partition per description) and produces them. (With the
builtin Kafka connector, a ``mapInArrow`` decodes and another runs the step after a shuffle
by writer partition.)

Recovery: a restarted query resumes from its checkpoint (``<checkpoint root>/write/<sink>-e<epoch>``,
durable across restarts): state and offsets together, so nothing is re-read from the topic's
history and recovery time depends on the state's size (the in-flight difference), not on
history. Every micro-batch is bounded by admission control (``maxRecordsPerTrigger``), also
the catch-up after a long outage. A re-run micro-batch (a failed attempt) re-stages from the
previous state version; the appender appends one report per partition per description, and
the orphaned objects are collected after the grace period.

Retention safety (the contract; see docs/operations.md, "Retention safety"):

- the sink never retracts a row only because its insert is no longer on the desired topic;
- a writer partition proves it has seen the desired history behind the shard by reading its
  partition from offset 0 (a fresh checkpoint starts there) or from its checkpoint's offsets,
  with nothing deleted in between. The source compares each micro-batch's start offsets with
  the partition's low watermark and marks a gap (:data:`shared.spark.kafka.HISTORY_GAP_HEADER`);
- a gap after the partition absorbed anything (shard rows or desired updates) cannot be
  proven harmless: the partition refuses to write (:class:`shared.sink_state.Refuse`), so the
  sink writes nothing, and nothing that deletes. It logs
  :class:`shared.errors.HistoryUnprovenError`, sets the metric
  ``shardsink_write_history_unproven_partitions`` and the sink's health object, which
  ``shardsink status`` shows, and stays so until an operator acts:
  ``shardsink sink adopt <sink>`` (or ``sink create --adopt-shard``) takes the shard's
  current contents as the desired baseline (a new epoch, a fresh checkpoint) and corrects
  only from the shard's upper on;
- a gap before anything was absorbed (a sink created on an empty collection, or an adopted
  baseline) is harmless: the sink writes what it reads, as before.

Quarantine: a micro-batch that fails again and again on the same input (a value the code
cannot handle, for example) would stall the sink for good. The supervisor reports each
failure of the write query (:func:`on_write_failure`); when the same planned micro-batch (the
checkpoint's pending offsets) failed ``quarantine_after`` times (default 3) with an error
raised in the Python step that is not an infrastructure error (S3, Kafka, lost history,
protocol), its desired topic ranges are recorded in the sink's quarantine object
(``sink-health/<sink>-e<epoch>.quarantine.json``): the ranges of the writer partition the
failure names (:func:`write_step` notes it on what it raises), else every range of the batch.
The restarted query decodes the updates of
those ranges as error rows at their own time (source offset, reason and the row as JSON in
the error text), so they land in the error collection and the sink goes on; progress
statements in the ranges keep counting. ``shardsink status`` and the metric
``shardsink_write_quarantined_ranges`` show it. Quarantine never retracts: the rows never
reach the correction buffer. Failures are counted in the same S3 object (``failing``), so
the count survives a restart of the service, and ``status`` shows a batch failing before it
is quarantined. Narrower than a partition's range (the offending records alone) would take a
re-run per halving of the range, each a query restart of seconds, for a failure that per-value
checks (decode, read-back) already keep from happening on bad values: a quarantined range
loses nothing (each update is an error row with its row), so it is not done.

Micro-batch order inside a writer partition's task (all on the executor):

1. load the partition's newest state version before this batch (or start it: absorb the
   shard's snapshot, or adopt it); re-key it if the row schema changed since it was saved;
2. resolve the desired rows to the current row schema; absorb history gaps, desired updates
   and progress in offset order;
3. when a description is held or arrives: read the shard's head; absorb (negated) everything
   appended since the persist frontier (a micro-batch without one defers this to the next
   that has one: nothing is decided before it);
4. absorb descriptions; decide; stage data objects (S3); write this batch's state version;
   emit reports.

Then on the driver (``foreachBatch``): set the micro-batch id as the job's local property
(:data:`services.write.source.BATCH_PROPERTY`), run the batch's job, produce the reports it
returns and flush them; only then does Spark commit the micro-batch (offsets), which makes
the state versions live.
A batch that fails before its commit is re-run with the same id and offsets from the versions
before it; what its failed attempt staged is collected after the grace period.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from services.runtime.settings import ServiceSettings
from services.runtime.checkpoints import checkpoint_path
from services.runtime.supervisor import interruptible
from services.sinkio import (
    KIND_BAD,
    KIND_CONTROL,
    KIND_GAP,
    KIND_PROGRESS,
    KIND_UNRESOLVED,
    KIND_UPDATE,
    ControlProducer,
    ROUTED_DDL,
    decode_partition,
    u64,
)
from shared.catalog import SinkDef
from shared.errors import DecodeError, HistoryUnprovenError, ShardsinkError, SinkProtocolError
from shared.frontier import Frontier
from shared.sink_state import (
    BatchDescription,
    NothingToWrite,
    Refuse,
    Stage,
    WriteState,
    error_partition,
)

log = logging.getLogger("shardsink.write")

#: One row per writer partition per micro-batch: reports to produce, refusals, statistics.
OUTPUT_DDL = "wp int, kind string, body string"
_TAG = re.compile(r"-w(\d+)of(\d+)\.parquet$")


def part_tag(key: str) -> tuple[int, int] | None:
    """``(partition, count)`` of a data object staged by a writer partition, else None."""
    m = _TAG.search(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class WriteMetrics:
    desired_updates: int = 0
    decode_errors: int = 0
    contract_violations: int = 0
    batches_staged: int = 0
    reports_sent: int = 0
    rows_staged: int = 0
    error_rows_staged: int = 0
    micro_batches: int = 0
    buffer_updates: int = 0
    buffer_bytes: int = 0
    history_unproven_partitions: int = 0
    quarantined_ranges: int = 0


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


# -- executor side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """Keys, times and diffs read back for a writer partition: data rows and error rows, and
    ``unwritable``: rows of the shard that hold a value the schema cannot hold, as
    ``(reason, time, diff)`` (see :meth:`_Context.keys_of`)."""

    keys: pa.Array
    times: np.ndarray
    diffs: np.ndarray
    error_keys: pa.Array
    error_times: np.ndarray
    error_diffs: np.ndarray
    unwritable: tuple[tuple[str, int, int], ...] = ()

    @staticmethod
    def of(keys: Any, times: Any, diffs: Any, ekeys: Any, etimes: Any, ediffs: Any) -> Rows:
        def binary(a: Any) -> pa.Array:
            a = a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a
            return a if a.type == pa.binary() else a.cast(pa.binary())

        return Rows(binary(keys), np.asarray(times, np.uint64), np.asarray(diffs, np.int64),
                    binary(ekeys), np.asarray(etimes, np.uint64), np.asarray(ediffs, np.int64))

    @staticmethod
    def empty() -> Rows:
        return Rows.of(pa.array([], pa.binary()), [], [], pa.array([], pa.binary()), [], [])

    def plus(self, o: Rows) -> Rows:
        if not len(o.keys) and not len(o.error_keys) and not o.unwritable:
            return self
        if not len(self.keys) and not len(self.error_keys) and not self.unwritable:
            return o
        return Rows(
            pa.concat_arrays([self.keys, o.keys]), np.concatenate([self.times, o.times]),
            np.concatenate([self.diffs, o.diffs]), pa.concat_arrays([self.error_keys, o.error_keys]),
            np.concatenate([self.error_times, o.error_times]), np.concatenate([self.error_diffs, o.error_diffs]),
            self.unwritable + o.unwritable,
        )


_CONTEXTS: dict[tuple[str, int, str], Any] = {}


class _Context:
    """Per executor process and sink: the shard handle and the codecs of the collection's
    current row schema, which it follows while the sink runs (:meth:`follow`).

    Schema evolution. Row keys are canonical encodings under the *current* schema. The
    context takes the shard's schema versions from every head it reads (at a partition's
    start, at each read-back, and when input names a writer schema it does not know), and a
    partition's state whose keys are in another version is re-keyed (:meth:`WriteState.rekey`)
    before anything else touches it, so old and new keys never coexist in a decision. Desired
    rows of any known version are resolved to the current one a table at a time
    (:meth:`resolve_rows`); shard parts are read as the current schema
    (:func:`shared.shard.conform_part`) but routed by their bodies as written
    (:meth:`read_objects`), so every writer partition attributes a row of an untagged part to
    the same partition whichever version it runs with."""

    def __init__(self, job: WriteJob) -> None:
        from shared.shard import Shard

        from shared.spark.state_files import WriterStateFiles

        self.job = job
        self.shard = Shard.open(job.settings.store(), job.sink.collection_id, grace_ms=job.settings.grace_ms)
        self.states = WriterStateFiles(job.checkpoint, job.settings.s3)
        self._columns_of: dict[bytes, Any] = {}
        self._take(self.shard.head(max_age_s=1e9))

    def _take(self, state: Any) -> None:
        """Codecs of ``state``'s current schema, with its earlier versions as writer schemas."""
        from shared.avro_columns import ColumnCodec
        from shared.codec import MARKER, RowCodec
        from shared.shard import schema_view

        self.schema: dict[str, Any] = state.schema
        self.codec = RowCodec(state.schema, previous=[v.schema for v in state.versions[:-1]])
        self.columns = ColumnCodec(self.codec.schema)
        self.view = schema_view(self.codec.schema)
        #: The single-object header of a canonical row: the current schema's fingerprint.
        self.header = MARKER + self.codec.fingerprint
        #: every version's schema by its fingerprint (as a single-object header names it)
        self.versions: dict[bytes, dict[str, Any]] = {
            self._fingerprint(v.schema): v.schema for v in state.versions
        }
        self._nversions = len(state.versions)

    @staticmethod
    def _fingerprint(schema: dict[str, Any]) -> bytes:
        from shared.codec import fingerprint

        return fingerprint(schema)

    def _column_codec(self, fp: bytes) -> Any:
        from shared.avro_columns import ColumnCodec

        c = self._columns_of.get(fp)
        if c is None:
            c = self._columns_of[fp] = ColumnCodec(self.versions[fp])
        return c

    def follow(self, ws: WriteState, state: Any = None) -> None:
        """Take the schema versions of ``state`` (default: the cached head) and re-key ``ws`` if
        its keys are in another version than the current one."""
        st = state if state is not None else self.shard.head()
        if len(st.versions) > self._nversions:  # versions only ever grow: never go back
            self._take(st)
            log.info("collection %s: now at row schema version %d", self.job.sink.collection_id, len(st.versions) - 1)
        fp = self.header[2:]
        if ws.key_schema != fp:
            n = ws.rekey(fp, self.current_keys)
            if n:
                log.info("partition %d: %d buffered keys re-keyed to row schema version %d",
                         ws.partition, n, len(self.versions) - 1)

    def current_keys(self, keys: pa.Array) -> pa.Array:
        """Canonical keys of any known version -> the same rows' canonical keys under the
        current schema (the re-keying of a partition's state). A key that does not resolve is
        a broken buffer: SinkProtocolError."""
        out, errors = self.resolve_keys(keys, trust_current=True)
        if errors:
            why = next(iter(errors.values()))
            raise SinkProtocolError(
                f"expected the correction buffer to hold rows of the collection's schema versions, "
                f"found {len(errors)} that do not resolve to the current one (the first: {why})",
                sink_id=self.job.sink.sink_id,
            )
        return out

    def resolve_keys(self, keys: pa.Array, *, trust_current: bool) -> tuple[pa.Array, dict[int, str]]:
        """Single-object encoded rows of any known version -> canonical rows of the current
        schema, a table per writer schema: decoded with that version's column codec, resolved
        (:class:`shared.schema_evolution.Resolver`), encoded with the current one. Rows that do
        not decode that way go through the per-row reference (fastavro's resolution). Returns
        the keys (null where a row failed) and ``{index: reason}`` of the failures.
        ``trust_current``: rows with the current header are canonical already (else they are
        canonicalised too)."""
        import pyarrow.compute as pc

        from shared.errors import DecodeError

        keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
        if keys.type != pa.binary():
            keys = keys.cast(pa.binary())
        n = len(keys)
        heads = pc.binary_slice(keys, 0, 10)
        current = pc.fill_null(pc.equal(heads, pa.scalar(self.header, pa.binary())), False).to_numpy(zero_copy_only=False)
        if trust_current and current.all():
            return keys, {}
        todo = np.flatnonzero(~current) if trust_current else np.arange(n)
        errors: dict[int, str] = {}
        pieces: list[tuple[np.ndarray, pa.Array]] = []
        if trust_current:
            pieces.append((np.flatnonzero(current), keys.filter(pa.array(current))))
        sub_heads = heads.take(pa.array(todo))
        for h in pc.unique(sub_heads).to_pylist():
            idx = todo[pc.fill_null(pc.equal(sub_heads, pa.scalar(h, pa.binary())), False).to_numpy(zero_copy_only=False)] \
                if h is not None else todo[sub_heads.is_null().to_numpy(zero_copy_only=False)]
            fp = bytes(h[2:]) if h is not None and len(h) == 10 and h[:2] == self.header[:2] else None
            if fp is None or fp not in self.versions:
                why = (f"expected a row written with a schema version of collection "
                       f"{self.job.sink.collection_id!r} (fingerprints {sorted(f.hex() for f in self.versions)}), "
                       f"found " + ("no single-object header" if fp is None else f"fingerprint {fp.hex()}"))
                errors.update((int(i), why) for i in idx)
                continue
            sub = keys.take(pa.array(idx))
            decoded = self._column_codec(fp).decode(sub, skip=10)
            good = idx[decoded.ok]
            if len(good):
                resolved = self.view.resolver.resolve(decoded.table)
                bodies = self.columns.encode(resolved)
                pieces.append((good, pc.binary_join_element_wise(
                    pa.scalar(self.header, pa.binary()), bodies, pa.scalar(b"", pa.binary()))))
            slow = idx[~decoded.ok]
            if len(slow):
                ks, ok_idx = [], []
                for i in slow.tolist():
                    try:
                        ks.append(self.codec.canonical(keys[i].as_py()))
                        ok_idx.append(i)
                    except DecodeError as e:
                        errors[i] = str(e)
                if ok_idx:
                    pieces.append((np.array(ok_idx, np.int64), pa.array(ks, pa.binary())))
        pos = np.full(n, -1, np.int64)
        arrays: list[pa.Array] = []
        base = 0
        for idx, vals in pieces:
            pos[idx] = base + np.arange(len(idx))
            arrays.append(vals)
            base += len(idx)
        arrays.append(pa.nulls(1, pa.binary()))
        pos[pos < 0] = base
        return pa.concat_arrays(arrays).take(pa.array(pos)), errors

    def resolve_rows(self, table: pa.Table, desired_topic: str) -> pa.Table:
        """The desired updates of ``table`` (decoded input, :data:`services.sinkio.ROUTED_SCHEMA`)
        with every row canonical under the current schema: rows the decoder canonicalised under
        another version, and ``unresolved`` rows (a writer schema the decoder did not know), are
        resolved; a row whose writer schema is no version of the collection (even after reading
        the shard's head again: the alter may have just landed) or that does not decode becomes
        a ``bad`` record at its time and diff, naming its offset and the reason."""
        import pyarrow.compute as pc

        from services.sinkio import KIND_BAD, KIND_UNRESOLVED

        if table.num_rows == 0:
            return table
        kind = table["kind"]
        desired = pc.equal(table["topic"], desired_topic)
        is_update = pc.fill_null(pc.and_(desired, pc.equal(kind, KIND_UPDATE)), False)
        unresolved = pc.fill_null(pc.and_(desired, pc.equal(kind, KIND_UNRESOLVED)), False)
        rows_all = table["row"].combine_chunks()
        heads = pc.binary_slice(rows_all, 0, 10)
        seen = pc.unique(heads.filter(pc.or_(is_update, unresolved))).to_pylist()
        fps = {bytes(h[2:]) for h in seen if h is not None and len(h) == 10}
        if not fps <= set(self.versions):
            self._take(self.shard.refresh())  # an alter may have landed since this context read the head
        other = pc.and_(is_update, pc.fill_null(pc.not_equal(heads, pa.scalar(self.header, pa.binary())), True))
        todo_mask = pc.or_(unresolved, other).to_numpy(zero_copy_only=False)
        if not todo_mask.any():
            return table
        todo = np.flatnonzero(todo_mask)
        rows = rows_all.take(pa.array(todo))
        trusted = is_update.to_numpy(zero_copy_only=False)[todo]
        new_rows = rows
        errors: dict[int, str] = {}
        for flag in (True, False):
            sel = np.flatnonzero(trusted == flag)
            if not len(sel):
                continue
            out, errs = self.resolve_keys(rows.take(pa.array(sel)), trust_current=bool(flag))
            new_rows = _put(new_rows, sel, out)
            errors.update((int(sel[i]), why) for i, why in errs.items())
        kinds = pc.if_else(pa.array(todo_mask), pa.scalar(KIND_UPDATE), kind)
        error_col = table["error"].combine_chunks()
        if errors:
            bad = np.array(sorted(todo[j] for j in errors), np.int64)
            part, off = table["partition"], table["offset"]
            from services.sinkio import describe_bytes

            texts = pa.array([
                f"row does not match the collection schema at {desired_topic}/{part[int(todo[j])].as_py()}@"
                f"{off[int(todo[j])].as_py()}: {errors[j]}: {describe_bytes(rows[j].as_py())}"
                for j in sorted(errors, key=lambda j: todo[j])
            ], pa.string())
            kinds = _put(kinds.combine_chunks() if isinstance(kinds, pa.ChunkedArray) else kinds, bad,
                         pa.array([KIND_BAD] * len(bad), pa.string()))
            error_col = _put(error_col, bad, texts)
        full_rows = _put(rows_all, todo, new_rows)
        out_table = table.set_column(table.schema.get_field_index("row"), "row", full_rows)
        out_table = out_table.set_column(out_table.schema.get_field_index("kind"), "kind", kinds)
        return out_table.set_column(out_table.schema.get_field_index("error"), "error", error_col)

    @staticmethod
    def of(job: WriteJob) -> _Context:
        k = (job.sink.sink_id, job.sink.epoch, job.sink.collection_id)
        ctx = _CONTEXTS.get(k)
        if ctx is None:
            ctx = _CONTEXTS[k] = _Context(job)
        return ctx

    # -- rows of the shard -> keys of one partition ------------------------------------------
    def keys_of(self, table: pa.Table, wp: int, *, routed: bool) -> Rows:
        """Rows (part schema) -> the keys, times and diffs of writer partition ``wp``, data rows
        and error rows apart; ``routed``: every row is known to be ``wp``'s.

        Data rows are encoded to their canonical keys a table at a time
        (:class:`shared.avro_columns.ColumnCodec`: no per-row Python); rows of objects no
        writer partition tagged are routed by the row hash, one ``hashlib`` call per row. A
        table holding a value no row of the schema can hold (written by hand, say) goes row
        by row: such a row has no key to correct it by, so it is never skipped in silence but
        returned in ``unwritable`` with a reason that names it, for the error collection
        (:meth:`absorb_unwritable`)."""
        import pyarrow.compute as pc

        from shared.desired import row_partition
        from shared.errors import EncodeError
        from shared.shard import DIFF, ERROR, TIME

        n = self.job.partitions
        if table.num_rows == 0:
            return Rows.empty()
        is_err = table[ERROR].is_valid().to_numpy(zero_copy_only=False)
        out = Rows.empty()
        if is_err.any():
            et = table.filter(pa.array(is_err))
            ekeys = pc.cast(et[ERROR], pa.binary()).combine_chunks()
            keep = np.ones(len(ekeys), bool) if routed else np.array(
                [error_partition(e, n) == wp for e in et[ERROR].to_pylist()], bool)
            out = Rows.of(pa.array([], pa.binary()), [], [], ekeys.filter(pa.array(keep)),
                          et[TIME].to_numpy()[keep], et[DIFF].to_numpy()[keep])
        data = table.filter(pa.array(~is_err)) if is_err.any() else table
        if data.num_rows == 0:
            return out
        try:
            bodies = self.columns.encode(data.select(self.view.row_columns))
        except EncodeError as e:
            log.warning("a shard part holds a value the schema cannot hold (%s): its rows go row by row", e,
                        extra={"sink_id": self.job.sink.sink_id})
            return out.plus(self._keys_row_by_row(data, wp, routed=routed))
        times = data[TIME].to_numpy()
        diffs = data[DIFF].to_numpy()
        if not routed:
            mine = np.array([row_partition(b, n) == wp for b in bodies.to_pylist()], bool)
            bodies, times, diffs = bodies.filter(pa.array(mine)), times[mine], diffs[mine]
        keys = pc.binary_join_element_wise(pa.scalar(self.header, pa.binary()), bodies, pa.scalar(b"", pa.binary()))
        return out.plus(Rows.of(keys, times, diffs, pa.array([], pa.binary()), [], []))

    def _keys_row_by_row(self, table: pa.Table, wp: int, *, routed: bool) -> Rows:
        """:meth:`keys_of` for a table holding rows that do not encode: the table is halved
        until each slice encodes or is one such row (a few column-codec calls per bad row, not
        one per row); the rows that encode get their keys, the others go to ``unwritable``,
        each owned by one partition (``wp`` for a routed object, else the one its reason hashes
        to)."""
        import pyarrow.compute as pc

        from shared.desired import row_partition
        from shared.shard import DIFF, TIME

        n = self.job.partitions
        rows = table.select(self.view.row_columns)
        all_times = table[TIME].to_numpy()
        all_diffs = table[DIFF].to_numpy()
        good_idx: list[np.ndarray] = []
        good_bodies: list[pa.Array] = []
        unwritable: list[tuple[str, int, int]] = []
        todo = [(0, table.num_rows)]
        while todo:
            lo, hi = todo.pop()
            try:
                good_bodies.append(self.columns.encode(rows.slice(lo, hi - lo)))
                good_idx.append(np.arange(lo, hi))
            except ShardsinkError as e:  # a value no row of the schema can hold: never stall
                if hi - lo > 1:
                    mid = (lo + hi) // 2
                    todo += [(mid, hi), (lo, mid)]
                    continue
                t, d = int(all_times[lo]), int(all_diffs[lo])
                reason = unwritable_reason(rows.slice(lo, 1), t, d, e)
                if routed or row_partition(reason.encode(), n) == wp:
                    unwritable.append((reason, t, d))
        idx = np.concatenate(good_idx) if good_idx else np.zeros(0, np.int64)
        bodies = pa.concat_arrays(good_bodies) if good_bodies else pa.array([], pa.binary())
        if not routed and len(idx):
            mine = np.array([row_partition(b, n) == wp for b in bodies.to_pylist()], bool)
            bodies, idx = bodies.filter(pa.array(mine)), idx[mine]
        keys = pc.binary_join_element_wise(pa.scalar(self.header, pa.binary()), bodies, pa.scalar(b"", pa.binary()))
        out = Rows.of(keys, all_times[idx], all_diffs[idx], pa.array([], pa.binary()), [], [])
        return Rows(out.keys, out.times, out.diffs, out.error_keys, out.error_times, out.error_diffs, tuple(unwritable))

    def absorb_unwritable(self, ws: WriteState, rows: Rows) -> None:
        """Rows of the shard that hold a value the schema cannot hold: the buffer cannot
        correct them (they have no key), so each becomes an error row, at the first time the
        partition can still write (its own time is sealed; the reason says it), and the sink
        goes on. Deterministic: the same row read back again (a partition's fresh start) gives
        the same error, which the shard's copy read back cancels."""
        for reason, t, d in rows.unwritable:
            ws.absorb_desired_error(reason, t, d)
        if rows.unwritable:
            log.error(
                "partition %d: %d row(s) of the shard hold a value the collection's schema cannot hold; "
                "they go to the error collection (the first: %s)", ws.partition, len(rows.unwritable),
                rows.unwritable[0][0], extra={"sink_id": self.job.sink.sink_id},
            )

    def read_objects(self, ws: WriteState, keys: list[str], lower: int | None, upper: Frontier, state: Any = None) -> Rows:
        """Rows of ``ws``'s partition in the given objects with ``lower <= time < upper``, in the
        current schema: own staged objects from the state, objects tagged for other partitions
        skipped, the rest read and routed (by the row hash of each row's body as its part was
        written, a function of the part alone). ``state``: the head the keys come from."""
        import pyarrow.compute as pc

        from shared.shard import TIME

        wp, n = ws.partition, self.job.partitions
        out = Rows.empty()
        routed: list[str] = []
        unrouted: list[str] = []
        for k in keys:
            own = ws.take_staged(k)
            if own is not None:
                u, e = own
                out = out.plus(Rows.of(u.keys, u.times, u.diffs, e.keys, e.times, e.diffs))
                continue
            tag = part_tag(k)
            if tag is not None and tag[1] == n:
                if tag[0] == wp:
                    routed.append(k)
                continue  # another partition's rows
            unrouted.append(k)
        def in_range(table: pa.Table) -> pa.Table:
            if table.num_rows and (lower is not None or upper.time is not None):
                mask = None
                if lower is not None:
                    mask = pc.greater_equal(table[TIME], pa.scalar(lower, pa.uint64()))
                if upper.time is not None:
                    m2 = pc.less(table[TIME], pa.scalar(upper.time, pa.uint64()))
                    mask = m2 if mask is None else pc.and_(mask, m2)
                table = table.filter(mask)
            return table

        if routed:
            out = out.plus(self.keys_of(in_range(self.shard.read_parts(routed, schema=self.schema)), wp, routed=True))
        if unrouted:
            from shared.shard import conform_part

            for written, table in self.shard.read_parts_as_written(unrouted, state):
                if written == self.schema:  # encoded once, routed by the same bodies
                    out = out.plus(self.keys_of(in_range(table), wp, routed=False))
                    continue
                mine = self._route(written, in_range(table), wp)
                out = out.plus(self.keys_of(conform_part(mine, self.view), wp, routed=True))
        return out

    def _route(self, schema: dict[str, Any], table: pa.Table, wp: int) -> pa.Table:
        """The rows of ``table`` (a part as written, in ``schema``'s part schema) that belong to
        writer partition ``wp``: data rows by the row hash of their body in ``schema``, error
        rows by their text. A row no row of ``schema`` can hold is left out (with a warning)."""
        from shared.avro_arrow import arrow_to_rows
        from shared.codec import RowCodec
        from shared.desired import row_partition
        from shared.errors import EncodeError
        from shared.shard import ERROR, schema_view

        n = self.job.partitions
        if table.num_rows == 0:
            return table
        is_err = table[ERROR].is_valid().to_numpy(zero_copy_only=False)
        keep = np.zeros(table.num_rows, bool)
        if is_err.any():
            errs = table[ERROR].to_pylist()
            for i in np.flatnonzero(is_err).tolist():
                keep[i] = error_partition(errs[i], n) == wp
        di = np.flatnonzero(~is_err)
        if len(di):
            data = table.take(pa.array(di)).select(schema_view(schema).row_columns)
            fp = self._fingerprint(schema)
            try:
                bodies = (self._column_codec(fp) if fp in self.versions else _column_codec_of(schema)).encode(data).to_pylist()
            except EncodeError as e:
                log.warning("a shard part holds a value the schema cannot hold (%s): its rows go row by row", e)
                codec = RowCodec(schema)
                bodies = []
                for row in arrow_to_rows(data, schema):
                    try:
                        bodies.append(codec.encode_body(row))
                    except ShardsinkError as e2:
                        log.warning("skipping a shard row that does not encode: %s", e2)
                        bodies.append(None)
            keep[di] = [b is not None and row_partition(b, n) == wp for b in bodies]
        return table.filter(pa.array(keep))

    # -- steps -------------------------------------------------------------------------------
    def start(self, ws: WriteState) -> None:
        """A partition's first start: absorb the shard's contents negated, or adopt them."""
        state = self.shard.refresh()
        self.follow(ws, state)
        upper = state.upper
        if self.job.sink.adopt_shard:
            ws.adopt_baseline(upper)
            log.info("partition %d adopted the shard's contents below %s as its baseline", ws.partition, upper)
            return
        keys = [p.key for b in state.batches for p in b.parts] if upper.time != 0 else []
        r = self.read_objects(ws, keys, None, upper, state)
        ws.absorb_persist_snapshot(
            upper, r.keys, r.times, r.diffs, error_keys=r.error_keys, error_times=r.error_times,
            error_diffs=r.error_diffs,
        )
        self.absorb_unwritable(ws, r)

    def read_back(self, ws: WriteState) -> None:
        """Absorb (negated) everything the shard gained since the persist frontier."""
        persist = ws.persist_frontier
        if persist.time is None:
            return
        state = self.shard.refresh()
        self.follow(ws, state)
        if not persist.less_than(state.upper):
            return
        keys = [p.key for b in state.batches if not b.upper.less_equal(persist) for p in b.parts]
        r = self.read_objects(ws, keys, persist.time, state.upper, state)
        ws.absorb_persist_batch(
            persist, state.upper, r.keys, r.times, r.diffs, error_keys=r.error_keys,
            error_times=r.error_times, error_diffs=r.error_diffs,
        )
        self.absorb_unwritable(ws, r)

    def stage(self, ws: WriteState, decision: Stage) -> str:
        from shared.shard import DIFF, ERROR, TIME

        upd, errs = decision.updates, decision.errors
        shard = self.shard
        parts: list[pa.Table] = []
        if len(upd):
            # The keys are canonical rows of the current schema (checked when decoded, or
            # encoded from the shard's columns): decoded a table at a time, no per-row Python.
            decoded = self.columns.decode(upd.keys, skip=len(self.header))
            if not decoded.ok.all():
                bad = next(iter(decoded.errors.items()))
                raise SinkProtocolError(
                    f"expected the correction buffer to hold canonical rows, found {len(decoded.errors)} "
                    f"that do not decode (the first: {bad[1]})",
                    sink_id=self.job.sink.sink_id,
                )
            body = decoded.table
            body = body.append_column(TIME, pa.array(upd.times, pa.uint64()))
            body = body.append_column(DIFF, pa.array(upd.diffs, pa.int64()))
            body = body.append_column(ERROR, pa.nulls(len(upd), pa.string()))
            parts.append(shard.to_table(body, schema=self.schema))
        if len(errs):
            etab = pa.table(
                {
                    **{f.name: pa.nulls(len(errs), f.type) for f in self.view.row_schema},
                    TIME: pa.array(errs.times, pa.uint64()),
                    DIFF: pa.array(errs.diffs, pa.int64()),
                    ERROR: _error_texts(errs.keys),
                }
            )
            parts.append(shard.to_table(etab, schema=self.schema))
        staged = shard.stage(pa.concat_tables(parts), tag=f"w{ws.partition}of{self.job.partitions}", schema=self.schema)
        ws.remember_staged(decision.desc, [p.key for p in staged.parts], decision)
        return json.dumps(staged.to_json(), sort_keys=True)


def _put(values: pa.Array, idx: np.ndarray, new: pa.Array) -> pa.Array:
    """``values`` with the elements at ``idx`` (increasing) replaced by ``new``, in order."""
    if not len(idx):
        return values
    pos = np.arange(len(values), dtype=np.int64)
    pos[idx] = len(values) + np.arange(len(idx))
    return pa.concat_arrays([values, new.cast(values.type)]).take(pa.array(pos))


_COLUMN_CODECS: dict[str, Any] = {}


def _column_codec_of(schema: dict[str, Any]) -> Any:
    from shared.avro_columns import ColumnCodec

    k = json.dumps(schema, sort_keys=True)
    if k not in _COLUMN_CODECS:
        _COLUMN_CODECS[k] = ColumnCodec(schema)
    return _COLUMN_CODECS[k]


def unwritable_reason(row: pa.Table, time: int, diff: int, error: BaseException) -> str:
    """The error text of a shard row that holds a value the schema cannot hold (a one-row
    table of the row columns): what it is, its time and diff, why, and the row's contents."""
    try:
        contents = json.dumps(row.to_pylist()[0], default=str, sort_keys=True)
    except Exception as e:  # noqa: BLE001 - a value Python cannot even show: say so
        contents = f"(not shown: {type(e).__name__})"
    return (f"a row of the shard at time {time} (diff {diff}) holds a value the collection's schema cannot "
            f"hold, so the sink cannot correct it: {error}: row {contents}")


def _error_texts(keys: pa.Array) -> pa.Array:
    """Error keys (UTF-8 bytes of the error texts) as strings; invalid bytes replaced."""
    try:
        return keys.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([k.decode("utf-8", "replace") for k in keys.to_pylist()], pa.string())


def absorb_input(ws: WriteState, table: pa.Table, desired_topic: str, codec: Any = None) -> int:
    """Gaps, updates and progress of one partition in offset order: each run of updates
    between two other records is absorbed as Arrow and numpy slices (no per-row Python; the
    other records are few). An update below its partition's progress becomes an error row
    that names its source offset, its diff and (with ``codec``, the collection's
    :class:`shared.codec.RowCodec`) its row. Returns the number of undecodable messages met."""
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return 0
    table = table.combine_chunks()
    kind = table["kind"]
    is_update = pc.equal(kind, KIND_UPDATE).to_numpy(zero_copy_only=False)
    other = np.flatnonzero(~is_update & pc.not_equal(kind, KIND_CONTROL).to_numpy(zero_copy_only=False)
                           & pc.equal(table["topic"], desired_topic).to_numpy(zero_copy_only=False))
    rows = table["row"].chunk(0) if table.num_rows else pa.array([], pa.binary())
    times = table["time"].fill_null(0).to_numpy().view(np.uint64)
    diffs = table["diff"].fill_null(0).to_numpy()
    bad = 0

    parts, offsets = table["partition"], table["offset"]

    def describe(i: int) -> str:
        """The update at row ``i``: where it came from, its diff and its row."""
        text = f"update at {desired_topic}/{parts[i].as_py()}@{offsets[i].as_py()}, diff {int(diffs[i])}"
        if codec is not None:
            try:
                text += ": row " + json.dumps(codec.decode(rows[i].as_py()), default=str, sort_keys=True)
            except ShardsinkError:  # pragma: no cover - the rows were canonicalised on decode
                pass
        return text

    def run(a: int, b: int) -> None:
        idx = np.flatnonzero(is_update[a:b]) + a
        if len(idx) == b - a and b > a:
            ws.absorb_desired_updates(rows.slice(a, b - a), times[a:b], diffs[a:b], describe=lambda j: describe(a + j))
        elif len(idx):
            ws.absorb_desired_updates(rows.take(pa.array(idx)), times[idx], diffs[idx],
                                      describe=lambda j: describe(int(idx[j])))

    pos = 0
    for i in other.tolist():
        run(pos, i)
        pos = i + 1
        k = kind[i].as_py()
        fr = table["frontier"][i].as_py()
        if k == KIND_PROGRESS:
            ws.absorb_desired_progress(None if table["frontier_closed"][i].as_py() else u64(fr))
        elif k == KIND_GAP:
            ws.absorb_history_gap(int(fr), int(table["time"][i].as_py()))
        elif k == KIND_BAD:
            # A row that does not match the schema keeps its time and diff; a message that does
            # not decode at all has none: it lands at the partition's frontier.
            t_bad = u64(table["time"][i].as_py())
            at = Frontier.at(t_bad) if t_bad is not None else ws.desired_frontier.join(ws.persist_frontier)
            if at.time is not None:
                d = table["diff"][i].as_py()
                ws.absorb_desired_error(table["error"][i].as_py() or "bad desired message", at.time, d if d is not None else 1)
                bad += 1
        elif k == KIND_UNRESOLVED:  # never met after _Context.resolve_rows; an error row, never dropped
            d = table["diff"][i].as_py()
            ws.absorb_desired_error(f"a row of an unresolved writer schema at {desired_topic}/"
                                    f"{table['partition'][i].as_py()}@{table['offset'][i].as_py()}",
                                    u64(table["time"][i].as_py()) or 0, d if d is not None else 1)
            bad += 1
    run(pos, table.num_rows)
    return bad


def write_step(job: WriteJob, wp: int, batch_id: int, table: pa.Table | None) -> list[dict[str, Any]]:
    """One writer partition, one micro-batch, on an executor: the steps of the module
    docstring. ``table``: the partition's decoded input (columns of
    :data:`services.sinkio.ROUTED_SCHEMA`), None or empty when it has none. Returns the rows
    for the driver: a report (or a refusal), and the partition's statistics. Whatever it
    raises carries a note naming the partition and the micro-batch, so a quarantine takes
    only the ranges of the partition that failed."""
    try:
        return _write_step(job, wp, batch_id, table)
    except Exception as e:
        e.add_note(f"in writer partition {wp} of write micro-batch {batch_id}")
        raise


def _write_step(job: WriteJob, wp: int, batch_id: int, table: pa.Table | None) -> list[dict[str, Any]]:
    import pyarrow.compute as pc

    from shared.codec import message_codec

    clock = time.perf_counter
    t0 = clock()
    ctx = _Context.of(job)
    t1 = clock()
    loaded = ctx.states.load(wp, batch_id, WriteState.from_checkpoint)
    if loaded is not None:
        ws: WriteState = loaded[1]
        if ws.partition_count != job.partitions:
            raise SinkProtocolError(
                f"expected the desired topic {job.sink.desired_topic!r} to keep the "
                f"{ws.partition_count} partitions its checkpoint was built for, found "
                f"{job.partitions}: the correction buffers are keyed by partition; run "
                f"`shardsink sink adopt {job.sink.sink_id}` to start a new checkpoint",
                sink_id=job.sink.sink_id,
            )
        ctx.follow(ws)  # keys of a state saved under an earlier schema version: re-keyed first
    else:
        ws = WriteState(job.sink.sink_id, wp, job.partitions)
        ctx.start(ws)
    t2 = clock()
    out: list[dict[str, Any]] = []
    descs: list[BatchDescription] = []
    if table is not None and table.num_rows and job.settings.test_fail_on_row:
        marker = job.settings.test_fail_on_row.encode()
        if any(r is not None and marker in r for r in table["row"].to_pylist()):
            raise RuntimeError(f"injected failure on a row holding {marker!r} (SHARDSINK_TEST_FAIL_ON_ROW)")
    if table is not None and table.num_rows:
        table = table.sort_by([("offset", "ascending")])
        desired = table.filter(pc.equal(table["topic"], job.sink.desired_topic))
        desired = ctx.resolve_rows(desired, job.sink.desired_topic)
        if ctx.header[2:] != ws.key_schema:
            ctx.follow(ws, ctx.shard.head(max_age_s=1e9))  # resolving found a newer schema version
        absorb_input(ws, desired, job.sink.desired_topic, ctx.codec)
        control = table.filter(pc.equal(table["topic"], job.descs_topic))
        desc_codec = message_codec("batch_description")
        for value in control["value"].to_pylist():
            try:
                d = BatchDescription.from_dict(desc_codec.decode(value or b""))
            except (DecodeError, ShardsinkError) as e:
                log.warning("skipping a bad description: %s", e)
                continue
            if d.sink_id == job.sink.sink_id:
                descs.append(d)
    t3 = clock()
    if descs or ws.description is not None:
        # Only a description is decided against the shard's contents: a micro-batch that holds
        # none (most of them, while a description is in flight) leaves the read-back to the
        # one that does, which absorbs every batch appended since, in order.
        ctx.read_back(ws)
    t4 = clock()
    for d in descs:
        ws.absorb_description(d)
    decision = ws.maybe_write()
    now = int(time.time() * 1000)
    if isinstance(decision, Stage):
        handle = ctx.stage(ws, decision)
        out.append({"wp": wp, "kind": "report", "body": json.dumps(decision.report(handle, now).to_dict())})
    elif isinstance(decision, NothingToWrite):
        out.append({"wp": wp, "kind": "report", "body": json.dumps(decision.report(now).to_dict())})
    elif isinstance(decision, Refuse):
        out.append({"wp": wp, "kind": "refuse", "body": decision.reason})
    t5 = clock()
    blob = ws.to_checkpoint()
    ctx.states.save(wp, batch_id, blob, ws)
    t6 = clock()
    stats = {
        "desired_updates": ws.absorbed_desired,
        "decode_errors": ws.decode_errors,
        "contract_violations": ws.contract_violations,
        "buffer_updates": ws.correction.size() + ws.errors.size(),
        "buffer_bytes": ws.correction.bytes() + ws.errors.bytes(),
        "unproven": ws.unproven,
        "state_bytes": len(blob),
        # seconds per step of this micro-batch: input, restore, absorb, read back, decide and
        # stage, checkpoint
        "timing": [round(b - a, 4) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))],
    }
    out.append({"wp": wp, "kind": "stats", "body": json.dumps(stats)})
    return out


OUTPUT_SCHEMA = pa.schema([pa.field("wp", pa.int32()), pa.field("kind", pa.string()), pa.field("body", pa.string())])


def write_batches(job: WriteJob, batch_id: int) -> Any:
    """The ``mapInArrow`` function of micro-batch ``batch_id``: every writer partition found in
    the task's input (one, from the write source; any, after the builtin connector's
    shuffle), each through :func:`write_step`."""

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from shared.spark.worker_heap import settle

        settle()
        got = [b for b in batches if b.num_rows]
        if not got:
            return
        table = pa.Table.from_batches(got)
        wps = table["wp"].to_numpy()
        for wp in sorted(set(wps.tolist())):
            part = table.filter(pa.array(wps == wp)) if len(set(wps.tolist())) > 1 else table
            rows = write_step(job, int(wp), batch_id, part)
            yield pa.RecordBatch.from_pylist(rows, schema=OUTPUT_SCHEMA)

    return fn


def run_write_step(job: WriteJob, wp: int, batch_id: int, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The write step inside the write source's ``read()`` (:mod:`services.write.source`):
    writer partition ``wp``'s decoded input in, its output rows out."""
    out = write_batches(job, batch_id)(batches)
    for b in out:
        if b.num_rows and not all(w == wp for w in b.column(0).to_pylist()):
            raise SinkProtocolError(f"expected the input of writer partition {wp} only, found others")
        yield b


# -- driver side --------------------------------------------------------------------------------


@dataclass
class SinkWriter:
    """The driver's part of one sink's write query: produce the partitions' reports, keep the
    metrics, publish the sink's health (what ``shardsink status`` shows)."""

    sink: SinkDef
    settings: ServiceSettings
    partitions: int
    producer: ControlProducer
    metrics: WriteMetrics = field(default_factory=WriteMetrics)
    #: latest statistics per writer partition (cumulative counters and gauges)
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    unproven: dict[int, str] = field(default_factory=dict)

    def _note_error_rows(self, report: Any) -> None:
        """A log line and the ``error_rows_staged`` metric when a staged batch holds error rows
        (updates that could not be written as rows; the parts count them)."""
        from shared.shard import StagedBatch

        errors = sum(p.errors for p in StagedBatch.from_json(json.loads(report.staged)).parts)
        if errors:
            self.metrics.error_rows_staged += errors
            log.warning(
                "sink %s: %d error row(s) staged for times [%s, %s) by writer partition %d (updates "
                "that could not be written as rows; each names its source offset and the reason: "
                "snapshot(include_errors=True), tail or subscribe show them)",
                self.sink.sink_id, errors, report.lower.to_json(), report.upper.to_json(), report.partition,
                extra={"sink_id": self.sink.sink_id},
            )

    def handle(self, rows: pa.Table) -> None:
        """One micro-batch of the stateful step's output (a few rows per partition)."""
        from shared.codec import message_codec
        from shared.sink_state import BatchReport

        codec = message_codec("written_batch")
        wps = rows["wp"].to_pylist() if rows.num_rows else []
        kinds = rows["kind"].to_pylist() if rows.num_rows else []
        bodies = rows["body"].to_pylist() if rows.num_rows else []
        refused: dict[int, str] = {}
        for wp, kind, body in zip(wps, kinds, bodies, strict=True):
            if kind == "report":
                report = BatchReport.from_dict(json.loads(body))
                self.producer.send(self.settings.batches_topic, codec.encode(report.to_dict()), key=self.sink.sink_id.encode())
                self.metrics.reports_sent += 1
                if report.staged is not None:
                    self.metrics.batches_staged += 1
                    self.metrics.rows_staged += report.rows
                    self._note_error_rows(report)
            elif kind == "refuse":
                refused[wp] = body
            elif kind == "stats":
                self.stats[wp] = json.loads(body)
                log.debug("partition %d: step timings (input, restore, absorb, read back, stage, "
                          "checkpoint) %s s", wp, self.stats[wp].get("timing"), extra={"sink_id": self.sink.sink_id})
        self.producer.flush()
        self.metrics.micro_batches += 1
        m = self.metrics
        vals = list(self.stats.values())
        m.desired_updates = sum(int(s["desired_updates"]) for s in vals)
        m.decode_errors = sum(int(s["decode_errors"]) for s in vals)
        m.contract_violations = sum(int(s["contract_violations"]) for s in vals)
        m.buffer_updates = sum(int(s["buffer_updates"]) for s in vals)
        m.buffer_bytes = sum(int(s["buffer_bytes"]) for s in vals)
        unproven = {wp: s["unproven"] for wp, s in self.stats.items() if s.get("unproven")}
        unproven.update(refused)
        if unproven != self.unproven:
            self.unproven = unproven
            self.publish_health()
        # After the health object: whoever sees the metric finds the health that explains it.
        m.history_unproven_partitions = len(unproven)

    def publish_health(self) -> None:
        from shared.catalog import SinkHealth, put_sink_health

        if self.unproven:
            err = HistoryUnprovenError(
                f"expected sink {self.sink.sink_id!r} to have seen the desired history behind "
                f"its shard, found partitions {sorted(self.unproven)} missing part of it: "
                f"{next(iter(self.unproven.values()))}. The sink writes nothing until an "
                f"operator runs `shardsink sink adopt {self.sink.sink_id}`",
                sink_id=self.sink.sink_id,
            )
            log.error("%s", err, extra={"sink_id": self.sink.sink_id})
            health = SinkHealth(self.sink.sink_id, self.sink.epoch, "refusing", str(err), sorted(self.unproven))
        else:
            health = SinkHealth(self.sink.sink_id, self.sink.epoch, "ok", "", [])
        try:
            put_sink_health(self.settings.store(), health)
        except ShardsinkError as e:  # the log line and metric stand; status catches up later
            log.warning("could not publish the sink's health: %s", e, extra={"sink_id": self.sink.sink_id})


def start_write_query(spark: Any, settings: ServiceSettings, sink: SinkDef, registry: dict[str, SinkWriter] | None = None) -> Any:
    from shared.io.kafka_admin import topic_partition_count
    from shared.spark.kafka import kafka_read_stream
    from shared.shard import Shard

    partitions = topic_partition_count(settings.kafka, sink.desired_topic)
    shard = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms)
    schema_json = json.dumps(shard.refresh().schema)
    writer = SinkWriter(
        sink=sink,
        settings=settings,
        partitions=partitions,
        producer=ControlProducer.create(settings.kafka, f"write-{sink.sink_id}"),
    )
    if registry is not None:
        registry[sink.sink_id] = writer
    checkpoint = checkpoint_path(settings, "write", sink)
    job = WriteJob(sink, settings, partitions, schema_json, settings.descs_topic, checkpoint)
    from services.write.source import BATCH_PROPERTY, desired_source
    from shared.spark.kafka import _connector

    quarantined = load_quarantine(settings, sink)
    writer.metrics.quarantined_ranges = len(quarantined)
    builtin = _connector(None) == "builtin"
    df = kafka_read_stream(
        spark,
        settings.kafka,
        [sink.desired_topic, settings.descs_topic],
        starting_offsets="earliest",
        max_records_per_trigger=settings.max_records_per_trigger,
        history_gap_topics=[sink.desired_topic],
        simulated_low_watermarks_file=settings.simulated_low_watermarks_file,
        # ours: one input partition per writer partition, decoded and written inside the
        # source's read() (the updates never cross into the JVM)
        source=None if builtin else desired_source(
            sink.desired_topic, schema_json, partitions, quarantined, step=job,
            name=f"shardsink-write-{sink.sink_id}-{sink.epoch}",
        ),
        wait_for_records_ms=settings.source_wait_ms,
    )
    sc = spark.sparkContext

    def each(batch_df: Any, batch_id: int) -> None:
        if builtin:
            from pyspark.sql import functions as F

            routed = batch_df.select("topic", "partition", "offset", "value", "headers").mapInArrow(
                decode_partition(sink.desired_topic, schema_json, route_to=partitions, quarantine=quarantined),
                ROUTED_DDL,
            ).repartition(max(1, partitions), F.col("wp"))
            writer.handle(routed.mapInArrow(write_batches(job, batch_id), OUTPUT_DDL).toArrow())
            return
        # The source's tasks run the write step of this batch: they read its id from the job's
        # local properties (set on this thread, which submits the job).
        sc.setLocalProperty(BATCH_PROPERTY, str(batch_id))
        try:
            writer.handle(batch_df.toArrow())
        finally:
            sc.setLocalProperty(BATCH_PROPERTY, None)

    name = f"write-{sink.sink_id}-{sink.epoch}"  # the query's name: its supervisor marks it while stopping it
    return (
        df.writeStream.foreachBatch(interruptible(each, name))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .queryName(name)
        .start()
    )


# -- quarantine ---------------------------------------------------------------------------------

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
    from shared.catalog import sink_quarantine

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
    import re

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
    from services.runtime.driver_state import CheckpointFiles, planned_offsets

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
    from shared.catalog import add_sink_quarantine, count_sink_failure
    from shared.spark.kafka import offsets_from_json

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
