"""Many sinks in one application: what N sinks cost the services (``python -m services``).

For each N of ``--sinks`` (default 1, 10, 100): N collections, each with a 2-partition desired
topic and a sink, served by one ``python -m services`` subprocess (mint, write and append in
one Spark application, the embedded stack's settings, ``SHARDSINK_QUERIES=--mode``). The
workload: every sink gets a step of 50 updates (inserts and retractions) and a progress
statement every 3 s, the N sinks' steps spread evenly over the 3 s. Figures per N (in
``per_n``; the largest N's are repeated at the top level):

- ``processes``: live processes in the services' tree (the subprocess and its descendants: the
  driver, the JVM, Spark's Python workers), in steady state (at the end of the idle phase);
  ``zombie_processes`` beside it: exited children not reaped, not counted in ``processes``
  (one is Spark's: its launcher script ``exec``s the JVM from a shell whose process
  substitution leaves a finished ``bash`` child that the JVM never waits for);
- ``rss_gib``: their summed RSS then (forked Python workers share pages, which are counted
  once per process); ``rss_gib_busy_max``: the largest sum sampled during the workload;
- ``busy_cpu_share``: CPU seconds of the tree during the workload over (wall seconds x cores);
- ``s3_requests_per_step``: the requests the S3 server answered during the workload (the
  services' or the peer's, and the benchmark's own reads of a shard behind) over the steps
  produced in it; ``s3_requests_per_step_by_kind`` splits them by method and object
  (``PUT if part``: a staged part, ``GET state`` / ``PUT if state``: a shard's state read and
  compare-and-appended, ``GET catalog``, ``PUT hint``, ``list``, ``other``; the embedded S3
  server's counts, :class:`shared.devstack.moto_server.RequestCounts`);
- ``idle_cpu_share``: the same over ``--idle-s`` (20 s) with no input, after the workload has
  drained and a settling pause;
- ``busy_cpu_by_process`` / ``idle_cpu_by_process``: the whole machine's share over the same
  windows, by who used it: ``services`` (or ``peer``, the tree above), ``broker`` (the embedded
  Kafka broker), ``s3_server`` and ``load`` (this benchmark's own process: the producers and the
  watchers), and ``other`` (the rest of the machine: CPU time the kernel counted, less those).
  On two cores the services share the machine with the stack and the load: a run whose
  ``busy_cpu_by_process`` adds up to nearly 1.0 had no core to spare, and its freshness is
  the queueing of a full machine;
- ``freshness_p50_s`` / ``freshness_p99_s``: per step, from ``advance_to`` returning (the
  progress statement is durable) until the shard's upper reaches it; steps whose upper never
  came within the drain budget are counted in ``steps_without_upper`` and left out;
  ``freshness_max_s`` is the longest, and ``slowest_steps`` lists the five longest with their
  sink, frontier, start (seconds into the workload) and stages (as below);
  ``freshness_by_window`` gives, per :data:`WINDOW_S` of the workload (by when each step was
  produced), its steps' ``[start s, steps, p50, p99]``: a first window slower than the rest is
  the services warming up (every Python worker making every sink's context, the JIT), a
  window in the middle the machine;
- ``stage_p50_s`` / ``stage_p99_s`` (the services only): each step's freshness in three parts,
  from the ``descs`` and ``batches`` topics (:class:`StageWatch`): ``mint``, from the progress
  statement until its description was minted (``minted_at_ms``); ``write``, from then until the
  last writer partition wrote it (``written_at_ms``); ``report``, from then until the last of
  its reports was produced (their Kafka timestamps: each unit's executor produces its report as
  the unit ends); ``append``, from then until the upper was announced.
  ``steps_split`` says over how many steps;
- ``start_to_first_uppers_s``: from starting the services (the N sinks created, their first
  step produced) until every sink's upper has passed its first step; ``null`` when some did
  not within the budget (``--budget-s``, default 120 s + 3 s per sink), with
  ``sinks_without_upper`` saying how many;
- ``new_sink_first_upper_s``: with the N sinks running, one more collection and sink is
  created and a step produced: the time from creating the sink until its first upper
  (``null`` past the budget);
- ``query_failures``: the supervisor's "query failed, restarting" lines in the services' log
  (``query_failed_lines``) plus the "Python worker failed to connect back" errors that no such
  line reports (``worker_connect_back_unreported``; a failed query's own Spark trace and the
  supervisor's line both name it, and count once); ``worker_connect_back_lines``: every line
  naming it. Counted before the services are stopped (their shutdown is not counted).

Uppers are timed as ``bench/upper_watch.py`` does, by the appenders' announcements on the
``frontiers`` topic, with one consumer for every shard; a shard behind what was produced to it
is also read now and then (one read every ``10 / pending`` seconds), so a lost announcement
cannot hide an upper.

One embedded stack serves every N; each N runs its own services process (and checkpoint
folder), and its sinks are dropped before the next N starts. The bench process itself (the
producers) shares the cores with the services. Progress goes to stderr; the JSON figures are
the last stdout line; figures and a plot (freshness and RSS against N) are saved as
``bench/results/sinks-<timestamp>.json`` / ``.png``. ``--quick``: ``--sinks 1,3`` and short
phases (a smoke run of a few minutes).

``--peer deltalake``: the same N topics and workload served instead by what a Python user
would write without shardsink, so that the services' figures at N sinks have a peer on the
same machine, stack and load. For each N, one child process (:func:`deltalake_peer`) in place
of the services: one confluent-kafka consumer assigned every partition of the N desired
topics from where the workload starts; per poll, the records grouped by topic, and each
topic's decoded as the sink does and appended to a Delta table of its own
(``s3://<bucket>/bench-sinks-deltalake/<run>/<topic>``, on the same S3 server) with one
delta-rs ``write_deltalake(..., mode="append")`` commit, exactly once (per partition a
``Transaction`` of its last offset, checked before the commit: ``bench/delta_peer.py``). The
tables commit side by side on 8 threads (a commit on the embedded S3 server takes about 57 ms,
and at 100 sinks some 33 tables commit every second); the next poll waits for every commit of
this one. A table's commit returning makes the topic's progress statements of that poll
visible, and the peer writes a progress line ``{"topic", "frontier", "t"}`` (the least progress
it now holds over the topic's partitions). Freshness per step is then from ``advance_to``
returning until the first such line of the step's topic whose frontier reaches the step, and
the start until every topic's first such line past its first step, from starting the peer
(its imports and the N tables' creation included). The CPU, RSS and processes are the peer
process's. There is no new sink (``new_sink_first_upper_s`` null) and no query
(``query_failures`` null); ``deltalake_rows`` / ``deltalake_rows_expected``: the rows in the
drained tables and the updates produced, equal when every update was written once. The JSON
says ``"peer": "deltalake"``; the files are ``sinks-deltalake-<timestamp>.json`` / ``.png``.

``--peer spark``: the same N topics and workload served by plain Spark Structured Streaming
(:func:`spark_peer`): one query over every partition of the N topics, landing each
micro-batch's records of each topic as one Parquet object on the same S3 server
(``bench-sinks-spark/<run>/<topic>/batch-<id>.parquet``), as ``bench/bench_sink.py``'s plain
Spark baseline does for one topic: no correction, no consolidation, no compare-and-append, the
least a Spark job from these topics to S3 does. A topic's object written makes its progress
statements of that micro-batch visible, and freshness and the start are timed from its progress
lines as the delta-rs peer's. The CPU, RSS and processes are the peer's tree (its JVM and
Python workers); ``query_failures`` null; ``spark_records`` / ``spark_records_expected``: the
records its objects hold and those produced to the topics since the start, equal when every
record landed once. The files are ``sinks-spark-<timestamp>.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from delta_peer import DeltaTopic, LeastProgress, delta_storage_options  # noqa: E402
from shared.devstack.embedded import ProcStat, process_stat  # noqa: E402

SCHEMA = {
    "type": "record",
    "name": "Item",
    "namespace": "sinks",
    "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "string"}],
}
PARTITIONS = 2
PERIOD_S = 3.0
UPDATES_PER_STEP = 50
#: The workload's windows of ``freshness_by_window`` (seconds).
WINDOW_S = 10.0
#: The steps of longest freshness a run lists (``slowest_steps``: sink, frontier, when, stages).
SLOWEST_STEPS = 5
STEP_TIMES = 10
#: What the services' log says when a query fails (services/runtime/supervisor.py) or a Python
#: worker Spark started could not reach its JVM.
QUERY_FAILED = "query failed, restarting"
CONNECT_BACK = "Python worker failed to connect back"


def log(msg: str) -> None:
    print(f"[bench-sinks] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    return round(s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))], 3)


def load() -> float:
    return round(os.getloadavg()[0], 1)


# -- the services' process tree -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """The services' process tree at one moment: live processes, CPU seconds (reaped children's
    included, so a Python worker that exited still counts in its parent's), summed RSS."""

    processes: int
    cpu_s: float
    rss_bytes: int
    #: Exited descendants not reaped by their parent (not in ``processes``).
    zombies: int = 0


