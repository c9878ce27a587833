"""I/O shared by the three sink services: the executor-side decode of Kafka micro-batches,
and the driver-side encode/produce of control messages (descs, batches, frontiers).

Decoding happens in the executors, one Spark task per Kafka partition (``mapInArrow``), so a
desired topic with N partitions is decoded by N parallel tasks; the driver receives compact
Arrow columns. Control topics are tiny; their raw values pass through and are decoded on the
driver.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

KIND_UPDATE = "update"
KIND_PROGRESS = "progress"
KIND_BAD = "bad"
KIND_CONTROL = "control"
#: History lost to retention (write service): ``frontier`` = first lost offset, ``time`` = the
#: first offset still available (see ``historyGapTopics`` in shared.spark.kafka_source).
KIND_GAP = "gap"
#: An update whose row is single-object encoded with a writer schema the decoder does not know
#: (the write service's decode, with ``route_to``): ``row`` holds the bytes as produced, with
#: ``time`` and ``diff``. The write step resolves it with the collection's schema versions,
#: which it follows live (the row schema may have been altered since the query started), or
#: makes it an error row; see :meth:`services.write.context.ShardContext.resolve_rows`.
KIND_UNRESOLVED = "unresolved"

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

    With ``route_to``, a row single-object encoded with a fingerprint other than the row
    schema's (an older or a newer version of the collection's schema: the schema may be altered
    while the sink runs) is not decided here: it becomes an ``unresolved`` record
    (:data:`KIND_UNRESOLVED`) with its bytes, time and diff, which the write step resolves
    with the collection's schema versions or makes an error row. Without ``route_to`` such a
    row is a ``bad`` record, as is any row that is not single-object encoded.

    ``executor``: the function runs in a Spark worker (it settles the worker's heap first,
    :mod:`shared.spark.worker_heap`); False when it runs on the driver.

    Decoding is vectorised (:class:`DesiredDecoder`): messages framed with the current desired
    schema, and rows framed with the collection's current schema, are decoded and re-encoded a
    record batch at a time (:class:`shared.avro_columns.ColumnCodec`); any other record (an
    older schema version, an irregular encoding, a bad message) goes through the per-record
    decoder, which decides and names the error, so both give the same records.
    """

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if executor:
            from shared.spark.worker_heap import settle

            settle()
        decoder = DesiredDecoder(
            desired_topic, row_schema_json, progress_only=progress_only, route_to=route_to,
            quarantine=quarantine, only_wp=only_wp,
        )
        for rb in batches:
            yield decoder.decode(rb)

    return fn


_K_UPDATE, _K_PROGRESS, _K_BAD, _K_CONTROL, _K_GAP, _K_UNRESOLVED, _K_SKIP = range(7)
_KIND_NAMES = (KIND_UPDATE, KIND_PROGRESS, KIND_BAD, KIND_CONTROL, KIND_GAP, KIND_UNRESOLVED)


@functools.cache
def _kinds() -> pa.Array:
    # Built on first use, not at import: pyarrow imports pandas (0.5 s) the first time it
    # converts a Python list, and the planning processes Spark starts for the write source
    # import this module without ever decoding.
    return pa.array(_KIND_NAMES, pa.string())

#: The two branches of ``schemas/desired.avsc`` as plain records (a time is a two's complement
#: long here, as in :data:`DECODED_SCHEMA`), read after the header and the union index byte.
_UPDATE_BODY = {"type": "record", "name": "Update", "fields": [
    {"name": "row", "type": "bytes"}, {"name": "time", "type": "long"}, {"name": "diff", "type": "long"}]}
_PROGRESS_BODY = {"type": "record", "name": "Progress", "fields": [
    {"name": "partition", "type": "int"}, {"name": "frontier", "type": ["null", "long"]}]}


@functools.cache
def desired_prefixes() -> tuple[bytes, bytes]:
    """The value prefixes (single-object header and union index, 11 bytes) of a desired update
    and of a progress statement framed with the current desired schema."""
    from shared.codec import MARKER, message_codec

    fp = message_codec("desired").fingerprint
    return MARKER + fp + b"\x00", MARKER + fp + b"\x02"


