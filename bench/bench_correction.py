"""Correction buffer memory during hydration: peak bytes over the collection's Arrow size.

Scenario (what a write task does when it starts against a shard that already holds the
collection): the buffer's since is the shard upper; the desired collection (``n`` rows, Avro
encoded, in random order, at times below the upper) is inserted in micro-batches, then the
shard's snapshot is inserted negated. The snapshot differs slightly from the collection
(about 1% of rows missing, 1% changed, 0.5% extra), so the buffer ends holding that
difference only.

Peak bytes are measured, not estimated:

* ``tracemalloc`` traces every Python and numpy allocation made during hydration (started
  after the inputs are generated, so the inputs are not counted);
* Arrow allocations (key arrays, sort indices, merge scratch) go to a proxy memory pool with
  its own statistics (``pa.proxy_memory_pool``), whose ``max_memory()`` is the Arrow peak.

The sum of the two peaks is an upper bound of the true peak. The denominator is the Arrow
size of the consolidated collection as the shard stores it: the row columns plus ``_time``
(uint64) and ``_diff`` (int64). The ratio against the row columns only is reported too.

Usage: ``python bench/bench_correction.py [n_rows]``; the last line is one JSON object.
"""

from __future__ import annotations

import io
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.correction import Correction  # noqa: E402

SCHEMA = fastavro.parse_schema(
    {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "customer", "type": "string"},
            {"name": "amount", "type": "double"},
            {"name": "category", "type": "string"},
            {"name": "created_ms", "type": "long"},
        ],
    }
)
CATEGORIES = ["books", "games", "garden", "kitchen", "music", "outdoor", "tools", "toys"]
BATCH = 10_000
UPPER = 1_000
# Arrays allocated from a proxy pool must not outlive it: keep every pool for the process.
_POOLS: list[pa.MemoryPool] = []


def _row(rng: random.Random, i: int) -> dict[str, Any]:
    return {
        "id": i,
        "customer": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(8, 16))),
        "amount": round(rng.uniform(0, 1000), 2),
        "category": rng.choice(CATEGORIES),
        "created_ms": 1_700_000_000_000 + rng.randrange(10**9),
    }


def _encode(row: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, SCHEMA, row)
    return buf.getvalue()


def _arrow_size(rows: list[dict[str, Any]], times: list[int]) -> tuple[int, int]:
    table = pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("id", pa.int64()),
                ("customer", pa.string()),
                ("amount", pa.float64()),
                ("category", pa.string()),
                ("created_ms", pa.int64()),
            ]
        ),
    )
    rows_only = int(table.nbytes)
    table = table.append_column("_time", pa.array(times, pa.uint64()))
    table = table.append_column("_diff", pa.array([1] * len(rows), pa.int64()))
    return int(table.nbytes), rows_only


def measure_hydration_ratio(n_rows: int, seed: int = 7) -> dict[str, Any]:
    """Hydrate a buffer with ``n_rows`` desired rows and a slightly different shard snapshot;
    return the peak bytes, the collection's Arrow size, their ratio and the time taken."""
    rng = random.Random(seed)
    rows = [_row(rng, i) for i in range(n_rows)]
    desired = [_encode(r) for r in rows]
    desired_times = [rng.randrange(UPPER) for _ in range(n_rows)]
    # The shard's snapshot: mostly the same rows, with a few missing, changed and extra.
    snapshot: list[bytes] = []
    for r, b in zip(rows, desired):
        x = rng.random()
        if x < 0.01:
            continue  # missing in the shard
        if x < 0.02:
            snapshot.append(_encode({**r, "amount": r["amount"] + 1.0}))  # changed
        else:
            snapshot.append(b)
    for i in range(n_rows // 200):
        snapshot.append(_encode(_row(rng, n_rows + i)))  # junk in the shard
    order = list(range(n_rows))
    rng.shuffle(order)
    desired = [desired[i] for i in order]
    desired_times = [desired_times[i] for i in order]
    rng.shuffle(snapshot)
    snapshot_time = UPPER - 1

    # One small hydration first, outside the measurement: pyarrow imports pandas (some 30 MB of
    # Python objects) the first time it converts a Python list, which is a process's one-time
    # cost, not the buffer's.
    warm = Correction()
    warm.insert(desired[:BATCH], desired_times[:BATCH], 1)
    warm.insert_negated(snapshot[:BATCH], snapshot_time, 1)
    warm.consolidate()
    del warm

    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    _POOLS.append(pool)
    previous_pool = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    accounted_peak = 0
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        buf = Correction()
        buf.advance_since(UPPER)  # the shard upper, known before its snapshot is read
        for a in range(0, n_rows, BATCH):
            buf.insert(desired[a : a + BATCH], desired_times[a : a + BATCH], 1)
            accounted_peak = max(accounted_peak, buf.bytes())
        for a in range(0, len(snapshot), BATCH):
            buf.insert_negated(snapshot[a : a + BATCH], snapshot_time, 1)
            accounted_peak = max(accounted_peak, buf.bytes())
        buf.consolidate()
        final_entries = buf.size()
        final_bytes = buf.bytes()
        _, traced_peak = tracemalloc.get_traced_memory()
        arrow_peak = int(pool.max_memory() or 0)
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous_pool)
    seconds = time.perf_counter() - t0
    del buf

    arrow_bytes, arrow_rows_only = _arrow_size(rows, [UPPER] * n_rows)
    peak = traced_peak + arrow_peak
    return {
        "correction_peak_ratio": round(peak / arrow_bytes, 3),
        "correction_peak_ratio_rows_only": round(peak / arrow_rows_only, 3),
        "correction_accounted_peak_ratio": round(accounted_peak / arrow_bytes, 3),
        "rows": n_rows,
        "snapshot_rows": len(snapshot),
        "seconds": round(seconds, 3),
        "peak_bytes": peak,
        "peak_traced_bytes": traced_peak,
        "peak_arrow_pool_bytes": arrow_peak,
        "accounted_peak_bytes": accounted_peak,
        "collection_arrow_bytes": arrow_bytes,
        "collection_arrow_rows_only_bytes": arrow_rows_only,
        "avro_row_bytes_mean": round(sum(map(len, desired)) / max(1, n_rows), 1),
        "final_entries": final_entries,
        "final_bytes": final_bytes,
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    result = measure_hydration_ratio(n)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
