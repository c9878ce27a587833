"""Many sinks in one application: what N sinks cost the services (``python -m services``).

For each N of ``--sinks`` (default 1, 10, 100): N collections, each with a 2-partition desired
topic and a sink, served by one ``python -m services`` subprocess (mint, write and append in
one Spark application, the embedded stack's settings, ``SHARDSINK_QUERIES=--mode``). The
workload: every sink gets a step of 50 updates (inserts and retractions) and a progress
statement every 3 s, the N sinks' steps spread evenly over the 3 s. Figures per N (in
``per_n``; the largest N's are repeated at the top level):

- ``processes``: processes in the services' tree (the subprocess and its descendants: the
  driver, the JVM, Spark's Python workers), in steady state (at the end of the idle phase);
- ``rss_gib``: their summed RSS then (forked Python workers share pages, which are counted
  once per process); ``rss_gib_busy_max``: the largest sum sampled during the workload;
- ``busy_cpu_share``: CPU seconds of the tree during the workload over (wall seconds x cores);
- ``idle_cpu_share``: the same over ``--idle-s`` (20 s) with no input, after the workload has
  drained and a settling pause;
- ``freshness_p50_s`` / ``freshness_p99_s``: per step, from ``advance_to`` returning (the
  progress statement is durable) until the shard's upper reaches it; steps whose upper never
  came within the drain budget are counted in ``steps_without_upper`` and left out;
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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

from shared.devstack.embedded import process_stat  # noqa: E402

SCHEMA = {
    "type": "record",
    "name": "Item",
    "namespace": "sinks",
    "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "string"}],
}
PARTITIONS = 2
PERIOD_S = 3.0
UPDATES_PER_STEP = 50
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
    n, cpu, rss = 0, 0.0, 0
    for p in procs:
        try:
            t = p.cpu_times()
            m = p.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        n += 1
        cpu += t.user + t.system + t.children_user + t.children_system
        rss += m.rss
    return Usage(n, cpu, rss)


def _tree_usage_proc(root: int) -> Usage:
    parents: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        st = process_stat(int(d)) if d.isdigit() else None
        if st is not None:
            parents[int(d)] = (st[1], st[2])
    page = os.sysconf("SC_PAGE_SIZE")
    n, cpu, rss = 0, 0.0, 0
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in parents:
            continue
        n += 1
        cpu += parents[pid][1]
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        todo.extend(c for c, (pp, _) in parents.items() if pp == pid)
    return Usage(n, cpu, rss)


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


class UppersWatch:
    """Every shard's upper as its appender announces it on ``frontiers`` (one consumer for all
    shards), timed by the announcement's ``updated_at_ms``; a registered shard whose upper is
    behind the frontier produced to it (``expect``) is also read, one such shard every
    ``check_s / pending`` seconds, and timed when the read saw it."""

    def __init__(self, kafka: Any, frontiers_topic: str, check_s: float = 10.0) -> None:
        from confluent_kafka import OFFSET_END, TopicPartition

        from shared.io.kafka import new_consumer

        self.check_s = check_s
        self._skew = time.monotonic() - time.time()  # wall clock -> monotonic
        self._lock = threading.Lock()
        self._upper: dict[str, int] = {}
        self._reached: dict[str, list[tuple[float, int]]] = {}
        self._shards: dict[str, Any] = {}
        self._expected: dict[str, int] = {}
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

    def expect(self, shard_id: str, frontier: int) -> None:
        with self._lock:
            self._expected[shard_id] = max(frontier, self._expected.get(shard_id, 0))

    def upper(self, shard_id: str) -> int:
        with self._lock:
            return self._upper.get(shard_id, 0)

    def when(self, shard_id: str, frontier: int) -> float | None:
        with self._lock:
            for t, u in self._reached.get(shard_id, ()):
                if u >= frontier:
                    return t
        return None

    def _advance(self, shard_id: str, u: int, at: float) -> None:
        with self._lock:
            if u > self._upper.get(shard_id, 0):
                self._upper[shard_id] = u
                self._reached.setdefault(shard_id, []).append((at, u))

    def _check_one(self, turn: int) -> int:
        """Read one shard that is behind what was produced to it; returns how many are."""
        with self._lock:
            pending = sorted(s for s, f in self._expected.items() if self._upper.get(s, 0) < f and s in self._shards)
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
        try:
            while not self._stop.is_set():
                for msg in self._consumer.consume(500, 0.05):
                    if msg.error() is not None or not msg.value():
                        continue
                    try:
                        d = codec.decode(msg.value())
                        f = Frontier.from_json(d["upper"])
                        u = 2**64 - 1 if f.time is None else f.time
                        self._advance(d["shard_id"], u, d["updated_at_ms"] / 1000 + self._skew)
                    except Exception:  # noqa: BLE001 - the reads below catch what this misses
                        self.read_errors += 1
                now = time.monotonic()
                if now >= next_check:
                    turn += 1
                    pending = self._check_one(turn)
                    next_check = now + self.check_s / max(1, pending)
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# -- one sink's feed ------------------------------------------------------------------------------------


@dataclass
class Feed:
    """One collection, its desired topic, its sink, and the steps produced to it."""

    name: str
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

    def step(self, watch: UppersWatch) -> int | None:
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
            watch.expect(self.name, f)
            return f
        except Exception as e:  # noqa: BLE001 - counted; the run goes on
            self.failed += 1
            log(f"{self.name}: step failed: {e}")
            return None
        finally:
            self.lock.release()


def new_feed(settings: Any, watch: UppersWatch, name: str, seed: int, create_sink: bool = True) -> Feed:
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard

    topic = f"desired-{name}"
    ensure_topic(settings.kafka, topic, PARTITIONS)
    create_collection(settings, name, SCHEMA)
    watch.add(name, Shard.open(settings.store(), name))
    feed = Feed(name, DesiredProducer(settings.kafka, topic, SCHEMA, linger_ms=5), random.Random(seed))
    if create_sink:
        settings.catalog().create_sink(SinkDef(name, topic, name))
    return feed


# -- the services subprocess -----------------------------------------------------------------------------


class Services:
    """``python -m services`` in its own process group (a kill takes its JVM and workers too)."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "services"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        """SIGTERM (the services stop their queries), SIGKILL after 20 s."""
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


def wait_until(pred: Any, budget_s: float, svc: Services) -> bool:
    """Whether ``pred()`` came true within the budget (False at once if the services exited)."""
    deadline = time.monotonic() + budget_s
    while not pred():
        if not svc.alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- one N ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phases:
    busy_s: float
    settle_s: float
    idle_s: float
    drain_s: float
    budget_s: float | None  # None: 120 s + 3 s per sink


def measure(n: int, settings: Any, env: dict[str, str], watch: UppersWatch, work: Path, run: str,
            ph: Phases) -> dict[str, Any]:
    from shared.catalog import SinkDef

    cores = os.cpu_count() or 1
    budget = ph.budget_s if ph.budget_s is not None else 120.0 + 3.0 * n
    out: dict[str, Any] = {"sinks": n, "budget_s": budget, "load_start": load()}
    t_setup = time.monotonic()
    feeds = [new_feed(settings, watch, f"n{n}s{i:03d}-{run}", seed=i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(16, n)) as pool:
        first = dict(zip([f.name for f in feeds], pool.map(lambda f: f.step(watch), feeds), strict=True))
    out["setup_s"] = round(time.monotonic() - t_setup, 1)
    log(f"N={n}: {n} collections, topics and sinks created, first steps produced in {out['setup_s']}s")

    ck = work / f"checkpoints-n{n}"
    log_path = work / f"services-n{n}.log"
    svc = Services({**env, "SHARDSINK_CHECKPOINT_DIR": str(ck)}, log_path)
    t0 = time.monotonic()
    extra: Feed | None = None
    out["services_log"] = str(log_path)
    try:
        def behind() -> list[Feed]:
            return [f for f in feeds if first[f.name] is None or watch.upper(f.name) < (first[f.name] or 0)]

        wait_until(lambda: not behind(), budget, svc)
        missing = behind()
        out["sinks_without_upper"] = len(missing)
        if missing:
            out["start_to_first_uppers_s"] = None
            log(f"N={n}: {len(missing)} of {n} sinks without an upper past their first step after "
                f"{time.monotonic() - t0:.0f}s (budget {budget:.0f}s){'' if svc.alive() else '; the services exited'}")
        else:
            last = max(watch.when(f.name, first[f.name] or 0) or time.monotonic() for f in feeds)
            out["start_to_first_uppers_s"] = round(last - t0, 1)
            log(f"N={n}: every sink's first upper {out['start_to_first_uppers_s']}s after starting the services")
        if not svc.alive():
            out["services_exit_code"] = svc.p.returncode
            return out

        # -- the workload: a step per sink every 3 s, spread over the 3 s -------------------------
        periods = max(1, int(ph.busy_s / PERIOD_S))
        samples: list[Usage] = []
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.wait(2.0):
                samples.append(tree_usage(svc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        log(f"N={n}: workload: {periods} steps of {UPDATES_PER_STEP} updates per sink, one every {PERIOD_S:.0f}s")
        out["load_busy"] = load()
        u0, w0 = tree_usage(svc.pid), time.monotonic()
        sampler.start()
        with ThreadPoolExecutor(max_workers=min(16, n)) as pool:
            for k in range(periods):
                for i, f in enumerate(feeds):
                    delay = w0 + k * PERIOD_S + i * PERIOD_S / n - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(f.step, watch)
            time.sleep(max(0.0, w0 + periods * PERIOD_S - time.monotonic()))
        u1, w1 = tree_usage(svc.pid), time.monotonic()
        stop_sampling.set()
        sampler.join()
        out["busy_cpu_share"] = round((u1.cpu_s - u0.cpu_s) / ((w1 - w0) * cores), 3)
        out["rss_gib_busy_max"] = round(max([s.rss_bytes for s in samples] + [u1.rss_bytes]) / 2**30, 2)
        out["steps_skipped"] = sum(f.skipped for f in feeds)
        out["steps_failed"] = sum(f.failed for f in feeds)

        # -- drain, then freshness --------------------------------------------------------------------
        wait_until(lambda: all(watch.upper(f.name) >= f.frontier for f in feeds), ph.drain_s, svc)
        fresh: list[float] = []
        unseen = 0
        for f in feeds:
            for fr, t in f.sent.items():
                if fr == first[f.name]:
                    continue  # the first step is the start's
                at = watch.when(f.name, fr)
                if at is None:
                    unseen += 1
                else:
                    fresh.append(at - t)
        out["steps"] = len(fresh) + unseen
        out["steps_without_upper"] = unseen
        out["freshness_p50_s"] = pct(fresh, 0.5)
        out["freshness_p99_s"] = pct(fresh, 0.99)
        out["freshness_max_s"] = round(max(fresh), 3) if fresh else None
        log(f"N={n}: busy CPU {out['busy_cpu_share']:.1%} of {cores} cores; freshness p50 {out['freshness_p50_s']}s "
            f"p99 {out['freshness_p99_s']}s over {len(fresh)} steps ({unseen} without an upper)")

        # -- idle -----------------------------------------------------------------------------------------
        time.sleep(ph.settle_s)
        out["load_idle"] = load()
        u0, w0 = tree_usage(svc.pid), time.monotonic()
        time.sleep(ph.idle_s)
        u1, w1 = tree_usage(svc.pid), time.monotonic()
        out["idle_cpu_share"] = round((u1.cpu_s - u0.cpu_s) / ((w1 - w0) * cores), 3)
        out["processes"] = u1.processes
        out["rss_gib"] = round(u1.rss_bytes / 2**30, 2)
        log(f"N={n}: idle CPU {out['idle_cpu_share']:.1%}; {u1.processes} processes, RSS {out['rss_gib']} GiB")

        # -- one more sink, with N running -------------------------------------------------------------
        name = f"n{n}new-{run}"
        extra = new_feed(settings, watch, name, seed=n + 1000, create_sink=False)
        t_new = time.monotonic()
        settings.catalog().create_sink(SinkDef(name, f"desired-{name}", name))
        f_new = extra.step(watch) or 0
        ok = wait_until(lambda: f_new > 0 and watch.upper(name) >= f_new, budget, svc)
        at = watch.when(name, f_new) if ok else None
        out["new_sink_first_upper_s"] = round(at - t_new, 1) if at is not None else None
        log(f"N={n}: new sink's first upper after {out['new_sink_first_upper_s']}s")
    finally:
        out.update(count_failures(log_path))
        out["services_alive_at_end"] = svc.alive()
        svc.stop()
        catalog = settings.catalog()
        for f in feeds + ([extra] if extra is not None else []):
            try:
                f.producer.close()
            except Exception as e:  # noqa: BLE001 - clean-up
                log(f"closing {f.name}'s producer: {e}")
            try:
                catalog.drop_sink(f.name)
            except Exception as e:  # noqa: BLE001 - not created, or already dropped
                log(f"dropping {f.name}: {e}")
            watch.forget(f.name)
    out["load_end"] = load()
    out["total_s"] = round(time.monotonic() - t_setup, 1)
    log(f"N={n}: {out['query_failures']} query failure lines; done in {out['total_s']}s")
    return out


# -- plot -------------------------------------------------------------------------------------------------------


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["per_n"]
    ns = [p["sinks"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(f"shardsink: N sinks in one application (SHARDSINK_QUERIES={res['service_mode']}, "
                 f"{res['cores']} cores{', quick' if res['quick'] else ''}, {res['timestamp']})")
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
    ax.set_title("CPU of the services' tree")
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
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help="where the figures and the plot go (default bench/results)")
    args = ap.parse_args(argv)

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
    res: dict[str, Any] = {"quick": q, "service_mode": args.mode, "sinks": sinks, "cores": os.cpu_count(),
                           "timestamp": ts, "load_start": load(), "phases": asdict(ph), "process_tree_from": tree_source}
    work = Path(os.environ.get("SHARDSINK_BENCH_DIR") or f"/tmp/shardsink-bench-sinks-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; SHARDSINK_QUERIES={args.mode}; sinks {sinks}")
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
        ensure_control_topics(settings)
        watch = UppersWatch(settings.kafka, settings.frontiers_topic)
        try:
            for n in sinks:
                try:
                    per_n.append(measure(n, settings, env, watch, work, run, ph))
                except Exception as e:  # noqa: BLE001 - a failed N is a figure; the next N runs
                    log(f"N={n}: failed: {type(e).__name__}: {e}")
                    per_n.append({"sinks": n, "error": f"{type(e).__name__}: {e}"})
        finally:
            watch.stop()
    res["per_n"] = per_n
    largest = max(per_n, key=lambda p: p["sinks"]) if per_n else {}
    for k in TOP_LEVEL:
        res[k] = largest.get(k)
    res["load_end"] = load()
    res["total_s"] = round(time.monotonic() - t_bench, 1)
    try:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / f"sinks-{ts}.json").write_text(json.dumps(res, indent=2) + "\n")
        png = args.results_dir / f"sinks-{ts}.png"
        plot(res, png)
        res["plot"] = str(png)
        log(f"figures {args.results_dir / f'sinks-{ts}.json'}, plot {png}")
    except Exception as e:  # noqa: BLE001 - matplotlib missing: the figures still print
        log(f"plot skipped: {type(e).__name__}: {e}")
    print(json.dumps(res))
    return 0 if per_n and all("error" not in p for p in per_n) else 1


if __name__ == "__main__":
    raise SystemExit(main())
