"""Mint's reads of the desired topics' progress: a range's latest statement, found from the
range's end backwards (:func:`read_latest_progress`), for many ranges together
(:func:`latest_progress_records`), their windows decided together
(:func:`progress_offsets`), and the shared mint's decode of every sink's statements as one
batch (:func:`decode_statements_on_driver`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from services.sinkio import (
    DECODED_SCHEMA,
    KIND_PROGRESS,
    RAW_SCHEMA,
    DesiredDecoder,
    body_codecs,
    decode_on_driver,
    decode_together,
    desired_prefixes,
)

#: The first window :func:`read_latest_progress` reads back from a range's end: the range's
#: last record alone. A producer sends a step's updates, then its progress statement
#: (:class:`shared.io.desired_producer.DesiredProducer` flushes the updates first), so the last
#: record is most often the statement, in a batch of its own; a fetch from it returns that
#: batch alone, where a wider window returns the step's batch of updates too (measured on the
#: embedded broker, :func:`latest_progress_records` of 80 partitions with 25 updates and a
#: statement each: 37 against 52 ms of the broker's CPU and 26 against 37 ms of the reader's
#: per read).
LATEST_PROGRESS_FIRST = 1
#: The window read after a first one without a statement (then 4x each time).
LATEST_PROGRESS_WINDOW = 512


def read_latest_progress(
    kafka: Any, topic: str, partition: int, start: int, end: int, skip_prefix: bytes | None
) -> pa.Table:
    """The records of ``topic``/``partition`` in ``[start, end)`` that mint needs: its
    latest progress statement, read from the end of the range backwards in growing windows
    (the last record, :data:`LATEST_PROGRESS_FIRST`; then :data:`LATEST_PROGRESS_WINDOW`, then 4x
    each time) until a window holds one, rather than
    every record of the range: a partition's progress only moves forward
    (:class:`shared.desired.DesiredFrontierTracker` ignores a regression), so the last
    statement of the range is the one that counts, and the updates before it are the write
    service's (mint reads a few windows per partition per micro-batch, not the topic's
    updates). The windows' progress statements and other non-update records come back
    (columns as :func:`read_planned_batch`'s), in offset order; a range without any progress
    is read whole, from its first offset still on the topic (retention may have deleted the
    start of a range mint left unread for long). A producer that breaks the contract with a
    statement below an earlier one in the same range can only make mint's frontier lag until
    the next statement: minting less is always safe. One range of
    :func:`read_latest_progress_of`."""
    return read_latest_progress_of(kafka, topic, {partition: (start, end)}, skip_prefix)


def read_latest_progress_of(
    kafka: Any, topic: str, ranges: Mapping[int, tuple[int, int]], skip_prefix: bytes | None
) -> pa.Table:
    """:func:`read_latest_progress` of several partitions of ``topic`` (``{partition: (start,
    end)}``), their windows read together (:func:`_progress_windows`), sorted by partition
    then offset; the first range's error is raised."""
    order = sorted(ranges)
    found, errors = _progress_windows(kafka, [(topic, p, *ranges[p]) for p in order], skip_prefix)
    if errors:
        raise errors[min(errors)]
    tables = [raw for windows in found for raw, _ in reversed(windows)]
    return pa.concat_tables(tables) if tables else RAW_SCHEMA.empty_table()


def latest_progress_record(
    kafka: Any, topic: str, partition: int, start: int, end: int, skip_prefix: bytes | None
) -> tuple[int, bytes] | None:
    """The offset and value of the latest progress statement of ``topic``/``partition`` in
    ``[start, end)`` (:func:`read_latest_progress`), None when the range holds none: one range
    of :func:`latest_progress_records`, whose error is raised."""
    found = latest_progress_records(kafka, [(topic, partition, start, end)], skip_prefix)[0]
    if isinstance(found, Exception):
        raise found
    return found


def latest_progress_records(
    kafka: Any, ranges: Sequence[tuple[str, int, int, int]], skip_prefix: bytes | None
) -> list[tuple[int, bytes] | None | Exception]:
    """The offset and value of the latest progress statement of each ``(topic, partition,
    start, end)`` (None: the range holds none), or the error of that range alone, from
    :func:`_progress_windows`."""
    found, errors = _progress_windows(kafka, ranges, skip_prefix)
    out: list[tuple[int, bytes] | None | Exception] = []
    for i, windows in enumerate(found):
        if i in errors or not windows:
            out.append(errors.get(i))
            continue
        window, offsets = windows[-1]  # only the last window read can hold a statement
        if not offsets:
            out.append(None)
            continue
        last = max(offsets)
        out.append((last, window["value"][window["offset"].to_pylist().index(last)].as_py()))
    return out


def _progress_windows(
    kafka: Any, ranges: Sequence[tuple[str, int, int, int]], skip_prefix: bytes | None
) -> tuple[list[list[tuple[pa.Table, list[int]]]], dict[int, Exception]]:
    """Per ``(topic, partition, start, end)``, the windows :func:`read_latest_progress` reads
    back from the range's end, raw and with the offsets of their progress statements
    (:func:`progress_offsets`), in the order read (only the last one read can
    hold a progress statement); and by the index of a range that failed, its error (the
    windows that range read before it are not to be used; the others are read on). Every range's windows are
    read together, round after round (:func:`shared.spark.kafka_ranges.read_ranges`: one
    consumer and one assignment for all, where one read a range costs an assignment, which
    waits for librdkafka holding the GIL)."""
    from shared.errors import ShardsinkError
    from shared.spark.kafka_ranges import Range
    from shared.spark.kafka_ranges import read_ranges as read_together
    from shared.spark.kafka_source import _arrow_schema

    schema = _arrow_schema()
    out: list[list[tuple[pa.Table, list[int]]]] = [[] for _ in ranges]
    errors: dict[int, Exception] = {}
    todo = {i: (r[3], LATEST_PROGRESS_FIRST) for i, r in enumerate(ranges) if r[3] > r[2]}  # the window's end, size
    while todo:
        idx = sorted(todo)
        specs = [Range(ranges[i][0], ranges[i][1], max(ranges[i][2], todo[i][0] - todo[i][1]), todo[i][0]) for i in idx]
        # Values and offsets are all the decode needs: no keys, timestamps or headers built.
        got = read_together(kafka, specs, schema=schema, fail_on_data_loss=False, values_only=True,
                            skip_prefixes={r.topic: skip_prefix for r in specs} if skip_prefix is not None else None)
        more: dict[int, tuple[int, int]] = {}
        read: dict[int, pa.Table] = {}
        for i, batches in zip(idx, got, strict=True):
            if isinstance(batches, Exception):
                errors[i] = batches if isinstance(batches, ShardsinkError) else ShardsinkError(str(batches))
            elif batches:
                read[i] = pa.Table.from_batches([b.select(["topic", "partition", "offset", "value"]) for b in batches])
        found = iter(progress_offsets([(ranges[i][0], w) for i, w in read.items()]))
        for i, r in zip(idx, specs, strict=True):
            if i in errors:
                continue
            if i in read:
                offsets = next(found)
                out[i].append((read[i], offsets))
                if offsets:
                    continue
            if r.start > ranges[i][2]:
                more[i] = (r.start, LATEST_PROGRESS_WINDOW if todo[i][1] < LATEST_PROGRESS_WINDOW else todo[i][1] * 4)
        todo = more
    return out, errors


def progress_offsets(windows: Sequence[tuple[str, pa.Table]]) -> list[list[int]]:
    """Per ``(desired topic, window)`` (records of one partition of the topic, in offset order,
    columns as :func:`read_planned_batch`'s), the offsets of its progress statements, as
    :func:`decode_on_driver` with ``progress_only`` finds them.

    Mint reads such a window per partition with news, twice (its source's admission and its
    driver's step), and a decoder's fixed cost is most of a window's: 1.4-1.7 ms for a
    one-record window, about 300 ms a second at 100 sinks. So the windows are decided
    together: a window whose every record is an update in the current framing (dropped
    undecoded, as ``progress_only`` does) or a progress statement in the current framing that
    its body's columnar decode accepts, with a partition of at least 0, is decided by one
    decode of all windows' statements; any other window (another framing, a body that does not
    decode, a null value) goes through :func:`decode_on_driver` alone, as before."""
    import numpy as np
    import pyarrow.compute as pc

    if not windows:
        return []
    update, progress = desired_prefixes()
    values = pa.chunked_array([w.column("value").cast(pa.binary()) for _, w in windows], pa.binary()).combine_chunks()
    head = pc.binary_slice(values, 0, len(progress))
    is_update = pc.fill_null(pc.equal(head, pa.scalar(update, pa.binary())), False).to_numpy(zero_copy_only=False)
    is_progress = pc.fill_null(pc.equal(head, pa.scalar(progress, pa.binary())), False).to_numpy(zero_copy_only=False)
    good = np.zeros(len(values), bool)
    ip = np.flatnonzero(is_progress)
    if len(ip):
        d = body_codecs()[1].decode(values.take(pa.array(ip)), skip=len(progress))
        ok = ip[d.ok]
        good[ok[d.table["partition"].to_numpy(zero_copy_only=False) >= 0]] = True
    out: list[list[int]] = []
    at = 0
    for topic, w in windows:
        n, offs = w.num_rows, w.column("offset").to_numpy()
        if (is_update[at:at + n] | good[at:at + n]).all():
            out.append(offs[good[at:at + n]].tolist())
        else:
            decoded = decode_on_driver(w, topic, progress_only=True)
            out.append([o for k, o in zip(decoded["kind"].to_pylist(), decoded["offset"].to_pylist(), strict=True)
                        if k == KIND_PROGRESS])
        at += n
    return out


def decode_statements_on_driver(items: Sequence[tuple[str, pa.Table]]) -> list[pa.Table]:
    """:func:`decode_on_driver` with ``progress_only`` of each ``(desired topic, raw records)``
    (columns as :func:`read_planned_batch`'s), decoded as one batch: the shared mint decodes the
    statements of every sink with news at each micro-batch, and a decoder's fixed cost (about
    1.5 ms) is most of a sink's few records. The records of every item's desired topic are
    desired records, which is what each item's alone makes of them as long as no item holds
    records of another item's desired topic that are not of its own (mint's items hold their
    desired topic's and the frontiers topic's)."""
    decoder = DesiredDecoder(frozenset(t for t, _ in items), None, progress_only=True)
    names = ["topic", "partition", "offset", "value"]
    tables = []
    for b in decode_together(decoder, [raw.select(names).cast(RAW_SCHEMA).to_batches() for _, raw in items]):
        t = pa.Table.from_batches([b], schema=DECODED_SCHEMA)
        tables.append(t.sort_by([("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")]) if t.num_rows else t)
    return tables
