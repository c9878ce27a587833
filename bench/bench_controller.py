"""Benchmark of the controller against the embedded stack (Tansu + moto), controller in-process.

Prints progress on stderr and, as its last stdout line, one JSON object:

- peek_1m_rows_s: a Peek of a 1M-row collection, command sent to response received (the
  result is a Parquet object on S3; median of 3)
- subscribe_lag_p50_s / subscribe_lag_p99_s: a shard upper advance (compare_and_append
  returned) to the progress row for that upper on the subscribe topic (200 small appends)
- compaction_mb_per_s: Parquet bytes of the batches merged when a read policy moves since
  past 20 batches of 50k rows (issue 31's workload: ids, names and amounts, each batch 70 %
  new rows and 30 % retractions of rows of earlier batches, so keys repeat across parts and
  the merge cancels them; what the tiered compaction left of them: 800k and 200k rows, a
  balanced run that the since move merges), divided by the time from the SetReadPolicy command to the
  merge's commit (the time stamped on the parts it retired; the bench polls every 50 ms, so
  that its own S3 requests do not slow the merge down); ``compaction_rows_per_s`` the rows
  merged per second; the controller merges in its process (no Spark master);
  ``compaction_s3_requests_alone_mb_per_s`` the same bytes over the time the merge's S3
  requests take with nothing else to do (every input part read, its bytes written back as 4
  parts): the ceiling the S3 server puts on the figure; ``compaction_cpu_s`` the CPU seconds
  spent from the command to the commit (this process, which runs the controller, less the
  bench's polling thread, and the stack's S3 server and broker: ``compaction_cpu_s_by_process``), and
  ``compaction_cpu_bound_mb_per_s`` the bytes over that CPU spread evenly on every core of the
  machine: the most the figure could reach here, were every core busy with the merge alone
- compaction_vs_duckdb / compaction_vs_polars: the same merged parts, copied once from the S3
  server to local files, consolidated the same way (times advanced to since, equal updates
  summed, zero sums dropped, snappy Parquet out) by the merge's own steps (read and decode,
  ``merge_table``, encode and write: ``compaction_local_mb_per_s``, ``compaction_local_cpu_s``),
  by DuckDB (``duckdb_mb_per_s``, ``duckdb_cpu_s``) and by Polars (``polars_mb_per_s``,
  ``polars_cpu_s``), in turn in this process after the controller stopped, median of 7 (3
  with ``--quick``): the ratio of our MB/s to each peer's (bench/compaction_peers.py; local
  copies for all, the S3 server for none). Targets: >= 1.0 against DuckDB, >= 0.9 against
  Polars. ``compaction_cpu_vs_duckdb`` / ``_polars``: the peer's CPU seconds over ours (above
  1: ours used less), steadier than the MB/s on a shared machine
- compaction_mb_per_s_cluster: the same compaction (after one untimed warm-up compaction)
  with a second controller whose merges are Spark jobs (SHARDSINK_CONTROLLER_SPARK_MASTER,
  threshold 0) on a standalone cluster of 2 workers x 1 core started from the pyspark wheel;
  ``compaction_cluster_vs_local`` its ratio to the one-process figure
- spark_read_1m_rows_s: ``read_collection(spark, "peek1m", as_of).toArrow()`` of the same 1M-row
  collection through the ``shardsink`` Spark batch source (local[2] session, already warm:
  median of 3 after one untimed read)

- idle_s3_requests_per_s / idle_tick_ms: a controller left alone with 100 collections (none
  written, waited on or announced), measured for 5 s: its S3 requests a second (counted at its
  client) and the mean duration of its ticks; ``idle_every_tick_*`` the same with
  ``head_refresh_ms`` 0 (every head read at every tick, as before the controller read quiet
  heads about once a second)

``--quick`` shrinks every size (for smoke runs); ``--no-cluster`` skips the standalone cluster
(its figures are then null); ``--compaction-rows N`` sets the rows of each of the 20 batches
compacted (default 50,000; 5,000 with ``--quick``); ``--idle-collections N`` the collections
of the idle figures (default 100; 10 with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import TopicPartition  # noqa: E402

from services.runtime.settings import ServiceSettings
from services.controller.service import Controller, ControllerSettings  # noqa: E402
from shared.codec import message_codec  # noqa: E402
from shared.devstack.embedded import EmbeddedStack  # noqa: E402
from shared.io.controller_client import ControllerClient, body_kind  # noqa: E402
from shared.io.kafka import new_consumer  # noqa: E402
from shared.shard import Shard  # noqa: E402
from shared.state import plan_merge, plan_since_merge  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compaction_peers import compare as compare_peers  # noqa: E402

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
    print(f"[bench-controller] {msg}", file=sys.stderr, flush=True)


def rows_table(start: int, n: int, time_: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "name": pa.array([f"name-{i % 1000}" for i in range(start, start + n)], pa.string()),
            "amount": pa.array([i * 0.5 for i in range(start, start + n)], pa.float64()),
            "_time": pa.array([time_] * n, pa.uint64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )


class Churn:
    """Issue 31's compaction workload, batch by batch: each batch 70 % new rows (random ids,
    names of 1,000 values, random amounts) and 30 % retractions of rows that earlier batches
    inserted and nothing retracted yet, shuffled; batch i at time i."""

    def __init__(self, seed: int = 31) -> None:
        self.rng = np.random.default_rng(seed)
        self.live_ids = np.empty(0, np.int64)
        self.live_amounts = np.empty(0, np.float64)
        self.names = np.array([f"name-{i}" for i in range(1000)], dtype=object)

    def batch(self, n: int, time_: int) -> pa.Table:
        rng = self.rng
        k = int(n * 0.3) if self.live_ids.size >= n else 0
        new_ids = rng.integers(0, 2**40, n - k)
        new_amounts = rng.random(n - k) * 1000
        pick = rng.choice(self.live_ids.size, size=k, replace=False) if k else np.empty(0, np.int64)
        ids = np.concatenate([new_ids, self.live_ids[pick]])
        amounts = np.concatenate([new_amounts, self.live_amounts[pick]])
        diffs = np.concatenate([np.ones(n - k, np.int64), -np.ones(k, np.int64)])
        self.live_ids = np.concatenate([np.delete(self.live_ids, pick), new_ids])
        self.live_amounts = np.concatenate([np.delete(self.live_amounts, pick), new_amounts])
        perm = rng.permutation(n)
        return pa.table({
            "id": pa.array(ids[perm], pa.int64()),
            "name": pa.array(self.names[ids[perm] % 1000].tolist(), pa.string()),
            "amount": pa.array(amounts[perm], pa.float64()),
            "_time": pa.array(np.full(n, time_, np.uint64)),
            "_diff": pa.array(diffs[perm], pa.int64()),
        })


def create(client: ControllerClient, cid: str) -> None:
    r = client.call("CreateCollection", {"collection_id": cid, "row_schema": json.dumps(SCHEMA), "initial_since": 0,
                                         "read_policy": None})
    assert body_kind(r) == "Ack", r


def bench_peek(client: ControllerClient, store: object, rows: int) -> float:
    create(client, "peek1m")
    shard = Shard(store, "peek1m")  # type: ignore[arg-type]
    step = 250_000
    for i, off in enumerate(range(0, rows, step)):
        shard.compare_and_append(rows_table(off, min(step, rows - off), i), i, i + 1)
    upper = shard.refresh().upper.time or 0
    log(f"loaded {rows} rows in {len(shard.refresh().batches)} batches")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = client.call("Peek", {"collection_id": "peek1m", "as_of": upper - 1}, timeout_s=120)
        times.append(time.perf_counter() - t0)
        assert body_kind(r) == "PeekResult", r
        res = r["body"][1]["result"][1]
        assert res.get("row_count") == rows, res
    log(f"peek {rows} rows: {[round(t, 3) for t in times]} s")
    return statistics.median(times)


def bench_spark_read(store_settings: object, rows: int) -> float:
    from pyspark.sql import SparkSession

    from shared.spark.shardsink_source import read_collection

    spark = (SparkSession.builder.master("local[2]").appName("bench-spark-read")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        shard = Shard(store_settings.store(), "peek1m")  # type: ignore[attr-defined]
        as_of = (shard.refresh().upper.time or 1) - 1
        s3 = store_settings.s3  # type: ignore[attr-defined]
        n = read_collection(spark, "peek1m", as_of, settings=s3).count()  # warm the workers
        assert n == rows, n
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            got = read_collection(spark, "peek1m", as_of, settings=s3).toArrow()
            times.append(time.perf_counter() - t0)
            assert got.num_rows == rows, got.num_rows
        log(f"spark read {rows} rows: {[round(t, 3) for t in times]} s")
        return statistics.median(times)
    finally:
        spark.stop()


def bench_subscribe_lag(stack: EmbeddedStack, client: ControllerClient, store: object, n: int) -> tuple[float, float]:
    create(client, "lag")
    topic = f"bench-sub-{uuid.uuid4().hex[:8]}"
    sid = client.send("Subscribe", {"collection_id": "lag", "output_topic": topic, "as_of": 0, "up_to": None,
                                    "with_snapshot": True})
    assert body_kind(client.wait(sid)) == "Ack"
    shard = Shard(store, "lag")  # type: ignore[arg-type]
    arrivals: dict[int, float] = {}
    stop = threading.Event()
    codec = message_codec("subscribe_output")

    def consume() -> None:
        c = new_consumer(ServiceSettings.from_env_and_args(None, stack.env()).kafka,
                         **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "5"})
        c.assign([TopicPartition(topic, 0, 0)])
        while not stop.is_set():
            for m in c.consume(num_messages=100, timeout=0.05):
                if m.error() is None:
                    msg = codec.decode(m.value())
                    if msg["progressed"] and msg["time"] is not None:
                        arrivals.setdefault(msg["time"], time.perf_counter())
        c.close()

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    done: dict[int, float] = {}
    upper = 0
    for i in range(n):
        shard.compare_and_append(rows_table(i * 10, 10, upper), upper, upper + 1)
        upper += 1
        done[upper] = time.perf_counter()
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while upper not in arrivals and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    th.join(5)
    # A progress row covers every upper at or below it (several advances may share one row).
    lags = []
    seen = sorted(arrivals)
    for u, t in done.items():
        covering = next((p for p in seen if p >= u), None)
        if covering is not None:
            lags.append(arrivals[covering] - t)
    lags.sort()
    p50 = lags[len(lags) // 2]
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    log(f"subscribe lag over {len(lags)} advances: p50 {p50:.3f}s p99 {p99:.3f}s")
    return p50, p99


def bench_compaction(client: ControllerClient, store: object, batches: int, rows: int,
                     cid: str = "compact", *, s3_alone: bool = False,
                     stack: EmbeddedStack | None = None) -> dict[str, Any]:
    """``mb_per_s`` and ``rows_per_s`` of merging ``batches`` batches of ``rows`` rows below a
    moved since; with ``s3_alone`` the MB/s of the merge's S3 requests alone
    (:func:`s3_requests_alone`); with ``stack`` the CPU seconds spent meanwhile
    (:func:`cpu_seconds`) and the MB/s those allow on this machine's cores."""
    create(client, cid)
    shard = Shard(store, cid)  # type: ignore[arg-type]
    churn = Churn()
    for i in range(batches):
        shard.compare_and_append(churn.batch(rows, i), i, i + 1)
    # Let the controller's tiered compaction of the appends settle first.
    st, quiet_since = shard.refresh(), time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        time.sleep(0.1)
        now = shard.refresh()
        if now.seqno != st.seqno or plan_merge(now) is not None:
            st, quiet_since = now, time.monotonic()
    # The controller's tiered compaction may already have merged some: count what is there,
    # then what the since move merged (plan_since_merge: a balanced run below since).
    parts = {p.key: p for b in st.batches for p in b.parts}
    samples: list[tuple[float, dict[str, float]]] = []
    t0_ms = time.time() * 1000
    cpu0 = cpu_seconds(stack)
    r = client.call("SetReadPolicy", {"collection_id": cid, "policy": ("io.shardsink.v1.LagWritesBy",
                                                                         {"lag": 0, "granularity": None})},
                    timeout_s=600)
    assert body_kind(r) == "Ack", r
    deadline = time.monotonic() + 300
    while True:
        st = shard.refresh()
        if stack is not None:
            samples.append((time.time() * 1000, cpu_seconds(stack)))
        merged = [x for x in st.retired if x.key in parts]
        if st.since.time == batches and plan_since_merge(st) is None and merged:
            break
        assert time.monotonic() < deadline, f"expected a merge below since {batches}, found none: {st.batches}"
        time.sleep(0.05)
    done_ms = max(x.retired_ms for x in merged)
    keys = sorted(x.key for x in merged)
    nbytes = sum(parts[k].bytes for k in keys)
    nrows = sum(parts[k].rows for k in keys)
    # After the timed merge: the S3 server's ceiling, measured on the merged parts' bytes.
    io_s = s3_requests_alone(store, keys, nbytes) if s3_alone else None
    dt = (done_ms - t0_ms) / 1000.0
    mb = nbytes / 1e6
    out: dict[str, Any] = {"mb_per_s": mb / dt, "rows_per_s": nrows / dt,
                           "s3_requests_alone_mb_per_s": None if io_s is None else mb / io_s,
                           "keys": keys, "since": batches}
    if stack is not None:
        # The first sample taken at or after the commit (polls are 50 ms apart: the CPU of up
        # to one poll interval after it is counted too, an overestimate of at most that).
        cpu1 = next((c for t, c in samples if t >= done_ms), samples[-1][1])
        used = {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0 if k in cpu1}
        total = sum(used.values())
        cores = os.cpu_count() or 1
        out |= {"cpu_s": round(total, 3), "cpu_s_by_process": used,
                "cpu_bound_mb_per_s": mb / (total / cores) if total > 0 else None}
    log(f"compaction {cid}: {mb:.1f} MB, {nrows} rows in {dt:.3f}s ({len(st.batches)} batches left)"
        + ("" if io_s is None else f"; its S3 requests alone {io_s:.3f}s")
        + ("" if stack is None else f"; CPU {out['cpu_s_by_process']}"))
    return out