def tree_usage(root: int) -> Usage:
    """``root`` and every live descendant (psutil when installed, else ``/proc``)."""
    try:
        import psutil
    except ImportError:
        return _tree_usage_proc(root)
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return Usage(0, 0.0, 0)
    n, cpu, rss, zombies = 0, 0.0, 0, 0
    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                zombies += 1
                continue
            t = p.cpu_times()
            m = p.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        n += 1
        cpu += t.user + t.system + t.children_user + t.children_system
        rss += m.rss
    return Usage(n, cpu, rss, zombies)


def _tree_usage_proc(root: int) -> Usage:
    procs: dict[int, ProcStat] = {}
    for d in os.listdir("/proc"):
        st = process_stat(int(d)) if d.isdigit() else None
        if st is not None:
            procs[int(d)] = st
    page = os.sysconf("SC_PAGE_SIZE")
    n, cpu, rss, zombies = 0, 0.0, 0, 0
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in procs:
            continue
        todo.extend(c for c, st in procs.items() if st.ppid == pid)
        if procs[pid].state == "Z":
            zombies += 1
            continue
        n += 1
        cpu += procs[pid].cpu_s
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return Usage(n, cpu, rss, zombies)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to reap it (state ``Z``)."""
    st = process_stat(pid)
    return st is not None and st.state == "Z"


def count_failures(log_path: Path) -> dict[str, int]:
    """Query failures in the services' log: the supervisor's "query failed" lines, plus the
    "failed to connect back" errors that no such line reports. A query that fails because its
    Python worker could not connect back shows the phrase twice: in Spark's "terminated with
    error" trace and in the supervisor's line; those count once, as the supervisor's."""
    failed = back = unreported = 0
    after_terminated = False
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if QUERY_FAILED in line:
                    failed += 1
                    back += CONNECT_BACK in line
                elif CONNECT_BACK in line:
                    back += 1
                    unreported += not after_terminated
                after_terminated = "terminated with error" in line
    except OSError:
        pass
    return {"query_failures": failed + unreported, "query_failed_lines": failed, "worker_connect_back_lines": back,
            "worker_connect_back_unreported": unreported}


# -- uppers of many shards ------------------------------------------------------------------------------


class Reached:
    """Uppers by name (a sink's collection), each with the times it reached its values
    (monotonic seconds): what freshness and start are timed by, whoever serves the sinks."""

    def __init__(self) -> None:
        self._skew = time.monotonic() - time.time()  # wall clock -> monotonic
        self._lock = threading.Lock()
        self._upper: dict[str, int] = {}
        self._reached: dict[str, list[tuple[float, int]]] = {}

    def expect(self, name: str, frontier: int) -> None:
        """A step's progress statement ``frontier`` was produced for ``name`` (nothing to do
        unless a watcher reads what is behind)."""

    def upper(self, name: str) -> int:
        with self._lock:
            return self._upper.get(name, 0)

    def when(self, name: str, frontier: int) -> float | None:
        with self._lock:
            for t, u in self._reached.get(name, ()):
                if u >= frontier:
                    return t
        return None

    def _advance(self, name: str, u: int, at: float) -> None:
        with self._lock:
            if u > self._upper.get(name, 0):
                self._upper[name] = u
                self._reached.setdefault(name, []).append((at, u))


def frontier_time(f: Any) -> int:
    """A frontier as a time to compare steps' frontiers with (the empty frontier: past them all)."""
    return 2**64 - 1 if f.time is None else int(f.time)


def polled(consumer: Any, stop: threading.Event) -> Iterator[list[Any]]:
    """The consumer's messages that hold a value, a round at a time (an empty one at least every
    50 ms or so), until ``stop`` is set; then the consumer is closed."""
    try:
        while not stop.is_set():
            yield [m for m in consumer.consume(500, 0.05) if m.error() is None and m.value()]
    finally:
        consumer.close()


