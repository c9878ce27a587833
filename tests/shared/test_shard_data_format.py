"""Format checks of a shard's data objects (issue 2, section 3.5, data-object half).

A data object must read with plain ``pyarrow.parquet`` (no shardsink code on the read path),
with the row fields, ``_time`` (uint64), ``_diff`` (int64), ``_error`` (string) and the
key-value metadata ``shardsink.format == "1"``. The state-object half (plain JSON codec and
golden fixtures) lives in ``tests/test_shard_format.py``.
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.shard import Shard

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [
        {"name": "k", "type": "long"},
        {"name": "v", "type": "string"},
        {"name": "score", "type": ["null", "double"], "default": None},
    ],
}


@pytest.fixture
def store(stack: EmbeddedStack) -> S3ObjectStore:
    return S3ObjectStore(
        S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing")
    )


def _fetch(s3_client: Any, bucket: str, key: str) -> pa.Table:
    """Read one data object with boto3 and plain pyarrow.parquet: the independent reader."""
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return pq.read_table(io.BytesIO(body))


def test_data_object_reads_with_plain_pyarrow_with_row_time_diff_error_columns(
    stack: EmbeddedStack, s3_client: Any, store: S3ObjectStore, unique_id: str
) -> None:
    sh = Shard.create(store, f"fmt-{unique_id}", SCHEMA, since=10)
    sh.compare_and_append(
        [
            ({"k": 1, "v": "one", "score": 0.5}, 10, 1),
            ({"k": 2, "v": "two", "score": None}, 11, 3),
            ({"k": 2, "v": "two", "score": None}, 11, -1),  # consolidates with the line above
            (None, 12, 1, "bad row: k missing"),
        ],
        10,
        13,
        token="t-fmt",
    )
    state = sh.refresh()
    assert len(state.batches) == 1
    parts = state.batches[0].parts
    assert parts, "expected the batch to reference at least one data object"
    tables = [_fetch(s3_client, stack.bucket, p.key) for p in parts]
    table = pa.concat_tables(tables)

    # Column names, order and physical types as the format promises.
    assert table.column_names == ["k", "v", "score", "_time", "_diff", "_error"]
    assert table.schema.field("k").type == pa.int64()
    assert table.schema.field("v").type == pa.string()
    assert table.schema.field("score").type == pa.float64()
    assert table.schema.field("_time").type == pa.uint64()
    assert table.schema.field("_diff").type == pa.int64()
    assert table.schema.field("_error").type == pa.string()

    # Key-value metadata names the format version (and the shard), readable without shardsink.
    meta = pq.read_metadata(
        io.BytesIO(s3_client.get_object(Bucket=stack.bucket, Key=parts[0].key)["Body"].read())
    ).metadata
    assert meta[b"shardsink.format"] == b"1"
    assert meta[b"shardsink.shard"] == f"fmt-{unique_id}".encode()
    assert table.schema.metadata[b"shardsink.format"] == b"1"

    # Contents: stored consolidated, the error row with null row columns.
    rows = sorted(table.to_pylist(), key=lambda r: (r["_time"], r["k"] is None, r["k"] or 0))
    assert rows == [
        {"k": 1, "v": "one", "score": 0.5, "_time": 10, "_diff": 1, "_error": None},
        {"k": 2, "v": "two", "score": None, "_time": 11, "_diff": 2, "_error": None},
        {"k": None, "v": None, "score": None, "_time": 12, "_diff": 1, "_error": "bad row: k missing"},
    ]
    # The Part metadata in the state matches the object.
    assert sum(p.rows for p in parts) == table.num_rows == state.batches[0].rows
    for p in parts:
        head = s3_client.head_object(Bucket=stack.bucket, Key=p.key)
        assert head["ContentLength"] == p.bytes


def test_compacted_data_object_keeps_the_same_plain_format(
    stack: EmbeddedStack, s3_client: Any, store: S3ObjectStore, unique_id: str
) -> None:
    sh = Shard.create(store, f"fmtc-{unique_id}", SCHEMA, since=0)
    for t in range(4):
        sh.compare_and_append([({"k": t % 2, "v": "x", "score": None}, t, 1)], t, t + 1)
    sh.register_reader("r", kind="critical")
    sh.downgrade_since("r", 4)
    assert sh.compact_below_since() is True
    state = sh.refresh()
    assert len(state.batches) == 1 and state.batches[0].since.time == 4
    table = pa.concat_tables([_fetch(s3_client, stack.bucket, p.key) for p in state.batches[0].parts])
    assert table.column_names == ["k", "v", "score", "_time", "_diff", "_error"]
    assert table.schema.field("_time").type == pa.uint64()
    assert table.schema.field("_diff").type == pa.int64()
    assert table.schema.metadata[b"shardsink.format"] == b"1"
    # Times advanced to since and consolidated: k=0 and k=1 each twice.
    assert sorted(table.select(["k", "_time", "_diff"]).to_pylist(), key=lambda r: r["k"]) == [
        {"k": 0, "_time": 4, "_diff": 2},
        {"k": 1, "_time": 4, "_diff": 2},
    ]
