"""``make chaos``: a fault campaign on the embedded stack, checked against a reference model.

What runs (all on one embedded stack, Tansu + moto):

- a steady workload: inserts and retractions of ``(k, v)`` rows on a desired topic (2
  partitions), a progress step every 0.5 s, every update recorded in the model;
- two sink replicas on one shard: sinks ``<run>-a`` (writable) and ``<run>-b`` (created
  read-only once a is in step, switched to writing mid-run with ``Catalog.allow_writes``),
  same desired topic, same collection; they race on every compare-and-append;
- the services as processes, each in its own process group: ``mint``, ``write``, ``append``
  (``--layout separate``, the compose/Kubernetes mode) or one ``python -m services``
  (``--layout combined``, the embedded default), and the ``controller``;
- a subscribe through the controller (``Subscribe`` command) to an output topic;
- SIGKILLs of randomly chosen services at random times (the victim restarts after a random
  pause; a process that exits by itself is restarted too and counted);
- injected faults in every service (``SHARDSINK_FAULTS``, see services/runtime/settings.py): S3
  errors, timeouts, PUTs that land and report a timeout, latency, and control-message
  delivery errors (dropped, or delivered but reported failed);
- network faults, after the kills: the stack's broker and S3 server sit behind loopback fault
  proxies (``EmbeddedStack(net_faults=True)``, shared/devstack/netfault.py) that every service
  reaches them through; each fault (a partition: connects refused and connections reset; a
  black hole: nothing forwarded; latency with jitter; 5 % packet loss each way), on the path
  to S3, to the broker or to both, lasts a few seconds (a partition 30 s in the full
  campaign), then heals, and the seconds from the heal to the next move of the shard's upper
  are measured (``network_faults``, ``network_fault_count``, ``heal_to_upper_p50_s``,
  ``heal_to_upper_max_s`` in the summary). Packet loss needs a real link: with loss faults in
  the plan the proxies reach their servers over a veth in a private network namespace with an
  eBPF packet dropper (``EmbeddedStack(net_loss=True)``, shared/devstack/lossy_link.py; root and
  Linux >= 6.6). Where that cannot be built the loss faults are skipped, and the summary says
  why (``loss_unavailable``, ``network_faults_skipped``). The checker reads S3 directly; the
  workload's producer reaches the broker through its proxy too (the broker advertises one
  address), so a Kafka partition holds it as well.
- with ``--cluster``: the services (combined layout) run on a Spark standalone cluster (a
  master and two workers of one core each, from the pyspark wheel) in client mode, their driver
  binding 127.0.0.1 and advertising 127.0.0.2, where fault proxies forward to it
  (``DriverFaultPath``, shared/devstack/embedded.py), so every connection of the executors to
  the driver goes through them; the network faults then begin with a partition and a black
  hole of that path (``driver``), and each fault's record says how many executors the workers
  launched meanwhile (an executor whose connection to the driver is reset exits; the master
  launches another). The executors reach the broker and S3 through the stack's proxies too.

The history checker records every shard state object (``shards/<id>/state/<n>``) as the run
goes (the services run with a 1-day GC grace so none disappears), and every message of the
subscribe output, then checks:

1. appends linearizable: state n+1 follows state n; each append record expects exactly the
   previous state's upper and ends at the new one; the upper moves only by appends and only
   forward; no append token twice;
2. every append's contents (its new batch) equal the model's updates in ``[lower, upper)``;
3. the shard at each upper equals the model (snapshot at upper-1, for a sample of uppers and
   the final one); no update lost or doubled (the consolidated ``(row, time, diff)`` of the
   whole shard equal the model's);
4. the subscribe's output (snapshot at 0, then changes) equals the model's change stream,
   with progress statements in order.

The last stdout line is one JSON summary; the exit code is 1 on any divergence (and 2 if the
run could not finish, e.g. the sink never converged).

    python bench/chaos.py              # full: >= 100 kills, 30 network faults (about 40 minutes on 2 cores)
    python bench/chaos.py --quick      # a few kills and 3 network faults, combined layout (a few minutes)
    python bench/chaos.py --kills 0 --network-faults 30   # the network faults alone
    python bench/chaos.py --quick --cluster    # on a standalone cluster, driver-executor faults first
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_FAULTS = "error_p=0.01,timeout_p=0.005,lost_ack_p=0.01,latency_ms=5,kafka_error_p=0.005,kafka_lost_ack_p=0.005"
STEP_TIMES = 10
#: The network faults of a campaign, in this order, repeated: (fault, path); the path "both" is
#: S3's and the broker's at once. Ten kinds: the full campaign's 30 faults are each three times.
NETWORK_FAULTS = (("partition", "s3"), ("partition", "kafka"), ("blackhole", "kafka"), ("blackhole", "s3"),
                  ("latency", "s3"), ("latency", "kafka"), ("loss", "s3"), ("loss", "kafka"),
                  ("partition", "both"), ("loss", "both"))
#: With ``--cluster``, before those: the path between the services' driver and the cluster's
#: executors, partitioned and black-holed.
DRIVER_NETWORK_FAULTS = (("partition", "driver"), ("blackhole", "driver"))
#: Network faults of a full campaign and of a quick one.
FULL_NETWORK_FAULTS, QUICK_NETWORK_FAULTS = 30, 3
#: A latency fault's delay per chunk, and its jitter (ms).
LATENCY_MS, LATENCY_JITTER_MS = 80.0, 60.0
#: A loss fault's share of the packets dropped, each direction (%).
LOSS_PERCENT = 5.0
#: How long a partition lasts in a full campaign (issue 32: "a partition of 30 s").
FULL_PARTITION_S = 30.0
Row = tuple[int, str]


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes ----------------------------------------------------------------------------------


@dataclass
class Service:
    """One service process, in its own process group (a kill takes its JVM and workers)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    exits: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.starts += 1
        with open(self.log_dir / f"{self.name}.log", "ab") as out:
            out.write(f"\n===== start {self.starts} at {time.strftime('%H:%M:%S')} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)

    def exited(self) -> int | None:
        """The exit code if the process ended by itself (it is then forgotten)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        try:  # its JVM or workers may outlive the driver: take the group down
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        self.exits.append(code)
        return code


# -- the workload and the model -----------------------------------------------------------------


@dataclass
class Workload:
    producer: Any
    rng: random.Random
    per_step: int
    sent: list[tuple[Row, int, int]] = field(default_factory=list)
    live: Counter[Row] = field(default_factory=Counter)
    next_key: int = 0
    frontier: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self) -> int:
        with self.lock:
            lo = self.frontier
            live_rows = [r for r, c in self.live.items() if c > 0]
            for _ in range(self.per_step):
                t = lo + self.rng.randrange(STEP_TIMES)
                x = self.rng.random()
                if x < 0.3 and live_rows:
                    row = live_rows.pop(self.rng.randrange(len(live_rows)))
                    diff = -self.live[row]
                elif x < 0.4 and live_rows:
                    row = live_rows.pop(self.rng.randrange(len(live_rows)))
                    diff = 1
                else:
                    row = (self.next_key, f"v{self.rng.randrange(1000)}")
                    self.next_key += 1
                    diff = 1
                self.producer.send({"k": row[0], "v": row[1]}, t, diff)
                self.sent.append((row, t, diff))
                self.live[row] += diff
                if self.live[row] == 0:
                    del self.live[row]
            self.frontier = lo + STEP_TIMES
            self.producer.advance_to(self.frontier)
            return self.frontier


def network_kinds(n: int, cluster: bool = False) -> list[tuple[str, str]]:
    """The ``(fault, path)`` of ``n`` network faults: :data:`NETWORK_FAULTS` in turn, after
    :data:`DRIVER_NETWORK_FAULTS` on a cluster."""
    kinds = (DRIVER_NETWORK_FAULTS if cluster else ()) + NETWORK_FAULTS
    return [kinds[i % len(kinds)] for i in range(n)]


def network_plan(n: int, quick: bool, rng: random.Random, cluster: bool = False) -> list[tuple[str, str, float]]:
    """``n`` network faults ``(fault, path, seconds)``: :func:`network_kinds`, 10 s each (8 s
    for a black hole) in a quick run; in a full one a partition lasts
    :data:`FULL_PARTITION_S`, any other fault 5-20 s at random."""
    plan = []
    for fault, path in network_kinds(n, cluster):
        if quick:
            seconds = 8.0 if fault == "blackhole" else 10.0
        else:
            seconds = FULL_PARTITION_S if fault == "partition" else round(rng.uniform(5.0, 20.0), 1)
        plan.append((fault, path, seconds))
    return plan


def model_at(sent: list[tuple[Row, int, int]], as_of: int) -> Counter[Row]:
    c: Counter[Row] = Counter()
    for r, t, d in sent:
        if t <= as_of:
            c[r] += d
    return Counter({r: n for r, n in c.items() if n != 0})


def model_between(sent: list[tuple[Row, int, int]], lo: int, hi: int) -> Counter[tuple[Row, int]]:
    c: Counter[tuple[Row, int]] = Counter()
    for r, t, d in sent:
        if lo <= t < hi:
            c[(r, t)] += d
    return Counter({k: n for k, n in c.items() if n != 0})


def table_updates(table: Any) -> Counter[tuple[Row, int]]:
    from shared.shard import DIFF, ERROR, TIME

    errors = [e for e in table[ERROR].to_pylist() if e is not None]
    if errors:
        raise Divergence(f"expected no error rows, found {errors[:3]}")
    c: Counter[tuple[Row, int]] = Counter()
    for k, v, t, d in zip(table["k"].to_pylist(), table["v"].to_pylist(), table[TIME].to_pylist(), table[DIFF].to_pylist(), strict=True):
        c[((k, v), t)] += d
    return Counter({k: n for k, n in c.items() if n != 0})


def table_rows(table: Any) -> Counter[Row]:
    from shared.shard import DIFF

    c: Counter[Row] = Counter()
    for k, v, d in zip(table["k"].to_pylist(), table["v"].to_pylist(), table[DIFF].to_pylist(), strict=True):
        c[(k, v)] += d
    return Counter({r: n for r, n in c.items() if n != 0})


def differ(actual: Counter[Any], expected: Counter[Any]) -> str:
    keys = set(actual) | set(expected)
    bad = sorted(((k, actual.get(k, 0), expected.get(k, 0)) for k in keys if actual.get(k, 0) != expected.get(k, 0)), key=str)
    return f"{len(bad)} differ (key, actual, model): {bad[:5]}"


class Divergence(AssertionError):
    """The system's history differs from the model."""


# -- the recorders ------------------------------------------------------------------------------


class StateRecorder:
    """Reads every shard state object as it appears (before any GC could remove it)."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.states: dict[int, Any] = {}
        self.missing: set[int] = set()
        self.errors = 0
        #: (monotonic seconds, upper) when a poll first saw each higher upper
        self.reached: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-recorder", daemon=True)

    def start(self) -> StateRecorder:
        self._thread.start()
        return self

    def poll_once(self) -> int:
        from shared.errors import ObjectNotFoundError
        from shared.state import ShardState

        head = self.shard.refresh()
        for n in range(max(self.states, default=-1) + 1, head.seqno + 1):
            if n in self.states or n in self.missing:
                continue
            try:
                self.states[n] = ShardState.decode(self.shard.store.get(self.shard.state_key(n)))
            except ObjectNotFoundError:
                self.missing.add(n)
        upper = int(head.upper.time or 0)
        if not self.reached or upper > self.reached[-1][1]:
            self.reached.append((time.monotonic(), upper))
        return upper

    def upper(self) -> int:
        return int(self.states[max(self.states)].upper.time or 0) if self.states else 0

    def when(self, upper: int) -> float | None:
        """When a poll first saw the upper at ``upper`` or beyond (monotonic seconds)."""
        return next((t for t, u in self.reached if u >= upper), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the embedded S3 is not faulted for us: retry
                self.errors += 1
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# -- the campaign -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few kills, combined layout")
    ap.add_argument("--kills", type=int, help="SIGKILLs to deliver (default 100, quick 4)")
    ap.add_argument("--layout", choices=("separate", "combined"), help="services as mint/write/append processes or one (default separate, quick combined)")
    ap.add_argument("--faults", default=DEFAULT_FAULTS, help=f"SHARDSINK_FAULTS for the services (default {DEFAULT_FAULTS!r}; '' for none)")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("SHARDSINK_CHAOS_SEED", "7007")))
    ap.add_argument("--switch-after", type=int, help="allow writes on the read-only replica after this many kills (default kills // 3)")
    ap.add_argument("--work-dir", help="logs and checkpoints (default a new /tmp dir)")
    ap.add_argument("--trigger-ms", type=int, default=500, help="micro-batch trigger of the services (SHARDSINK_TRIGGER_MS; default 500)")
    ap.add_argument("--network-faults", type=int, help=f"network faults after the kills (default {FULL_NETWORK_FAULTS}, quick {QUICK_NETWORK_FAULTS}; 0: none, and no proxies)")
    ap.add_argument("--cluster", action="store_true", help="the services on a Spark standalone cluster (2 workers x 1 core), their driver behind fault proxies; the network faults begin with the driver-executor path's (combined layout only)")
    args = ap.parse_args(argv)
    if args.cluster and args.layout == "separate":
        ap.error("--cluster runs the combined layout (one application on the cluster's two cores)")
    # SIGTERM (e.g. a timeout) unwinds like an exception: the services and the stack are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kills_wanted = args.kills if args.kills is not None else (4 if args.quick else 100)
    layout = args.layout or ("combined" if args.quick or args.cluster else "separate")
    switch_after = args.switch_after if args.switch_after is not None else max(1, kills_wanted // 3)
    per_step = 40 if args.quick else 100
    net_wanted = args.network_faults if args.network_faults is not None else (QUICK_NETWORK_FAULTS if args.quick else FULL_NETWORK_FAULTS)
    loss_planned = any(fault == "loss" for fault, _ in network_kinds(net_wanted, args.cluster))
    work = Path(args.work_dir or f"/tmp/shardsink-chaos-{uuid.uuid4().hex[:8]}")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    log(f"seed {args.seed}, {kills_wanted} kills, {net_wanted} network faults, layout {layout}"
        f"{' on a standalone cluster' if args.cluster else ''}, faults {args.faults!r}, work dir {work}")

    from shardsink.cli.catalog import create_collection
    from services.runtime.settings import ServiceSettings
    from shared.io.controller_client import ControllerClient
    from services.runner import ensure_control_topics
    from shared.catalog import SinkDef
    from shared.devstack.embedded import DriverFaultPath, EmbeddedStack, SparkStandalone
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard
    from tests.controller_fixture import SCHEMA, check_progress_order, changes_of, read_subscribe

    summary: dict[str, Any] = {"seed": args.seed, "layout": layout, "faults": args.faults, "quick": args.quick,
                               "cluster": args.cluster}
    divergences: list[str] = []
    t_run = time.monotonic()
    with EmbeddedStack(net_faults=net_wanted > 0, net_loss=loss_planned) as stack, contextlib.ExitStack() as on_cluster:
        cluster = driver_path = None
        if args.cluster:
            cluster = on_cluster.enter_context(SparkStandalone(workers=2, cores=1, log_dir=work / "logs" / "spark"))
            driver_path = on_cluster.enter_context(DriverFaultPath())
            log(f"standalone cluster at {cluster.master_url}; the driver advertises {driver_path.host}")
        run = uuid.uuid4().hex[:6]
        if stack.loss_unavailable:
            log(f"loss faults not possible here, they are skipped: {stack.loss_unavailable}")
        base_env = {
            **os.environ,
            **stack.env(direct_s3=True),  # the checker's S3 path is never faulted
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SHARDSINK_CHECKPOINT_DIR": str(work / "checkpoints"),
            # A failed query is restarted at the next catalog poll: 2 s between restarts keeps
            # a storm of them (Python workers timing out on a loaded machine) from feeding itself.
            "SHARDSINK_CATALOG_POLL_MS": "2000",
            "SHARDSINK_TRIGGER_MS": str(args.trigger_ms),
            "SHARDSINK_STAGED_GRACE_MS": str(24 * 3600 * 1000),  # keep every state for the checker
        }
        base_env.pop("SHARDSINK_FAULTS", None)
        # On a loaded machine Spark's Python workers can take longer than the default 15 s
        # to connect back; a failed query is restarted, but a storm of them stalls the run.
        base_env.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.python.authenticate.socketTimeout=120s pyspark-shell")
        svc_env = {**base_env, **stack.env(), "SHARDSINK_FAULTS": args.faults}  # through the proxies
        clean = ServiceSettings.from_env_and_args(None, base_env)  # the checker's view: no faults
        collection, topic = f"chaos-{run}", f"desired-chaos-{run}"
        sink_a, sink_b = f"chaos-{run}-a", f"chaos-{run}-b"
        commands, responses, sub_topic = f"commands-{run}", f"responses-{run}", f"subscribe-{run}"
        ensure_control_topics(clean)
        ensure_topic(clean.kafka, topic, 2)
        ensure_topic(clean.kafka, sub_topic, 1)
        create_collection(clean, collection, SCHEMA)
        catalog = clean.catalog()
        catalog.create_sink(SinkDef(sink_a, topic, collection))
        # Replica b (read-only) is created once a is in step: starting six queries at once
        # on a loaded 2-core machine times out Spark's Python workers.

        ctl_argv = [sys.executable, "-m", "services.controller", "--commands-topic", commands, "--responses-topic", responses]
        services: dict[str, Service] = {"controller": Service("controller", ctl_argv, svc_env, work / "logs")}
        names = ("mint", "write", "append") if layout == "separate" else ("services",)
        on_cluster_env: dict[str, str] = {}
        if cluster is not None and driver_path is not None:
            on_cluster_env = {"SHARDSINK_SPARK_MASTER": cluster.master_url,
                              "PYSPARK_SUBMIT_ARGS": driver_path.submit_args(svc_env["PYSPARK_SUBMIT_ARGS"])}
        for name in names:
            mod = "services" if name == "services" else f"services.{name}"
            services[name] = Service(name, [sys.executable, "-m", mod], {**svc_env, **on_cluster_env}, work / "logs")
        victims_pool = list(services)

        shard = Shard.open(clean.store(), collection)
        recorder = StateRecorder(shard).start()
        producer = DesiredProducer(clean.kafka, topic, SCHEMA)
        workload = Workload(producer, random.Random(rng.random()), per_step)
        client = ControllerClient(clean.kafka, commands_topic=commands, responses_topic=responses)
        stop = threading.Event()
        bg_errors: list[BaseException] = []

        def produce() -> None:
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    workload.step()
                    stop.wait(max(0.0, 0.5 - (time.monotonic() - t0)))
            except BaseException as e:  # noqa: BLE001 - reported
                bg_errors.append(e)

        restarts_by_self: Counter[str] = Counter()

        def reap() -> None:
            """Restart any service that exited by itself (as a container runtime would)."""
            for s in services.values():
                code = s.exited()
                if code is not None:
                    restarts_by_self[s.name] += 1
                    log(f"{s.name} exited by itself (code {code}); restarting")
                    s.start()

        def wait_upper(target: int, timeout_s: float, what: str) -> bool:
            deadline = time.monotonic() + timeout_s
            while recorder.upper() < target:
                reap()
                if time.monotonic() > deadline:
                    log(f"expected the upper to reach {target} within {timeout_s}s ({what}), found {recorder.upper()}")
                    return False
                time.sleep(0.2)
            return True

        def network_fault(fault: str, path: str, seconds: float) -> dict[str, Any]:
            """Inflict ``fault`` on the path to ``path`` (``s3``, ``kafka``, ``both``, or
            ``driver``: between the services' driver and the cluster's executors) for
            ``seconds``, heal it, and time the sink's resumption: from the heal to the first
            upper beyond the one at the heal."""
            by_path: dict[str, list[Any]] = {"s3": [stack.s3_proxy], "kafka": [stack.kafka_proxy],
                                         "both": [stack.s3_proxy, stack.kafka_proxy],
                                         "driver": driver_path.proxies if driver_path is not None else []}
            proxies = by_path[path]
            exits_before = sum(restarts_by_self.values())
            resets_before = sum(p.counters.resets for p in proxies if p is not None)
            launched_before = len(cluster.executor_dirs()) if cluster is not None else 0
            dropped_before = [p.loss_counters() for p in proxies if p is not None]
            t0 = time.monotonic()
            for proxy in proxies:
                assert proxy is not None
                if fault == "partition":
                    proxy.partition()
                elif fault == "blackhole":
                    proxy.blackhole()
                elif fault == "loss":
                    proxy.loss(LOSS_PERCENT)
                else:
                    proxy.latency(LATENCY_MS, LATENCY_JITTER_MS)
            while time.monotonic() - t0 < seconds:
                reap()
                time.sleep(0.1)
            at_heal = recorder.reached[-1][1] if recorder.reached else 0
            for proxy in proxies:
                assert proxy is not None
                proxy.heal()
            t_heal = time.monotonic()
            if not wait_upper(at_heal + 1, 300, f"after healing the {fault} of {path}"):
                raise TimeoutError(f"the sink did not resume within 300 s after healing the {fault} of {path}")
            moved = recorder.when(at_heal + 1) or time.monotonic()
            rec: dict[str, Any] = {
                "fault": fault, "path": path, "seconds": round(t_heal - t0, 1), "upper_at_heal": at_heal,
                "heal_to_upper_s": round(max(0.0, moved - t_heal), 2),
                "exits": sum(restarts_by_self.values()) - exits_before,
                "connections_reset": sum(p.counters.resets for p in proxies if p is not None) - resets_before}
            if cluster is not None:  # executors the workers launched since the fault began
                rec["executors_launched"] = len(cluster.executor_dirs()) - launched_before
            if fault == "loss":  # the packets the dropper saw and lost meanwhile, both ways
                after = [p.loss_counters() for p in proxies if p is not None]
                rec["packets_dropped"] = sum(a.out_dropped + a.in_dropped - b.out_dropped - b.in_dropped
                                             for a, b in zip(after, dropped_before, strict=True))
                rec["packets_passed"] = sum(a.out_passed + a.in_passed - b.out_passed - b.in_passed
                                            for a, b in zip(after, dropped_before, strict=True))
            log(f"network fault: {rec}")
            return rec

        kills: list[dict[str, Any]] = []
        net_faults: list[dict[str, Any]] = []
        net_skipped: list[dict[str, Any]] = []
        switched_at: int | None = None
        producer_thread = threading.Thread(target=produce, name="workload", daemon=True)
        exit_code = 0
        try:
            for s in services.values():
                s.start()
            sub_id = client.send("Subscribe", {"collection_id": collection, "output_topic": sub_topic, "as_of": 0,
                                               "up_to": None, "with_snapshot": True})
            producer_thread.start()
            if not wait_upper(2 * STEP_TIMES, 600, "first appends"):
                raise TimeoutError("the sink never started")
            # The shard holds a's rows by now; b reads the same topic, the whole truth.
            catalog.create_sink(SinkDef(sink_b, topic, collection, read_only=True, replace_contents=True))
            log(f"in step (upper {recorder.upper()}); read-only replica {sink_b} created; starting the kills")
            # Every service is hit at least once; the rest at random.
            order = list(victims_pool)
            rng.shuffle(order)
            order += [rng.choice(victims_pool) for _ in range(max(0, kills_wanted - len(order)))]
            order = order[:kills_wanted] if kills_wanted >= len(victims_pool) else order[:kills_wanted]
            gap = (1.0, 4.0) if args.quick else (2.0, 8.0)
            for i, victim in enumerate(order):
                if i == switch_after and switched_at is None:
                    catalog.allow_writes(sink_b)
                    switched_at = recorder.upper()
                    log(f"allow_writes({sink_b}) at upper {switched_at}")
                if i and i % 10 == 0 or args.quick and victim != "controller":
                    # Let the sink make progress between bursts of kills (bounded wait).
                    wait_upper(workload.frontier, 300, f"progress before kill {i}")
                t_end = time.monotonic() + rng.uniform(*gap)
                while time.monotonic() < t_end:
                    reap()
                    time.sleep(0.1)
                if bg_errors:
                    raise RuntimeError(f"the workload failed: {bg_errors[0]!r}")
                s = services[victim]
                at = {"victim": victim, "t_s": round(time.monotonic() - t_run, 1), "upper": recorder.upper(), "frontier": workload.frontier}
                s.kill()
                s.kills += 1
                time.sleep(rng.uniform(0.0, 1.5))
                s.start()
                kills.append(at)
                if (i + 1) % 10 == 0 or args.quick:
                    log(f"{i + 1}/{len(order)} kills; last {victim}; upper {recorder.upper()}, frontier {workload.frontier}")
            if switched_at is None:
                catalog.allow_writes(sink_b)
                switched_at = recorder.upper()
            for j, (fault, path, seconds) in enumerate(network_plan(net_wanted, args.quick, rng, args.cluster)):
                if fault == "loss" and stack.loss_unavailable:
                    net_skipped.append({"fault": fault, "path": path, "reason": stack.loss_unavailable})
                    continue
                wait_upper(workload.frontier, 300, f"progress before network fault {j}")
                net_faults.append(network_fault(fault, path, seconds))
                log(f"{j + 1}/{net_wanted} network faults")
            # Converge: the last step's frontier, then the subscribe's.
            if not wait_upper(workload.frontier + STEP_TIMES, 900, "after the last kill"):
                raise TimeoutError("the sink did not get back in step after the last kill")
            stop.set()
            producer_thread.join(timeout=30)
            if bg_errors:
                raise RuntimeError(f"the workload failed: {bg_errors[0]!r}")
            final = workload.step()
            if not wait_upper(final, 900, "final convergence"):
                raise TimeoutError(f"the sink did not converge to {final}")
            deadline = time.monotonic() + 600
            while True:
                reap()
                msgs = read_subscribe(stack, sub_topic, sub_id, until_final=False, timeout_s=2.0)
                progressed = [m["time"] for m in msgs if m["progressed"] and m["time"] is not None]
                if progressed and max(progressed) >= final:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the subscribe did not reach {final}, found {max(progressed, default=None)}")
                time.sleep(1.0)
            cancel_id = client.send("CancelSubscribe", {"subscribe_command_id": sub_id})
            deadline = time.monotonic() + 600
            while not client.responses(cancel_id):
                reap()  # a controller that exited under faults is restarted and answers
                client.poll(0.5)
                if time.monotonic() > deadline:
                    raise TimeoutError("expected an answer to CancelSubscribe within 600 s")
            while True:
                reap()
                msgs = read_subscribe(stack, sub_topic, sub_id, until_final=False, timeout_s=2.0)
                if msgs and msgs[-1]["progressed"] and msgs[-1]["time"] is None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("expected the subscribe's final progress statement within 600 s")
            time.sleep(2.0)  # late appenders: their appends must all fail now
            recorder.stop()
            recorder.poll_once()
        except Exception as e:  # noqa: BLE001 - reported in the summary, exit code 2
            import traceback

            traceback.print_exc()
            log(f"the run did not finish: {e!r}")
            summary["error"] = repr(e)
            exit_code = 2
        finally:
            stop.set()
            recorder.stop()
            for s in services.values():
                s.kill()
            client.close()
            with contextlib.suppress(Exception):  # its client goes before the broker does
                producer.close()
        heals = sorted(f["heal_to_upper_s"] for f in net_faults)
        summary.update(
            network_faults=net_faults,
            network_fault_count=len(net_faults),
            network_faults_by_kind=dict(Counter(f"{f['fault']}/{f['path']}" for f in net_faults)),
            network_faults_skipped=net_skipped,
            loss_unavailable=stack.loss_unavailable if loss_planned else None,
            heal_to_upper_p50_s=round(statistics.median(heals), 2) if heals else None,
            heal_to_upper_max_s=heals[-1] if heals else None,
            executors_launched=len(cluster.executor_dirs()) if cluster is not None else None,
            kills=len(kills),
            kills_by_service=dict(Counter(k["victim"] for k in kills)),
            exits_by_service=dict(restarts_by_self),
            updates=len(workload.sent),
            switched_read_only_at_upper=switched_at,
            states_recorded=len(recorder.states),
            states_missing=len(recorder.missing),
        )
        if exit_code == 0:
            try:
                check(summary, divergences, shard, recorder, workload, final, msgs, check_progress_order, changes_of, args.quick)
            except Divergence as e:
                divergences.append(str(e))
        elif recorder.states:
            # The run could not finish (a sink that stalled, a timeout): check the history it
            # made up to the upper the shard reached (no subscribe check), so that the summary
            # still says whether anything was lost, doubled or misplaced on the way.
            try:
                recorder.poll_once()
                reached = int(shard.refresh().upper.time or 0)
                summary["checked_up_to_upper"] = reached
                check(summary, divergences, shard, recorder, workload, reached, None, check_progress_order, changes_of, args.quick)
            except Divergence as e:
                divergences.append(str(e))
            except Exception as e:  # noqa: BLE001 - the run's own error is the one reported
                log(f"the partial check of the unfinished run failed: {e!r}")
        summary["logs"] = str(work / "logs")
    summary["seconds"] = round(time.monotonic() - t_run, 1)
    summary["divergences"] = divergences
    ok = exit_code == 0 and not divergences
    summary["ok"] = ok
    for d in divergences:
        log(f"DIVERGENCE: {d}")
    print(
        f"chaos: {'OK' if ok else 'FAILED'}: {summary['kills']} kills {summary['kills_by_service']}, "
        f"{len(summary['network_faults'])} network faults (heal to upper: max {summary['heal_to_upper_max_s']} s"
        f"{', %d skipped: %s' % (len(summary['network_faults_skipped']), summary['loss_unavailable']) if summary['network_faults_skipped'] else ''}), "
        f"{summary.get('appends', 0)} appends, {summary['updates']} updates, "
        f"{summary.get('subscribe_changes', 0)} subscribe changes, {len(divergences)} divergences",
        file=sys.stderr,
    )
    print(json.dumps(summary, default=str))
    return exit_code or (0 if ok else 1)


def description_lower(token: str | None) -> int | None:
    """The lower of the description an append's token names (``"<sink id>:<epoch>:<lower>"``,
    then an optional nonce); None for an append without one (an upper bump, an ``Append``)."""
    parts = (token or "").split(":")
    if len(parts) in (3, 4) and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[2])
    return None


def check(summary: dict[str, Any], divergences: list[str], shard: Any, recorder: StateRecorder, workload: Workload,
          final: int, msgs: list[dict[str, Any]] | None, check_progress_order: Any, changes_of: Any, quick: bool) -> None:
    """The history checker (see the module docstring); appends each divergence found."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from shared.frontier import Frontier
    from shared.shard import TIME

    sent = workload.sent
    head = shard.refresh()
    if head.upper.time != final:
        divergences.append(f"expected the upper to stop at the last frontier {final}, found {head.upper}")
    states = recorder.states
    if recorder.missing:
        divergences.append(f"expected every state object readable, found {len(recorder.missing)} missing: {sorted(recorder.missing)[:5]}")
    seqnos = sorted(states)

    # 1. linearizable appends.
    tokens: list[str] = []
    appends: list[tuple[Any, Any]] = []  # (state, new batch)
    lowers_checked = 0
    for a, b in zip(seqnos, seqnos[1:], strict=False):
        prev, cur = states[a], states[b]
        if b != a + 1:
            continue  # a gap (reported above)
        if not prev.upper.less_equal(cur.upper):
            divergences.append(f"expected the upper to move forward, found {prev.upper} -> {cur.upper} at seqno {b}")
        new = [r for r in cur.recent if r.seqno == cur.seqno]
        if new:
            (rec,) = new
            if rec.expected_upper != prev.upper or rec.new_upper != cur.upper:
                divergences.append(f"expected the append at seqno {b} to go {prev.upper} -> {cur.upper}, found {rec}")
            tokens.append(rec.token)
            lower = description_lower(rec.token)
            if lower is not None:
                lowers_checked += 1
                if prev.upper.time != lower:
                    divergences.append(
                        f"expected the description appended at seqno {b} ({rec.token}) to start at the shard's "
                        f"upper at its append, {prev.upper}, found lower {lower}"
                    )
            prev_ids = {x.id for x in prev.batches}
            added = [x for x in cur.batches if x.id not in prev_ids]
            if any(x.lower != prev.upper or x.upper != cur.upper for x in added):
                divergences.append(f"expected the batch appended at seqno {b} to span {prev.upper} -> {cur.upper}")
            appends.append((cur, added))
        elif cur.upper != prev.upper:
            divergences.append(f"expected the upper to change only by an append, found {prev.upper} -> {cur.upper} at seqno {b}")
    dup = [t for t, n in Counter(tokens).items() if n > 1]
    if dup:
        divergences.append(f"expected every append token once, found {len(dup)} twice: {dup[:3]}")

    # 2. each append's contents equal the model's updates in [lower, upper).
    sample = appends if quick or len(appends) <= 300 else random.Random(1).sample(appends, 300)
    checked_appends = 0
    for cur, added in sample:
        keys = [p.key for x in added for p in x.parts]
        lo = int(added[0].lower.time) if added and added[0].lower.time is not None else None
        if not added:
            continue
        hi = int(cur.upper.time or 0)
        got = table_updates(shard._read_parts(keys)) if keys else Counter()
        want = model_between(sent, lo or 0, hi)
        checked_appends += 1
        if got != want:
            divergences.append(f"expected the append at seqno {cur.seqno} ([{lo}, {hi})) to hold the model's updates: {differ(got, want)}")
            break

    # 3. the shard at each upper (sampled) and at the final one; no update lost or doubled.
    everything = shard.updates_between(head, 0, head.upper)
    all_got = table_updates(everything)
    all_want = model_between(sent, 0, final)
    # Per (row, time): more weight than the model is doubled, less is lost.
    doubled = lost = 0
    for key in set(all_got) | set(all_want):
        got_n, want_n = abs(all_got.get(key, 0)), abs(all_want.get(key, 0))
        doubled += max(0, got_n - want_n)
        lost += max(0, want_n - got_n)
    summary.update(doubled_updates=doubled, lost_updates=lost)
    if all_got != all_want:
        divergences.append(f"expected the shard's updates to equal the model's (none lost or doubled): {differ(all_got, all_want)}")
    uppers = sorted({int(s.upper.time) for s in states.values() if s.upper.time})
    picked = uppers[:: max(1, len(uppers) // 15)] + [final]
    for u in picked:
        if u <= int(head.since.time or 0):
            continue
        snap = table_rows(shard.snapshot(u - 1))
        want = model_at(sent, u - 1)
        if snap != want:
            divergences.append(f"expected the shard at upper {u} to equal the model: {differ(snap, want)}")
    _ = (pa, pc, TIME, Frontier)

    # 4. the subscribe output equals the model's change stream (when there is one: a run
    #    without a subscribe passes ``msgs=None``).
    got_changes: Counter[Any] = Counter()
    last = 0
    if msgs is not None:
        try:
            check_progress_order(msgs)
        except AssertionError as e:
            divergences.append(f"expected the subscribe's progress statements in order, found {e}")
        progressed = [m["time"] for m in msgs if m["progressed"] and m["time"] is not None]
        last = max(progressed, default=0)
        got_changes = Counter((t, r, d) for t, r, d in changes_of(msgs))
        want_changes: Counter[Any] = Counter()
        for r, d in model_at(sent, 0).items():
            want_changes[(0, r, d)] += 1
        for (r, t), d in model_between(sent, 1, last).items():
            want_changes[(t, r, d)] += 1
        if got_changes != want_changes:
            divergences.append(f"expected the subscribe's output to equal the model's change stream up to {last}: {differ(got_changes, want_changes)}")

    # An append's token is its batch description's: "<sink id>:<epoch>:<lower>[:<nonce>]".
    writers = Counter(t.split(":", 1)[0] for t in tokens)
    summary.update(
        appends=len(appends),
        append_contents_checked=checked_appends,
        uppers_checked=len(picked),
        final_upper=final,
        rows=sum(model_at(sent, final - 1).values()),
        subscribe_messages=len(msgs or []),
        subscribe_changes=sum(got_changes.values()),
        subscribe_last_progress=last,
        appends_by=dict(writers),
        description_lowers_checked=lowers_checked,
    )


if __name__ == "__main__":
    raise SystemExit(main())
