"""The delta-rs peer's table writer: a desired topic appended to a Delta table, exactly once.

What a Python user would write to land a desired topic in a lakehouse table without
shardsink: confluent-kafka for the records, delta-rs (``deltalake``) for the table, on the
same S3 server as the sink. ``bench/bench_sink.py`` runs one topic through it
(``deltalake_worker``), ``bench/bench_sinks.py --peer deltalake`` many topics in one process;
both decode as the sink does, so the peer's work per record is the sink's, and the
difference lies in how the records reach storage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

#: Prefix of the peer's Delta transaction app ids: one per desired partition, whose version is the
#: last offset of that partition the table holds.
DELTA_APP = "bench-deltalake"


def delta_storage_options(env: Mapping[str, str] | os._Environ[str]) -> dict[str, str]:
    """delta-rs's object store settings for the embedded S3 server (the services' endpoint).
    No unsafe-rename setting: delta-rs commits with a conditional put, which moto supports."""
    return {
        "AWS_ENDPOINT_URL": env["SHARDSINK_S3_ENDPOINT"],
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": env.get("AWS_DEFAULT_REGION", "us-east-1"),
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
    }


def delta_row_schema(row_schema: Mapping[str, Any]) -> Any:
    """A peer table's columns: the collection's row columns, then ``_time`` and ``_diff``
    (``_time`` signed: Delta has no unsigned long)."""
    import pyarrow as pa

    from shared.avro_columns import ColumnCodec

    return pa.schema([*ColumnCodec(row_schema).arrow_schema, pa.field("_time", pa.int64()),
                      pa.field("_diff", pa.int64())])


class LeastProgress:
    """A topic's desired frontier as a peer holds it: per partition the latest progress
    statement written, and the least over the topic's partitions once each has one."""

    def __init__(self, partitions: Iterable[int]) -> None:
        self.partitions = frozenset(partitions)
        self.latest: dict[int, int] = {}

    def absorb(self, decoded: Any) -> None:
        """The progress statements of ``decoded`` (rows of ``services.sinkio.DECODED_SCHEMA``),
        now written."""
        import pyarrow.compute as pc

        from services.sinkio import KIND_PROGRESS

        prog = decoded.filter(pc.equal(decoded.column("kind"), KIND_PROGRESS))
        for p, f in zip(prog.column("partition").to_pylist(), prog.column("frontier").to_pylist(), strict=True):
            if f is not None:
                self.latest[p] = max(self.latest.get(p, f), f)

    def held(self) -> int | None:
        """The least progress over the partitions (None until every partition's is written)."""
        return min(self.latest.values()) if len(self.latest) == len(self.partitions) else None


