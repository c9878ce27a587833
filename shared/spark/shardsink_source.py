"""Reading a collection from Spark: the ``shardsink`` batch data source (time travel).

Built on PySpark's Python Data Source API, like :mod:`shared.spark.kafka_source`. Register once
per session, then::

    register_shardsink_source(spark)
    df = (spark.read.format("shardsink")
          .option("asOf", 41)                      # default: the latest readable time
          .option("endpoint", "http://s3:9000").option("bucket", "shardsink")
          .load("orders"))                         # the collection id

or :func:`read_collection` (``read_collection(spark, "orders", as_of=41)``), which checks the
time on the driver first and raises the typed error itself.

Columns: the collection's row columns (its Avro schema mapped to Arrow, then to Spark), then
``_diff long`` (the row's count at ``asOf``); with ``includeErrors=true`` also ``_error string``
before ``_diff`` (rows that failed to decode: row columns null), as
``open_collection(...).snapshot(as_of, include_errors=True)`` gives them. Without it, error
rows are left out, as ``snapshot(as_of)`` leaves them out. The contents equal that snapshot.

Errors (the Python API's): ``asOf`` below the collection's since: SinceViolationError; at or
beyond its upper: NotReadableYetError; no collection: ShardNotFoundError; dropped:
ShardDroppedError. Spark raises them while planning the read (``load()``), wrapped in its own
exception whose message starts with the error's class name; :func:`read_collection` raises
the error class itself.

Options: ``asOf``; ``includeErrors`` (default false); ``numPartitions`` (default: the number
of visible parts, at most 64); the S3 settings ``endpoint``, ``bucket``, ``prefix``,
``region``, ``accessKey``, ``secretKey`` (each defaults to the driver's environment, as
:meth:`shared.io.s3.S3Settings.from_env` reads it; executors get the settings from the plan,
not from their own environment).

Distribution. The driver reads only the shard's head state: it picks the parts visible at
``asOf`` (batches whose lower is at or below it) and plans ``numPartitions`` input partitions,
one per row bucket. A task reads the visible parts one by one on its executor, keeps the rows
of its bucket with times at or before ``asOf`` (a deterministic function of the row's values:
equal rows always fall in the same bucket), and consolidates them with Arrow
(:func:`shared.shard.consolidate`): every row's updates meet in one task, so the union of the
tasks is consolidated without a shuffle. The parts are immutable, and parts that a later
compaction retires stay readable for the grace period, so a read that starts within it sees
exactly the state it planned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import LongType, StringType, StructField, StructType

from shared.avro_arrow import avro_to_arrow_schema
from shared.errors import InvalidUsageError
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.shard import DIFF, ERROR, TIME, SchemaView, Shard, conform_part, consolidate, decode_part, schema_view

SOURCE_NAME = "shardsink"
MAX_DEFAULT_PARTITIONS = 64
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """The source's options, parsed once on the driver (see the module docstring)."""

    collection_id: str
    s3: S3Settings
    as_of: int | None = None
    include_errors: bool = False
    num_partitions: int | None = None

    @staticmethod
    def parse(options: Mapping[str, str]) -> ReadOptions:
        low = {k.lower(): str(v) for k, v in options.items()}
        cid = low.get("path") or low.get("collection") or ""
        if not cid:
            raise InvalidUsageError(
                "expected a collection id (load('orders') or option 'collection'), found none among "
                f"{sorted(options)}"
            )
        s3 = S3Settings.from_env()
        over = {"endpoint": "endpoint", "bucket": "bucket", "prefix": "prefix", "region": "region",
                "accesskey": "access_key", "secretkey": "secret_key"}
        s3 = replace(s3, **{field: low[k] for k, field in over.items() if k in low})  # type: ignore[arg-type]
        return ReadOptions(
            collection_id=cid,
            s3=s3,
            as_of=_int(low, "asof"),
            include_errors=low.get("includeerrors", "false").strip().lower() in ("1", "true", "yes"),
            num_partitions=_int(low, "numpartitions"),
        )

    def options(self) -> dict[str, str]:
        """The options that :meth:`parse` reads back as this value."""
        out = {"collection": self.collection_id, "bucket": self.s3.bucket, "prefix": self.s3.prefix,
               "region": self.s3.region, "includeErrors": str(self.include_errors).lower()}
        for k, v in (("endpoint", self.s3.endpoint), ("accessKey", self.s3.access_key),
                     ("secretKey", self.s3.secret_key), ("asOf", self.as_of), ("numPartitions", self.num_partitions)):
            if v is not None:
                out[k] = str(v)
        return out


def _int(low: Mapping[str, str], key: str) -> int | None:
    if key not in low or low[key] == "":
        return None
    try:
        return int(low[key])
    except ValueError:
        raise InvalidUsageError(f"expected an integer option {key!r}, found {low[key]!r}") from None


