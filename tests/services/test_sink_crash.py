"""Issue 4, test 4: every sink service SIGKILLed at random points and restarted, several times
per run, while a steady workload goes on: no lost or doubled update, a linearizable commit
history whose upper only moves forward, and staged parts that were never appended cleaned up.

The three services run as separate processes (``python -m services.mint`` etc., the mode that
compose and Kubernetes use), each in its own process group so that a kill takes down the
Python driver, its JVM and its Python workers at once, as a container kill would. Each
service rebuilds its state on start from the topics (earliest offsets) and the shard.

The kill schedule comes from a seeded RNG (``SHARDSINK_CRASH_SEED``): which service, how long
after the sink is back in step, how long before the restart. The exact point in a service's
micro-batch where the kill lands is up to timing, which is the point: over runs it hits
decode, staging, reporting, compare-and-append and publishing.

Staged-part accounting at the end, over the data objects of the shard:

* appended: referenced by the head;
* deleted by the services: named in a report on ``batches`` and gone from S3 (the appender's
  DeleteStaged: duplicates of a restarted writer, superseded or outdated descriptions);
* left over but reported: named in a report, not appended, still there: a cleanup the
  services owed and did not do (asserted to be none);
* left over and never reported: a writer killed between staging and reporting; nobody knows
  these parts, so only ``Shard.gc`` can reclaim them: ``gc(grace_ms=0)`` must remove exactly
  these and leave the contents unchanged.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.shard import DIFF, ERROR, TIME, Shard
from shared.state import ShardState

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "record",
    "name": "Row",
    "namespace": "crash",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
PARTITIONS = 3
STEP_TIMES = 10  # each progress step spans 10 times
UPDATES_PER_STEP = 200
STEP_INTERVAL_S = 0.5
KILLS = 5
SEED = int(os.environ.get("SHARDSINK_CRASH_SEED", "4004"))
# Generous: on 2 cores a Spark service starts in about 10 s, but the machine may be shared
# (under a load average of 20 a SparkSession took 50 s to start). Measured: 7 min under a
# load average of ~20 and 15 min under ~35-45 (2 cores); the restarts dominate.
START_TIMEOUT_S = 300.0
BACK_IN_STEP_TIMEOUT_S = 240.0
CONVERGE_TIMEOUT_S = 240.0

Row = tuple[int, str]


# -- the services, as processes ----------------------------------------------------------------


@dataclass
class ServiceProcess:
    """One service (mint, write or append) run as ``python -m services.<name>``."""

    name: str
    sink_id: str
    env: dict[str, str]
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def start(self) -> None:
        self.starts += 1
        log = self.log_dir / f"{self.name}.{self.starts}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{self.name}", "--sink", self.sink_id],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the JVM and workers too
            )

    def kill(self) -> None:
        """SIGKILL the whole process group (driver, JVM, Python workers) and reap it."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)

    def wait_started(self, timeout_s: float) -> None:
        """Wait until this start's query runs (the supervisor logged it: per sink, or the
        shared query of ``SHARDSINK_QUERIES=shared``)."""
        deadline = time.monotonic() + timeout_s
        needles = (f'"msg": "started {self.name} for sink"', f'"msg": "started the shared {self.name} query"')
        while not any(n in self.logs[-1].read_text(errors="replace") for n in needles):
            assert self.alive(), f"expected {self.name} running, found it exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"expected {self.name} to start its query within {timeout_s}s"
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        out = []
        for log in self.logs[-2:]:
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"----- {log.name} (last {lines} lines) -----")
            out.extend(text[-lines:])
        return "\n".join(out)


# -- the workload and its model ----------------------------------------------------------------


