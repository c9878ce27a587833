"""The ``shardsink`` Spark batch source equals the Python API's snapshot (issue 13).

A collection with retractions, multiplicities and error rows, some of it compacted below
since; the Spark read (distributed over buckets, several tasks) at every readable time equals
``open_collection(...).snapshot(t)`` (with and without error rows), and a time below since or
at the upper gives the typed errors. The same after the history below since was merged by the
controller's Spark job, on rows told apart only by fixed-length strings (their bytes spread
them over the buckets).
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.errors import NotReadableYetError, SinceViolationError
from shared.io.client import open_collection
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.spark.shardsink_source import plan_read, read_bucket, read_collection, register_shardsink_source
from shared.shard import Shard

SCHEMA = {
    "type": "record",
    "name": "Order",
    "fields": [{"name": "id", "type": "long"}, {"name": "item", "type": ["null", "string"]},
               {"name": "qty", "type": "double"}],
}


def as_counter(rows: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        key = tuple(sorted((k, v) for k, v in r.items() if k != "_diff"))
        assert key not in out, f"expected consolidated rows, found {key} twice"
        assert r["_diff"] != 0
        out[key] = r["_diff"]
    return out


@pytest.fixture(scope="module")
def orders(stack: EmbeddedStack) -> tuple[str, S3Settings, int, int]:
    settings = S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing",
                          secret_key="testing", prefix=f"spark-src-{uuid.uuid4().hex[:8]}")
    cid = "orders"
    sh = Shard.create(S3ObjectStore(settings), cid, SCHEMA)

    def row(i: int, item: str | None = "apple", qty: float = 1.0) -> dict[str, Any]:
        return {"id": i, "item": item, "qty": qty}

    batches: list[list[tuple[Any, ...]]] = [
        [(row(i, f"item-{i % 7}", i * 0.5), 0, 1) for i in range(300)] + [(row(1000), 0, 3)],
        [(row(5, "item-5", 2.5), 1, -1), (row(5, "item-5", 9.0), 1, 1), (row(1000), 1, -1),
         (None, 1, 1, "bad: id"), (row(2000, None, -0.0), 1, 2)],
        [(row(i, f"item-{i % 7}", i * 0.5), 2, -1) for i in range(10, 40)] + [(None, 2, 2, "bad: id")],
        [(row(2000, None, -0.0), 3, -2), (row(3000, "pear", 1.5), 3, 4), (None, 3, -3, "bad: id")],
        [(row(i, "late", 0.0), 4, 1) for i in range(300, 500)],
    ]
    for t, b in enumerate(batches):
        sh.compare_and_append(b, t, t + 1)
    sh.register_reader("hold", kind="critical")
    sh.downgrade_since("hold", 2)
    assert sh.compact_below_since() is True
    return cid, settings, 2, 5


def test_spark_read_equals_the_python_snapshot_at_every_readable_time(spark: Any, orders: Any) -> None:
    cid, settings, since, upper = orders
    col = open_collection(cid, settings)
    for as_of in range(since, upper):
        for errors in (False, True):
            want = col.snapshot(as_of, include_errors=errors)
            df = read_collection(spark, cid, as_of, settings=settings, include_errors=errors, num_partitions=3)
            assert df.columns == want.column_names
            got = as_counter([r.asDict() for r in df.collect()])
            assert got == as_counter(want.to_pylist()), f"as_of {as_of}, errors {errors}"
    # The format name and options, as a Spark user writes them (latest readable time by default).
    register_shardsink_source(spark)
    df = (spark.read.format("shardsink").option("endpoint", settings.endpoint).option("bucket", settings.bucket)
          .option("prefix", settings.prefix).option("accessKey", "testing").option("secretKey", "testing")
          .option("asOf", upper - 1).load(cid))
    assert as_counter([r.asDict() for r in df.collect()]) == as_counter(col.snapshot(upper - 1).to_pylist())
    assert sum(r["_diff"] for r in df.collect()) == pa.compute.sum(col.snapshot(upper - 1)["_diff"]).as_py()


def test_spark_read_gives_the_typed_errors_below_since_and_at_upper(spark: Any, orders: Any) -> None:
    cid, settings, since, upper = orders
    with pytest.raises(SinceViolationError) as err:
        read_collection(spark, cid, since - 1, settings=settings)
    assert err.value.since.time == since
    with pytest.raises(NotReadableYetError):
        read_collection(spark, cid, upper, settings=settings)
    # Through spark.read directly: Spark wraps the error raised while planning, by name.
    register_shardsink_source(spark)
    with pytest.raises(Exception, match="SinceViolationError") as wrapped:
        (spark.read.format("shardsink").option("endpoint", settings.endpoint).option("bucket", settings.bucket)
         .option("prefix", settings.prefix).option("accessKey", "testing").option("secretKey", "testing")
         .option("asOf", since - 1).load(cid).collect())
    assert f"found {since - 1}" in str(wrapped.value)


KEYED = {
    "type": "record",
    "name": "Keyed",
    "fields": [{"name": "key", "type": "string"}, {"name": "tag", "type": ["null", "string"]}],
}


def test_spark_read_equals_the_snapshot_after_a_merge_run_as_a_spark_job_and_spreads_string_keys(
    spark: Any, stack: EmbeddedStack
) -> None:
    """Rows that differ only in fixed-length strings: the history below since is merged by the
    controller's Spark job (bucketed parts written by the tasks), and the reader's buckets, a
    hash of the strings' bytes, all hold rows; the read still equals the snapshot."""
    from services.controller.spark_jobs import ControllerSpark, SparkJobSettings

    settings = S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing",
                          secret_key="testing", prefix=f"spark-src-{uuid.uuid4().hex[:8]}")
    store = S3ObjectStore(settings)
    sh = Shard.create(store, "keyed", KEYED)

    def key(i: int) -> dict[str, Any]:
        return {"key": f"k-{i:08d}", "tag": None if i % 3 else f"t{i % 7}"}

    for t in range(6):
        ups: list[tuple[Any, ...]] = [(key(t * 40 + i), t, 1 + (i % 4 == 0)) for i in range(40)]
        ups += [(key(t * 40 - 40 + i), t, -1) for i in range(0, 40, 5) if t]
        ups += [(None, t, 1, "bad: key")] if t % 2 else [(None, t, -1, "bad: key")]
        sh.compare_and_append(ups, t, t + 1)
    jobs = ControllerSpark(SparkJobSettings(master="local[2]", min_bytes=0), settings, lambda: spark)
    sh.merger = jobs.merger
    sh.register_reader("hold", kind="critical")
    sh.downgrade_since("hold", 3)
    col = open_collection("keyed", settings)
    before = {t: col.snapshot(t, include_errors=True) for t in range(3, 6)}
    assert sh.compact_below_since() is True
    assert jobs.jobs == {("merge", "spark"): 1}
    merged = sh.refresh().batches[0]
    assert merged.since.time == 3 and len(merged.parts) >= 2, "one part per bucket task"

    plan = plan_read(sh, 5, 3)
    sizes = [read_bucket(store, plan.keys, sh.part_schema, plan.as_of, plan.skip_time_filter, b, 3, True).num_rows
             for b in range(3)]
    assert min(sizes) > 0, f"expected rows in every bucket, found {sizes}"
    for as_of in range(3, 6):
        want = col.snapshot(as_of, include_errors=True)
        assert as_counter(want.to_pylist()) == as_counter(before[as_of].to_pylist())
        df = read_collection(spark, "keyed", as_of, settings=settings, include_errors=True, num_partitions=3)
        assert as_counter([r.asDict() for r in df.collect()]) == as_counter(want.to_pylist()), f"as_of {as_of}"