@functools.cache
def body_codecs() -> tuple[Any, Any]:
    """The column codecs of the desired message's update and progress bodies (built once per
    process: mint builds a decoder for every window it reads)."""
    from shared.avro_columns import ColumnCodec

    return ColumnCodec(_UPDATE_BODY), ColumnCodec(_PROGRESS_BODY)


_CODECS = threading.local()


def _row_codecs(row_schema_json: str) -> tuple[Any, Any]:
    """The row codec and column codec of a row schema, kept per thread (a write task builds a
    decoder for each of its units, most of them with a schema it met before; a codec is not
    shared between threads)."""
    from shared.avro_columns import ColumnCodec
    from shared.codec import RowCodec

    cache: dict[str, tuple[Any, Any]] | None = getattr(_CODECS, "by_schema", None)
    if cache is None:
        cache = _CODECS.by_schema = {}
    got = cache.get(row_schema_json)
    if got is None:
        import json

        if len(cache) >= 64:
            cache.clear()
        row = RowCodec(json.loads(row_schema_json))
        got = cache[row_schema_json] = (row, ColumnCodec(row.schema))
    return got


class DesiredDecoder:
    """Decodes record batches of the Kafka source into :data:`DECODED_SCHEMA` (or
    :data:`ROUTED_SCHEMA`) rows; see :func:`decode_partition`. ``desired_topic`` may be a set
    of topics whose records are all desired records, for a batch of several sinks' records
    (:func:`services.mint.progress.decode_statements_on_driver`, :func:`decode_units`)."""

    def __init__(
        self,
        desired_topic: str | frozenset[str],
        row_schema_json: str | None = None,
        *,
        progress_only: bool = False,
        route_to: int | None = None,
        quarantine: list[tuple[int, int, int, str]] | None = None,
        only_wp: int | None = None,
    ) -> None:
        from shared.codec import MARKER

        self.desired_topic = desired_topic
        self.progress_only = progress_only
        self.route_to = route_to
        self.quarantine = list(quarantine or [])
        self.only_wp = only_wp
        #: rows of another writer schema are left to the write step (see decode_partition)
        self.resolve_later = route_to is not None
        codecs: tuple[Any, Any] = _row_codecs(row_schema_json) if row_schema_json else (None, None)
        self.row_codec, self.rows = codecs
        self.row_header = MARKER + self.row_codec.fingerprint if self.row_codec is not None else b""
        self.update_prefix, self.progress_prefix = desired_prefixes()
        self.updates, self.progress = body_codecs()
        self.out_schema = ROUTED_SCHEMA if route_to is not None else DECODED_SCHEMA
        #: the input rows of the last :meth:`decode`'s output, in order (None: every row)
        self.kept: Any = None

    def decode(self, rb: pa.RecordBatch, control_wps: Any = None) -> pa.RecordBatch:
        """``control_wps``: with ``route_to``, the writer partition of each input row should it
        be a control record, for a batch of several units' records (:func:`decode_units`)."""
        import numpy as np
        import pyarrow.compute as pc

        n = rb.num_rows
        topic = rb.column("topic")
        part = rb.column("partition").to_numpy(zero_copy_only=False).astype(np.int64)
        off = rb.column("offset").to_numpy(zero_copy_only=False).astype(np.int64)
        val = rb.column("value")
        if val.type != pa.binary():  # large_binary from Spark's Arrow, null when all are null
            val = val.cast(pa.binary())
        if isinstance(self.desired_topic, frozenset):  # several sinks' records (decode_statements_on_driver)
            desired = pc.fill_null(pc.is_in(topic, value_set=pa.array(sorted(self.desired_topic), pa.string())), False)
        else:
            desired = pc.fill_null(pc.equal(topic, pa.scalar(self.desired_topic, pa.string())), False)
        is_desired = desired.to_numpy(zero_copy_only=False)
        head = pc.binary_slice(val, 0, 11)
        is_update = is_desired & pc.fill_null(pc.equal(head, pa.scalar(self.update_prefix, pa.binary())), False).to_numpy(zero_copy_only=False)
        is_progress = is_desired & pc.fill_null(pc.equal(head, pa.scalar(self.progress_prefix, pa.binary())), False).to_numpy(zero_copy_only=False)

        kind = np.full(n, _K_CONTROL, np.int8)
        row = Column(n, pa.binary())
        tm = np.zeros(n, np.int64)
        has_tm = np.zeros(n, bool)
        diff = np.zeros(n, np.int64)
        has_diff = np.zeros(n, bool)
        fr = np.zeros(n, np.int64)
        has_fr = np.zeros(n, bool)
        closed = np.zeros(n, bool)
        err = Column(n, pa.string())
        fallback = is_desired & ~is_update & ~is_progress
        if self.progress_only:
            kind[is_update] = _K_SKIP
        else:
            iu = np.flatnonzero(is_update)
            d = self.updates.decode(val.take(pa.array(iu)), skip=11) if len(iu) else None
            if d is not None:
                ok = iu[d.ok]
                fallback[iu[~d.ok]] = True
                kind[ok] = _K_UPDATE
                tm[ok] = d.table["time"].to_numpy()
                diff[ok] = d.table["diff"].to_numpy()
                has_tm[ok] = has_diff[ok] = True
                self._rows(ok, d.table["row"].combine_chunks(), kind, row, err, fallback, part, off, topic)
        ip = np.flatnonzero(is_progress)
        if len(ip):
            d = self.progress.decode(val.take(pa.array(ip)), skip=11)
            good = d.ok.copy()
            pidx = ip[good]
            parts = d.table["partition"].to_numpy(zero_copy_only=False)
            frs = d.table["frontier"]
            neg = parts < 0  # refused by the per-record decoder: let it name the error
            fallback[ip[~good]] = True
            fallback[pidx[neg]] = True
            keep = pidx[~neg]
            kind[keep] = _K_PROGRESS
            fvals = frs.fill_null(0).to_numpy(zero_copy_only=False)[~neg]
            fvalid = frs.is_valid().to_numpy(zero_copy_only=False)[~neg]
            fr[keep] = fvals
            has_fr[keep] = fvalid
            closed[keep] = ~fvalid
        for i in np.flatnonzero(fallback):
            self._one(int(i), rb, val, kind, row, tm, has_tm, diff, has_diff, fr, has_fr, closed, err, part, off)
        if self.quarantine:
            for qp, qs, qe, why in self.quarantine:
                is_row = (kind == _K_UPDATE) | (kind == _K_UNRESOLVED)
                for i in np.flatnonzero(is_row & (part == qp) & (off >= qs) & (off < qe)):
                    r = row.get(int(i))
                    kind[i] = _K_BAD
                    err.set(int(i), _quarantined(str(topic[int(i)].as_py()), qp, int(off[i]), why, r, self.row_codec))
                    row.set(int(i), None)
        keep_rows = np.flatnonzero(kind != _K_SKIP)
        self.kept = keep_rows if len(keep_rows) < n else None
        control = kind == _K_CONTROL
        cols = {
            "topic": topic,
            "partition": rb.column("partition"),
            "offset": rb.column("offset"),
            "kind": pc.take(_kinds(), pa.array(np.where(kind == _K_SKIP, 0, kind).astype(np.int32))),
            "row": row.array(),
            "time": pa.array(tm, pa.int64(), mask=~has_tm),
            "diff": pa.array(diff, pa.int64(), mask=~has_diff),
            "frontier": pa.array(fr, pa.int64(), mask=~has_fr),
            "frontier_closed": pa.array(closed, pa.bool_()),
            "error": err.array(),
            "value": pc.if_else(pa.array(control), val, pa.nulls(n, pa.binary())),
        }
        out = pa.RecordBatch.from_pydict(cols, schema=DECODED_SCHEMA)
        if len(keep_rows) < n:
            out = out.take(pa.array(keep_rows))
            control = control[keep_rows]
            part = part[keep_rows]
        if self.route_to is None:
            return out
        wps = part.astype(np.int32)
        if control_wps is not None:
            wps[control] = np.asarray(control_wps if len(keep_rows) == n else control_wps[keep_rows])[control]
            return pa.RecordBatch.from_arrays([pa.array(wps, pa.int32()), *out.columns], schema=self.out_schema)
        if self.only_wp is not None or not control.any():
            wps[control] = self.only_wp if self.only_wp is not None else 0
            return pa.RecordBatch.from_arrays([pa.array(wps, pa.int32()), *out.columns], schema=self.out_schema)
        # Every control record to every writer partition.
        pieces = [pa.RecordBatch.from_arrays([pa.array(wps[~control], pa.int32()), *out.filter(pa.array(~control)).columns], schema=self.out_schema)]
        ctl = out.filter(pa.array(control))
        for w in range(self.route_to):
            pieces.append(pa.RecordBatch.from_arrays([pa.array(np.full(ctl.num_rows, w, np.int32)), *ctl.columns], schema=self.out_schema))
        return pa.Table.from_batches(pieces).combine_chunks().to_batches()[0] if pieces else out

    def _rows(self, idx: Any, rows: pa.Array, kind: Any, row: Column, err: Column, fallback: Any, part: Any, off: Any,
              topic: Any) -> None:
        """The rows of decoded updates ``idx``: canonical encodings, or the per-record path."""
        import numpy as np
        import pyarrow.compute as pc

        from shared.codec import MARKER

        if self.rows is None or self.row_codec is None:
            row.put(idx, rows)
            return
        heads = pc.binary_slice(rows, 0, 10)
        same = pc.fill_null(pc.equal(heads, pa.scalar(self.row_header, pa.binary())), False).to_numpy(zero_copy_only=False)
        if self.resolve_later:
            # Single-object encoded with another schema: the write step resolves it.
            framed = pc.fill_null(pc.equal(pc.binary_slice(rows, 0, 2), pa.scalar(MARKER, pa.binary())), False)
            long_enough = pc.fill_null(pc.greater_equal(pc.binary_length(rows), 10), False)
            other = np.asarray(pc.and_(framed, long_enough).to_numpy(zero_copy_only=False)) & ~same
            if other.any():
                oi = np.flatnonzero(other)
                kind[idx[oi]] = _K_UNRESOLVED
                row.put(idx[oi], rows.take(pa.array(oi)))
                same_or_other = same | other
            else:
                same_or_other = same
        else:
            same_or_other = same
        fast = np.flatnonzero(same)
        if len(fast):
            d = self.rows.decode(rows.take(pa.array(fast)), skip=10)
            ok = fast[d.ok]
            if len(ok):
                bodies = self.rows.encode(d.table)
                canon = pc.binary_join_element_wise(pa.scalar(self.row_header, pa.binary()), bodies, pa.scalar(b"", pa.binary()))
                row.put(idx[ok], canon)
            slow = np.concatenate([fast[~d.ok], np.flatnonzero(~same_or_other)])
        else:
            slow = np.flatnonzero(~same_or_other)
        from shared.errors import DecodeError

        for j in slow.tolist():
            i = int(idx[j])
            try:
                row.set(i, self.row_codec.canonical(rows[j].as_py()))
            except DecodeError as e:
                kind[i] = _K_BAD
                err.set(i, f"row does not match the collection schema at {topic[i].as_py()}/{int(part[i])}@{int(off[i])}: "
                           f"{e}: {describe_bytes(rows[j].as_py())}")

    def _one(self, i: int, rb: pa.RecordBatch, val: pa.Array, kind: Any, row: Column, tm: Any, has_tm: Any,
             diff: Any, has_diff: Any, fr: Any, has_fr: Any, closed: Any, err: Column, part: Any, off: Any) -> None:
        """The per-record decoder, for records the vectorised pass leaves to it."""
        from shared.desired import DesiredProgress, decode_desired
        from shared.errors import DecodeError

        v = val[i].as_py()
        where = f"{rb.column('topic')[i].as_py()}/{int(part[i])}@{int(off[i])}"  # a desired topic's
        if v is None and "headers" in rb.schema.names:
            gap = _gap(rb.column("headers")[i].as_py())
            if gap is not None:
                kind[i] = _K_GAP
                fr[i], tm[i] = gap
                has_fr[i] = has_tm[i] = True
                return
        if self.progress_only and v is not None and v[:11] == self.update_prefix:
            kind[i] = _K_SKIP
            return
        try:
            msg = decode_desired(v if v is not None else b"")
        except DecodeError as e:
            kind[i] = _K_BAD
            err.set(i, f"undecodable desired message at {where}: {e}: {describe_bytes(v, what='message')}")
            return
        if isinstance(msg, DesiredProgress):
            kind[i] = _K_PROGRESS
            closed[i] = msg.frontier.is_empty()
            if not closed[i]:
                fr[i] = _signed(msg.frontier.time or 0)
                has_fr[i] = True
            return
        kind[i] = _K_UPDATE
        tm[i], diff[i] = _signed(msg.time), msg.diff
        has_tm[i] = has_diff[i] = True
        if self.progress_only:
            kind[i] = _K_SKIP
            return
        if self.row_codec is None:
            row.set(i, msg.row)
            return
        fp = self.row_codec.codec.writer_fingerprint(msg.row)
        if self.resolve_later and fp is not None and not self.row_codec.codec.knows(fp):
            kind[i] = _K_UNRESOLVED  # another version of the schema: the write step resolves it
            row.set(i, msg.row)
            return
        try:
            row.set(i, self.row_codec.canonical(msg.row))
        except DecodeError as e:
            kind[i] = _K_BAD
            err.set(i, f"row does not match the collection schema at {where}: {e}: {describe_bytes(msg.row)}")


