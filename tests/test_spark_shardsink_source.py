"""The ``shardsink`` Spark batch source equals the Python API's snapshot (issue 13).

A collection with retractions, multiplicities and error rows, some of it compacted below
since; the Spark read (distributed over buckets, several tasks) at every readable time equals
``open_collection(...).snapshot(t)`` (with and without error rows), and a time below since or
at the upper gives the typed errors.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from shared.embedded import EmbeddedStack
from shared.errors import NotReadableYetError, SinceViolationError
from shared.io.client import open_collection
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.io.spark_shardsink import read_collection, register_shardsink_source
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