def cpu_seconds(stack: EmbeddedStack | None) -> dict[str, float]:
    """CPU seconds used so far by this process less the calling thread (the controller runs
    in-process; the bench polls from the calling thread, its own CPU is left out) and by the
    stack's S3 server and broker (:meth:`EmbeddedStack.cpu_seconds`)."""
    if stack is None:
        return {}
    return {"controller": time.process_time() - time.thread_time(), **stack.cpu_seconds()}


def s3_requests_alone(store: object, keys: list[str], nbytes: int) -> float:
    """Seconds the S3 requests of a merge take with no work between them: GET every input
    part (8 threads, as the merge reads) and PUT a quarter of their bytes 4 times (the merge
    writes its result as parts of at most 256k rows, in parallel); median of 3. The ceiling
    the S3 server puts on ``compaction_mb_per_s``."""
    from concurrent.futures import ThreadPoolExecutor

    blob = os.urandom(max(1, nbytes // 4))
    times = []
    for rep in range(3):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(store.get, keys))  # type: ignore[attr-defined]
        junk = [f"bench-io/{uuid.uuid4().hex}-{i}" for i in range(4)]
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda k: store.put(k, blob, if_absent=True), junk))  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
        store.delete_many(junk)  # type: ignore[attr-defined]
    return statistics.median(times)