class Column:
    """A nullable column assembled from vectorised pieces and single values, by row index."""

    def __init__(self, n: int, type_: pa.DataType) -> None:
        import numpy as np

        self.n = n
        self.type = type_
        self._pieces: list[tuple[Any, pa.Array]] = []
        self._single: dict[int, Any] = {}
        self._np = np

    def put(self, idx: Any, values: pa.Array) -> None:
        """Rows ``idx`` take ``values`` (same length)."""
        if len(idx):
            self._pieces.append((idx, values))

    def set(self, i: int, value: Any) -> None:
        self._single[i] = value

    def get(self, i: int) -> Any:
        if i in self._single:
            return self._single[i]
        for idx, values in reversed(self._pieces):
            hit = self._np.flatnonzero(idx == i)
            if len(hit):
                return values[int(hit[0])].as_py()
        return None

    def array(self) -> pa.Array:
        np = self._np
        if not self._pieces and not self._single:
            return pa.nulls(self.n, self.type)
        arrays: list[pa.Array] = []
        pos = np.full(self.n, -1, np.int64)
        base = 0
        for idx, values in self._pieces:
            pos[idx] = base + np.arange(len(idx))
            arrays.append(values.cast(self.type) if values.type != self.type else values)
            base += len(idx)
        if self._single:
            keys = list(self._single)
            arrays.append(pa.array([self._single[k] for k in keys], self.type))
            pos[keys] = base + np.arange(len(keys))
            base += len(keys)
        arrays.append(pa.nulls(1, self.type))
        pos[pos < 0] = base
        return pa.concat_arrays(arrays).take(pa.array(pos))


