"""The write step: one writer partition, one micro-batch, in a Spark task on an executor
(the order of its steps is in :mod:`services.write.service`'s docstring).

It runs inside the write source's ``read()`` (:func:`run_write_step`, from
:mod:`services.write.source`) or, with the builtin Kafka connector, as a ``mapInArrow``
after a shuffle by writer partition (:func:`write_batches`). :func:`write_step` loads the
partition's state, absorbs its decoded input (:func:`absorb_input`), reads the shard back
when a description is held or arrives, decides, stages, saves the state version and returns
the rows for the driver (:data:`services.write.job.OUTPUT_DDL`). The shard and the
collection's schema are the process's :class:`services.write.context.ShardContext`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from services.sinkio import (
    KIND_BAD,
    KIND_CONTROL,
    KIND_GAP,
    KIND_PROGRESS,
    KIND_UNRESOLVED,
    KIND_UPDATE,
    u64,
)
from services.write.context import ShardContext
from services.write.job import OUTPUT_SCHEMA, WriteJob
from shared.codec import message_codec
from shared.errors import DecodeError, ShardsinkError, SinkProtocolError
from shared.frontier import Frontier
from shared.sink_messages import BatchDescription
from shared.write_state import NothingToWrite, Refuse, Stage, WriteState
from shared.spark.worker_heap import settle

log = logging.getLogger("shardsink.write")


def absorb_input(ws: WriteState, table: pa.Table, desired_topic: str, codec: Any = None) -> int:
    """Gaps, updates and progress of one partition in offset order: each run of updates
    between two other records is absorbed as Arrow and numpy slices (no per-row Python; the
    other records are few). An update below its partition's progress becomes an error row
    that names its source offset, its diff and (with ``codec``, the collection's
    :class:`shared.codec.RowCodec`) its row. Returns the number of undecodable messages met."""
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
        elif k == KIND_UNRESOLVED:  # never met after ShardContext.resolve_rows; an error row, never dropped
            d = table["diff"][i].as_py()
            ws.absorb_desired_error(f"a row of an unresolved writer schema at {desired_topic}/"
                                    f"{table['partition'][i].as_py()}@{table['offset'][i].as_py()}",
                                    u64(table["time"][i].as_py()) or 0, d if d is not None else 1)
            bad += 1
    run(pos, table.num_rows)
    return bad


def write_step(job: WriteJob, wp: int, batch_id: int, table: pa.Table | None) -> list[dict[str, Any]]:
    """One writer partition, one micro-batch, on an executor: the steps of
    :mod:`services.write.service`'s docstring. ``table``: the partition's decoded input (columns of
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
    clock = time.perf_counter
    t0 = clock()
    ctx = ShardContext.of(job)
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
        newest = max(descs, key=lambda d: _frontier_order(d.lower)) if descs and ws.description is None else None
        ctx.read_back(ws, at_least=None if newest is None else newest.lower, appended=None if newest is None else newest.appended)
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


def _frontier_order(f: Frontier) -> tuple[int, int]:
    """A frontier's place in time order (the empty frontier last)."""
    return (1, 0) if f.time is None else (0, f.time)


def write_batches(job: WriteJob, batch_id: int) -> Any:
    """The ``mapInArrow`` function of micro-batch ``batch_id``: every writer partition found in
    the task's input (one, from the write source; any, after the builtin connector's
    shuffle), each through :func:`write_step`."""

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
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