class UppersWatch(Reached):
    """Every shard's upper as its appender announces it on ``frontiers`` (one consumer for all
    shards), timed by the announcement's ``updated_at_ms``; a registered shard whose upper is
    behind a frontier produced to it (``expect``) more than ``grace_s`` ago is also read (an
    announcement may be lost), one such shard every ``check_s / pending`` seconds, and timed
    when the read saw it. (Reading every shard behind at all read 100 shards ten times a second
    at 100 sinks, whose steps take seconds: the benchmark's own load on the S3 server.)"""

    def __init__(self, kafka: Any, frontiers_topic: str, check_s: float = 10.0, grace_s: float = 20.0) -> None:
        from confluent_kafka import OFFSET_END, TopicPartition

        from shared.io.kafka import new_consumer

        super().__init__()
        self.check_s = check_s
        self.grace_s = grace_s
        self._shards: dict[str, Any] = {}
        self._expected: dict[str, int] = {}
        #: per shard, the frontiers produced to it that its upper has not reached, with when
        self._waiting: dict[str, collections.deque[tuple[int, float]]] = {}
        self.read_errors = 0
        self._consumer = new_consumer(kafka, **{"fetch.wait.max.ms": "100"})
        self._consumer.assign([TopicPartition(frontiers_topic, 0, OFFSET_END)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uppers-watch", daemon=True)
        self._thread.start()

    def add(self, shard_id: str, shard: Any) -> None:
        with self._lock:
            self._shards[shard_id] = shard

    def forget(self, shard_id: str) -> None:
        with self._lock:
            self._shards.pop(shard_id, None)
            self._expected.pop(shard_id, None)
            self._waiting.pop(shard_id, None)

    def expect(self, name: str, frontier: int) -> None:
        with self._lock:
            self._expected[name] = max(frontier, self._expected.get(name, 0))
            if self._upper.get(name, 0) < frontier:
                self._waiting.setdefault(name, collections.deque()).append((frontier, time.monotonic()))

    def _advance(self, name: str, u: int, at: float) -> None:
        super()._advance(name, u, at)
        with self._lock:
            waiting = self._waiting.get(name)
            while waiting and waiting[0][0] <= u:
                waiting.popleft()

    def _check_one(self, turn: int) -> int:
        """Read one shard that has been behind what was produced to it for ``grace_s``; returns
        how many have."""
        now = time.monotonic()
        with self._lock:
            pending = sorted(s for s, w in self._waiting.items() if w and now - w[0][1] >= self.grace_s and s in self._shards)
            if not pending:
                return 0
            sid = pending[turn % len(pending)]
            shard = self._shards[sid]
        try:
            self._advance(sid, shard.refresh().upper.time or 0, time.monotonic())
        except Exception:  # noqa: BLE001 - a transient S3 error: read again later
            self.read_errors += 1
        return len(pending)

    def _run(self) -> None:
        from shared.codec import message_codec
        from shared.frontier import Frontier

        codec = message_codec("frontier_update")
        next_check, turn = time.monotonic() + self.check_s, 0
        for msgs in polled(self._consumer, self._stop):
            for msg in msgs:
                try:
                    d = codec.decode(msg.value() or b"")
                    u = frontier_time(Frontier.from_json(d["upper"]))
                    self._advance(d["shard_id"], u, d["updated_at_ms"] / 1000 + self._skew)
                except Exception:  # noqa: BLE001 - the reads below catch what this misses
                    self.read_errors += 1
            now = time.monotonic()
            if now >= next_check:
                turn += 1
                pending = self._check_one(turn)
                next_check = now + self.check_s / max(1, pending)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class StageWatch:
    """When each step's description was minted, when its last writer partition wrote it and
    when the last of its reports was produced, from the ``descs`` and ``batches`` topics
    (``minted_at_ms``, ``written_at_ms`` and the reports' Kafka timestamps): a step's freshness
    split into mint (progress statement to description), write (description to the last
    partition written), report (to the last report on ``batches``) and append (to the announced
    upper)."""

    def __init__(self, kafka: Any, descs_topic: str, batches_topic: str) -> None:
        from confluent_kafka import TopicPartition

        from shared.io.kafka import OffsetProbe, new_consumer

        self._skew = time.monotonic() - time.time()
        self._lock = threading.Lock()
        #: per sink id, its descriptions ``(upper, minted, token)`` in the order seen
        self._minted: dict[str, list[tuple[int, float, str]]] = {}
        #: per description token, its count of writer partitions and per writer partition when
        #: it was written and when its report was produced
        self._written: dict[str, tuple[int, dict[int, tuple[float, float]]]] = {}
        self._topics = (descs_topic, batches_topic)
        self._consumer = new_consumer(kafka, **{"fetch.wait.max.ms": "100"})
        # From the ends as they are now (what is produced from here on is seen).
        with OffsetProbe(kafka) as probe:
            ends = probe.ends([(t, p) for t in self._topics for p in probe.partitions_of(t)])
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in ends.items()])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from shared.codec import message_codec
        from shared.sink_messages import BatchDescription, BatchReport

        descs, reports = message_codec("batch_description"), message_codec("written_batch")
        for msgs in polled(self._consumer, self._stop):
            for msg in msgs:
                try:
                    if msg.topic() == self._topics[0]:
                        d = BatchDescription.from_dict(descs.decode(msg.value() or b""))
                        with self._lock:
                            self._minted.setdefault(d.sink_id, []).append(
                                (frontier_time(d.upper), d.minted_at_ms / 1000 + self._skew, d.token))
                    else:
                        r = BatchReport.from_dict(reports.decode(msg.value() or b""))
                        with self._lock:
                            _, by_wp = self._written.setdefault(r.desc_token, (r.partition_count, {}))
                            by_wp.setdefault(r.partition, (r.written_at_ms / 1000 + self._skew,
                                                           msg.timestamp()[1] / 1000 + self._skew))
                except Exception:  # noqa: BLE001 - a message it cannot read leaves its step unsplit
                    continue

    def split(self, name: str, frontier: int) -> tuple[float, float, float] | None:
        """When the first description of sink ``name`` whose upper reached ``frontier`` was
        minted, when every writer partition had written it, and when every report of it was
        produced (None: unseen)."""
        with self._lock:
            for u, minted, token in self._minted.get(name, ()):
                if u >= frontier:
                    n, by_wp = self._written.get(token, (0, {}))
                    if not by_wp or len(by_wp) < n:
                        return None
                    return minted, max(w for w, _ in by_wp.values()), max(r for _, r in by_wp.values())
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class PeerUppers(Reached):
    """The frontiers the delta-rs peer's tables reached, from its progress file (one line per
    table and poll, ``{"topic", "frontier", "t"}``, written once the poll's commit of that table
    returned), read as the peer writes it and timed by each line's ``t``."""

    def __init__(self, progress_file: Path, names: dict[str, str], read_s: float = 0.05) -> None:
        super().__init__()
        self._path = progress_file
        self._names = names  # topic -> name
        self._read_s = read_s
        self._pos = 0
        self._tail = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-uppers", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return  # the peer has not started yet
        self._pos += len(chunk)
        *lines, self._tail = (self._tail + chunk).split(b"\n")
        for line in lines:
            d = json.loads(line)
            name, frontier = self._names.get(d.get("topic", "")), d.get("frontier")
            if name is not None and frontier is not None:
                self._advance(name, frontier, d["t"] + self._skew)

    def _run(self) -> None:
        while not self._stop.wait(self._read_s):
            self._read()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# -- one sink's feed ------------------------------------------------------------------------------------


