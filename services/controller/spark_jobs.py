"""The controller's data-heavy work as Spark jobs: merges, gc sweeps, peeks, subscribe snapshots.

With ``SHARDSINK_CONTROLLER_SPARK_MASTER`` set (``spark://host:7077``, ``k8s://...``,
``local[N]``), the controller process is also a Spark driver in client mode, and work on a
shard whose visible data reaches ``SHARDSINK_CONTROLLER_SPARK_MIN_BYTES`` runs on the
executors; smaller work, and everything when the setting is empty (the default), runs in the
controller's process as before. The command loop, the catalog and every shard state write stay
in the controller: executors read and write data objects only.

One job shape serves merges, peeks and snapshots (a shuffle of Arrow, never of rows)::

    stage 1  one task per group of parts (about 64 MB each, at least one per core): read
             the parts, advance their times to since (merge) or keep those at or before
             as_of (peek, snapshot), split the rows by bucket
             (:func:`shared.spark.shardsink_source.row_buckets`: equal rows, equal bucket) and
             emit ``(bucket, Arrow IPC stream)`` per bucket
    shuffle  ``partitionBy(buckets)``: bucket b is partition b
    stage 2  one task per bucket: read the bucket's Arrow, consolidate
             (:func:`shared.shard.merge_table` / :func:`shared.shard.consolidate`), then
             - merge: write the merged parts (``shards/<id>/data/``) and return them; the
               controller builds the merged batch and swaps it in by one conditional state
               write (:meth:`shared.shard.Shard.compact`), or deletes the parts when the
               batches it replaces are gone;
             - peek: write the bucket as ``peeks/<collection>/<digest>/part-<bucket>.parquet``
               and return its key and counts; the answer names the folder (format
               ``parquet-dataset``), or carries the rows inline when they are few;
             - snapshot: encode each row as a subscribe message on the executor; a range
               sort of ``(error?, row bytes, diff)`` gives the in-process step's exact
               order, and the controller streams it partition by partition to Kafka
               (``toLocalIterator``), so a subscribe's recovery counts the same messages.

A gc sweep lists and deletes unreferenced data objects in 16 tasks, one per first hex digit
of the object names (``data/<uuid>...``), with the protected keys broadcast.

A job that fails, or does not finish within ``SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS`` (a
cluster with no free cores runs nothing: its job group is cancelled), is logged and the work
is done in the controller's process instead; :attr:`ControllerSpark.jobs` counts both.
"""

from __future__ import annotations

import io
import json
import logging
import math
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from services.runtime.settings import controller_default
from shared.frontier import Frontier
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.shard import (
    DIFF,
    ERROR,
    MERGE_ROWS_PER_PART,
    TIME,
    SchemaView,
    Shard,
    conform_part,
    consolidate,
    decode_part,
    dictionary_columns,
    merge_table,
    merged_batch,
    schema_view,
)
from shared.state import BatchMeta, Part

if TYPE_CHECKING:
    from services.runtime.settings import ServiceSettings

log = logging.getLogger("shardsink")

T = TypeVar("T")
U = TypeVar("U")

#: A stage-1 task reads about this many bytes of parts.
TASK_BYTES = 64 * 1024 * 1024
#: A peek or snapshot bucket holds about this many rows.
RESULT_ROWS_PER_BUCKET = 1_000_000
#: Sweep tasks: one per first hex digit of a data object's name.
SWEEP_PREFIXES = "0123456789abcdef"


