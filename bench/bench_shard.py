"""Benchmark of the shard storage layer against the embedded S3 server (moto).

Prints progress on stderr and, as its last stdout line, one JSON object:

- cas_p50_ms / cas_p99_ms: compare_and_append of a small batch (10 rows) on a warm handle
- baseline_put_p50_ms: a plain unconditional S3 PUT of a part of the same size, same run
- append_updates_per_s: compare_and_append of 100k-row batches
- snapshot_1m_rows_s: snapshot of a shard holding 1M consolidated rows
- snapshot_1m_rows_mixed_versions_s: the same, with half the rows written under schema v1
  and half under v2 (v1 + a nullable field and a field with a default): the v1 parts are read
  as v2 (target: within 1.5x of snapshot_1m_rows_s; ``mixed_versions_ratio``)
- batches_after_10k_appends: batch count after 10k appends with compaction on
- since_trailing_rewrites_per_row: rows rewritten by merges per row appended when since
  trails the upper by one (moved after each of 200 appends of 100 rows, as a lagging read
  policy does) and the controller's merge runs at each move (``compact_since_moved``, then
  the tiered ``compact``); ``since_trailing_s`` the time of the whole run;
  ``full_collapse_*`` the same with every batch below since merged at each move
  (``compact_below_since``, what the controller did before)

``--quick`` shrinks every size (for smoke runs); the figures in BENCHMARKS.md are full runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.devstack.embedded import EmbeddedStack  # noqa: E402
from shared.io.s3 import S3ObjectStore, S3Settings  # noqa: E402
from shared.shard import Shard  # noqa: E402

SCHEMA = {
    "type": "record",
    "name": "Row",
    "namespace": "bench",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": "string"},
        {"name": "amount", "type": "double"},
    ],
}


def log(msg: str) -> None:
    print(f"[bench-shard] {msg}", file=sys.stderr, flush=True)


#: v2 of SCHEMA (issue 16): a nullable field and a field with a default added.
SCHEMA_V2 = {
    **SCHEMA,
    "fields": [
        *SCHEMA["fields"],  # type: ignore[misc]
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "region", "type": "string", "default": "eu"},
    ],
}


def rows_table_v2(start: int, n: int, time_: int) -> pa.Table:
    t = rows_table(start, n, time_)
    t = t.append_column("note", pa.array([None if i % 3 else f"n{i % 7}" for i in range(start, start + n)], pa.string()))
    return t.append_column("region", pa.array([("eu", "us", "ap")[i % 3] for i in range(start, start + n)], pa.string()))


def rows_table(start: int, n: int, time_: int, diff: int = 1) -> pa.Table:
    ids = pa.array(range(start, start + n), pa.int64())
    return pa.table(
        {
            "id": ids,
            "name": pa.array([f"name-{i % 1000}" for i in range(start, start + n)], pa.string()),
            "amount": pa.array([i * 0.5 for i in range(start, start + n)], pa.float64()),
            "_time": pa.array([time_] * n, pa.uint64()),
            "_diff": pa.array([diff] * n, pa.int64()),
        }
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def since_trailing(store: S3ObjectStore, shard_id: str, appends: int, rows: int, merge: str) -> tuple[int, float]:
    """(rows rewritten by merges, seconds) of ``appends`` appends with since one behind the
    upper after each and ``merge`` (a Shard method) then the tiered compaction at each move."""
    rewritten = [0]

    class Counting(Shard):
        def merge_here(self, run, since, schema=None):  # type: ignore[no-untyped-def]
            rewritten[0] += sum(b.rows for b in run)
            return super().merge_here(run, since, schema)

    sh = Counting.create(store, shard_id, SCHEMA)
    sh.register_reader("lag", kind="critical")
    a = time.perf_counter()
    for i in range(appends):
        sh.compare_and_append(rows_table(i * rows, rows, i), i, i + 1)
        sh.downgrade_since("lag", i)
        getattr(sh, merge)()
        sh.compact()
    seconds = time.perf_counter() - a
    snap = sh.snapshot(appends - 1)
    assert snap.num_rows == appends * rows, snap.num_rows
    return rewritten[0], seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--appends", type=int, help="1-row appends of the batch-count figure (default 10000, quick 500)")
    args = ap.parse_args()
    n_cas = 100 if args.quick else 500
    big = 20_000 if args.quick else 100_000
    n_big = 3 if args.quick else 10
    snap_rows = 100_000 if args.quick else 1_000_000
    n_appends = args.appends or (500 if args.quick else 10_000)

    out: dict[str, object] = {}
    with EmbeddedStack() as stack:
        store = S3ObjectStore(
            S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing")
        )
        run = uuid.uuid4().hex[:8]

        # 1. CAS latency of a small batch, and a plain PUT of the same size.
        sh = Shard.create(store, f"cas-{run}", SCHEMA)
        upper = 0
        lat: list[float] = []
        for i in range(n_cas):
            t = rows_table(i * 10, 10, upper)
            a = time.perf_counter()
            sh.compare_and_append(t, upper, upper + 1)
            lat.append((time.perf_counter() - a) * 1000)
            upper += 1
        part_bytes = sh.refresh().batches[-1].parts[0].bytes
        out["cas_p50_ms"] = round(statistics.median(lat), 2)
        out["cas_p99_ms"] = round(pct(lat, 0.99), 2)
        payload = os.urandom(part_bytes)
        put_lat: list[float] = []
        for i in range(n_cas):
            a = time.perf_counter()
            store.put(f"baseline/{run}/{i}", payload)
            put_lat.append((time.perf_counter() - a) * 1000)
        out["baseline_put_p50_ms"] = round(statistics.median(put_lat), 2)
        out["cas_small_batch_bytes"] = part_bytes
        log(f"cas p50 {out['cas_p50_ms']} ms, put p50 {out['baseline_put_p50_ms']} ms")

        # 2. Throughput of 100k-row appends.
        sh = Shard.create(store, f"big-{run}", SCHEMA)
        tables = [rows_table(i * big, big, i) for i in range(n_big)]
        a = time.perf_counter()
        for i, t in enumerate(tables):
            sh.compare_and_append(t, i, i + 1)
        dt = time.perf_counter() - a
        out["append_updates_per_s"] = round(n_big * big / dt)
        log(f"append {out['append_updates_per_s']} updates/s")

        # 3. Snapshot of a shard holding 1M consolidated rows.
        sh = Shard.create(store, f"snap-{run}", SCHEMA)
        chunk = 250_000 if not args.quick else 50_000
        for i in range(snap_rows // chunk):
            sh.compare_and_append(rows_table(i * chunk, chunk, i), i, i + 1)
        as_of = snap_rows // chunk - 1
        times = []
        for _ in range(3):
            a = time.perf_counter()
            snap = sh.snapshot(as_of)
            times.append(time.perf_counter() - a)
        assert snap.num_rows == snap_rows, snap.num_rows
        out["snapshot_1m_rows_s"] = round(min(times), 3)
        out["snapshot_rows"] = snap_rows
        log(f"snapshot {snap_rows} rows in {out['snapshot_1m_rows_s']} s")

        # 3b. The same with half the rows under v1 and half under v2 (schema evolution).
        sh = Shard.create(store, f"snap-mixed-{run}", SCHEMA)
        chunks = snap_rows // chunk
        for i in range(chunks):
            if i == chunks // 2:
                sh.alter_schema(SCHEMA_V2)
            t = rows_table(i * chunk, chunk, i) if i < chunks // 2 else rows_table_v2(i * chunk, chunk, i)
            sh.compare_and_append(t, i, i + 1)
        times = []
        for _ in range(3):
            a = time.perf_counter()
            snap = sh.snapshot(as_of)
            times.append(time.perf_counter() - a)
        assert snap.num_rows == snap_rows and "region" in snap.column_names, snap.schema
        assert snap.filter(pa.compute.equal(snap["id"], 0))["region"].to_pylist() == ["eu"]  # a v1 row: the default
        out["snapshot_1m_rows_mixed_versions_s"] = round(min(times), 3)
        out["mixed_versions_ratio"] = round(min(times) / max(out["snapshot_1m_rows_s"], 1e-9), 2)  # type: ignore[arg-type]
        log(f"snapshot {snap_rows} rows of two schema versions in {out['snapshot_1m_rows_mixed_versions_s']} s "
            f"({out['mixed_versions_ratio']}x the single version)")

        # 4. Batch count after many small appends with compaction on.
        sh = Shard.create(store, f"compact-{run}", SCHEMA, auto_compact=True)
        a = time.perf_counter()
        for i in range(n_appends):
            sh.compare_and_append(rows_table(i, 1, i), i, i + 1)
            if i % 1000 == 999:
                log(f"{i + 1} appends, {len(sh.refresh().batches)} batches")
        out["batches_after_10k_appends"] = len(sh.refresh().batches)
        out["appends_for_batch_count"] = n_appends
        out["appends_with_compaction_per_s"] = round(n_appends / (time.perf_counter() - a), 1)
        snap = sh.snapshot(n_appends - 1)
        assert snap.num_rows == n_appends, snap.num_rows

        # 5. Write amplification of the merges when since trails the upper.
        n_trail = 50 if args.quick else 200
        for name, merge in (("since_trailing", "compact_since_moved"), ("full_collapse", "compact_below_since")):
            rewritten, seconds = since_trailing(store, f"{name}-{run}", n_trail, 100, merge)
            out[f"{name}_rewrites_per_row"] = round(rewritten / (n_trail * 100), 2)
            out[f"{name}_s"] = round(seconds, 2)
            log(f"{name}: {n_trail} appends of 100 rows, {out[f'{name}_rewrites_per_row']} rewrites per row, "
                f"{out[f'{name}_s']} s")

    out["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(), "pyarrow": pa.__version__}
    out["quick"] = args.quick
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
