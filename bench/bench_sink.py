"""Benchmark of the sink (mint, write, append) on the embedded stack.

Prints progress on stderr and, as its last stdout line, one JSON object:

- How a shard's upper is timed: by the appenders' announcements on ``frontiers`` (each
  follows the compare-and-append that made the upper durable, and carries its time), with
  the shard read once a second as a check (``bench/upper_watch.py``,
  :class:`AnnouncedUpperWatch`); polling the S3 server every 20 ms, as before 11-24, took a
  sizeable share of the cores from the sink it measured.
- ``sink_updates_per_s``: sustained throughput, desired topic to committed shard. The
  services run warm (``python -m services``: the three queries in one Spark application, the
  embedded default) and in step; N updates (inserts and retractions over 3 partitions) are
  produced in progress steps as fast as the producer goes; a burst's rate is N over the time
  from its first produce until the shard's upper passes its last progress. The figure is the
  median of ``--repeats`` bursts (default 3; each burst's rate in ``sink_updates_per_s_runs``):
  on a 2-core machine shared with the producer, one burst's rate moves by a quarter from one
  burst to the next.
- ``baseline_updates_per_s``: the same measurement for plain Spark Structured Streaming on
  the same desired topic, in the same run: our Kafka source
  (``shared.spark.kafka_connector.kafka_read_stream``), same Spark settings, trigger and wait for
  records (``SHARDSINK_SOURCE_WAIT_MS``) as the services, and a ``foreachBatch`` that
  converts the micro-batch with ``toArrow()`` and PUTs it as one Parquet object with boto3
  to the same S3 server (the pyspark wheel has no hadoop-aws, so
  ``df.write.parquet("s3a://...")`` is not available). Raw records, no decode, no correction,
  no compare-and-append. Done when every record produced (updates and
  progress) is in a Parquet object. The median of as many bursts as the sink's
  (``baseline_updates_per_s_runs``); ``sink_vs_baseline`` is the ratio of the two medians.
- ``freshness_p50_s`` / ``freshness_p99_s``: at a steady ~10k updates/s (a progress step
  every 0.5 s), per step the time from ``advance_to`` returning until the shard's upper
  reaches that frontier. The control messages carry their own timestamps (``minted_at_ms``,
  ``written_at_ms``, ``updated_at_ms``), so the delay is split into its hops
  (``freshness_breakdown``): progress -> description minted, minted -> last writer report,
  last report -> upper published. ``freshness_1k_p50_s`` / ``freshness_1k_p99_s``: the same
  at ~1k updates/s, a rate far below the sink's throughput: the latency floor of the hops.
  ``freshness_broker_cpu_share`` / ``freshness_1k_broker_cpu_share``: the embedded broker's
  CPU over each run (its steps and the catch-up after them), as a share of all cores (the
  broker lists a partition's batches on every fetch that finds records: see "Fetch waits" in
  ``shared/io/kafka.py``).
- ``correction_peak_ratio``: peak bytes of the correction buffer during hydration over the
  collection's Arrow size (``bench/bench_correction.py``'s ``measure_hydration_ratio``).
- ``baseline_cpu_s`` / ``sink_cpu_s``: CPU seconds of the baseline's and of the services'
  process trees during a timed burst, the median over the bursts (the producer shares the same
  two cores: the more CPU a pipeline takes, the slower the updates arrive).
- ``driver_cpu_share``: during the throughput run's bursts, CPU seconds of the services' driver Python
  process (where ``foreachBatch`` runs: reports, descriptions, appends) over the CPU seconds of
  the whole services process tree (the JVM, the Python workers that decode, absorb, read back
  and stage, the Python source runners, the driver), from ``/proc`` CPU times. In local mode
  the JVM is driver and executor at once and counts as sink CPU; ``jvm_cpu_share`` and
  ``workers_cpu_share`` are reported next to it.
- ``recovery_s``: with the services run as three processes (the compose/Kubernetes mode), on
  a fresh sink whose live collection stays at ``recovery_live_rows`` rows (each step inserts
  as many rows as it retracts), the write service is SIGKILLed (its whole process group) and
  restarted at once after a history of N updates, then again after 10N; the time from the
  kill until the shard's upper catches up with the first progress step made after it.
  Each history size is measured ``--repeats`` times (a kill each, the services back in step
  between them; the single times in ``recovery_runs`` and ``recovery_n_runs``, whose spread
  on this machine is 2-4 s); ``recovery_s`` is the median after 10N, ``recovery_n_s`` after N, and
  ``recovery_history_ratio`` their ratio: the restarted writer resumes from its checkpoint,
  so recovery depends on the state's size, not on the history's.
- ``baseline_recovery_s``: the same for the plain Spark baseline, in the same run: after its
  bursts, with the baseline idle, its process (group) is SIGKILLed and restarted at once on
  its checkpoint; the time from the kill until a step of 1,000 updates produced after it is in
  a Parquet object (median of ``--repeats`` kills, runs in ``baseline_recovery_runs``). A
  restart of any Spark Structured Streaming application pays the same process, JVM,
  SparkSession, query and first micro-batch starts, so this is the floor a SIGKILLed write
  service is measured against: ``recovery_vs_baseline`` = ``recovery_s`` /
  ``baseline_recovery_s`` (lower is better).

- The delta-rs peer (issue 31; ``--no-deltalake`` leaves it out): after the sink's freshness
  runs, a minimal Kafka-to-Delta loop (:func:`deltalake_worker`, a child process) reads the
  same desired topic from its end at that moment with confluent-kafka, decodes each poll as the
  sink does (the write service's ``DesiredDecoder``, the collection's ``ColumnCodec``) and
  appends its updates with one ``deltalake.write_deltalake(..., mode="append")`` commit to a
  Delta table on the same S3 server, exactly once: per partition a
  ``Transaction(app_id, last offset)`` in the commit, checked against
  ``transaction_version`` before it. The same bursts as the sink's give
  ``deltalake_updates_per_s`` (its commit of the burst's last record, from the burst's first
  produce; runs in ``deltalake_updates_per_s_runs``, CPU seconds ``deltalake_cpu_s``) and
  ``sink_vs_deltalake`` = ``sink_updates_per_s`` / ``deltalake_updates_per_s``. The same
  freshness steps as the sink's 10k/s run give ``deltalake_freshness_p50_s`` / ``_p99_s``: per
  step, from ``advance_to`` returning until the commit after which the table holds every
  update below that frontier (the commit of the poll that read the step's progress
  statements in every partition); ``freshness_vs_deltalake`` =
  ``freshness_p50_s`` / ``deltalake_freshness_p50_s`` (lower is better). The table is checked
  to hold every update produced since the loop started, once (``deltalake_rows``).
- ``snapshot_1m_vs_deltalake``: the same 1M inserts (100k with ``--quick``:
  ``snapshot_rows``), appended in 4 commits to a collection's shard and to a Delta table on
  the same S3 server, read whole as of the last commit's time (best of 3, opening included):
  ours with the read API, ``open_collection(...).snapshot(as_of)`` (the contents:
  consolidated and sorted by row; ``snapshot_1m_s``); delta-rs reading the version
  (``DeltaTable(uri, version).to_pyarrow_table()``: ``deltalake_read_1m_s``, the rows as
  appended) and the same read consolidated and sorted by Polars, the same work and contents
  as ours (:func:`deltalake_snapshot`: ``deltalake_snapshot_1m_s``). The figure is
  ``snapshot_1m_s`` / ``deltalake_snapshot_1m_s`` (lower is better).

Every ``*_vs_*`` figure is ours over the other's: a rate (updates/s: ``sink_vs_baseline``,
``sink_vs_deltalake``) is better above 1, a time (``freshness_vs_deltalake``,
``snapshot_1m_vs_deltalake``, ``recovery_vs_baseline``) below 1.

``--quick`` shrinks every size (a smoke run). Figures on a shared 2-core machine are noisy:
the load average of each phase is reported (``load``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from delta_peer import DeltaTopic, delta_storage_options  # noqa: E402
from shared.devstack.embedded import ProcStat, process_stat  # noqa: E402
from upper_watch import AnnouncedUpperWatch  # noqa: E402

SCHEMA = {
    "type": "record",
    "name": "Order",
    "namespace": "bench",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "category", "type": "string"},
    ],
}
PARTITIONS = 3
STEP_TIMES = 10
CATEGORIES = ["books", "games", "garden", "kitchen", "music", "outdoor", "tools", "toys"]


def log(msg: str) -> None:
    print(f"[bench-sink] {msg}", file=sys.stderr, flush=True)


def load() -> float:
    return round(os.getloadavg()[0], 1)


# -- workload -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """Pre-encoded updates (row bytes, diff): mostly inserts of new orders, some retractions
    of live ones. Produced in progress steps; the frontier only moves forward."""

    producer: Any
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    live: list[bytes] = field(default_factory=list)
    next_id: int = 0
    frontier: int = 0
    updates: int = 0

    def make(self, n: int, retract: float = 0.15) -> list[tuple[bytes, int]]:
        out: list[tuple[bytes, int]] = []
        enc = self.producer.rows.encode
        for _ in range(n):
            if self.live and self.rng.random() < retract:
                i = self.rng.randrange(len(self.live))
                self.live[i], self.live[-1] = self.live[-1], self.live[i]
                out.append((self.live.pop(), -1))
                continue
            row = {
                "id": self.next_id,
                "customer": f"c{self.rng.randrange(100_000)}",
                "amount": round(self.rng.uniform(0, 1000), 2),
                "category": self.rng.choice(CATEGORIES),
            }
            self.next_id += 1
            b = enc(row)
            self.live.append(b)
            out.append((b, 1))
        return out

    def send_step(self, updates: list[tuple[bytes, int]]) -> int:
        """Send updates at times in ``[frontier, frontier + STEP_TIMES)``, then advance the
        progress past them; returns the new frontier."""
        lo = self.frontier
        rnd = self.rng.randrange
        for b, d in updates:
            self.producer.send_encoded(b, lo + rnd(STEP_TIMES), d)
        self.updates += len(updates)
        self.frontier = lo + STEP_TIMES
        self.producer.advance_to(self.frontier)
        return self.frontier


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    """A child process in its own process group (so a kill takes its JVM and workers too)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    p: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as out:
            self.p = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 30.0) -> None:
        p, self.p = self.p, None
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=wait_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (the services stop their queries), then SIGKILL after 20 s."""
        self.kill(signal.SIGTERM, wait_s=20.0)

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, procs: list[Proc] = (), poll_s: float = 0.02) -> float:  # type: ignore[assignment]
    t0 = time.monotonic()
    while not pred():
        for p in procs:
            if p.p is not None and not p.alive():
                raise RuntimeError(f"expected {p.name} running while waiting for {what}, found it exited (log {p.log_path})")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"expected {what} within {timeout_s}s, found it still pending")
        time.sleep(poll_s)
    return time.monotonic() - t0


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, with reaped children) of ``root`` and every live descendant,
    by pid, with a kind: ``driver`` (root), ``jvm``, ``worker`` (Python under the JVM)."""
    procs: dict[int, ProcStat] = {}
    for d in os.listdir("/proc"):
        st = process_stat(int(d)) if d.isdigit() else None
        if st is not None:
            procs[int(d)] = st
    out: dict[int, tuple[str, float]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in procs:
            continue
        st = procs[pid]
        kind = "driver" if pid == root else ("jvm" if st.comm == "java" else "worker")
        out[pid] = (kind, st.cpu_s)
        todo.extend(c for c, other in procs.items() if other.ppid == pid)
    return out


def cpu_shares(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """Each kind's share of the CPU seconds spent between two :func:`tree_cpu` snapshots."""
    spent: dict[str, float] = {}
    for pid, (kind, cpu) in after.items():
        spent[kind] = spent.get(kind, 0.0) + cpu - before.get(pid, (kind, 0.0))[1]
    total = sum(spent.values()) or 1.0
    return {k: round(v / total, 3) for k, v in spent.items()} | {"cpu_s": round(total, 1)}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


# -- the baseline worker (a child process) --------------------------------------------------------


def baseline_worker(topic: str, prefix: str, progress_file: str) -> int:
    """Plain Spark Structured Streaming: Kafka topic -> one Parquet object per micro-batch on S3."""
    import boto3
    import pyarrow.parquet as pq

    from services.runtime.settings import ServiceSettings
    from services.runtime.spark import spark_session
    from shared.spark.kafka_connector import kafka_read_stream

    settings = ServiceSettings.from_env_and_args(None)
    spark = spark_session(settings, "bench-baseline")
    env = os.environ
    s3 = boto3.client(
        "s3",
        endpoint_url=env["SHARDSINK_S3_ENDPOINT"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    bucket = settings.s3.bucket
    out = open(progress_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the query

    def each(batch_df: Any, batch_id: int) -> None:
        table = batch_df.select("topic", "partition", "offset", "timestamp", "key", "value").toArrow()
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="snappy")
        s3.put_object(Bucket=bucket, Key=f"{prefix}/batch-{batch_id:08d}.parquet", Body=buf.getvalue())
        out.write(json.dumps({"batch": batch_id, "rows": table.num_rows, "t": time.time()}) + "\n")

    df = kafka_read_stream(spark, settings.kafka, [topic], starting_offsets="earliest",
                           wait_for_records_ms=settings.source_wait_ms)
    q = (
        df.writeStream.foreachBatch(each)
        # One checkpoint per prefix: a restarted worker resumes from it (the baseline's recovery).
        .option("checkpointLocation", os.path.join(settings.checkpoint_dir, "baseline", prefix.replace("/", "-")))
        .trigger(processingTime=f"{settings.trigger_ms} milliseconds")
        .start()
    )
    out.write(json.dumps({"started": True, "t": time.time()}) + "\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set() and q.isActive:
        time.sleep(0.2)
    q.stop()
    spark.stop()
    return 0


def baseline_rows(progress_file: Path) -> int:
    """The rows the baseline wrote, each micro-batch counted once (a batch a restarted worker
    ran again writes the same object and line again)."""
    try:
        lines = progress_file.read_text().splitlines()
    except OSError:
        return 0
    rows: dict[int, int] = {}
    for x in lines:
        if x.strip():
            d = json.loads(x)
            if "batch" in d:
                rows[d["batch"]] = d["rows"]
    return sum(rows.values())


# -- the delta-rs peer (a child process) ----------------------------------------------------------

def deltalake_worker(topic: str, uri: str, progress_file: str, start_json: str) -> int:
    """A minimal Kafka-to-Delta loop with delta-rs, exactly once: per poll (what the consumer
    has fetched, waiting at most one trigger, 100 ms, for the first record), one
    :meth:`DeltaTopic.write <delta_peer.DeltaTopic.write>` (one append commit when the poll holds
    updates), reported on ``progress_file`` (records, updates, the desired frontier the table
    now holds, commit wall time). Starts at the offsets in ``start_json``
    (``{partition: offset}``), or after the table's transaction version of a partition when it
    has one.
    """
    from confluent_kafka import TopicPartition

    from services.runtime.settings import ServiceSettings
    from shared.io.kafka import consume_available, new_consumer

    settings = ServiceSettings.from_env_and_args(None)
    start = {int(p): int(o) for p, o in json.loads(start_json).items()}
    table = DeltaTopic(topic, uri, SCHEMA, start, delta_storage_options(os.environ))
    pos = table.positions(start)
    consumer = new_consumer(settings.kafka)
    consumer.assign([TopicPartition(topic, p, o) for p, o in pos.items()])
    out = open(progress_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the loop
    out.write(json.dumps({"started": True, "version": table.table.version(), "from": pos}) + "\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            msgs = [m for m in consume_available(consumer, 100_000, 0.1) if m.error() is None]
            line = table.write(msgs) if msgs else None
            if line is not None:
                out.write(json.dumps(line) + "\n")
    finally:
        consumer.close()
    return 0


def delta_lines(progress_file: Path) -> list[dict[str, Any]]:
    try:
        lines = progress_file.read_text().splitlines()
    except OSError:
        return []
    out = []
    for x in lines:
        with contextlib.suppress(ValueError):  # a line being written
            d = json.loads(x)
            if "rows" in d:
                out.append(d)
    return out


def delta_done_at(progress_file: Path, records: int) -> float | None:
    """Wall time of the peer's poll that brought its record count to ``records`` (None: not yet)."""
    n = 0
    for d in delta_lines(progress_file):
        n += d["rows"]
        if n >= records:
            return float(d["t"])
    return None


def delta_visible_at(progress_file: Path) -> dict[int, float]:
    """Per desired frontier the peer's table reached, the wall time it first held it."""
    out: dict[int, float] = {}
    for d in delta_lines(progress_file):
        f = d.get("frontier")
        if f is not None and f not in out:
            out[f] = float(d["t"])
    return out


# -- control messages (for the freshness breakdown) ---------------------------------------------------


def read_topic(kafka: Any, topic: str, codec_name: str, sink_id: str) -> list[dict[str, Any]]:
    from confluent_kafka import TopicPartition

    from shared.codec import message_codec
    from shared.io.kafka import end_offsets, new_consumer

    codec = message_codec(codec_name)
    ends = {p: e for p, e in end_offsets(kafka, topic).items() if e > 0}
    out: list[dict[str, Any]] = []
    if not ends:
        return out
    c = new_consumer(kafka)
    try:
        c.assign([TopicPartition(topic, p, 0) for p in ends])
        pos = dict.fromkeys(ends, 0)
        deadline = time.monotonic() + 120
        while any(pos[p] < ends[p] for p in ends) and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            pos[msg.partition()] = msg.offset() + 1
            d = codec.decode(msg.value())
            if d.get("sink_id") == sink_id:
                out.append(d)
    finally:
        c.close()
    return out


def frontier_time(f: Any) -> int | None:
    """A frontier as the control messages encode it (``Frontier.to_json``)."""
    from shared.frontier import Frontier

    return Frontier.from_json(f).time


def freshness_breakdown(kafka: Any, settings: Any, sink_id: str, adv: dict[int, float]) -> dict[str, Any]:
    """Split each step's delay into hops, from the control messages' own timestamps.

    ``adv`` maps a frontier to the wall-clock time its ``advance_to`` returned."""
    descs = read_topic(kafka, settings.descs_topic, "batch_description", sink_id)
    reports = read_topic(kafka, settings.batches_topic, "written_batch", sink_id)
    fronts = read_topic(kafka, settings.frontiers_topic, "frontier_update", sink_id)
    last_report: dict[str, float] = {}
    for r in reports:
        last_report[r["desc_token"]] = max(last_report.get(r["desc_token"], 0.0), r["written_at_ms"] / 1000)
    published = {f["desc_token"]: f["updated_at_ms"] / 1000 for f in fronts if f.get("desc_token")}
    to_mint, to_written, to_published, sizes = [], [], [], []
    for d in descs:
        up = frontier_time(d["upper"])
        lo = frontier_time(d["lower"])
        tok = d["token"]
        if up not in adv or tok not in published or tok not in last_report:
            continue
        minted = d["minted_at_ms"] / 1000
        to_mint.append(minted - adv[up])
        to_written.append(last_report[tok] - minted)
        to_published.append(published[tok] - last_report[tok])
        if lo is not None and up is not None:
            sizes.append((up - lo) // STEP_TIMES)

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 3) if xs else None

    return {
        "appended_descriptions": len(to_mint),
        "progress_to_minted_p50_s": med(to_mint),
        "minted_to_last_report_p50_s": med(to_written),
        "last_report_to_published_p50_s": med(to_published),
        "steps_per_description_p50": med([float(x) for x in sizes]),
    }


# -- phases -------------------------------------------------------------------------------------------


def produce_timed(workload: Workload, batches: list[list[tuple[bytes, int]]]) -> tuple[float, float, int]:
    """Send pre-made steps as fast as possible. Returns (t0 monotonic, produce seconds,
    final frontier)."""
    t0 = time.monotonic()
    f = workload.frontier
    for b in batches:
        f = workload.send_step(b)
    return t0, time.monotonic() - t0, f


def deltalake_phase(wl: Workload, topic: str, env: dict[str, str], settings: Any, work: Path, procs: list[Proc], *,
                    n_updates: int, step_updates: int, repeats: int, fresh_s: float) -> dict[str, Any]:
    """The delta-rs peer on the sink's desired topic: throughput bursts as the sink's, then
    freshness at ~10k updates/s (see the module docstring). Starts at the topic's end."""
    from shared.io.kafka import end_offsets

    producer = wl.producer
    producer.flush()
    start = end_offsets(settings.kafka, topic)
    sent0 = producer.sent_updates + producer.sent_progress
    upd0 = producer.sent_updates
    run = uuid.uuid4().hex[:8]
    uri = f"s3://{settings.s3.bucket}/bench-deltalake/{run}"
    progress = work / f"deltalake-{run}-progress.jsonl"  # a reused work dir keeps older runs' files
    log(f"deltalake: starting the delta-rs loop (Kafka -> Delta table {uri}) at offsets {start}")
    peer = Proc(
        "deltalake",
        [sys.executable, str(REPO / "bench" / "bench_sink.py"), "--deltalake-worker", topic, uri, str(progress),
         json.dumps(start)],
        env,
        work / "deltalake.log",
    ).start()
    procs.append(peer)
    assert peer.p is not None

    def records() -> int:
        return producer.sent_updates + producer.sent_progress - sent0

    out: dict[str, Any] = {}
    wl.send_step(wl.make(step_updates))
    want = records()
    wait_for(lambda: delta_done_at(progress, want) is not None, 300, "the delta-rs loop's warm-up step", [peer])
    runs: list[tuple[float, float]] = []  # (seconds, CPU seconds)
    for _ in range(repeats):
        batches = [wl.make(step_updates) for _ in range(n_updates // step_updates)]
        time.sleep(1.0)  # the previous burst's last commit
        cpu0 = tree_cpu(peer.p.pid)
        t0_wall = time.time()
        t0, prod_s, _ = produce_timed(wl, batches)
        want = records()
        wait_for(lambda: delta_done_at(progress, want) is not None, 600, "the delta-rs loop to commit every record",
                 [peer], poll_s=0.01)
        run_s = (delta_done_at(progress, want) or time.time()) - t0_wall
        runs.append((run_s, cpu_shares(cpu0, tree_cpu(peer.p.pid))["cpu_s"]))
        log(f"deltalake: {n_updates} updates in {run_s:.2f}s ({n_updates / run_s:.0f}/s); produced in {prod_s:.2f}s")
    secs = statistics.median(r[0] for r in runs)
    out["deltalake_updates_per_s"] = round(n_updates / secs)
    out["deltalake_updates_per_s_runs"] = [round(n_updates / r[0]) for r in runs]
    out["deltalake_cpu_s"] = round(statistics.median(r[1] for r in runs), 1)

    # Freshness: the same steps as the sink's 10k/s run (5,000 updates every 0.5 s).
    steps = int(fresh_s / 0.5)
    batches = [wl.make(5_000) for _ in range(steps)]
    adv: dict[int, float] = {}
    log(f"deltalake freshness: {steps} steps of 5000 updates every 0.5 s")
    t_start = time.monotonic()
    for i, b in enumerate(batches):
        f = wl.send_step(b)
        adv[f] = time.time()
        sleep = t_start + (i + 1) * 0.5 - time.monotonic()
        if sleep > 0:
            time.sleep(sleep)
    achieved = steps * 5_000 / (time.monotonic() - t_start)
    last = max(adv)
    wait_for(lambda: any(f >= last for f in delta_visible_at(progress)), 600, "the delta-rs loop to catch up", [peer])
    seen = sorted(delta_visible_at(progress).items())
    fresh = [next(t for g, t in seen if g >= f) - t_adv for f, t_adv in adv.items()]
    lines = delta_lines(progress)
    commits = [d["commit_s"] for d in lines if d["updates"]]
    out["deltalake_freshness_p50_s"] = round(pct(fresh, 0.5), 3)
    out["deltalake_freshness_p99_s"] = round(pct(fresh, 0.99), 3)
    out["deltalake_freshness_rate_updates_per_s"] = round(achieved)
    out["deltalake_commit_p50_s"] = round(pct(commits, 0.5), 3)
    out["deltalake_commits"] = len(commits)
    out["deltalake_table_version"] = lines[-1]["version"] if lines else None
    out["deltalake_bad_rows"] = lines[-1]["bad"] if lines else None
    log(f"deltalake freshness: p50 {out['deltalake_freshness_p50_s']}s p99 {out['deltalake_freshness_p99_s']}s at "
        f"{achieved:.0f} updates/s; {len(commits)} commits, p50 {out['deltalake_commit_p50_s']}s each")
    peer.stop()
    # Exactly once: the table holds every update of the topic from the start offsets, once.
    from deltalake import DeltaTable

    rows = DeltaTable(uri, storage_options=delta_storage_options(env)).count()
    out["deltalake_rows"] = rows
    if rows != producer.sent_updates - upd0:
        raise RuntimeError(f"expected the delta-rs table to hold every update once ({producer.sent_updates - upd0}), "
                           f"found {rows} rows")
    return out


def snapshot_table(start: int, n: int, time_: int) -> Any:
    """``n`` inserts of the bench's orders (ids ``start..``) at ``time_``."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(start)
    ids = np.arange(start, start + n, dtype=np.int64)
    cats = pa.array(CATEGORIES, pa.string())
    return pa.table({
        "id": pa.array(ids),
        "customer": pa.array([f"c{i}" for i in rng.integers(0, 100_000, n).tolist()], pa.string()),
        "amount": pa.array(np.round(rng.uniform(0, 1000, n), 2)),
        "category": cats.take(pa.array(rng.integers(0, len(CATEGORIES), n))),
        "_time": pa.array(np.full(n, time_, np.uint64)),
        "_diff": pa.array(np.ones(n, np.int64)),
    })


def deltalake_snapshot(uri: str, opts: dict[str, str], version: int, row_columns: list[str]) -> Any:
    """What a delta-rs user does for the contents of the collection as of a time: delta-rs reads
    the table's ``version`` (``DeltaTable(uri, version=...).to_pyarrow_table()``: every
    ``(row columns, _time, _diff)`` appended up to it), and Polars consolidates it into the
    contents: grouped by the row columns, ``_diff`` summed, zero sums dropped. And sorted by
    row (nulls last), because our snapshot hands the contents out sorted (the read API's
    contract, ``Collection.snapshot``): the same table is the same work. A Polars DataFrame.

    Polars rather than DuckDB: it is the dataframe library delta-rs's documentation pairs
    with it (``polars.read_delta`` / ``scan_delta`` are built on the ``deltalake`` package), it
    takes the Arrow table delta-rs returns as it is (``pl.from_arrow``), and the bench already
    pins it (the compaction peers of ``make bench-controller``). The two cost the same on
    these rows (1M rows in memory, a loaded 2-core machine: 0.37 CPU-s for Polars' lazy
    query, 0.35 for DuckDB's ``GROUP BY ALL HAVING SUM(_diff) <> 0 ORDER BY``); the lazy
    API, as Polars' guide recommends: the eager one took three times its CPU. Polars groups
    ``0.0`` with ``-0.0`` and NaNs together where ours keeps floats apart by their bits; the
    bench's amounts have neither."""
    import polars as pl
    from deltalake import DeltaTable

    table = DeltaTable(uri, version=version, storage_options=opts).to_pyarrow_table()
    return (pl.from_arrow(table).lazy()
            .group_by(row_columns).agg(pl.col("_diff").sum())
            .filter(pl.col("_diff") != 0)
            .sort(row_columns, nulls_last=True)
            .collect())


def snapshot_vs_deltalake(settings: Any, env: dict[str, str], rows: int, chunk: int) -> dict[str, Any]:
    """The same ``rows`` inserts, appended in ``rows // chunk`` commits (commit ``i`` at time
    ``i``) to a collection's shard and to a Delta table on the same S3 server, then read as of
    the last time three times each, in turns (the best counts; open included in all):

    - ours, the read API: ``open_collection(...).snapshot(as_of)``, the collection's contents
      (consolidated: rows summed, zero sums dropped) sorted by row (``snapshot_1m_s``);
    - delta-rs's raw read of the version holding those times, ``DeltaTable(uri,
      version).to_pyarrow_table()``: the rows as appended, not consolidated
      (``deltalake_read_1m_s``);
    - the same read consolidated and sorted by Polars (:func:`deltalake_snapshot`): the same
      work as ours, the same contents (checked) (``deltalake_snapshot_1m_s``).

    ``snapshot_1m_vs_deltalake`` is ours over the consolidated read (lower is better)."""
    from deltalake import DeltaTable, write_deltalake

    from shared.io.client import open_collection
    from shared.shard import Shard

    opts = delta_storage_options(env)
    run = uuid.uuid4().hex[:8]
    shard_id, uri = f"snap-{run}", f"s3://{settings.s3.bucket}/bench-deltalake/snap-{run}"
    shard = Shard.create(settings.store(), shard_id, SCHEMA)
    commits = rows // chunk
    for i in range(commits):
        t = snapshot_table(i * chunk, chunk, i)
        shard.compare_and_append(t, i, i + 1)
        write_deltalake(uri, t.set_column(4, "_time", t["_time"].cast("int64")), mode="append", storage_options=opts)
    as_of = commits - 1  # the Delta table's version as_of holds the commits at times 0..as_of
    row_columns = [f["name"] for f in SCHEMA["fields"]]
    readers: dict[str, Callable[[], Any]] = {
        "ours": lambda: open_collection(shard_id, settings).snapshot(as_of),
        "read": lambda: DeltaTable(uri, version=as_of, storage_options=opts).to_pyarrow_table(),
        "snapshot": lambda: deltalake_snapshot(uri, opts, as_of, row_columns),
    }
    times: dict[str, list[float]] = {name: [] for name in readers}
    last: dict[str, Any] = {}
    for _ in range(3):
        for name, read in readers.items():
            a = time.perf_counter()
            last[name] = read()
            times[name].append(time.perf_counter() - a)
    ours, raw, peer = last["ours"], last["read"], last["snapshot"].to_arrow()
    if ours.num_rows != rows or raw.num_rows != rows or peer.num_rows != rows:
        raise RuntimeError(f"expected {rows} rows in every read, found ours {ours.num_rows}, delta-rs "
                           f"{raw.num_rows}, consolidated {peer.num_rows}")
    differ = [c for c in ours.column_names if not ours[c].equals(peer[c].cast(ours[c].type))]
    if differ:
        raise RuntimeError(f"expected the same contents from ours and the consolidated delta-rs read, found "
                           f"columns {differ} differ")
    ours_s, read_s, snap_s = (min(times[k]) for k in ("ours", "read", "snapshot"))
    log(f"snapshot of {rows} rows: ours {ours_s:.3f}s, delta-rs read {read_s:.3f}s, "
        f"read and consolidated by Polars {snap_s:.3f}s")
    return {"snapshot_rows": rows, "snapshot_1m_s": round(ours_s, 3), "deltalake_read_1m_s": round(read_s, 3),
            "deltalake_snapshot_1m_s": round(snap_s, 3), "snapshot_1m_vs_deltalake": round(ours_s / snap_s, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--updates", type=int, help="updates in the throughput runs (default 200k, quick 30k)")
    ap.add_argument("--freshness-s", type=float, help="length of the 10k/s freshness run (default 20, quick 10)")
    ap.add_argument("--hydration-rows", type=int, help="rows of the hydration measurement (default 500k, quick 100k)")
    ap.add_argument("--repeats", type=int, help="timed bursts of each throughput run and kills at each history size of "
                    "the recovery run; the figures are their medians (default 3, quick 1)")
    ap.add_argument("--profile", action="store_true", help="py-spy the services (and their Python workers) during the sink throughput run")
    ap.add_argument("--no-deltalake", action="store_true", help="leave out the delta-rs peer (its phase and figures)")
    ap.add_argument("--baseline-worker", nargs=3, metavar=("TOPIC", "PREFIX", "PROGRESS_FILE"), help=argparse.SUPPRESS)
    ap.add_argument("--deltalake-worker", nargs=4, metavar=("TOPIC", "URI", "PROGRESS_FILE", "START"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_worker:
        return baseline_worker(*args.baseline_worker)
    if args.deltalake_worker:
        return deltalake_worker(*args.deltalake_worker)

    from shardsink.cli.catalog import create_collection
    from services.runtime.settings import ServiceSettings
    from services.runner import ensure_control_topics
    from shared.catalog import SinkDef
    from shared.devstack.embedded import EmbeddedStack
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard

    n_updates = args.updates or (30_000 if args.quick else 200_000)
    step_updates = 5_000 if args.quick else 10_000
    fresh_s = args.freshness_s or (10.0 if args.quick else 20.0)
    hyd_rows = args.hydration_rows or (100_000 if args.quick else 500_000)
    repeats = max(1, args.repeats or (1 if args.quick else 3))
    out: dict[str, Any] = {"quick": args.quick, "updates": n_updates, "partitions": PARTITIONS, "cores": os.cpu_count(),
                           "repeats": repeats}
    loads: dict[str, float] = {"start": load()}
    work = Path(os.environ.get("SHARDSINK_BENCH_DIR") or f"/tmp/shardsink-bench-sink-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}")
    t_bench = time.monotonic()
    procs: list[Proc] = []

    with EmbeddedStack() as stack:
        env = {
            **os.environ,
            **stack.env(),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SHARDSINK_CHECKPOINT_DIR": str(work / "checkpoints"),
        }  # every other setting at its default (trigger 100 ms, catalog poll 1 s)
        settings = ServiceSettings.from_env_and_args(None, env)
        ensure_control_topics(settings)
        topic, collection, sink_id = "desired-bench", "bench", "bench"
        ensure_topic(settings.kafka, topic, PARTITIONS)
        create_collection(settings, collection, SCHEMA)
        producer = DesiredProducer(settings.kafka, topic, SCHEMA, linger_ms=20)
        wl = Workload(producer)
        rwl: Workload | None = None  # the recovery phase's workload
        shard = Shard.open(settings.store(), collection)
        try:
            # -- 1. baseline: plain Spark, Kafka -> Parquet on S3 --------------------------------
            log("baseline: starting plain Spark Structured Streaming (Kafka -> Parquet on S3)")
            progress = work / "baseline-progress.jsonl"
            base = Proc(
                "baseline",
                [sys.executable, str(REPO / "bench" / "bench_sink.py"), "--baseline-worker", topic, f"baseline/{uuid.uuid4().hex[:8]}", str(progress)],
                env,
                work / "baseline.log",
            ).start()
            procs.append(base)
            warm = wl.make(step_updates)
            wl.send_step(warm)
            records = producer.sent_updates + producer.sent_progress
            wait_for(lambda: baseline_rows(progress) >= records, 600, "the baseline's warm-up batch", [base])
            loads["baseline"] = load()
            assert base.p is not None
            base_runs: list[tuple[float, float, float]] = []  # (seconds, produce seconds, CPU seconds)
            for _ in range(repeats):
                batches = [wl.make(step_updates) for _ in range(n_updates // step_updates)]
                time.sleep(1.0)  # the previous burst's last micro-batch commits
                bcpu0 = tree_cpu(base.p.pid)
                t0, prod_s, _ = produce_timed(wl, batches)
                records = producer.sent_updates + producer.sent_progress
                wait_for(lambda: baseline_rows(progress) >= records, 600, "the baseline to write every record", [base],
                         poll_s=0.01)
                base_s = time.monotonic() - t0
                base_runs.append((base_s, prod_s, cpu_shares(bcpu0, tree_cpu(base.p.pid))["cpu_s"]))
                log(f"baseline: {n_updates} updates in {base_s:.2f}s ({n_updates / base_s:.0f}/s); produced in {prod_s:.2f}s")
            base_s = statistics.median(r[0] for r in base_runs)
            out["baseline_cpu_s"] = round(statistics.median(r[2] for r in base_runs), 1)
            out["baseline_updates_per_s"] = round(n_updates / base_s)
            out["baseline_updates_per_s_runs"] = [round(n_updates / r[0]) for r in base_runs]
            out["baseline_seconds"] = round(base_s, 2)
            out["produce_updates_per_s"] = round(n_updates / statistics.median(r[1] for r in base_runs))
            # Its recovery: SIGKILLed while idle, restarted at once on its checkpoint, until a
            # step produced after the kill is written.
            base_recov: list[float] = []
            for _ in range(repeats):
                time.sleep(1.0)  # the last burst's micro-batches commit
                log("baseline: SIGKILL")
                base.kill()
                t_kill = time.monotonic()
                base.start()
                wl.send_step(wl.make(1_000))
                producer.flush()
                records = producer.sent_updates + producer.sent_progress
                wait_for(lambda: baseline_rows(progress) >= records, 600, "the baseline back in step after the kill",
                         [base])
                base_recov.append(time.monotonic() - t_kill)
                log(f"baseline: back in step {base_recov[-1]:.2f}s after the kill")
            out["baseline_recovery_s"] = round(statistics.median(base_recov), 2)
            out["baseline_recovery_runs"] = [round(x, 2) for x in base_recov]
            base.stop()

            # -- 2. the sink, warm and in step: throughput ------------------------------------
            settings.catalog().create_sink(SinkDef(sink_id, topic, collection))
            watch = AnnouncedUpperWatch(shard, settings.kafka, settings.frontiers_topic, on_error=log)
            svc = Proc("services", [sys.executable, "-m", "services", "--sink", sink_id], env, work / "services.log").start()
            procs.append(svc)
            log("sink: services starting (all three queries in one application); catching up the baseline's data")
            wl.send_step(wl.make(step_updates))
            t_catch = time.monotonic()
            target = wl.frontier
            wait_for(lambda: watch.upper >= target, 900, "the sink to catch up", [svc])
            log(f"sink: in step after {time.monotonic() - t_catch:.1f}s (start + catch-up of {wl.updates} updates)")
            out["sink_catch_up_s"] = round(time.monotonic() - t_catch, 1)
            loads["sink"] = load()
            spy = None
            if args.profile:
                assert svc.p is not None
                spy = subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(svc.p.pid), "--subprocesses",
                     "--rate", "50", "--format", "raw", "--output", str(work / "profile-sink.txt"), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                time.sleep(2.0)
            assert svc.p is not None
            sink_runs: list[tuple[float, float, float]] = []  # (seconds, produce seconds, CPU seconds)
            cpu_first = tree_cpu(svc.p.pid)
            for _ in range(repeats):
                batches = [wl.make(step_updates) for _ in range(n_updates // step_updates)]
                time.sleep(1.0)  # the previous burst's last micro-batches commit
                cpu0 = tree_cpu(svc.p.pid)
                t0, prod_s, final = produce_timed(wl, batches)
                wait_for(lambda: watch.upper >= final, 900, "the sink to commit every update", [svc], poll_s=0.01)
                run_s = (watch.when(final) or time.monotonic()) - t0
                sink_runs.append((run_s, prod_s, cpu_shares(cpu0, tree_cpu(svc.p.pid))["cpu_s"]))
                log(f"sink: {n_updates} updates in {run_s:.2f}s ({n_updates / run_s:.0f}/s); produced in {prod_s:.2f}s")
            # The shares over every timed burst (and the pauses between them).
            shares = cpu_shares(cpu_first, tree_cpu(svc.p.pid))
            out["driver_cpu_share"] = shares.get("driver", 0.0)
            out["jvm_cpu_share"] = shares.get("jvm", 0.0)
            out["workers_cpu_share"] = shares.get("worker", 0.0)
            out["sink_cpu_s"] = round(statistics.median(r[2] for r in sink_runs), 1)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
                out["profile"] = str(work / "profile-sink.txt")
            sink_s = statistics.median(r[0] for r in sink_runs)
            out["sink_updates_per_s"] = round(n_updates / sink_s)
            out["sink_updates_per_s_runs"] = [round(n_updates / r[0]) for r in sink_runs]
            out["sink_seconds"] = round(sink_s, 2)
            out["sink_produce_s"] = round(statistics.median(r[1] for r in sink_runs), 2)
            out["sink_vs_baseline"] = round(out["sink_updates_per_s"] / out["baseline_updates_per_s"], 3)

            # -- 3. freshness at a steady ~10k updates/s (and at 1k/s: the latency floor) -------
            def freshness(per_step: int, seconds: float) -> tuple[list[float], float, dict[int, float], float]:
                steps = int(seconds / 0.5)
                batches = [wl.make(per_step) for _ in range(steps)]
                adv_mono: dict[int, float] = {}
                adv_wall: dict[int, float] = {}
                log(f"freshness: {steps} steps of {per_step} updates every 0.5 s")
                broker0 = stack.cpu_seconds().get("kafka", 0.0)
                t_start = time.monotonic()
                for i, b in enumerate(batches):
                    f = wl.send_step(b)
                    adv_mono[f] = time.monotonic()
                    adv_wall[f] = time.time()
                    sleep = t_start + (i + 1) * 0.5 - time.monotonic()
                    if sleep > 0:
                        time.sleep(sleep)
                achieved = steps * per_step / (time.monotonic() - t_start)
                last = max(adv_mono)
                wait_for(lambda: watch.upper >= last, 900, "the sink to catch up after the freshness run", [svc])
                broker = (stack.cpu_seconds().get("kafka", 0.0) - broker0) / ((time.monotonic() - t_start) * (os.cpu_count() or 1))
                return [(watch.when(f) or 0.0) - t for f, t in adv_mono.items()], achieved, adv_wall, round(broker, 3)

            loads["freshness"] = load()
            fresh, achieved, adv_wall, out["freshness_broker_cpu_share"] = freshness(5_000, fresh_s)
            out["freshness_p50_s"] = round(pct(fresh, 0.5), 3)
            out["freshness_p99_s"] = round(pct(fresh, 0.99), 3)
            out["freshness_max_s"] = round(max(fresh), 3)
            out["freshness_rate_updates_per_s"] = round(achieved)
            out["freshness_breakdown"] = freshness_breakdown(settings.kafka, settings, sink_id, adv_wall)
            log(f"freshness: p50 {out['freshness_p50_s']}s p99 {out['freshness_p99_s']}s at {achieved:.0f} updates/s; {out['freshness_breakdown']}")
            loads["freshness_1k"] = load()
            fresh, achieved, adv_wall, out["freshness_1k_broker_cpu_share"] = freshness(500, fresh_s / 2)
            out["freshness_1k_p50_s"] = round(pct(fresh, 0.5), 3)
            out["freshness_1k_p99_s"] = round(pct(fresh, 0.99), 3)
            out["freshness_1k_breakdown"] = freshness_breakdown(settings.kafka, settings, sink_id, adv_wall)
            log(f"freshness at 1k/s: p50 {out['freshness_1k_p50_s']}s p99 {out['freshness_1k_p99_s']}s; {out['freshness_1k_breakdown']}")
            svc.stop()

            # -- 3b. the delta-rs peer on the same topic and S3 server; a snapshot read of both --
            if not args.no_deltalake:
                loads["deltalake"] = load()
                out.update(deltalake_phase(wl, topic, env, settings, work, procs, n_updates=n_updates,
                                           step_updates=step_updates, repeats=repeats, fresh_s=fresh_s))
                out["sink_vs_deltalake"] = round(out["sink_updates_per_s"] / out["deltalake_updates_per_s"], 3)
                out["freshness_vs_deltalake"] = round(out["freshness_p50_s"] / out["deltalake_freshness_p50_s"], 3)
                loads["snapshot"] = load()
                snap_rows = 100_000 if args.quick else 1_000_000
                out.update(snapshot_vs_deltalake(settings, env, snap_rows, snap_rows // 4))

            # -- 4. recovery of a SIGKILLed write service (separate processes) -----------------------
            watch.stop()
            loads["recovery"] = load()
            rec_topic, rec_id = "desired-recovery", "recovery"
            ensure_topic(settings.kafka, rec_topic, PARTITIONS)
            create_collection(settings, rec_id, SCHEMA)
            settings.catalog().create_sink(SinkDef(rec_id, rec_topic, rec_id))
            rec_shard = Shard.open(settings.store(), rec_id)
            watch = AnnouncedUpperWatch(rec_shard, settings.kafka, settings.frontiers_topic, on_error=log)
            rwl = Workload(DesiredProducer(settings.kafka, rec_topic, SCHEMA, linger_ms=20))
            live = 2_000 if args.quick else 10_000
            n_hist = 5_000 if args.quick else 50_000
            out["recovery_live_rows"] = live

            def steady(n: int) -> list[tuple[bytes, int]]:
                """n updates: inserts until ``live`` rows, then as many retractions as inserts."""
                ins = rwl.make(n if len(rwl.live) < live else n // 2, retract=0.0)
                outs = []
                while len(rwl.live) > live:
                    outs.append((rwl.live.pop(0), -1))
                return ins + outs

            log("recovery: starting mint, write and append as separate processes")
            sep = {
                name: Proc(name, [sys.executable, "-m", f"services.{name}", "--sink", rec_id], env, work / f"{name}.log").start()
                for name in ("mint", "write", "append")
            }
            procs.extend(sep.values())
            recov: dict[int, list[float]] = {}
            for history in (n_hist, 10 * n_hist):
                while rwl.updates < history:
                    rwl.send_step(steady(5_000))
                producer_flush = rwl.producer.flush
                for _ in range(repeats):
                    producer_flush()
                    target = rwl.frontier
                    wait_for(lambda: watch.upper >= target, 900, f"the separate services in step at {history}",
                             list(sep.values()))
                    time.sleep(1.0)  # the write service idle, as a kill between bursts finds it
                    log(f"recovery: in step after {rwl.updates} updates ({len(rwl.live)} live); SIGKILL write")
                    sep["write"].kill()
                    t_kill = time.monotonic()
                    sep["write"].start()
                    after_kill = rwl.send_step(steady(1_000))
                    producer_flush()
                    wait_for(lambda: watch.upper >= after_kill, 900, "the sink back in step after the kill",
                             list(sep.values()))
                    took = (watch.when(after_kill) or time.monotonic()) - t_kill
                    recov.setdefault(history, []).append(took)
                    log(f"recovery: back in step {took:.2f}s after the kill at {history} updates")
            rec_n, rec_10n = statistics.median(recov[n_hist]), statistics.median(recov[10 * n_hist])
            out["recovery_n_updates"] = n_hist
            out["recovery_n_s"] = round(rec_n, 2)
            out["recovery_s"] = round(rec_10n, 2)
            out["recovery_n_runs"] = [round(x, 2) for x in recov[n_hist]]
            out["recovery_runs"] = [round(x, 2) for x in recov[10 * n_hist]]
            out["recovery_history_ratio"] = round(rec_10n / rec_n, 2)
            out["recovery_vs_baseline"] = round(rec_10n / out["baseline_recovery_s"], 3)
            out["recovery_topic_updates"] = rwl.updates
            out["recovery_shard_rows"] = rec_shard.refresh().total_rows()
            watch.stop()
        finally:
            for p in procs:
                p.kill()
            # The workload's producers let their librdkafka clients go before the broker does.
            for wp in (producer, rwl.producer if rwl is not None else None):
                if wp is not None:
                    with contextlib.suppress(Exception):
                        wp.close()

    # -- 5. correction buffer memory during hydration (no I/O) --------------------------------
    from bench_correction import measure_hydration_ratio

    loads["hydration"] = load()
    log(f"correction: hydration of {hyd_rows} rows")
    hyd = measure_hydration_ratio(hyd_rows)
    out["correction_peak_ratio"] = hyd["correction_peak_ratio"]
    out["correction_rows"] = hyd_rows
    out["correction_seconds"] = hyd["seconds"]
    out["load"] = loads
    out["total_s"] = round(time.monotonic() - t_bench, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