ROUTED_SCHEMA = pa.schema([pa.field("wp", pa.int32()), *DECODED_SCHEMA])
ROUTED_DDL = "wp int, " + DECODED_DDL


def describe_bytes(row: bytes | None, limit: int = 256, what: str = "row") -> str:
    """A row (or message) that does not decode, as what it is: its bytes in hex (the first
    ``limit``)."""
    if not row:
        return f"no {what} bytes"
    shown = row[:limit].hex()
    return f"{what} bytes {shown}" + (f"... ({len(row)} bytes)" if len(row) > limit else "")


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
    from shared.spark.kafka_source import HISTORY_GAP_HEADER

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


def planned_ranges(
    files: Any, batch_id: int, end: Mapping[str, Any] | None = None
) -> list[tuple[str, int, int, int]] | None:
    """``(topic, partition, start, end)`` of micro-batch ``batch_id`` of a query reading
    ``shardsink-kafka``, from the offsets Spark logged for the batch (``end``, when the caller
    read them already) and the one before it (``files``: the query's
    :class:`services.runtime.driver_state.CheckpointFiles`). None when the log does not hold both (the
    first batch of a checkpoint starts at the source's initial offsets, which Spark does not
    log): read the batch's DataFrame then."""
    from services.runtime.driver_state import planned_offsets
    from shared.kafka_offsets import offsets_from_json, pending

    end = end if end is not None else planned_offsets(files, batch_id)
    start = planned_offsets(files, batch_id - 1) if batch_id > 0 else None
    if end is None or start is None:
        return None
    return pending(offsets_from_json(start), offsets_from_json(end))