@dataclass
class Workload:
    """A steady stream of inserts and retractions at several times per progress step, with a
    model of every update sent (``(row, time, diff)``)."""

    producer: Any
    rng: random.Random
    sent: list[tuple[Row, int, int]] = field(default_factory=list)
    live: Counter[Row] = field(default_factory=Counter)
    next_key: int = 0
    frontier: int = 0
    steps: int = 0

    def step(self) -> int:
        """Send one step's updates at times in ``[frontier, frontier + STEP_TIMES)``, then
        advance the progress past them. Returns the new frontier."""
        lo = self.frontier
        live_rows = [r for r, c in self.live.items() if c > 0]
        for _ in range(UPDATES_PER_STEP):
            t = lo + self.rng.randrange(STEP_TIMES)
            x = self.rng.random()
            if x < 0.35 and live_rows:
                row = live_rows.pop(self.rng.randrange(len(live_rows)))
                diff = -self.live[row]  # retract every copy
            elif x < 0.45 and live_rows:
                row = live_rows.pop(self.rng.randrange(len(live_rows)))
                diff = 1  # a second copy of a live row (each row changes once per step)
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
        self.steps += 1
        return self.frontier

    def model_at(self, as_of: int) -> Counter[Row]:
        out: Counter[Row] = Counter()
        for row, t, d in self.sent:
            if t <= as_of:
                out[row] += d
        return nonzero(out)


def nonzero(c: Counter[Row]) -> Counter[Row]:
    return Counter({r: n for r, n in c.items() if n != 0})


def as_counter(table: pa.Table) -> Counter[Row]:
    """A consolidated table (k, v, _error, _diff) as a Counter; errors are not expected."""
    errors = [e for e in table[ERROR].to_pylist() if e is not None]
    assert errors == [], f"expected no error rows, found {errors[:3]}"
    out: Counter[Row] = Counter()
    for k, v, d in zip(table["k"].to_pylist(), table["v"].to_pylist(), table[DIFF].to_pylist(), strict=True):
        out[(k, v)] += d
    return out


def diff_summary(actual: Counter[Row], expected: Counter[Row]) -> str:
    keys = set(actual) | set(expected)
    bad = sorted((r, actual.get(r, 0), expected.get(r, 0)) for r in keys if actual.get(r, 0) != expected.get(r, 0))
    return f"{len(bad)} rows differ (row, shard, model): {bad[:10]}"


# -- observing the shard ----------------------------------------------------------------------


@dataclass
class UpperWatch:
    """Polls the shard's head in a thread: records every (seqno, upper) seen, so the test can
    check the upper only ever moved forward, in seqno order and in real time."""

    shard: Shard
    seen: list[tuple[float, int, int]] = field(default_factory=list)  # (monotonic, seqno, upper)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def upper(self) -> int:
        return self.seen[-1][2] if self.seen else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                st = self.shard.refresh()
                assert st.upper.time is not None
                if not self.seen or self.seen[-1][1] != st.seqno:
                    self.seen.append((time.monotonic(), st.seqno, st.upper.time))
            except Exception as e:  # noqa: BLE001 - surfaced by the test
                self.errors.append(e)
            self._stop.wait(0.05)

    def start(self) -> UpperWatch:
        self._thread = threading.Thread(target=self._run, name="upper-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wait_upper(self, target: int, timeout_s: float, what: str, procs: list[ServiceProcess]) -> float:
        """Wait until the shard's upper reaches ``target``; returns the seconds waited."""
        t0 = time.monotonic()
        while self.upper() < target:
            if time.monotonic() - t0 > timeout_s:
                dead = [p.name for p in procs if not p.alive()]
                raise AssertionError(
                    f"expected the shard upper to reach {target} within {timeout_s}s ({what}), "
                    f"found {self.upper()}; dead services: {dead}"
                )
            time.sleep(0.05)
        return time.monotonic() - t0


def state_history(shard: Shard, head: ShardState) -> list[ShardState]:
    """Every state object 0..head (the services never GC, so none is missing)."""
    return [ShardState.decode(shard.store.get(shard.state_key(n))) for n in range(head.seqno + 1)]


def batches_reports(kafka: Any, topic: str, sink_id: str) -> list[dict[str, Any]]:
    """Every written-batch report of ``sink_id`` on ``topic``, read from the beginning."""
    from confluent_kafka import TopicPartition

    from shared.codec import message_codec
    from shared.io.kafka import end_offsets, new_consumer

    codec = message_codec("written_batch")
    ends = {p: e for p, e in end_offsets(kafka, topic).items() if e > 0}
    out: list[dict[str, Any]] = []
    if not ends:
        return out
    c = new_consumer(kafka, **{"enable.partition.eof": "true"})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in ends])
        pos = {p: 0 for p in ends}
        deadline = time.monotonic() + 60
        while any(pos[p] < ends[p] for p in ends):
            assert time.monotonic() < deadline, f"expected to read {topic} to {ends}, stuck at {pos}"
            msg = c.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            pos[msg.partition()] = msg.offset() + 1
            d = codec.decode(msg.value())
            if d["sink_id"] == sink_id:
                out.append(d)
    finally:
        c.close()
    return out