def bench_compaction_cluster(stack: EmbeddedStack, batches: int, rows: int) -> float:
    """The compaction as a Spark job on a standalone cluster of 2 workers x 1 core."""
    from dataclasses import replace

    from services.controller.spark_jobs import SparkJobSettings
    from shared.devstack.embedded import SparkStandalone

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    with SparkStandalone(workers=2, cores=1) as cluster:
        env = {**stack.env(), "SHARDSINK_S3_PREFIX": f"bench-cluster-{uuid.uuid4().hex[:8]}"}
        svc = ServiceSettings.from_env_and_args(None, env)
        u = uuid.uuid4().hex[:8]
        cs = ControllerSettings(svc, commands_topic=f"commands-c{u}", responses_topic=f"responses-c{u}")
        cs = replace(cs, spark=SparkJobSettings(master=cluster.master_url, min_bytes=0, gc_min_objects=1 << 40))
        controller = Controller(cs).start()
        client = ControllerClient(svc.kafka, commands_topic=cs.commands_topic, responses_topic=cs.responses_topic)
        try:
            bench_compaction(client, svc.store(), batches, max(rows // 10, 1), "warm-up")
            out = float(bench_compaction(client, svc.store(), batches, rows, "compact-cluster")["mb_per_s"])
            assert controller.spark_jobs is not None
            jobs = dict(controller.spark_jobs.jobs)
            log(f"controller jobs on the cluster: {jobs}")
            assert jobs.get(("merge", "fallback"), 0) == 0, jobs
            return out
        finally:
            controller.stop()
            client.close()


def bench_idle(stack: EmbeddedStack, collections: int, seconds: float = 5.0) -> dict[str, float]:
    """S3 requests a second and mean tick of an idle controller with ``collections`` quiet
    collections, with the default ``head_refresh_ms`` and with 0 (every head at every tick)."""
    from dataclasses import replace

    from shared.io.s3 import S3ObjectStore

    requests = [0]
    originals = {n: getattr(S3ObjectStore, n) for n in ("get", "exists", "put", "list", "delete", "delete_many")}

    def counted(f: Any) -> Any:
        def call(self: Any, *a: Any, **k: Any) -> Any:
            requests[0] += 1
            return f(self, *a, **k)
        return call

    env = {**stack.env(), "SHARDSINK_S3_PREFIX": f"bench-idle-{uuid.uuid4().hex[:8]}"}
    svc = ServiceSettings.from_env_and_args(None, env)
    u = uuid.uuid4().hex[:8]
    base = ControllerSettings(svc, commands_topic=f"commands-i{u}", responses_topic=f"responses-i{u}")
    out: dict[str, float] = {}
    for name, every in (("idle", base.head_refresh_ms), ("idle_every_tick", 0)):
        controller = Controller(replace(base, head_refresh_ms=every)).start()
        client = ControllerClient(svc.kafka, commands_topic=base.commands_topic, responses_topic=base.responses_topic)
        ticks: list[float] = []
        tick = controller.tick

        def timed_tick(tick: Any = tick) -> None:
            t0 = time.perf_counter()
            tick()
            ticks.append(time.perf_counter() - t0)

        controller.tick = timed_tick  # type: ignore[method-assign]
        try:
            if name == "idle":
                for i in range(collections):
                    create(client, f"idle{i}")
            time.sleep(2.0)  # the second controller opens them all at its recovery
            for n, f in originals.items():
                setattr(S3ObjectStore, n, counted(f))
            requests[0], ticks[:] = 0, []
            t0 = time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - t0
        finally:
            for n, f in originals.items():
                setattr(S3ObjectStore, n, f)
            controller.stop()
            client.close()
        out[f"{name}_s3_requests_per_s"] = round(requests[0] / elapsed, 1)
        out[f"{name}_tick_ms"] = round(1000 * statistics.mean(ticks), 1) if ticks else float("nan")
    log(f"idle controller, {collections} collections: {out}")
    return out


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-cluster", action="store_true")
    ap.add_argument("--compaction-rows", type=int)
    ap.add_argument("--idle-collections", type=int)
    args = ap.parse_args()
    comp_n = args.compaction_rows or (5_000 if args.quick else 50_000)
    peek_rows = 100_000 if args.quick else 1_000_000
    lag_n = 30 if args.quick else 200
    with EmbeddedStack() as stack:
        env = {**stack.env(), "SHARDSINK_S3_PREFIX": f"bench-{uuid.uuid4().hex[:8]}"}
        svc = ServiceSettings.from_env_and_args(None, env)
        u = uuid.uuid4().hex[:8]
        cs = ControllerSettings(svc, commands_topic=f"commands-{u}", responses_topic=f"responses-{u}",
                                max_inline_bytes=64 * 1024)
        controller = Controller(cs).start()
        client = ControllerClient(svc.kafka, commands_topic=cs.commands_topic, responses_topic=cs.responses_topic)
        store = svc.store()
        try:
            peek_s = bench_peek(client, store, peek_rows)
            p50, p99 = bench_subscribe_lag(stack, client, store, lag_n)
            compaction = bench_compaction(client, store, 20, comp_n, s3_alone=True, stack=stack)
            comp = compaction["mb_per_s"]
        finally:
            controller.stop()
            client.close()
        # The peers on the bytes the timed merge consolidated (retired parts outlive the merge
        # by the grace period), with the controller stopped: this process does nothing else.
        peers = compare_peers(store, compaction["keys"], compaction["since"], SCHEMA, reps=3 if args.quick else 7,
                              log=log)
        comp_cluster = None if args.no_cluster else bench_compaction_cluster(stack, 20, comp_n)
        spark_read_s = bench_spark_read(svc, peek_rows)
        idle = bench_idle(stack, args.idle_collections or (10 if args.quick else 100))
    out = {
        "peek_1m_rows_s": round(peek_s, 3),
        "peek_rows": peek_rows,
        "subscribe_lag_p50_s": round(p50, 4),
        "subscribe_lag_p99_s": round(p99, 4),
        "compaction_mb_per_s": round(comp, 2),
        "compaction_s3_requests_alone_mb_per_s": _round(compaction["s3_requests_alone_mb_per_s"], 2),
        "compaction_cpu_s": compaction.get("cpu_s"),
        "compaction_cpu_s_by_process": compaction.get("cpu_s_by_process"),
        "compaction_cpu_bound_mb_per_s": _round(compaction.get("cpu_bound_mb_per_s"), 2),
        "compaction_rows_per_s": round(compaction["rows_per_s"]),
        "compaction_rows": 20 * comp_n,
        "compaction_vs_duckdb": peers["vs_duckdb"],
        "compaction_vs_polars": peers["vs_polars"],
        "compaction_cpu_vs_duckdb": peers["cpu_vs_duckdb"],
        "compaction_cpu_vs_polars": peers["cpu_vs_polars"],
        "compaction_local_mb_per_s": peers["ours_mb_per_s"],
        "compaction_local_cpu_s": peers["ours_cpu_s"],
        "duckdb_mb_per_s": peers["duckdb_mb_per_s"],
        "duckdb_cpu_s": peers["duckdb_cpu_s"],
        "polars_mb_per_s": peers["polars_mb_per_s"],
        "polars_cpu_s": peers["polars_cpu_s"],
        "peers_mb": peers["mb"],
        "peers_input": "local copies of the merged parts (all engines)",
        "compaction_mb_per_s_cluster": None if comp_cluster is None else round(comp_cluster, 2),
        "compaction_cluster_vs_local": None if comp_cluster is None else round(comp_cluster / comp, 3),
        "spark_read_1m_rows_s": round(spark_read_s, 3),
        "idle_collections": args.idle_collections or (10 if args.quick else 100),
        **idle,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