def read_ranges_on_driver(
    kafka: Any, ranges: Sequence[tuple[str, int, int, int]], skip_prefixes: Mapping[str, bytes] | None = None
) -> pa.Table:
    """The records of ``ranges`` read on the driver (columns ``topic, partition, offset,
    value``); ``skip_prefixes`` as the source's ``skipValuePrefixes``."""
    from shared.spark.kafka_ranges import Range
    from shared.spark.kafka_ranges import read_ranges as read_together
    from shared.spark.kafka_source import _arrow_schema

    skip = skip_prefixes or {}
    # Every range read together (one consumer assignment for all); the first that fails raises.
    got = read_together(kafka, [Range(t, p, lo, hi) for t, p, lo, hi in ranges], schema=_arrow_schema(), skip_prefixes=skip,
                       values_only=True)
    tables: list[pa.Table] = []
    for batches in got:
        if isinstance(batches, Exception):
            raise batches
        if batches:
            tables.append(pa.Table.from_batches([b.select(["topic", "partition", "offset", "value"]) for b in batches]))
    return pa.concat_tables(tables) if tables else _empty_raw()


def read_planned_batch(
    files: Any, batch_id: int, kafka: Any, skip_prefixes: Mapping[str, bytes] | None = None
) -> pa.Table | None:
    """The records of micro-batch ``batch_id`` of a query reading ``shardsink-kafka``, read on
    the driver straight from Kafka by the offsets Spark logged (:func:`planned_ranges`),
    without running a Spark job: for the control messages of mint and append, a job
    (planning, a task, a Python worker round trip) costs 100-400 ms for a handful of records,
    a pooled consumer's read a few milliseconds. The source reads exactly these ranges too, so
    the records are the same. Columns ``topic, partition, offset, value``; ``skip_prefixes``
    as the source's ``skipValuePrefixes``. None when the log does not hold the batch's
    offsets: read the batch's DataFrame then."""
    ranges = planned_ranges(files, batch_id)
    return None if ranges is None else read_ranges_on_driver(kafka, ranges, skip_prefixes)


