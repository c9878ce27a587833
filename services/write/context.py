"""The write step's view of the shard, kept per executor process and sink
(:class:`ShardContext`): the shard handle, the writer partitions' state files, and the codecs
of the collection's current row schema, which it follows while the sink runs.

What the step (:mod:`services.write.executor`) asks of it: resolve desired rows to the current
schema (:meth:`ShardContext.resolve_rows`), start a partition from the shard's contents
(:meth:`ShardContext.start`), read back what the shard gained since the persist frontier
(:meth:`ShardContext.read_back`: rows of the shard -> keys, times and diffs of one writer
partition, :class:`Rows`) and stage a decision as data objects (:meth:`ShardContext.stage`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from services.sinkio import KIND_BAD, KIND_UNRESOLVED, KIND_UPDATE, describe_bytes
from services.write import heads
from services.write.job import WriteJob
from shared.avro_arrow import arrow_to_rows
from shared.avro_columns import ColumnCodec
from shared.codec import MARKER, RowCodec, fingerprint
from shared.desired import row_partition
from shared.errors import DecodeError, EncodeError, ShardsinkError, SinkProtocolError
from shared.frontier import Frontier
from shared.shard import DIFF, ERROR, TIME, Shard, conform_part, schema_view
from shared.sink_messages import AppendedBatch
from shared.write_state import Stage, WriteState, error_partition
from shared.spark.state_files import WriterStateFiles

log = logging.getLogger("shardsink.write")

_TAG = re.compile(r"-w(\d+)of(\d+)\.parquet$")


def part_tag(key: str) -> tuple[int, int] | None:
    """``(partition, count)`` of a data object staged by a writer partition, else None."""
    m = _TAG.search(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Rows:
    """Keys, times and diffs read back for a writer partition: data rows and error rows, and
    ``unwritable``: rows of the shard that hold a value the schema cannot hold, as
    ``(reason, time, diff)`` (see :meth:`ShardContext.keys_of`)."""

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


class ShardContext:
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
        self.job = job
        self.shard = Shard(job.settings.store(), job.sink.collection_id, grace_ms=job.settings.grace_ms)
        self.states = WriterStateFiles(job.checkpoint, job.settings.s3)
        s3 = job.settings.s3
        #: names the shard among the heads the write tasks on this host tell each other
        self.heads_key = f"{s3.endpoint}|{s3.bucket}|{s3.prefix}|{self.shard.prefix}"
        self._columns_of: dict[bytes, Any] = {}
        # A sink's units land on any of the executor's Python workers, so each worker makes the
        # sink's context once, all of them at a restart: the search for the head starts at the
        # state another worker read (two GETs where the shard's hint costs three or more).
        self._take(self._refresh())

    def _refresh(self, enough: Any = None) -> Any:
        """The shard's head (with ``enough``: the first state that passes it), searched from the
        newest state another write task on this host read (:mod:`services.write.heads`), which
        it then tells in turn."""
        told = heads.heard(self.heads_key)
        state = self.shard.refresh(enough=enough, start_at=told)
        if state.seqno != told:
            heads.tell(self.heads_key, state.seqno)
        return state

    def _take(self, state: Any) -> None:
        """Codecs of ``state``'s current schema, with its earlier versions as writer schemas."""
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
        return fingerprint(schema)

    def _column_codec(self, fp: bytes) -> Any:
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
    def of(job: WriteJob) -> ShardContext:
        k = (job.sink.sink_id, job.sink.epoch, job.sink.collection_id)
        ctx = _CONTEXTS.get(k)
        if ctx is None:
            ctx = _CONTEXTS[k] = ShardContext(job)
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

    def read_back(self, ws: WriteState, at_least: Frontier | None = None, appended: AppendedBatch | None = None) -> None:
        """Absorb (negated) everything the shard gained since the persist frontier.
        ``at_least``: an upper the shard is known to have reached (the lower of a new
        description, which mint read from the shard or an announcement): a head cached in this
        process that has reached it serves (a sink's other writer partition read it moments
        ago), with no round trip to the store, or else the first state that reached it (one
        GET, no probe beyond). A newer head only makes the description stale, which the
        compare-and-append refuses. ``appended``: what the append that reached ``at_least``
        added to the shard (the description carries it): when it starts at the persist
        frontier, it serves instead of the state (:meth:`follow_appended`)."""
        persist = ws.persist_frontier
        if persist.time is None:
            return
        if at_least is not None and appended is not None and self.follow_appended(ws, at_least, appended):
            return
        state = self.shard.cached() if at_least is not None else None
        if state is None or (at_least is not None and state.upper.less_than(at_least)):
            # With a lower to reach, the first state that reached it serves (no probe beyond);
            # the search starts at the newest state another write task on this host read.
            state = self._refresh(None if at_least is None else (lambda st: not st.upper.less_than(at_least)))
        self.follow(ws, state)
        if not persist.less_than(state.upper):
            return
        self._absorb_batch(ws, state.keys_above(persist), state.upper, state)

    def _absorb_batch(self, ws: WriteState, keys: list[str], upper: Frontier, state: Any = None) -> None:
        """Absorb (negated) the rows of ``keys`` from the persist frontier up to ``upper``, and
        move the persist frontier there (``state``: the head the keys come from, if read)."""
        persist = ws.persist_frontier
        r = self.read_objects(ws, keys, persist.time, upper, state)
        ws.absorb_persist_batch(
            persist, upper, r.keys, r.times, r.diffs, error_keys=r.error_keys,
            error_times=r.error_times, error_diffs=r.error_diffs,
        )
        self.absorb_unwritable(ws, r)

    def follow_appended(self, ws: WriteState, upper: Frontier, appended: AppendedBatch) -> bool:
        """Absorb the batch an append added from the persist frontier up to ``upper``, from what
        the append announced instead of the shard's state: the same objects the state lists
        above that frontier (:meth:`shared.state.ShardState.keys_above`), so the same rows.
        Only when it needs nothing else of the state: it starts at the persist frontier, the
        state had the row schema versions this context knows, and each object is this
        partition's own staged one or tagged with a writer partition (a merged or untagged
        object is routed by the state's schemas). Returns whether it did; False leaves
        everything as it was, for a read of the state."""
        persist = ws.persist_frontier
        n = self.job.partitions
        if (appended.lower != persist or not persist.less_than(upper) or appended.schema_versions != self._nversions
                or not all(ws.staged(k) or ((tag := part_tag(k)) is not None and tag[1] == n) for k in appended.parts)):
            return False
        self._absorb_batch(ws, list(appended.parts), upper)
        return True

    def stage(self, ws: WriteState, decision: Stage) -> str:
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
        # The correction buffer's updates are consolidated by (key, time), and a canonical key
        # is one row: consolidating them again changes nothing (error rows: their texts may meet).
        staged = shard.stage(pa.concat_tables(parts), tag=f"w{ws.partition}of{self.job.partitions}", schema=self.schema,
                             consolidated=not len(errs))
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