def spark_schema(row_schema: pa.Schema, include_errors: bool) -> StructType:
    """Row columns, then ``_error`` (with errors), then ``_diff``."""
    fields = list(from_arrow_schema(row_schema).fields)
    if include_errors:
        fields.append(StructField(ERROR, StringType(), True))
    fields.append(StructField(DIFF, LongType(), True))
    # Every column nullable: Spark compares the Arrow batches' schema with this one exactly.
    return StructType([StructField(f.name, f.dataType, True) for f in fields])


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What the driver decided: the time, the visible parts and the bucket count."""

    as_of: int
    keys: tuple[str, ...]
    skip_time_filter: bool
    buckets: int


def plan_read(shard: Shard, as_of: int | None, num_partitions: int | None) -> ReadPlan:
    """Validate ``as_of`` against the head (the typed errors of ``snapshot``) and pick parts."""
    if as_of is None:
        st = shard.refresh()
        as_of = (1 << 64) - 1 if st.upper.is_empty() else max((st.upper.time or 0) - 1, 0)
    state = shard._wait_readable(as_of, 0.0)
    visible = [b for b in state.batches if b.lower.beyond(as_of)]
    keys = tuple(p.key for b in visible for p in b.parts)
    skip = all(b.upper.time is not None and b.upper.time <= as_of + 1 for b in visible)
    if num_partitions is not None and num_partitions < 1:
        raise InvalidUsageError(f"expected numPartitions >= 1, found {num_partitions}")
    n = num_partitions or max(1, min(len(keys), MAX_DEFAULT_PARTITIONS))
    return ReadPlan(as_of, keys, skip, n)


def row_buckets(table: pa.Table, columns: Sequence[str], n: int) -> np.ndarray:
    """A bucket in ``[0, n)`` per row, a function of the values only (equal rows, equal bucket).

    Each column contributes an integer (integers and times their value, floats their bits,
    strings and binaries a hash of their bytes, lists and maps their length, other types 0;
    nulls 0), mixed multiplicatively; the spread is good on ids and keys, and never wrong
    elsewhere. The controller's Spark jobs (services/controller/spark_jobs.py) route rows to
    their merge task with it.
    """
    h = np.zeros(table.num_rows, dtype=np.uint64)
    for name in columns:
        h = h * _MIX + _contribution(table[name])
    h ^= h >> np.uint64(31)
    h *= _MIX
    h ^= h >> np.uint64(29)
    return (h % np.uint64(n)).astype(np.int64)


def _contribution(col: pa.ChunkedArray) -> np.ndarray:
    t = col.type
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    try:
        if pa.types.is_floating(t):
            width = {16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[t.bit_width]
            arr = pc.cast(arr.view(width), pa.int64())
        elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
            arr = pc.cast(arr, pa.int64(), safe=False)
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
                or pa.types.is_large_binary(t):
            return _bytes_hash(arr)
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
            arr = pc.cast(pc.list_value_length(arr), pa.int64())
        else:
            return np.zeros(len(arr), dtype=np.uint64)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return np.zeros(len(arr), dtype=np.uint64)
    out: np.ndarray = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False).view(np.uint64)
    return out


#: Per-position multipliers of the byte hash (odd, fixed: every process hashes alike).
_HASH_BLOCK = 256 * 1024
_BYTE_WEIGHTS = np.random.default_rng(0x5EED).integers(1, 2**63, 256, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _bytes_hash(arr: pa.Array) -> np.ndarray:
    """A hash of each value's bytes (strings, binaries), vectorised: the sum over its bytes of
    ``(byte + 1) * weight[position % 256]``, mixed with its length; nulls 0. Computed over
    blocks of about 256 KiB of values, so that the temporaries stay small."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    arr = arr.cast(pa.large_binary() if large else pa.binary())
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1]
    offsets = offsets.astype(np.int64)
    lens = np.diff(offsets)
    out = lens.astype(np.uint64) * _MIX
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if arr.buffers()[2] is not None else np.zeros(0, np.uint8)
    i = 0
    while i < n:
        # the values [i, j) hold about _HASH_BLOCK bytes (at least one value)
        j = int(np.searchsorted(offsets, offsets[i] + _HASH_BLOCK, side="right")) - 1
        j = min(max(j, i + 1), n)
        base, end = int(offsets[i]), int(offsets[j])
        if end > base:
            starts = np.asarray(offsets[i:j] - base, dtype=np.int64)
            ls = lens[i:j]
            pos = np.arange(end - base, dtype=np.int64) - np.repeat(starts, ls)
            contrib = (data[base:end].astype(np.uint64) + np.uint64(1)) * _BYTE_WEIGHTS[pos & 255]
            nonempty = ls > 0
            out[i:j][nonempty] ^= np.add.reduceat(contrib, starts[nonempty])
        i = j
    if arr.null_count:
        out[~pc.is_valid(arr).to_numpy(zero_copy_only=False)] = 0
    return out