#: Raw records as the driver reads them (:func:`read_planned_batch`).
RAW_SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("value", pa.binary())])


def _empty_raw() -> pa.Table:
    return RAW_SCHEMA.empty_table()


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


def decode_units(
    units: Sequence[tuple[str, Sequence[pa.RecordBatch], int]], row_schema_json: str | None, route_to: int
) -> list[pa.RecordBatch]:
    """Each ``(desired topic, raw batches, writer partition)`` decoded as
    ``decode_partition(topic, row_schema_json, route_to=route_to, only_wp=wp)`` decodes it, as
    one batch of :data:`ROUTED_SCHEMA` per unit (its batches' rows, in order), the units
    decoded as one batch: a write task runs many sinks' units of a few records each, and a
    decoder's fixed cost (about 2.5 ms, whatever the records) was a quarter of the write
    workers' CPU at 100 sinks. Every unit's desired topic is desired in the batch, which is
    what each unit's alone makes of its records as long as no unit holds records of another
    unit's desired topic that are not of its own (a write unit holds its desired topic's and
    the descriptions topic's)."""
    decoder = DesiredDecoder(frozenset(t for t, _, _ in units), row_schema_json, route_to=route_to)
    return decode_together(decoder, [batches for _, batches, _ in units], [wp for _, _, wp in units])


def decode_together(
    decoder: DesiredDecoder, inputs: Sequence[Sequence[pa.RecordBatch]], control_wps: Sequence[int] | None = None
) -> list[pa.RecordBatch]:
    """Per input (raw batches of the Kafka source's columns, or ``topic, partition, offset,
    value``), its rows of one ``decoder.decode`` of all inputs' rows together, in order;
    ``control_wps``: per input, the writer partition of its control records."""
    import numpy as np

    parts = [(i, b) for i, batches in enumerate(inputs) for b in batches if b.num_rows]
    if not parts:
        return [pa.RecordBatch.from_pylist([], schema=decoder.out_schema) for _ in inputs]
    batch = pa.Table.from_batches([b for _, b in parts]).combine_chunks().to_batches()[0]
    owner = np.repeat(np.array([i for i, _ in parts]), [b.num_rows for _, b in parts])
    wps = None if control_wps is None else np.array(control_wps, np.int32)[owner]
    out = decoder.decode(batch, control_wps=wps)
    if decoder.kept is not None:
        owner = owner[decoder.kept]
    return [out.filter(pa.array(owner == i)) for i in range(len(inputs))]