@dataclass
class Feed:
    """One sink's desired topic (and, served by the services, its collection and sink), and the
    steps produced to it."""

    name: str
    topic: str
    producer: Any
    rng: random.Random
    live: list[bytes] = field(default_factory=list)
    next_id: int = 0
    frontier: int = 0
    #: frontier -> monotonic time its ``advance_to`` returned
    sent: dict[int, float] = field(default_factory=dict)
    skipped: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self, uppers: Reached) -> int | None:
        """50 updates and a progress statement; None if the previous step is still being sent
        (counted in ``skipped``) or this one failed (``failed``)."""
        if not self.lock.acquire(blocking=False):
            self.skipped += 1
            return None
        try:
            enc = self.producer.rows.encode
            lo = self.frontier
            for _ in range(UPDATES_PER_STEP):
                t = lo + self.rng.randrange(STEP_TIMES)
                if self.live and self.rng.random() < 0.2:
                    i = self.rng.randrange(len(self.live))
                    self.live[i], self.live[-1] = self.live[-1], self.live[i]
                    self.producer.send_encoded(self.live.pop(), t, -1)
                else:
                    b = enc({"id": self.next_id, "v": f"v{self.next_id % 9973}"})
                    self.next_id += 1
                    self.live.append(b)
                    self.producer.send_encoded(b, t, 1)
            f = lo + STEP_TIMES
            self.producer.advance_to(f)
            self.frontier = f
            self.sent[f] = time.monotonic()
            uppers.expect(self.name, f)
            return f
        except Exception as e:  # noqa: BLE001 - counted; the run goes on
            self.failed += 1
            log(f"{self.name}: step failed: {e}")
            return None
        finally:
            self.lock.release()


def new_feed(settings: Any, watch: UppersWatch | None, name: str, seed: int, create_sink: bool = True) -> Feed:
    """The desired topic ``desired-<name>`` and its producer; with a watch (the services), also
    the collection ``name``, watched, and (``create_sink``) its sink. Without one (the delta-rs
    peer), no collection: the peer writes tables of its own."""
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard

    topic = f"desired-{name}"
    ensure_topic(settings.kafka, topic, PARTITIONS)
    if watch is not None:
        create_collection(settings, name, SCHEMA)
        watch.add(name, Shard.open(settings.store(), name))
    feed = Feed(name, topic, DesiredProducer(settings.kafka, topic, SCHEMA, linger_ms=5), random.Random(seed))
    if watch is not None and create_sink:
        settings.catalog().create_sink(SinkDef(name, topic, name))
    return feed


# -- the child process: the services or the peer ---------------------------------------------------------