def read_bucket(
    store: Any, keys: Sequence[str], schema: pa.Schema, as_of: int, skip_time_filter: bool,
    bucket: int, buckets: int, include_errors: bool, io_threads: int = 8, view: SchemaView | None = None,
) -> pa.Table:
    """The consolidated contents at ``as_of`` of one bucket: read part by part, keep the
    bucket's rows at or before ``as_of``, consolidate over the row columns and ``_error``.
    ``view``: the collection's current row schema; parts written under an earlier version are
    read as it (:func:`shared.shard.conform_part`) before they are bucketed."""
    row_cols = [n for n in schema.names if n not in (TIME, DIFF, ERROR)]

    def one(key: str) -> pa.Table:
        t = decode_part(store.get(key))
        if view is not None:
            t = conform_part(t, view)
        t = t if t.schema.equals(schema) else t.cast(schema)
        if not skip_time_filter:
            t = t.filter(pc.less_equal(t[TIME], pa.scalar(as_of, pa.uint64())))
        if buckets > 1 and t.num_rows:
            t = t.filter(pa.array(row_buckets(t, [*row_cols, ERROR], buckets) == bucket))
        return t

    if keys:
        with ThreadPoolExecutor(max_workers=max(1, min(io_threads, len(keys)))) as ex:
            table = pa.concat_tables(list(ex.map(one, keys)))
    else:
        table = schema.empty_table()
    out = consolidate(table, [*row_cols, ERROR])
    if not include_errors:
        if out.num_rows and out[ERROR].null_count != out.num_rows:
            out = out.filter(pc.is_null(out[ERROR]))
        return out.select([*row_cols, DIFF])
    return out.select([*row_cols, ERROR, DIFF])


class BucketPartition(InputPartition):
    """Input partition ``bucket`` of ``buckets``: the rows whose bucket it is."""

    def __init__(self, bucket: int) -> None:
        super().__init__(bucket)
        self.bucket = bucket


class ShardsinkBatchReader(DataSourceReader):
    """Plans on the driver (head state only), reads on executors (see the module docstring)."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        shard = Shard(S3ObjectStore(options.s3), options.collection_id)
        self.plan = plan_read(shard, options.as_of, options.num_partitions)
        #: the row schema of the planned head: every part is read as it
        self.row_schema = shard.head(max_age_s=1e9).schema
        self.part_schema = shard.view(self.row_schema).part_schema

    def partitions(self) -> Sequence[InputPartition]:
        return [BucketPartition(i) for i in range(self.plan.buckets)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BucketPartition)
        from shared.spark.worker_heap import settle

        settle()
        p = self.plan
        table = read_bucket(
            S3ObjectStore(self.options.s3), p.keys, self.part_schema, p.as_of, p.skip_time_filter,
            partition.bucket, p.buckets, self.options.include_errors, view=schema_view(self.row_schema),
        )
        nullable = pa.schema([f.with_nullable(True) for f in table.schema])  # as spark_schema says
        yield from table.cast(nullable).to_batches()


class ShardsinkDataSource(DataSource):
    """``shardsink``: a batch reader of a collection as of a time (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        opts = ReadOptions.parse(self.options)
        shard = Shard.open(S3ObjectStore(opts.s3), opts.collection_id)
        return spark_schema(avro_to_arrow_schema(shard.refresh().schema), opts.include_errors)

    def reader(self, schema: StructType) -> DataSourceReader:
        return ShardsinkBatchReader(ReadOptions.parse(self.options))


def register_shardsink_source(spark: SparkSession) -> None:
    """Register ``shardsink`` with the session (idempotent)."""
    spark.dataSource.register(ShardsinkDataSource)


def read_collection(
    spark: SparkSession,
    collection_id: str,
    as_of: int | None = None,
    *,
    settings: S3Settings | None = None,
    include_errors: bool = False,
    num_partitions: int | None = None,
) -> DataFrame:
    """``spark.read.format("shardsink")`` for one collection, with ``as_of`` checked on the
    driver first: below since raises SinceViolationError, at or beyond upper
    NotReadableYetError (the classes themselves, not Spark's wrapper). ``num_partitions``
    defaults to the session's default parallelism."""
    if num_partitions is None:
        num_partitions = spark.sparkContext.defaultParallelism  # one task per core
    opts = ReadOptions(collection_id, settings or S3Settings.from_env(), as_of, include_errors, num_partitions)
    plan_read(Shard.open(S3ObjectStore(opts.s3), collection_id), as_of, num_partitions)
    register_shardsink_source(spark)
    return spark.read.format(SOURCE_NAME).options(**opts.options()).load()