@dataclass(frozen=True, slots=True)
class SparkJobSettings:
    """Where and when the controller runs Spark jobs (parsed once in ``__main__``)."""

    #: The Spark master (None or '': everything in the controller's process).
    master: str | None = controller_default("spark.master")
    #: Merges, peeks and snapshots reading at least this many bytes of parts run on Spark.
    min_bytes: int = controller_default("spark.min_bytes")
    #: gc of a shard with at least this many data objects sweeps on Spark.
    gc_min_objects: int = controller_default("spark.gc_min_objects")
    #: A job still running after this long is cancelled and the work done in-process.
    timeout_ms: int = controller_default("spark.timeout_ms")

    def __post_init__(self) -> None:
        if self.min_bytes < 0 or self.gc_min_objects < 0 or self.timeout_ms <= 0:
            raise ValueError(
                "expected min_bytes >= 0, gc_min_objects >= 0 and timeout_ms > 0, found "
                f"{self.min_bytes}, {self.gc_min_objects}, {self.timeout_ms}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.master)


# ==================================================================================================
# what the tasks run (module functions of plain values: they are pickled to the executors)
# ==================================================================================================
@dataclass(frozen=True, slots=True)
class ShardJob:
    """What every task of a job needs to know (no clients: each task makes its own)."""

    s3: S3Settings
    shard_id: str
    root: str
    #: The row schema (Avro, as JSON) the job reads every part as and writes its parts in.
    avro: str
    buckets: int
    #: merge: times advanced to ``at``; read: rows at or before ``at`` (None: all of them).
    mode: str
    at: int | None

    def store(self) -> S3ObjectStore:
        return S3ObjectStore(self.s3)

    @property
    def view(self) -> SchemaView:
        return schema_view(json.loads(self.avro))

    @property
    def schema(self) -> pa.Schema:
        """The part schema."""
        return self.view.part_schema

    @property
    def row_columns(self) -> tuple[str, ...]:
        return tuple(self.view.row_columns)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _from_ipc(blobs: Iterable[bytes], schema: pa.Schema) -> pa.Table:
    tables = [pa.ipc.open_stream(pa.py_buffer(b)).read_all() for b in blobs]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def split_task(job: ShardJob, keys: Sequence[str]) -> Iterator[tuple[int, bytes]]:
    """Stage 1: the rows of ``keys`` (times advanced, or filtered at as_of) per bucket."""
    from shared.spark.shardsink_source import row_buckets
    from shared.spark.worker_heap import settle

    settle()
    store = job.store()
    view = job.view

    def one(key: str) -> pa.Table:
        t = conform_part(decode_part(store.get(key)), view)  # any schema version
        if job.at is not None and t.num_rows:
            at = pa.scalar(job.at, pa.uint64())
            if job.mode == "merge":
                t = t.set_column(t.schema.get_field_index(TIME), TIME, pc.max_element_wise(t[TIME], at))
            else:
                t = t.filter(pc.less_equal(t[TIME], at))
        return t

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(keys)))) as ex:
        tables = list(ex.map(one, keys))
    table = pa.concat_tables(tables) if tables else job.schema.empty_table()
    if table.num_rows == 0:
        return
    b = row_buckets(table, [*job.row_columns, ERROR], job.buckets)
    order = np.argsort(b, kind="stable")
    counts = np.bincount(b, minlength=job.buckets)
    table = table.take(pa.array(order))
    off = 0
    for bucket, n in enumerate(counts.tolist()):
        if n:
            yield bucket, _ipc(table.slice(off, n))
        off += n


def merge_task(job: ShardJob, bucket: int, rows: Iterable[tuple[int, bytes]]) -> Iterator[dict[str, Any]]:
    """Stage 2 of a merge: consolidate the bucket and write it as parts (their metadata)."""
    table = _from_ipc((blob for _, blob in rows), job.schema)
    assert job.at is not None
    table = merge_table(table, Frontier.at(job.at), job.row_columns, job.schema)
    if table.num_rows == 0:
        return
    shard = Shard(job.store(), job.shard_id, root=job.root)
    for part in shard.write_parts(table, view=job.view):
        yield part.to_json()


def _consolidated_bucket(job: ShardJob, rows: Iterable[tuple[int, bytes]]) -> pa.Table:
    table = _from_ipc((blob for _, blob in rows), job.schema)
    return consolidate(table, [*job.row_columns, ERROR])


def peek_task(job: ShardJob, folder: str, limit: int | None, bucket: int,
              rows: Iterable[tuple[int, bytes]]) -> Iterator[dict[str, Any]]:
    """Stage 2 of a peek: the bucket's consolidated rows as one Parquet object (at most
    ``limit`` of them); returns its key, row count, Arrow size and error rows."""
    table = _consolidated_bucket(job, rows).select([*job.row_columns, ERROR, DIFF])
    if limit is not None:
        table = table.slice(0, limit)
    if table.num_rows == 0:
        return
    key = f"{folder}part-{bucket:05d}.parquet"
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="snappy", use_dictionary=dictionary_columns(table))
    job.store().put(key, buf.getvalue())
    yield {"bucket": bucket, "key": key, "rows": table.num_rows, "nbytes": table.nbytes,
           "errors": table.num_rows - table[ERROR].null_count}