def staged_keys(report: dict[str, Any]) -> list[str]:
    staged = report.get("staged_batch")
    if staged is None:
        return []
    handle = json.loads(staged) if isinstance(staged, str) else staged
    return [p["key"] for p in handle["parts"]]


def data_keys(shard: Shard) -> set[str]:
    return {i.key for i in shard.store.list(f"{shard.prefix}data/")}


# -- the test ---------------------------------------------------------------------------------


@pytest.fixture
def crash_setup(stack: EmbeddedStack, unique_id: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from shardsink.cli.catalog import create_collection
    from services.runtime.settings import ServiceSettings
    from shared.catalog import SinkDef
    from shared.io.kafka_admin import ensure_topic

    env = {
        **os.environ,
        **stack.env(),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "300",
        "SHARDSINK_LOG_LEVEL": "DEBUG",
    }
    settings = ServiceSettings.from_env_and_args(None, env)
    collection, sink_id, topic = f"crash-{unique_id}", f"crash-{unique_id}", f"desired-crash-{unique_id}"
    create_collection(settings, collection, SCHEMA)
    ensure_topic(settings.kafka, topic, PARTITIONS)
    # The control topics exist before the services race to create them.
    from services.runner import ensure_control_topics

    ensure_control_topics(settings)
    settings.catalog().create_sink(SinkDef(sink_id, topic, collection))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs = {name: ServiceProcess(name, sink_id, env, log_dir) for name in ("mint", "write", "append")}
    yield {"settings": settings, "collection": collection, "sink_id": sink_id, "topic": topic, "procs": procs}
    for p in procs.values():
        p.kill()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sink_survives_sigkills_of_every_service_without_losing_or_doubling_updates(
    crash_setup: dict[str, Any],
) -> None:
    from shared.io.desired_producer import DesiredProducer

    settings = crash_setup["settings"]
    procs: dict[str, ServiceProcess] = crash_setup["procs"]
    plist = list(procs.values())
    rng = random.Random(SEED)
    shard = Shard.open(settings.store(), crash_setup["collection"])
    watch = UpperWatch(shard).start()
    producer = DesiredProducer(settings.kafka, crash_setup["topic"], SCHEMA)
    workload = Workload(producer, random.Random(rng.random()))
    stop_producing = threading.Event()
    producer_errors: list[BaseException] = []

    def produce() -> None:
        try:
            while not stop_producing.is_set():
                t0 = time.monotonic()
                workload.step()
                stop_producing.wait(max(0.0, STEP_INTERVAL_S - (time.monotonic() - t0)))
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            producer_errors.append(e)

    # Which service each kill hits: every service at least once, the rest at random.
    victims = ["mint", "write", "append"]
    rng.shuffle(victims)
    victims += [rng.choice(["mint", "write", "append"]) for _ in range(KILLS - 3)]
    kills: list[dict[str, Any]] = []
    t_start = time.monotonic()
    producer_thread = threading.Thread(target=produce, name="workload", daemon=True)
    ok = False
    try:
        for p in plist:
            p.start()
        producer_thread.start()
        # In step: the first appends land (every service is up).
        watch.wait_upper(3 * STEP_TIMES, START_TIMEOUT_S, "first start", plist)
        for i, victim in enumerate(victims):
            proc = procs[victim]
            if i % 2 == 0:
                # A kill in steady operation: the sink made progress since the last restart.
                watch.wait_upper(workload.frontier, BACK_IN_STEP_TIMEOUT_S, f"before kill {i}", plist)
            else:
                # A kill that overlaps a recovery: only the victim's query must be running.
                proc.wait_started(BACK_IN_STEP_TIMEOUT_S)
            time.sleep(rng.uniform(0.5, 4.0))  # a random point in the victim's micro-batches
            frontier_at_kill, upper_at_kill = workload.frontier, watch.upper()
            proc.kill()
            t_kill = time.monotonic()
            time.sleep(rng.uniform(0.0, 1.5))
            proc.start()
            kills.append(
                {
                    "victim": victim,
                    "at_s": round(t_kill - t_start, 1),
                    "frontier": frontier_at_kill,
                    "upper": upper_at_kill,
                    "steady": i % 2 == 0,
                }
            )
            assert not producer_errors, f"expected the workload to keep going, found {producer_errors[0]!r}"
        # Back in step after the last restart: the shard catches up with a progress step made
        # after the last kill.
        watch.wait_upper(workload.frontier + STEP_TIMES, BACK_IN_STEP_TIMEOUT_S, "after the last restart", plist)
        stop_producing.set()
        producer_thread.join(timeout=30)
        assert not producer_errors, f"expected the workload to keep going, found {producer_errors[0]!r}"
        final = workload.step()  # one more progress step after the last restart
        watch.wait_upper(final, CONVERGE_TIMEOUT_S, "final convergence", plist)
        time.sleep(3.0)  # the appender processes late and outdated reports
        watch.stop()
        assert not watch.errors, f"expected the shard readable throughout, found {watch.errors[0]!r}"
        head = shard.refresh()
        assert head.upper.time == final, f"expected the upper to stop at the desired frontier {final}, found {head.upper}"

        # 1. No lost or doubled update: contents at upper - 1 equal the model exactly, and so
        #    do the contents at every 10th upper of the history (read once, consolidated).
        snap = shard.snapshot(final - 1)
        expected = workload.model_at(final - 1)
        actual = as_counter(snap)
        assert actual == expected, diff_summary(actual, expected)
        history = state_history(shard, head)
        everything = shard.updates_between(head, 0, head.upper)
        uppers = sorted({s.upper.time for s in history if s.upper.time})
        for u in uppers[:: max(1, len(uppers) // 12)]:
            at = everything.filter(pc.less(everything[TIME], pa.scalar(u, pa.uint64())))
            got = Counter[Row]()
            for k, v, d in zip(at["k"].to_pylist(), at["v"].to_pylist(), at[DIFF].to_pylist(), strict=True):
                got[(k, v)] += d
            want = workload.model_at(u - 1)
            assert nonzero(got) == want, f"at upper {u}: {diff_summary(nonzero(got), want)}"

        # 2. Linearizable history: each state's upper is its predecessor's or the upper of an
        #    append recorded in it that expected exactly the predecessor's upper; tokens are
        #    unique over the whole history (no description appended twice); the upper never
        #    moved backwards, in seqno order or as observed in real time.
        tokens: list[str] = []
        appends = 0
        for prev, cur in zip(history, history[1:], strict=False):
            assert cur.seqno == prev.seqno + 1
            assert prev.upper.less_equal(cur.upper), f"expected the upper to move forward, found {prev.upper} -> {cur.upper} at seqno {cur.seqno}"
            new_records = [r for r in cur.recent if r.seqno == cur.seqno]
            if new_records:
                (rec,) = new_records
                assert rec.expected_upper == prev.upper and rec.new_upper == cur.upper, (
                    f"expected the append at seqno {cur.seqno} to go {prev.upper} -> {cur.upper}, found {rec}"
                )
                tokens.append(rec.token)
                appends += 1
                added = [b for b in cur.batches if b.id not in {x.id for x in prev.batches}]
                assert all(b.lower == prev.upper and b.upper == cur.upper for b in added)
            else:
                assert cur.upper == prev.upper, f"expected an upper change only by an append, found one at seqno {cur.seqno}"
        assert len(tokens) == len(set(tokens)), f"expected unique append tokens, found {Counter(tokens).most_common(3)}"
        recent = [r.token for r in head.recent]
        assert len(recent) == len(set(recent)) and recent == tokens[-len(recent) :]
        seen = [u for _, _, u in watch.seen]
        assert seen == sorted(seen), "expected the observed upper never to move backwards"
        assert [s for _, s, _ in watch.seen] == sorted(s for _, s, _ in watch.seen)

        # 3. Staged parts never appended are cleaned up.
        reports = batches_reports(settings.kafka, settings.batches_topic, crash_setup["sink_id"])
        reported = {k for r in reports for k in staged_keys(r)}
        referenced = head.protected_keys()
        present = data_keys(shard)
        assert referenced <= present, "expected every referenced data object to exist"
        assert referenced <= reported, "expected every appended data object to come from a report"
        deleted_by_services = reported - referenced - present
        left_reported = (present - referenced) & reported
        left_unreported = present - referenced - reported
        # Stop the services before a zero-grace GC (which would also reclaim parts in flight).
        for p in plist:
            p.kill()
        gc = shard.gc(grace_ms=0)
        after = data_keys(shard)
        summary = {
            "seed": SEED,
            "kills": kills,
            "steps": workload.steps,
            "updates": len(workload.sent),
            "rows": sum(expected.values()),
            "appends": appends,
            "reports": len(reports),
            "appended_parts": len(referenced),
            "staged_deleted_by_services": len(deleted_by_services),
            "staged_left_reported": len(left_reported),
            "staged_left_unreported_gc": len(left_unreported),
            "gc_deleted": gc.data_deleted,
            "seconds": round(time.monotonic() - t_start, 1),
        }
        print(json.dumps(summary))
        assert not left_reported, (
            f"expected the appender to delete every reported part it did not append, found "
            f"{len(left_reported)} left: {sorted(left_reported)[:3]}"
        )
        assert gc.data_deleted == len(left_unreported) and after == referenced, (
            f"expected gc to remove exactly the {len(left_unreported)} unreported staged parts, "
            f"found {gc.data_deleted} deleted and {len(after - referenced)} unreferenced left"
        )
        assert as_counter(shard.snapshot(final - 1)) == expected, "expected gc to leave the contents unchanged"
        assert {k["victim"] for k in kills} == {"mint", "write", "append"}
        ok = True
    finally:
        stop_producing.set()
        watch.stop()
        for p in plist:
            p.kill()
        if not ok:
            print(f"kills so far: {kills}", file=sys.stderr)
            for p in plist:
                print(p.tail(), file=sys.stderr)


def test_a_restarted_appender_deletes_the_parts_of_outdated_reports_it_replays(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    """The deterministic core of the cleanup above: an appender killed before it processed a
    report that was already outdated (a restarted writer's second write of a description
    that was appended meanwhile) finds the report again when it replays ``batches`` and
    ``descs`` from the earliest offsets, and deletes the report's parts; the committed parts
    stay. Kafka's micro-batch puts ``batches`` before ``descs``; the appender must still
    know the description is its own."""
    from services.append.service import SinkAppender
    from shardsink.cli.catalog import create_collection
    from services.runtime.settings import ServiceSettings
    from services.sinkio import KIND_CONTROL
    from shared.catalog import SinkDef
    from shared.codec import message_codec
    from shared.frontier import Frontier
    from shared.sink_messages import BatchDescription, BatchReport

    env = {**os.environ, **stack.env(), "SHARDSINK_CHECKPOINT_DIR": str(tmp_path)}
    settings = ServiceSettings.from_env_and_args(None, env)
    collection = f"replay-{unique_id}"
    create_collection(settings, collection, SCHEMA)
    sink = SinkDef(collection, f"desired-{collection}", collection)
    shard = Shard.open(settings.store(), collection)
    d = BatchDescription(sink.sink_id, Frontier.at(0), Frontier.at(10), 1, f"{collection}:1:0", 0, 1)
    committed = shard.stage([({"k": 1, "v": "a"}, 5, 1)])
    shard.compare_and_append_staged([committed], 0, 10, token=d.token)  # appended before the crash
    late = shard.stage([({"k": 1, "v": "a"}, 5, 1)])  # the second write, reported late
    reports = [
        BatchReport.for_description(d, 0, json.dumps(committed.to_json(), sort_keys=True)),
        BatchReport.for_description(d, 0, json.dumps(late.to_json(), sort_keys=True)),
    ]
    table = pa.table(
        {
            "kind": [KIND_CONTROL] * 3,
            "topic": [settings.batches_topic, settings.batches_topic, settings.descs_topic],
            "value": [message_codec("written_batch").encode(r.to_dict()) for r in reports]
            + [message_codec("batch_description").encode(d.to_dict())],
        }
    )
    appender = SinkAppender.create(sink, settings)  # a fresh appender: the replay
    appender.process(table)
    keys = data_keys(shard)
    assert {p.key for p in committed.parts} <= keys, "expected the committed parts kept"
    assert not {p.key for p in late.parts} & keys, "expected the late report's parts deleted"
    assert as_counter(shard.snapshot(9)) == Counter({(1, "a"): 1})