class DeltaTopic:
    """One desired topic's Delta table (created if missing), appended to by :meth:`write`, and
    the desired frontier it holds.

    One writer per table; a table is written by one thread at a time (different tables may be
    written side by side: delta-rs releases the GIL while it commits)."""

    def __init__(self, topic: str, uri: str, row_schema: Mapping[str, Any], partitions: Iterable[int],
                 storage_options: Mapping[str, str]) -> None:
        from deltalake import DeltaTable

        from services.sinkio import DesiredDecoder
        from shared.avro_columns import ColumnCodec

        self.topic = topic
        self.schema = delta_row_schema(row_schema)
        opts = dict(storage_options)
        if not DeltaTable.is_deltatable(uri, opts):
            DeltaTable.create(uri, self.schema, storage_options=opts)
        self.table = DeltaTable(uri, storage_options=opts)
        self.app = {p: f"{DELTA_APP}-{topic}-{p}" for p in partitions}
        self.rows = ColumnCodec(row_schema)
        self.decoder = DesiredDecoder(topic)
        #: the progress statements the table holds
        self.progress = LeastProgress(self.app)
        self.bad = 0

    def positions(self, start: Mapping[int, int]) -> dict[int, int]:
        """Where to read each partition: after the table's transaction version of it (the last
        offset an earlier writer committed), else at ``start``."""
        pos = {}
        for p, o in start.items():
            v = self.table.transaction_version(self.app[p])
            pos[p] = o if v is None else v + 1
        return pos

    def held(self) -> int | None:
        """The least progress over the topic's partitions the table holds (None until every
        partition's progress is)."""
        return self.progress.held()

    def write(self, msgs: list[Any]) -> dict[str, Any] | None:
        """Append one poll's records of this topic (confluent-kafka messages, in offset order
        per partition), exactly once:

        1. read the table's last transaction version of every partition in the poll
           (``update_incremental`` then ``transaction_version``) and drop the records at or
           below it: an earlier commit holds them (delta-rs does not refuse a repeated
           transaction version itself, delta-rs issue 2580; the writer checks before it commits);
        2. decode the rest as the sink does: the desired messages with the write service's
           vectorised decoder (``services.sinkio.DesiredDecoder``), the rows of the updates with
           the collection's column codec (``shared.avro_columns.ColumnCodec``);
        3. append the updates (row columns, ``_time``, ``_diff``) with one ``write_deltalake``
           commit whose ``app_transactions`` hold, per partition, the poll's last offset;
        4. only then count the progress statements of the poll as visible (the updates below
           them are committed).

        A poll of progress statements only makes no commit (nothing to write; re-reading them
        after a restart is harmless). Returns the poll's report (records, updates, bad rows so
        far, the desired frontier the table now holds, commit seconds, table version, wall time
        after the commit), or None when every record was held already."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        from deltalake import CommitProperties, Transaction, write_deltalake

        from services.sinkio import KIND_UPDATE

        dt = self.table
        part = np.fromiter((m.partition() for m in msgs), np.int32, len(msgs))
        off = np.fromiter((m.offset() for m in msgs), np.int64, len(msgs))
        # 1. exactly once: what an earlier commit holds is not written again.
        dt.update_incremental()
        keep = np.ones(len(msgs), bool)
        for p in np.unique(part).tolist():
            done = dt.transaction_version(self.app[p])
            if done is not None:
                keep &= (part != p) | (off > done)
        if not keep.all():
            idx = np.flatnonzero(keep)
            msgs = [msgs[i] for i in idx]
            part, off = part[idx], off[idx]
            if not msgs:
                return None
        # 2. decode as the sink does.
        rb = pa.RecordBatch.from_pydict({
            "topic": pa.array([self.topic] * len(msgs), pa.string()),
            "partition": pa.array(part, pa.int32()),
            "offset": pa.array(off, pa.int64()),
            "value": pa.array([m.value() for m in msgs], pa.binary()),
        })
        dec = self.decoder.decode(rb)
        upd = dec.filter(pc.equal(dec.column("kind"), KIND_UPDATE))
        table = self.schema.empty_table()
        if upd.num_rows:
            d = self.rows.decode(upd.column("row"), skip=10)  # single-object encoded: a 10-byte header
            self.bad += len(d.errors)
            ok = pa.array(d.ok)
            table = pa.Table.from_arrays(
                [*d.table.columns, upd.column("time").filter(ok), upd.column("diff").filter(ok)], schema=self.schema)
        # 3. one append commit, with every partition's last offset as its transaction version.
        t_commit = time.time()
        if table.num_rows:
            last = {p: int(off[part == p].max()) for p in np.unique(part).tolist()}
            write_deltalake(dt, table, mode="append", commit_properties=CommitProperties(
                app_transactions=[Transaction(self.app[p], v) for p, v in last.items()]))
        # 4. the progress of the poll is visible now.
        self.progress.absorb(dec)
        return {"rows": len(msgs), "updates": table.num_rows, "bad": self.bad, "frontier": self.held(),
                "commit_s": round(time.time() - t_commit, 4), "version": dt.version(), "t": time.time()}