def snapshot_task(job: ShardJob, sid: str, row_schema: dict[str, Any], bucket: int,
                  rows: Iterable[tuple[int, bytes]]) -> Iterator[tuple[tuple[bool, bytes, int], bytes]]:
    """Stage 2 of a subscribe snapshot: each consolidated row as its subscribe message,
    keyed by the in-process step's sort key ``(error?, row or error bytes, diff)``."""
    from shared.avro_arrow import arrow_to_rows
    from shared.codec import RowCodec, message_codec

    table = _consolidated_bucket(job, rows)
    if table.num_rows == 0:
        return
    assert job.at is not None
    enc = message_codec("subscribe_output").encode
    codec = RowCodec(row_schema)
    ok_mask = pc.is_null(table[ERROR])
    ok = table.filter(ok_mask)
    for r, d in zip(arrow_to_rows(ok.select(list(job.row_columns)), codec.schema), ok[DIFF].to_pylist(), strict=True):
        row = codec.encode(r)
        msg = enc({"subscribe_id": sid, "time": job.at, "progressed": False, "diff": int(d), "row": row, "error": None})
        yield (False, row, int(d)), bytes(msg)
    if ok.num_rows < table.num_rows:
        bad = table.filter(pc.invert(ok_mask))
        for e, d in zip(bad[ERROR].to_pylist(), bad[DIFF].to_pylist(), strict=True):
            msg = enc({"subscribe_id": sid, "time": job.at, "progressed": False, "diff": int(d), "row": None,
                       "error": str(e)})
            yield (True, str(e).encode(), int(d)), bytes(msg)


def sweep_task(s3: S3Settings, data_prefix: str, protected: Any, expired: frozenset[str], cutoff_ms: int,
               hex_digit: str) -> Iterator[int]:
    """List ``data_prefix + hex_digit`` and delete what is neither protected nor young, and
    the expired parts under it; returns how many it deleted."""
    store = S3ObjectStore(s3)
    keep = protected.value if hasattr(protected, "value") else protected
    prefix = data_prefix + hex_digit
    doomed = {i.key for i in store.list(prefix) if i.key not in keep and i.last_modified_ms <= cutoff_ms}
    doomed |= {k for k in expired if k.startswith(prefix)}
    if doomed:
        store.delete_many(sorted(doomed))
    yield len(doomed)


# ==================================================================================================
# the driver side
# ==================================================================================================
@dataclass(frozen=True, slots=True)
class StoredPeek:
    """A peek answered by Spark: the Parquet objects of its folder, in bucket order."""

    folder: str
    objects: tuple[dict[str, Any], ...]

    @property
    def rows(self) -> int:
        return sum(int(o["rows"]) for o in self.objects)

    @property
    def errors(self) -> int:
        return sum(int(o["errors"]) for o in self.objects)

    @property
    def nbytes(self) -> int:
        return sum(int(o["nbytes"]) for o in self.objects)


class SparkJobError(RuntimeError):
    """A controller job failed or timed out on Spark (the work is then done in-process)."""