def u64(v: int | None) -> int | None:
    return None if v is None else v & (2**64 - 1)


class Delivery:
    """One message's delivery (:meth:`ControlProducer.send_tracked`): set by librdkafka's
    callback, which a flush or poll of the producer serves."""

    __slots__ = ("deadline", "done", "error")

    def __init__(self, deadline: float) -> None:
        #: ``time.monotonic()`` after which :meth:`ControlProducer.settle` stops waiting for it
        self.deadline = deadline
        self.done = threading.Event()
        self.error: Any = None

    def __call__(self, err: Any, _msg: Any) -> None:
        self.error = err
        self.done.set()

    @property
    def ok(self) -> bool:
        """Acknowledged by the broker."""
        return self.done.is_set() and self.error is None


class ControlProducer:
    """Produces control messages (descs, batches, frontiers) from a driver; :meth:`flush` is
    called before the micro-batch that decided them commits, and raises if any failed."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self._errors: list[Any] = []

    @staticmethod
    def create(kafka_settings: Any, client_id: str, *, auto_create_topics: bool = True,
               config: Mapping[str, Any] | None = None) -> ControlProducer:
        """``auto_create_topics=False``: a topic missing at a metadata refresh stays missing (a
        producer that only writes topics made beforehand, and that others may delete: the
        controller, whose subscribers delete their output topics). ``config``: more librdkafka
        options over these defaults (the user's pass-through options still win)."""
        from confluent_kafka import Producer

        import logging

        from services.runtime.settings import faults_from_env

        # librdkafka's own log lines go through Python logging (delivered on poll/flush) rather
        # than straight to stderr, so a producer outliving its broker does not spam the console.
        conf = kafka_settings.config(
            **{
                "enable.idempotence": True,
                "client.id": client_id,
                "linger.ms": 2,
                "logger": logging.getLogger("shardsink.kafka.client"),
                **({} if auto_create_topics else {"allow.auto.create.topics": False}),
                **(config or {}),
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

    def send_tracked(self, topic: str, value: bytes, key: bytes | None = None, timeout_s: float = 5.0) -> Delivery | None:
        """Produce one message without waiting for it, from any thread: its :class:`Delivery`
        (given ``timeout_s`` from now; :meth:`settle` waits for it), None when it could not be
        produced."""
        import logging

        from confluent_kafka import KafkaException

        d = Delivery(time.monotonic() + timeout_s)
        try:
            self.producer.produce(topic, value=value, key=key, on_delivery=d)
        except (BufferError, KafkaException, ValueError) as e:
            logging.getLogger("shardsink.kafka").warning("could not produce to %s: %s", topic, e)
            return None
        return d

    def settle(self, deliveries: Sequence[Delivery]) -> None:
        """Wait until each delivery is acknowledged, has failed or is past its deadline (the
        callbacks of those done already are served first, whatever their deadline)."""
        self.producer.poll(0)
        for d in deliveries:
            while not d.done.is_set() and time.monotonic() < d.deadline:
                self.producer.flush(0.05)  # serves the callbacks of every thread's messages

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every message sent is delivered: :class:`KafkaTimeoutError` when some
        are still pending after ``timeout_s``, :class:`KafkaDeliveryError` when any failed
        (both transient: the caller's step fails and is retried)."""
        from shared.errors import KafkaDeliveryError, KafkaTimeoutError

        deadline = time.monotonic() + timeout_s
        while self.producer.flush(0.5) > 0:
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"expected control messages delivered within {timeout_s}s, found some pending")
        if self._errors:
            errs, self._errors = self._errors, []
            raise KafkaDeliveryError(f"expected control messages delivered, found errors: {errs[:3]}")