class Child:
    """``python -m services`` (or the delta-rs peer) in its own process group (a kill takes the
    services' JVM and workers too)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.p = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        """SIGTERM (the services stop their queries, the peer its loop), SIGKILL after 20 s."""
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; the JVM and workers may linger in the group.
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def wait_until(pred: Any, budget_s: float, child: Child) -> bool:
    """Whether ``pred()`` came true within the budget (False at once if the child exited)."""
    deadline = time.monotonic() + budget_s
    while not pred():
        if not child.alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- the delta-rs peer -------------------------------------------------------------------------------------

#: Threads of the peer that write its tables side by side: a commit on the embedded S3 server
#: takes about 57 ms, and at 100 sinks about 33 tables commit every second, more than one thread
#: keeps up with (delta-rs releases the GIL while it commits).
PEER_THREADS = 8


def deltalake_peer(spec_file: str) -> int:
    """The delta-rs peer (a child process): every desired topic of ``spec_file`` (``root``,
    ``progress``, ``start``: ``{topic: {partition: offset}}``) into a Delta table of its own,
    ``<root>/<topic>``, exactly once.

    One consumer is assigned every partition of every topic. Per poll (what it has fetched,
    waiting at most 100 ms for the first record) the records are grouped by topic and each
    topic's are written by :meth:`delta_peer.DeltaTopic.write` (one append commit when they hold
    updates), the topics side by side on a pool of :data:`PEER_THREADS` threads. A table's
    progress line goes to the progress file as its commit returns; the next poll waits for every
    commit of this one, so a progress statement counts as visible only once the updates before
    it, in this poll or an earlier one, are committed."""
    from concurrent.futures import as_completed

    from confluent_kafka import TopicPartition

    from services.runtime.settings import ServiceSettings
    from shared.io.kafka import consume_available, new_consumer

    spec = json.loads(Path(spec_file).read_text())
    start = {t: {int(p): o for p, o in parts.items()} for t, parts in spec["start"].items()}
    settings = ServiceSettings.from_env_and_args(None)
    opts = delta_storage_options(os.environ)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ThreadPoolExecutor(PEER_THREADS) as pool, open(spec["progress"], "a", buffering=1) as out:
        opened = pool.map(lambda t: DeltaTopic(t, f"{spec['root']}/{t}", SCHEMA, start[t], opts), start)
        tables = dict(zip(start, opened, strict=True))
        consumer = new_consumer(settings.kafka)
        consumer.assign([TopicPartition(t, p, o) for t, table in tables.items()
                         for p, o in table.positions(start[t]).items()])
        out.write(json.dumps({"started": True, "tables": len(tables)}) + "\n")
        try:
            while not stop.is_set():
                by_topic: dict[str, list[Any]] = {}
                for m in consume_available(consumer, 100_000, 0.1):
                    if m.error() is None:
                        by_topic.setdefault(m.topic(), []).append(m)
                writes = {pool.submit(tables[t].write, msgs): t for t, msgs in by_topic.items()}
                for done in as_completed(writes):
                    line = done.result()
                    if line is not None:
                        out.write(json.dumps({"topic": writes[done], **line}) + "\n")
        finally:
            consumer.close()
    return 0


# -- the plain Spark peer --------------------------------------------------------------------------------


def spark_peer(spec_file: str) -> int:
    """The plain Spark peer (a child process): every desired topic of ``spec_file`` (``prefix``,
    ``progress``, ``checkpoint``, ``start``: ``{topic: {partition: offset}}``) landed
    as raw records on S3 by one Spark Structured Streaming query, what ``bench/bench_sink.py``'s
    plain Spark baseline does for one topic: the least any Spark job from these topics to S3 does.

    One query reads every partition of every topic (the Kafka source of the services, as the
    baseline: the pyspark wheel has no Kafka connector), triggered as the services' queries
    (``SHARDSINK_TRIGGER_MS``, ``SHARDSINK_SOURCE_WAIT_MS``). Its ``foreachBatch`` takes the
    micro-batch's records (topic, partition, offset, value) to Arrow, and per topic with records
    writes one Parquet object, ``<prefix>/<topic>/batch-<id>.parquet`` (a replayed micro-batch
    writes the same key again: each record lands once), the topics side by side on
    :data:`PEER_THREADS` threads. A topic's object written makes its progress statements of the
    micro-batch visible (decoded as the sink does, ``services.sinkio.DesiredDecoder``), and the
    peer writes a progress line ``{"topic", "frontier", "records", "t"}``, ``frontier`` the least
    progress it holds over the topic's partitions. The next micro-batch starts once every object
    of this one is written. No correction, no consolidation, no compare-and-append: the records
    as they came."""
    import io

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from services.runtime.settings import ServiceSettings
    from services.runtime.spark import spark_session
    from services.sinkio import DesiredDecoder
    from shared.spark.kafka_connector import kafka_read_stream

    spec = json.loads(Path(spec_file).read_text())
    start = {t: {int(p): int(o) for p, o in parts.items()} for t, parts in spec["start"].items()}
    settings = ServiceSettings.from_env_and_args(None)
    store = settings.store()
    decoder = DesiredDecoder(frozenset(start), progress_only=True)
    held = {t: LeastProgress(parts) for t, parts in start.items()}
    spark = spark_session(settings, "bench-sinks-spark-peer")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ThreadPoolExecutor(PEER_THREADS) as pool, open(spec["progress"], "a", buffering=1) as out:

        def land(batch_id: int, topic: str, table: pa.Table) -> dict[str, Any]:
            buf = io.BytesIO()
            pq.write_table(table, buf, compression="snappy")
            store.put(f"{spec['prefix']}/{topic}/batch-{batch_id:08d}.parquet", buf.getvalue())
            held[topic].absorb(decoder.decode(table.combine_chunks().to_batches()[0]))
            return {"topic": topic, "frontier": held[topic].held(), "records": table.num_rows, "batch": batch_id,
                    "t": time.time()}

        def each(batch_df: Any, batch_id: int) -> None:
            table = batch_df.select("topic", "partition", "offset", "value").toArrow()
            topics = table.column("topic")
            writes = [pool.submit(land, batch_id, t, table.filter(pc.equal(topics, t)))
                      for t in pc.unique(topics).to_pylist()]
            for w in writes:
                out.write(json.dumps(w.result()) + "\n")

        df = kafka_read_stream(spark, settings.kafka, sorted(start), starting_offsets=json.dumps(start),
                               wait_for_records_ms=settings.source_wait_ms)
        q = (df.writeStream.foreachBatch(each).option("checkpointLocation", spec["checkpoint"])
             .trigger(processingTime=f"{settings.trigger_ms} milliseconds").start())
        out.write(json.dumps({"started": True, "topics": len(start)}) + "\n")
        while not stop.is_set() and q.isActive:
            stop.wait(0.2)
        q.stop()
    spark.stop()
    return 0


def peer_records(progress_file: Path, feeds: list[Feed], starts: dict[str, dict[int, int]], kafka: Any) -> dict[str, int]:
    """Records the plain Spark peer wrote (each micro-batch's object of a topic counted once), and
    records produced to its topics since the start: equal when it landed every record once."""
    written: dict[tuple[str, int], int] = {}
    for line in progress_file.read_text().splitlines():
        d = json.loads(line)
        if "records" in d:
            written[(d["topic"], d["batch"])] = d["records"]
    ends = topic_ends(kafka, [f.topic for f in feeds])
    expected = sum(o - starts[t][p] for t, parts in ends.items() for p, o in parts.items())
    return {"spark_records": sum(written.values()), "spark_records_expected": expected}


def topic_ends(kafka: Any, topics: list[str]) -> dict[str, dict[int, int]]:
    """The end offset of every partition of ``topics`` (where the workload starts in each)."""
    from shared.io.kafka import OffsetProbe

    with OffsetProbe(kafka) as probe:
        ends = probe.ends([(t, p) for t in topics for p in range(PARTITIONS)])
    out: dict[str, dict[int, int]] = {}
    for (t, p), o in ends.items():
        out.setdefault(t, {})[p] = o
    return out


def peer_rows(feeds: list[Feed], root: str, env: dict[str, str]) -> dict[str, int]:
    """Rows in the peer's tables, and updates produced to their topics: equal when the peer
    wrote every update once."""
    from deltalake import DeltaTable

    opts = delta_storage_options(env)
    with ThreadPoolExecutor(PEER_THREADS) as pool:
        rows = sum(pool.map(lambda f: DeltaTable(f"{root}/{f.topic}", storage_options=opts).count(), feeds))
    return {"deltalake_rows": rows, "deltalake_rows_expected": sum(f.producer.sent_updates for f in feeds)}


# -- one N ----------------------------------------------------------------------------------------------------


def requests_per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, Any]:
    """``s3_requests_per_step`` and ``s3_requests_per_step_by_kind`` from two snapshots of the
    S3 server's counts around ``steps`` steps."""
    from shared.devstack.moto_server import counts_since

    spent = counts_since(before, after)
    per = max(1, steps)
    return {"s3_requests_per_step": round(sum(spent.values()) / per, 2),
            "s3_requests_per_step_by_kind": {k: round(v / per, 2) for k, v in spent.items()}}


@dataclass(frozen=True, slots=True)
class Phases:
    busy_s: float
    settle_s: float
    idle_s: float
    drain_s: float
    budget_s: float | None  # None: 120 s + 3 s per sink


def machine_cpu(stack_cpu: Callable[[], dict[str, float]] | None) -> dict[str, float]:
    """CPU seconds so far: the stack's servers (``broker``, ``s3_server``), this process
    (``load``) and the whole machine (``all``, from ``/proc/stat``; absent elsewhere)."""
    out: dict[str, float] = {}
    names = {"kafka": "broker", "s3": "s3_server"}
    for role, s in (stack_cpu() if stack_cpu is not None else {}).items():
        out[names.get(role, role)] = s
    t = os.times()
    out["load"] = t.user + t.system
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        # user, nice, system, (idle, iowait), irq, softirq, steal
        out["all"] = (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_split(before: dict[str, float], after: dict[str, float], who: str, tree_cpu_s: float,
              wall_s: float, cores: int) -> dict[str, float]:
    """The machine's share of CPU (of ``wall_s`` x ``cores``) between two :func:`machine_cpu`
    readings, by who used it (``who``: the services' or the peer's tree, ``tree_cpu_s``), and
    ``other``: what the machine used beyond those."""
    cap = wall_s * cores
    out = {who: round(tree_cpu_s / cap, 3)}
    for k in ("broker", "s3_server", "load"):
        if k in before and k in after:
            out[k] = round((after[k] - before[k]) / cap, 3)
    if "all" in before and "all" in after:
        out["other"] = round(max(0.0, (after["all"] - before["all"]) / cap - sum(out.values())), 3)
    return out


def measure(n: int, settings: Any, env: dict[str, str], watch: UppersWatch | None, work: Path, run: str,
            ph: Phases, stage_watch: StageWatch | None = None,
            s3_requests: Callable[[], dict[str, int]] | None = None,
            stack_cpu: Callable[[], dict[str, float]] | None = None, peer_kind: str = "deltalake") -> dict[str, Any]:
    """One N's figures: its sinks served by the services, their uppers seen by ``watch`` (and
    each step's freshness split by ``stage_watch``); with no watch, the peer ``peer_kind``
    (``deltalake`` or ``spark``) serves the N topics instead."""
    from shared.catalog import SinkDef

    peer = None if watch is not None else peer_kind
    at, who = (f"N={n} peer {peer}", "peer") if peer else (f"N={n}", "services")
    cores = os.cpu_count() or 1
    budget = ph.budget_s if ph.budget_s is not None else 120.0 + 3.0 * n
    out: dict[str, Any] = {"sinks": n, "budget_s": budget, "load_start": load()}
    t_setup = time.monotonic()
    feeds = [new_feed(settings, watch, f"n{n}s{i:03d}-{run}", seed=i) for i in range(n)]
    progress = work / f"{peer}-n{n}-{run}.jsonl"
    starts = topic_ends(settings.kafka, [f.topic for f in feeds]) if peer else {}
    uppers = watch if watch is not None else PeerUppers(progress, {f.topic: f.name for f in feeds})
    with ThreadPoolExecutor(max_workers=min(16, n)) as pool:
        first = dict(zip([f.name for f in feeds], pool.map(lambda f: f.step(uppers), feeds), strict=True))
    out["setup_s"] = round(time.monotonic() - t_setup, 1)
    log(f"{at}: {n} {'topics' if peer else 'collections, topics and sinks'} created, first steps produced in "
        f"{out['setup_s']}s")

    log_path = work / f"{who}-n{n}.log"
    root = f"s3://{settings.s3.bucket}/bench-sinks-deltalake/{run}"
    if peer == "spark":
        spec = work / f"spark-n{n}-{run}.json"
        spec.write_text(json.dumps({"prefix": f"bench-sinks-spark/{run}",
                                    "progress": str(progress), "checkpoint": str(work / f"spark-checkpoint-n{n}"),
                                    "start": starts}))
        child = Child([sys.executable, str(Path(__file__).resolve()), "--spark-peer", str(spec)], env, log_path)
    elif peer == "deltalake":
        spec = work / f"deltalake-n{n}-{run}.json"
        spec.write_text(json.dumps({"root": root, "progress": str(progress), "start": starts}))
        child = Child([sys.executable, str(Path(__file__).resolve()), "--deltalake-peer", str(spec)], env, log_path)
    else:
        ck = work / f"checkpoints-n{n}"
        child = Child([sys.executable, "-m", "services"], {**env, "SHARDSINK_CHECKPOINT_DIR": str(ck)}, log_path)
    t0 = time.monotonic()
    extra: Feed | None = None
    out[f"{who}_log"] = str(log_path)
    try:
        def behind() -> list[Feed]:
            return [f for f in feeds if first[f.name] is None or uppers.upper(f.name) < (first[f.name] or 0)]

        wait_until(lambda: not behind(), budget, child)
        missing = behind()
        out["sinks_without_upper"] = len(missing)
        if missing:
            out["start_to_first_uppers_s"] = None
            log(f"{at}: {len(missing)} of {n} sinks without an upper past their first step after "
                f"{time.monotonic() - t0:.0f}s (budget {budget:.0f}s){'' if child.alive() else f'; the {who} exited'}")
        else:
            last = max(uppers.when(f.name, first[f.name] or 0) or time.monotonic() for f in feeds)
            out["start_to_first_uppers_s"] = round(last - t0, 1)
            log(f"{at}: every sink's first upper {out['start_to_first_uppers_s']}s after starting the {who}")
        if not child.alive():
            out[f"{who}_exit_code"] = child.p.returncode
            return out

        # -- the workload: a step per sink every 3 s, spread over the 3 s -------------------------
        periods = max(1, int(ph.busy_s / PERIOD_S))
        samples: list[Usage] = []
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.wait(2.0):
                samples.append(tree_usage(child.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        log(f"{at}: workload: {periods} steps of {UPDATES_PER_STEP} updates per sink, one every {PERIOD_S:.0f}s")
        out["load_busy"] = load()
        r0 = s3_requests() if s3_requests is not None else None
        c0 = machine_cpu(stack_cpu)
        u0, w0 = tree_usage(child.pid), time.monotonic()
        sampler.start()
        with ThreadPoolExecutor(max_workers=min(16, n)) as pool:
            for k in range(periods):
                for i, f in enumerate(feeds):
                    delay = w0 + k * PERIOD_S + i * PERIOD_S / n - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(f.step, uppers)
            time.sleep(max(0.0, w0 + periods * PERIOD_S - time.monotonic()))
        u1, w1 = tree_usage(child.pid), time.monotonic()
        out["busy_cpu_by_process"] = cpu_split(c0, machine_cpu(stack_cpu), who, u1.cpu_s - u0.cpu_s, w1 - w0, cores)
        if r0 is not None and s3_requests is not None:
            out.update(requests_per_step(r0, s3_requests(), periods * n))
        stop_sampling.set()
        sampler.join()
        out["busy_cpu_share"] = round((u1.cpu_s - u0.cpu_s) / ((w1 - w0) * cores), 3)
        out["rss_gib_busy_max"] = round(max([s.rss_bytes for s in samples] + [u1.rss_bytes]) / 2**30, 2)
        out["steps_skipped"] = sum(f.skipped for f in feeds)
        out["steps_failed"] = sum(f.failed for f in feeds)

        # -- drain, then freshness --------------------------------------------------------------------
        wait_until(lambda: all(uppers.upper(f.name) >= f.frontier for f in feeds), ph.drain_s, child)
        fresh: list[float] = []
        stages: dict[str, list[float]] = {"mint": [], "write": [], "report": [], "append": []}
        slowest: list[dict[str, Any]] = []
        unseen = 0
        by_window: dict[int, list[float]] = {}
        for f in feeds:
            for fr, t in f.sent.items():
                if fr == first[f.name]:
                    continue  # the first step is the start's
                reached = uppers.when(f.name, fr)
                if reached is None:
                    unseen += 1
                    continue
                fresh.append(reached - t)
                by_window.setdefault(int((t - w0) // WINDOW_S), []).append(reached - t)
                split = stage_watch.split(f.name, fr) if stage_watch is not None else None
                step: dict[str, Any] = {"sink": f.name, "frontier": fr, "after_start_s": round(t - w0, 3),
                                        "freshness_s": round(reached - t, 3)}
                if split is not None:
                    took_each = (split[0] - t, split[1] - split[0], split[2] - split[1], reached - split[2])
                    for stage, took in zip(stages, took_each, strict=True):
                        stages[stage].append(took)
                    step["stages_s"] = [round(x, 3) for x in took_each]
                slowest = sorted([*slowest, step], key=lambda x: -x["freshness_s"])[:SLOWEST_STEPS]
        out["steps"] = len(fresh) + unseen
        out["steps_without_upper"] = unseen
        out["freshness_p50_s"] = pct(fresh, 0.5)
        out["freshness_p99_s"] = pct(fresh, 0.99)
        out["freshness_max_s"] = round(max(fresh), 3) if fresh else None
        out["slowest_steps"] = slowest
        out["freshness_by_window"] = [[round(w * WINDOW_S), len(xs), pct(xs, 0.5), pct(xs, 0.99)]
                                      for w, xs in sorted(by_window.items())]
        if stage_watch is not None:
            out["stage_p50_s"] = {k: pct(v, 0.5) for k, v in stages.items()}
            out["stage_p99_s"] = {k: pct(v, 0.99) for k, v in stages.items()}
            out["steps_split"] = len(stages["mint"])
        log(f"{at}: busy CPU {out['busy_cpu_share']:.1%} of {cores} cores; freshness p50 {out['freshness_p50_s']}s "
            f"p99 {out['freshness_p99_s']}s over {len(fresh)} steps ({unseen} without an upper)")

        # -- idle -----------------------------------------------------------------------------------------
        time.sleep(ph.settle_s)
        out["load_idle"] = load()
        c0 = machine_cpu(stack_cpu)
        u0, w0 = tree_usage(child.pid), time.monotonic()
        time.sleep(ph.idle_s)
        u1, w1 = tree_usage(child.pid), time.monotonic()
        out["idle_cpu_share"] = round((u1.cpu_s - u0.cpu_s) / ((w1 - w0) * cores), 3)
        out["idle_cpu_by_process"] = cpu_split(c0, machine_cpu(stack_cpu), who, u1.cpu_s - u0.cpu_s, w1 - w0, cores)
        out["processes"] = u1.processes
        out["zombie_processes"] = u1.zombies
        out["rss_gib"] = round(u1.rss_bytes / 2**30, 2)
        log(f"{at}: idle CPU {out['idle_cpu_share']:.1%}; {u1.processes} processes ({u1.zombies} exited, not reaped), "
            f"RSS {out['rss_gib']} GiB")

        if peer == "spark":
            # The peer's topics are fixed when it starts (no new sink); drained, it wrote every
            # record once.
            out["new_sink_first_upper_s"] = None
            out.update(peer_records(progress, feeds, starts, settings.kafka))
            log(f"{at}: {out['spark_records']} records written, {out['spark_records_expected']} produced")
        elif peer == "deltalake":
            # The peer's topics are fixed when it starts (no new sink); its tables, drained, hold
            # every update once.
            out["new_sink_first_upper_s"] = None
            out.update(peer_rows(feeds, root, env))
            log(f"{at}: {out['deltalake_rows']} rows in the tables, {out['deltalake_rows_expected']} updates produced")
        else:
            # -- one more sink, with N running ---------------------------------------------------------
            name = f"n{n}new-{run}"
            extra = new_feed(settings, watch, name, seed=n + 1000, create_sink=False)
            t_new = time.monotonic()
            settings.catalog().create_sink(SinkDef(name, extra.topic, name))
            f_new = extra.step(uppers) or 0
            ok = wait_until(lambda: f_new > 0 and uppers.upper(name) >= f_new, budget, child)
            reached = uppers.when(name, f_new) if ok else None
            out["new_sink_first_upper_s"] = round(reached - t_new, 1) if reached is not None else None
            log(f"{at}: new sink's first upper after {out['new_sink_first_upper_s']}s")
    finally:
        # The services' query failures; the peer runs no queries (a failure ends it: *_alive_at_end).
        out.update(count_failures(log_path) if not peer else {"query_failures": None})
        out[f"{who}_alive_at_end"] = child.alive()
        child.stop()
        if isinstance(uppers, PeerUppers):
            uppers.stop()
        close_feeds(settings, watch, feeds + ([extra] if extra is not None else []))
    out["load_end"] = load()
    out["total_s"] = round(time.monotonic() - t_setup, 1)
    failures = "" if peer else f"{out['query_failures']} query failure lines; "
    log(f"{at}: {failures}done in {out['total_s']}s")
    return out


def close_feeds(settings: Any, watch: UppersWatch | None, feeds: list[Feed]) -> None:
    """Close the feeds' producers; with a watch (the services), drop their sinks and stop
    watching their shards."""
    for f in feeds:
        try:
            f.producer.close()
        except Exception as e:  # noqa: BLE001 - clean-up
            log(f"closing {f.name}'s producer: {e}")
    if watch is None:
        return
    catalog = settings.catalog()
    for f in feeds:
        try:
            catalog.drop_sink(f.name)
        except Exception as e:  # noqa: BLE001 - not created, or already dropped
            log(f"dropping {f.name}: {e}")
        watch.forget(f.name)


# -- plot -------------------------------------------------------------------------------------------------------


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["per_n"]
    ns = [p["sinks"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    served = ({"deltalake": "the delta-rs peer: N desired topics in one process (",
               "spark": "the plain Spark peer: N desired topics in one query ("}[res["peer"]] if res["peer"] else
              f"shardsink: N sinks in one application (SHARDSINK_QUERIES={res['service_mode']}, ")
    fig.suptitle(f"{served}{res['cores']} cores{', quick' if res['quick'] else ''}, {res['timestamp']})")
    ax = axes[0]
    for key, label in (("freshness_p50_s", "freshness p50"), ("freshness_p99_s", "freshness p99"),
                       ("start_to_first_uppers_s", "start to first uppers"), ("new_sink_first_upper_s", "new sink's first upper")):
        xs = [n for n, p in zip(ns, pts, strict=True) if p.get(key) is not None]
        ax.plot(xs, [p[key] for p in pts if p.get(key) is not None], "o-", label=label)
    ax.set_ylabel("seconds")
    ax.set_title("freshness and start")
    ax = axes[1]
    ax.plot(ns, [p.get("rss_gib") for p in pts], "o-", color="tab:blue", label="RSS (GiB)")
    ax.set_ylabel("GiB")
    ax2 = ax.twinx()
    ax2.plot(ns, [p.get("processes") for p in pts], "s:", color="tab:gray", markersize=4, label="processes")
    ax2.set_ylabel("processes")
    ax.set_title("memory and processes")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    ax = axes[2]
    ax.plot(ns, [p.get("busy_cpu_share") for p in pts], "o-", label="busy")
    ax.plot(ns, [p.get("idle_cpu_share") for p in pts], "o-", label="idle")
    ax.set_ylabel("share of all cores")
    ax.set_title("CPU of the peer's processes" if res["peer"] else "CPU of the services' tree")
    for a in axes:
        a.set_xscale("log")
        a.minorticks_off()
        a.set_xlabel("sinks")
        a.set_xticks(ns, [str(n) for n in ns])
        a.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------------------------

TOP_LEVEL = (
    "processes", "rss_gib", "idle_cpu_share", "busy_cpu_share", "freshness_p50_s", "freshness_p99_s",
    "start_to_first_uppers_s", "sinks_without_upper", "new_sink_first_upper_s", "query_failures",
    "s3_requests_per_step",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sinks", default=None, help="comma-separated numbers of sinks (default 1,10,100; quick 1,3)")
    ap.add_argument("--mode", default="shared", choices=("shared", "per-sink"), help="SHARDSINK_QUERIES for the services: per-sink or shared (default shared)")
    ap.add_argument("--quick", action="store_true", help="--sinks 1,3 and short phases (a smoke run)")
    ap.add_argument("--busy-s", type=float, help="length of the workload (default 60, quick 15)")
    ap.add_argument("--idle-s", type=float, help="length of the idle measurement (default 20, quick 10)")
    ap.add_argument("--settle-s", type=float, help="pause between the drained workload and the idle measurement (default 10, quick 5)")
    ap.add_argument("--drain-s", type=float, help="budget for the workload's last steps to reach their uppers (default 120, quick 60)")
    ap.add_argument("--budget-s", type=float, help="budget for every sink's first upper (default 120 s + 3 s per sink)")
    ap.add_argument("--peer", choices=("deltalake", "spark"), help="serve the N desired topics with a peer instead of "
                    "the services: deltalake (one process writing a Delta table per topic) or spark (one plain Spark "
                    "query landing each topic's records as Parquet objects)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help="where the figures and the plot go (default bench/results)")
    ap.add_argument("--deltalake-peer", metavar="SPEC_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--spark-peer", metavar="SPEC_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.deltalake_peer:
        return deltalake_peer(args.deltalake_peer)
    if args.spark_peer:
        return spark_peer(args.spark_peer)

    from services.runner import ensure_control_topics
    from services.runtime.settings import ServiceSettings
    from shared.devstack.embedded import EmbeddedStack

    sinks = [int(x) for x in (args.sinks or ("1,3" if args.quick else "1,10,100")).split(",") if x.strip()]
    q = args.quick
    ph = Phases(
        busy_s=args.busy_s or (15.0 if q else 60.0),
        settle_s=args.settle_s if args.settle_s is not None else (5.0 if q else 10.0),
        idle_s=args.idle_s or (10.0 if q else 20.0),
        drain_s=args.drain_s or (60.0 if q else 120.0),
        budget_s=args.budget_s,
    )
    ts = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        import psutil  # noqa: F401 - only whether it is there
        tree_source = "psutil"
    except ImportError:
        tree_source = "/proc"
    res: dict[str, Any] = {"quick": q, "service_mode": None if args.peer else args.mode, "peer": args.peer,
                           "sinks": sinks, "cores": os.cpu_count(), "timestamp": ts, "load_start": load(),
                           "phases": asdict(ph), "process_tree_from": tree_source}
    work = Path(os.environ.get("SHARDSINK_BENCH_DIR") or f"/tmp/shardsink-bench-sinks-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; {f'peer {args.peer}' if args.peer else f'SHARDSINK_QUERIES={args.mode}'}; sinks {sinks}")
    t_bench = time.monotonic()
    run = uuid.uuid4().hex[:6]
    per_n: list[dict[str, Any]] = []
    with EmbeddedStack() as stack:
        env = {
            **os.environ,
            **stack.env(),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SHARDSINK_QUERIES": args.mode,
        }  # every other setting at its default (trigger 100 ms, catalog poll 1 s)
        settings = ServiceSettings.from_env_and_args(None, env)
        watch = None  # the peer: no services, no shards to watch
        stage_watch = None
        if not args.peer:
            ensure_control_topics(settings)
            watch = UppersWatch(settings.kafka, settings.frontiers_topic)
            stage_watch = StageWatch(settings.kafka, settings.descs_topic, settings.batches_topic)
        try:
            for n in sinks:
                try:
                    per_n.append(measure(n, settings, env, watch, work, run, ph, stage_watch, stack.s3_requests,
                                         stack.cpu_seconds, peer_kind=args.peer or "deltalake"))
                except Exception as e:  # noqa: BLE001 - a failed N is a figure; the next N runs
                    log(f"N={n}: failed: {type(e).__name__}: {e}")
                    per_n.append({"sinks": n, "error": f"{type(e).__name__}: {e}"})
        finally:
            if watch is not None:
                watch.stop()
            if stage_watch is not None:
                stage_watch.stop()
    res["per_n"] = per_n
    largest = max(per_n, key=lambda p: p["sinks"]) if per_n else {}
    for k in TOP_LEVEL:
        res[k] = largest.get(k)
    res["load_end"] = load()
    res["total_s"] = round(time.monotonic() - t_bench, 1)
    stem = args.results_dir / (f"sinks-{args.peer}-{ts}" if args.peer else f"sinks-{ts}")
    try:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        png = stem.with_suffix(".png")
        plot(res, png)
        res["plot"] = str(png)
        log(f"figures {stem.with_suffix('.json')}, plot {png}")
    except Exception as e:  # noqa: BLE001 - matplotlib missing: the figures still print
        log(f"plot skipped: {type(e).__name__}: {e}")
    print(json.dumps(res))
    return 0 if per_n and all("error" not in p for p in per_n) else 1


if __name__ == "__main__":
    raise SystemExit(main())