class ControllerSpark:
    """The controller's Spark driver: a session started in the background, the jobs above, and
    the decision of which work goes to Spark (see the module docstring)."""

    def __init__(self, settings: SparkJobSettings, s3: S3Settings, session: Callable[[], Any]) -> None:
        self.settings = settings
        self.s3 = s3
        #: Makes the SparkSession (called once, in the background: :meth:`start`).
        self._make_session = session
        self._spark: Any = None
        self._lock = threading.Lock()  # the session (held while it starts)
        self._counts_lock = threading.Lock()
        self._starting: threading.Thread | None = None
        self.start_error: BaseException | None = None
        #: ``(kind, outcome)`` -> count; kind: merge, sweep, peek, snapshot; outcome: spark,
        #: fallback (failed or timed out on Spark, done in-process).
        self.jobs: Counter[tuple[str, str]] = Counter()

    # -- the session ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the session in a background thread (the first job waits for it)."""
        with self._lock:
            if self._spark is not None or self._starting is not None:
                return
            self._starting = threading.Thread(target=self._start_session, name="controller-spark-start", daemon=True)
            self._starting.start()

    def _start_session(self) -> None:
        try:
            self.session()
        except Exception as e:  # noqa: BLE001 - reported by session() to the first job
            self.start_error = e
            log.warning("controller: the Spark session did not start: %r", e)

    def session(self) -> Any:
        with self._lock:
            if self._spark is None:
                try:
                    self._spark = self._make_session()
                except Exception as e:  # noqa: BLE001 - the work is then done in-process
                    raise SparkJobError(f"expected a Spark session, found {type(e).__name__}: {e}") from e
            return self._spark

    def stop(self) -> None:
        starting = self._starting
        if starting is not None:
            starting.join(120)
        with self._lock:
            spark, self._spark, self._starting = self._spark, None, None
        if spark is not None:
            spark.stop()

    def parallelism(self) -> int:
        return max(1, int(self.session().sparkContext.defaultParallelism))

    # -- running a job -------------------------------------------------------------------------
    def _run(self, kind: str, job: Callable[[Any], T]) -> T:
        """Run ``job(sc)`` in its own job group, cancelled after the timeout."""
        sc = self.session().sparkContext
        group = f"shardsink-{kind}-{uuid.uuid4().hex[:8]}"
        sc.setJobGroup(group, f"shardsink controller: {kind}", interruptOnCancel=True)
        timer = threading.Timer(self.settings.timeout_ms / 1000.0, sc.cancelJobGroup, args=(group,))
        timer.daemon = True
        timer.start()
        try:
            return job(sc)
        except Exception as e:  # noqa: BLE001 - py4j and Spark errors, as one of ours
            raise SparkJobError(f"expected the {kind} job to finish on Spark, found {type(e).__name__}: {e}") from e
        finally:
            timer.cancel()
            sc.setLocalProperty("spark.jobGroup.id", None)

    def _attempt(self, kind: str, on_spark: Callable[[], U], here: Callable[[], T]) -> U | T:
        try:
            out = on_spark()
        except SparkJobError as e:
            self._count(kind, "fallback")
            log.warning("controller: %s on Spark failed, doing it in-process: %s", kind, str(e)[:2000])
            return here()
        self._count(kind, "spark")
        return out

    def _count(self, kind: str, outcome: str) -> None:
        with self._counts_lock:
            self.jobs[(kind, outcome)] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        """A copy of :attr:`jobs` (for metrics, from another thread)."""
        with self._counts_lock:
            return dict(self.jobs)

    def _job(self, shard: Shard, mode: str, at: int | None, buckets: int,
             schema: dict[str, Any] | None = None) -> ShardJob:
        """A job reading and writing in ``schema`` (default: the shard's current one, as of
        its cached head, which the caller has just refreshed)."""
        root = shard.prefix[: -len(shard.shard_id) - 2]
        avro = json.dumps(shard.view(schema).schema, sort_keys=True)
        return ShardJob(self.s3, shard.shard_id, root, avro, buckets, mode, at)

    def _groups(self, parts: Sequence[Part]) -> list[list[str]]:
        """Parts in groups of about TASK_BYTES, at least one per core (when there are parts
        enough), balanced by size."""
        total = sum(p.bytes for p in parts)
        n = min(len(parts), max(self.parallelism(), math.ceil(total / TASK_BYTES)))
        groups: list[list[str]] = [[] for _ in range(max(n, 1))]
        sizes = [0] * len(groups)
        for p in sorted(parts, key=lambda p: -p.bytes):
            i = sizes.index(min(sizes))
            groups[i].append(p.key)
            sizes[i] += p.bytes
        return [g for g in groups if g]

    def _shuffled(self, sc: Any, job: ShardJob, parts: Sequence[Part]) -> Any:
        groups = self._groups(parts)
        n = job.buckets
        return (
            sc.parallelize(groups, len(groups))
            .flatMap(lambda keys: split_task(job, keys))
            .partitionBy(n, lambda bucket: bucket)
        )

    # -- merges ----------------------------------------------------------------------------------
    def wants(self, nbytes: int) -> bool:
        return self.settings.enabled and nbytes >= self.settings.min_bytes

    def merger(self, shard: Shard, run: Sequence[BatchMeta], since: Frontier,
               schema: dict[str, Any] | None = None) -> BatchMeta | None:
        """:attr:`shared.shard.Shard.merger`: large runs merge on Spark, the rest here; either
        way in ``schema`` (the head's: parts of earlier versions are read as it)."""
        parts = [p for b in run for p in b.parts]
        if not self.wants(sum(p.bytes for p in parts)) or since.time is None:
            return shard.merge_here(run, since, schema)
        return self._attempt("merge", lambda: self._merge(shard, run, since, parts, schema),
                             lambda: shard.merge_here(run, since, schema))

    def _merge(self, shard: Shard, run: Sequence[BatchMeta], since: Frontier, parts: Sequence[Part],
               schema: dict[str, Any] | None) -> BatchMeta | None:
        rows = sum(p.rows for p in parts)
        buckets = max(self.parallelism(), math.ceil(rows / MERGE_ROWS_PER_PART))
        job = self._job(shard, "merge", since.time, buckets, schema)

        def run_it(sc: Any) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = (
                self._shuffled(sc, job, parts).mapPartitionsWithIndex(lambda i, it: merge_task(job, i, it)).collect()
            )
            return out

        merged = [Part.from_json(d) for d in self._run("merge", run_it)]
        return merged_batch(run, since, merged)

    # -- gc ----------------------------------------------------------------------------------------
    def sweeper(self, shard: Shard, protected: set[str], expired: set[str], cutoff_ms: int) -> int:
        """:attr:`shared.shard.Shard.sweeper`: shards of many objects sweep on Spark."""
        if not self.settings.enabled or len(protected) + len(expired) < self.settings.gc_min_objects:
            return shard.sweep_here(protected, expired, cutoff_ms)
        return self._attempt("sweep", lambda: self._sweep(shard, protected, expired, cutoff_ms),
                             lambda: shard.sweep_here(protected, expired, cutoff_ms))

    def _sweep(self, shard: Shard, protected: set[str], expired: set[str], cutoff_ms: int) -> int:
        data = f"{shard.prefix}data/"
        s3 = self.s3
        frozen = frozenset(expired)

        def run_it(sc: Any) -> int:
            keep = sc.broadcast(frozenset(protected))
            try:
                counts = (
                    sc.parallelize(list(SWEEP_PREFIXES), len(SWEEP_PREFIXES))
                    .flatMap(lambda h: sweep_task(s3, data, keep, frozen, cutoff_ms, h))
                    .collect()
                )
            finally:
                keep.destroy()
            return int(sum(counts))

        n = self._run("sweep", run_it)
        stray = sorted(k for k in expired if not k.startswith(tuple(data + h for h in SWEEP_PREFIXES)))
        if stray:
            shard.store.delete_many(stray)
        return n + len(stray)

    # -- peeks and snapshots -------------------------------------------------------------------------
    def visible_parts(self, shard: Shard, as_of: int) -> list[Part]:
        """The parts a read at ``as_of`` needs, from a fresh head (the typed errors of
        ``snapshot`` when ``as_of`` is not readable)."""
        state = shard._wait_readable(as_of, 0.0)
        return [p for b in state.batches if b.lower.beyond(as_of) for p in b.parts]

    def _read_job(self, shard: Shard, as_of: int, parts: Sequence[Part]) -> ShardJob:
        rows = sum(p.rows for p in parts)
        buckets = max(self.parallelism(), math.ceil(rows / RESULT_ROWS_PER_BUCKET))
        return self._job(shard, "read", as_of, buckets)

    def peek(self, shard: Shard, as_of: int, limit: int | None, folder: str,
             here: Callable[[], T]) -> StoredPeek | T:
        """The consolidated contents at ``as_of`` as Parquet objects under ``folder`` (at most
        ``limit`` rows in all), or ``here()`` when the work is small or Spark failed. The
        caller has checked that ``as_of`` is readable."""
        parts = self.visible_parts(shard, as_of)
        if not self.wants(sum(p.bytes for p in parts)):
            return here()
        return self._attempt("peek", lambda: self._peek(shard, as_of, limit, folder, parts), here)

    def _peek(self, shard: Shard, as_of: int, limit: int | None, folder: str, parts: Sequence[Part]) -> StoredPeek:
        job = self._read_job(shard, as_of, parts)
        # A peek answered again after a restart writes its folder again: objects of a first
        # attempt with more buckets must not join the answer.
        stale = [i.key for i in shard.store.list(folder)]
        if stale:
            shard.store.delete_many(stale)

        def run_it(sc: Any) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = (
                self._shuffled(sc, job, parts)
                .mapPartitionsWithIndex(lambda i, it: peek_task(job, folder, limit, i, it))
                .collect()
            )
            return out

        objects = sorted(self._run("peek", run_it), key=lambda o: int(o["bucket"]))
        if limit is not None:
            objects = self._cut(shard, objects, limit)
        return StoredPeek(folder, tuple(objects))

    @staticmethod
    def _cut(shard: Shard, objects: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
        """Keep the first ``limit`` rows in bucket order: objects past it are deleted, the one
        it falls in is rewritten shorter."""
        kept: list[dict[str, Any]] = []
        left = limit
        doomed: list[str] = []
        for o in objects:
            if left <= 0:
                doomed.append(o["key"])
                continue
            if o["rows"] > left:
                t = decode_part(shard.store.get(o["key"])).slice(0, left)
                buf = io.BytesIO()
                pq.write_table(t, buf, compression="snappy", use_dictionary=dictionary_columns(t))
                shard.store.put(o["key"], buf.getvalue())
                o = {**o, "rows": t.num_rows, "nbytes": t.nbytes, "errors": t.num_rows - t[ERROR].null_count}
            kept.append(o)
            left -= int(o["rows"])
        if doomed:
            shard.store.delete_many(doomed)
        return kept

    def read_peek(self, shard: Shard, peek: StoredPeek) -> pa.Table:
        """A (small) stored peek read back into one table: row columns, ``_error``, ``_diff``."""
        schema = pa.schema([shard.part_schema.field(c) for c in [*shard.row_columns, ERROR, DIFF]])
        tables = [decode_part(shard.store.get(o["key"])) for o in peek.objects]
        return pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()

    def snapshot_messages(self, shard: Shard, as_of: int, sid: str, row_schema: dict[str, Any],
                          here: Callable[[], list[bytes]]) -> Iterable[bytes]:
        """The snapshot messages of a subscribe step, sorted as the in-process step sorts them,
        streamed from the executors; ``here()`` when small or when Spark failed before the
        first message."""
        parts = self.visible_parts(shard, as_of)
        if not self.wants(sum(p.bytes for p in parts)):
            return here()
        result: Iterable[bytes] = self._attempt(
            "snapshot", lambda: self._snapshot(shard, as_of, sid, row_schema, parts), here
        )
        return result

    def _snapshot(self, shard: Shard, as_of: int, sid: str, row_schema: dict[str, Any],
                  parts: Sequence[Part]) -> Iterable[bytes]:
        job = self._read_job(shard, as_of, parts)

        def run_it(sc: Any) -> Any:
            rdd = (
                self._shuffled(sc, job, parts)
                .mapPartitionsWithIndex(lambda i, it: snapshot_task(job, sid, row_schema, i, it))
                .sortByKey(numPartitions=job.buckets)
                .values()
                .persist()
            )
            rdd.count()  # computed (and kept on the executors) before the step's intent
            return rdd

        rdd = self._run("snapshot", run_it)
        return _Streamed(self, rdd)


def controller_session(service: ServiceSettings, master: str) -> Any:
    """The controller's SparkSession: the services' settings (services/runtime/settings.py) on
    ``master``; Spark options from ``PYSPARK_SUBMIT_ARGS``."""
    from services.runtime.spark import spark_session

    return spark_session(replace(service, spark_master=master), "shardsink-controller")


class _Streamed:
    """The messages of a persisted RDD, in order, one partition at a time on the driver."""

    def __init__(self, jobs: ControllerSpark, rdd: Any) -> None:
        self.jobs = jobs
        self.rdd = rdd

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.rdd.toLocalIterator(prefetchPartitions=True)
        finally:
            self.rdd.unpersist(blocking=False)

