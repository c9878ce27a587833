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
- a command prober, from the first kill to the last network fault: every few seconds
  (``--probe-every-s``) a ``Peek`` of the collection at a time its shard has reached, and an
  ``Append`` of one row to a side collection (created by ``CreateCollection``) at its upper,
  one at a time, each through a ``ControllerClient`` as a user's would (:class:`CommandProber`;
  kills of the controller and network faults are faults for it);
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
  the driver goes through them; the network faults then begin with a partition, a black
  hole, latency and packet loss on that path (``driver``), and each fault's record says how many executors the workers
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
   with progress statements in order;
5. the prober's commands (:class:`CommandLedger`): each peek's rows equal the model at its
   as_of; an error is only a transient one (``Internal``; an append's ``UpperMismatch`` only
   when another append took its time); every command is answered (by the controller, or by
   the client's typed timeout) within ``--answer-bound-s`` after the heal of the faults around
   it; the side collection holds exactly one row per time, of the append that expected it,
   every acknowledged append's and none refused for good.

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
#: executors, partitioned, black-holed, slowed and lossy.
DRIVER_NETWORK_FAULTS = (("partition", "driver"), ("blackhole", "driver"), ("latency", "driver"), ("loss", "driver"))
#: Network faults of a full campaign and of a quick one.
FULL_NETWORK_FAULTS, QUICK_NETWORK_FAULTS = 30, 3
#: A latency fault's delay per chunk, and its jitter (ms): each way, so a round trip gains
#: 200 ms on average (issue 32: "200 ms of added latency with jitter").
LATENCY_MS, LATENCY_JITTER_MS = 100.0, 50.0
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


# -- the command prober ---------------------------------------------------------------------------
#
# Commands and peeks go to the controller while the faults run (issue 32: "while commands and
# peeks go to the controller"), through a ControllerClient as a user's would. The rules: a
# command sent during a fault may be answered late, or with a typed error (the client's own
# timeout, or an Error of kind Internal: a transient failure), never wrongly; once the faults
# have healed every command is answered within a bound; a peek's rows equal the model's at
# its as_of; an append is applied iff it was acknowledged (its outcome is unknown only after
# an Internal error or no answer).

#: Error kinds an answer may carry during a fault: a transient failure (S3 or Kafka unreachable,
#: an outcome unknown). Any other kind, for a peek at a time the shard has reached or for an
#: append at the side collection's upper, is a wrong answer.
TRANSIENT_ERROR_KINDS = frozenset({"Internal"})
#: Seconds, after the fault around it heals, within which a command must be answered (in a
#: quick run, which must not fail on a loaded CI machine, more: see BENCHMARKS.md).
FULL_ANSWER_BOUND_S, QUICK_ANSWER_BOUND_S = 30.0, 90.0
#: The prober sends no more commands while this many are unanswered (a user would wait too;
#: enough for a command every 2 s through a fault of 10 s on a controller already behind).
MAX_IN_FLIGHT = 8


@dataclass
class CommandRecord:
    """One command the prober sent, and what became of it (times are wall-clock seconds, the
    clock of the responses' ``emitted_at_ms``)."""

    kind: str  # "peek" or "append"
    command_id: str
    sent_at: float
    #: peek: the time read at; append: the side collection's upper it expects (its row's time)
    as_of: int
    #: append: the value of its row (``probe-<n>``), which says which append filled a time
    tag: str | None = None
    answered_at: float | None = None
    #: "ok", "error:<Error.kind>", or None while unanswered
    outcome: str | None = None
    #: the client's own typed error when the send was not acknowledged in time (the command
    #: may still arrive: librdkafka keeps it queued), and when it was raised
    client_error: str | None = None
    client_error_at: float | None = None
    #: peek: whether its rows equal the model's at as_of (None: not a PeekResult)
    equal: bool | None = None
    note: str | None = None

    def settled(self) -> bool:
        return self.answered_at is not None

    def told_at(self) -> float | None:
        """When the user was answered: by the controller, else by the client's typed error."""
        return self.answered_at if self.answered_at is not None else self.client_error_at

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def answer_due(sent_at: float, faults: list[tuple[float, float]], bound_s: float) -> float:
    """When a command sent at ``sent_at`` must have been answered: ``bound_s`` seconds of no
    fault after its send; a fault that begins before then (or is on at the send) pushes the
    start of those seconds to its heal. ``faults`` are ``(start, heal)`` wall-clock times."""
    t = sent_at
    for start, heal in sorted(faults):
        if heal <= t:
            continue
        if start > t + bound_s:
            break
        t = heal
    return t + bound_s


def side_row(slot: int, n: int) -> Row:
    """The row the prober's ``n``-th append writes at time ``slot`` of the side collection
    (one row per time: its value says which append filled it)."""
    return (slot, f"probe-{n}")


def peek_rows_of(response: dict[str, Any], settings: Any = None) -> Counter[Row]:
    """A PeekResult's rows as a Counter, read as the CLI reads them: inline, or from the S3
    object (or folder) it names, through ``settings`` (the checker's unfaulted path)."""
    from shardsink.cli.data import _stored_rows
    from tests.controller_fixture import ROWS

    kind, res = response["body"][1]["result"]
    if kind.endswith("InlineRows"):
        out: Counter[Row] = Counter()
        for rc in res["rows"]:
            row = ROWS.decode(rc["row"])
            out[(row["k"], row["v"])] += int(rc["count"])
        return Counter({r: n for r, n in out.items() if n != 0})
    return table_rows(_stored_rows(settings, res))


class CommandLedger:
    """The prober's record of its commands and their answers, and the rules they are judged by
    (in memory, thread-safe). ``updates`` returns the campaign model's updates so far (the
    workload's ``sent``): a peek's rows are compared with :func:`model_at` of them."""

    def __init__(self, updates: Any, bound_s: float) -> None:
        self.updates = updates
        self.bound_s = bound_s
        self.records: dict[str, CommandRecord] = {}
        self.order: list[str] = []
        #: (start, heal) of every fault that can keep the controller from answering
        self.faults: list[tuple[float, float]] = []
        self.open_fault: float | None = None
        self.lock = threading.Lock()

    def fault_began(self, at: float) -> None:
        with self.lock:
            self.open_fault = at

    def fault_healed(self, at: float) -> None:
        with self.lock:
            if self.open_fault is not None:
                self.faults.append((self.open_fault, at))
                self.open_fault = None

    def sent(self, kind: str, command_id: str, at: float, as_of: int, tag: str | None = None) -> CommandRecord:
        rec = CommandRecord(kind, command_id, at, as_of, tag)
        with self.lock:
            self.records[command_id] = rec
            self.order.append(command_id)
        return rec

    def send_failed(self, command_id: str, error: BaseException, at: float) -> None:
        with self.lock:
            rec = self.records[command_id]
            rec.client_error, rec.client_error_at = type(error).__name__, at

    def _faults(self, now: float) -> list[tuple[float, float]]:
        """The faults, one still on ending at ``now`` (call with the lock held)."""
        return self.faults + ([(self.open_fault, now)] if self.open_fault is not None else [])

    def due(self, rec: CommandRecord) -> float:
        """When ``rec`` must be answered, as far as is known now (a fault still on: never)."""
        with self.lock:
            return answer_due(rec.sent_at, self._faults(float("inf")), self.bound_s)

    def answered(self, response: dict[str, Any], at: float, rows_of: Any) -> CommandRecord | None:
        """Absorb a response (the first one per command counts; a replay is ignored);
        ``rows_of(response)`` reads a PeekResult's rows as a Counter of rows."""
        from shared.io.controller_client import body_kind

        rec = self.records.get(str(response.get("command_id")))
        if rec is None or rec.settled():
            return None
        kind, body = body_kind(response), response["body"][1]
        equal, note = None, None
        if kind == "Error":
            outcome = f"error:{body['kind']}"
            # An append's UpperMismatch is right iff another append filled its time after the
            # prober read the upper (one whose outcome it could not know): :meth:`check_side`.
            if body["kind"] not in TRANSIENT_ERROR_KINDS and (rec.kind, body["kind"]) != ("append", "UpperMismatch"):
                note = f"{body['kind']}: {body['message']}"
        elif rec.kind == "peek" and kind == "PeekResult":
            outcome = "ok"
            if int(body["as_of"]) != rec.as_of:
                equal, note = False, f"expected a PeekResult as of {rec.as_of}, found one as of {body['as_of']}"
            else:
                try:
                    got = rows_of(response)
                except Exception as e:  # noqa: BLE001 - an answer that cannot be read is wrong
                    got, note = None, f"expected a readable PeekResult, found {e!r}"
                want = model_at(list(self.updates()), rec.as_of)
                equal = got == want
                if got is not None and not equal:
                    note = differ(got, want)
        elif rec.kind == "append" and kind == "Ack":
            outcome = "ok"
        else:
            outcome, note = f"unexpected:{kind}", f"expected an answer to a {rec.kind}, found a {kind}"
        with self.lock:
            rec.answered_at, rec.outcome, rec.equal, rec.note = at, outcome, equal, note
        return rec

    def unanswered(self) -> int:
        """How many commands the user has no answer to yet, and may still have one in time."""
        now = time.time()
        with self.lock:
            faults = self._faults(float("inf"))
            return sum(1 for r in self.records.values()
                       if r.told_at() is None and answer_due(r.sent_at, faults, self.bound_s) >= now)

    def pending_due(self) -> float | None:
        """The latest due time of a command the user has no answer to (None: none)."""
        with self.lock:
            faults = self._faults(float("inf"))
            dues = [answer_due(r.sent_at, faults, self.bound_s) for r in self.records.values() if r.told_at() is None]
        return max(dues, default=None)

    def judge(self, now: float) -> tuple[dict[str, Any], list[str]]:
        """The figures of the summary, and a divergence for each broken rule: a wrong peek, a
        wrong error, a command not answered (by the controller, or by the client's typed
        error) within ``bound_s`` after the faults around it healed (judged only once that
        time has passed by ``now``)."""
        bound_s = self.bound_s
        with self.lock:
            recs = [self.records[c] for c in self.order]
            faults = self._faults(now)
        divergences: list[str] = []
        latencies = sorted(r.answered_at - r.sent_at for r in recs if r.answered_at is not None)
        late = []
        pending = during = 0
        heal_to_answer = []
        for r in recs:
            due = answer_due(r.sent_at, faults, bound_s)
            told = r.told_at()
            if told is None and due > now:
                pending += 1
            elif told is None or told > due:
                late.append(r)
            heal = next((h for start, h in faults if start <= r.sent_at < h), None)
            if heal is not None:  # sent during a fault: its answer timed from that fault's heal
                during += 1
                if r.answered_at is not None:
                    heal_to_answer.append(max(0.0, r.answered_at - heal))
        mismatches = [r for r in recs if r.equal is False]
        wrong = [r for r in recs if r.note is not None and r.equal is None]
        for r in mismatches[:5]:
            divergences.append(f"expected the peek {r.command_id} at as_of {r.as_of} to equal the model: {r.note}")
        for r in wrong[:5]:
            divergences.append(f"expected the {r.kind} {r.command_id} answered rightly or with a transient error, found {r.note}")
        if late:
            r = late[0]
            told = r.told_at()
            found = "none" if told is None else f"one {told - r.sent_at:.1f} s after its send"
            divergences.append(
                f"expected every command answered within {bound_s:.0f} s of the heal of the faults around it, found "
                f"{len(late)} not: the first, a {r.kind} sent {r.sent_at - recs[0].sent_at:.1f} s into the probe, "
                f"answered by {found}")
        outcomes = Counter(f"{r.kind} {r.outcome or ('client:' + r.client_error if r.client_error else 'none')}" for r in recs)

        def q(p: float) -> float | None:
            if not latencies:
                return None
            return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2)

        figures = {
            "commands_sent": len(recs),
            "commands_answered": len(latencies),
            "commands_client_errors": sum(1 for r in recs if r.client_error is not None),
            "commands_unanswered_after_heal": len(late),
            "commands_pending_at_end": pending,
            "commands_during_faults": during,
            "commands_by_outcome": dict(sorted(outcomes.items())),
            "commands_wrong_errors": len(wrong),
            "peeks_checked": sum(1 for r in recs if r.equal is not None),
            "peek_mismatches": len(mismatches),
            "command_answer_p50_s": q(0.5),
            "command_answer_p99_s": q(0.99),
            "command_answer_max_s": round(latencies[-1], 2) if latencies else None,
            "command_heal_to_answer_max_s": round(max(heal_to_answer), 2) if heal_to_answer else None,
            "command_answer_bound_s": bound_s,
        }
        return figures, divergences

    def check_side(self, updates: Counter[tuple[Row, int]]) -> tuple[int, list[str]]:
        """The side collection's updates (``((k, v), time) -> diff``) against the appends'
        answers: one row per time, at the time its append expected; an acknowledged append's
        row there; none of an append refused with a determinate error. Returns how many rows
        landed, and the divergences."""
        with self.lock:
            appends = {r.tag: r for r in self.records.values() if r.kind == "append"}
        out: list[str] = []
        landed: set[str] = set()
        at: dict[int, str] = {}
        for ((k, v), t), d in sorted(updates.items(), key=str):
            rec = appends.get(v)
            if d != 1 or k != t or rec is None or rec.as_of != t:
                out.append(f"expected one row per time of the side collection, written by the append that "
                           f"expected that time, found ({k}, {v!r}) at {t} x{d}")
                continue
            landed.add(v)
            at[t] = v
            if rec.outcome is not None and rec.outcome != "ok" and rec.outcome.split(":", 1)[-1] not in TRANSIENT_ERROR_KINDS:
                out.append(f"expected the append {rec.command_id} refused with {rec.outcome} to have no effect, "
                           f"found its row at {t}")
        for tag, rec in appends.items():
            if rec.outcome == "ok" and tag not in landed:
                out.append(f"expected the acknowledged append {rec.command_id} to have landed at {rec.as_of}, found it absent")
            if rec.outcome == "error:UpperMismatch" and at.get(rec.as_of) in (None, tag):
                out.append(f"expected the append {rec.command_id} refused with UpperMismatch to find its time "
                           f"{rec.as_of} taken by another append, found {at.get(rec.as_of)!r} there")
        return len(landed), out[:5]


class CommandProber:
    """A thread that sends the controller a ``Peek`` of the collection (at a time the shard
    has reached) and an ``Append`` to a side collection every ``every_s`` seconds, through its
    own :class:`ControllerClient`, and records each in a :class:`CommandLedger`. Sending is on
    a second thread (``ControllerClient.send`` blocks up to 30 s while the broker cannot be
    reached), so answers are timed as they arrive."""

    def __init__(self, ledger: CommandLedger, client: Any, collection: str, side: Any, recorder: StateRecorder,
                 settings: Any, rng: random.Random, every_s: float) -> None:
        self.ledger, self.client, self.collection, self.side = ledger, client, collection, side
        self.recorder, self.settings, self.rng, self.every_s = recorder, settings, rng, every_s
        self.appends = 0
        self.errors: list[BaseException] = []
        self._outbox: list[tuple[str, str, bytes, int, str | None]] = []
        self._wake = threading.Condition()
        self._sending = threading.Event()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._guard, args=(f,), name=f"prober-{f.__name__}", daemon=True)
                         for f in (self._probe, self._send)]

    def start(self) -> CommandProber:
        self._sending.set()
        for t in self._threads:
            t.start()
        return self

    def stop_sending(self) -> None:
        """No more commands; the answers of those sent are still awaited (:meth:`finish`)."""
        self._sending.clear()

    def finish(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every command is answered or past its due time,
        then stop both threads."""
        self.stop_sending()
        self._threads[0].join(timeout_s)
        self._done.set()
        with self._wake:
            self._wake.notify_all()
        for t in self._threads:
            t.join(35)

    def _guard(self, f: Any) -> None:
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - reported in the summary
            self.errors.append(e)
            log(f"the command prober failed: {e!r}")

    def rows_of(self, response: dict[str, Any]) -> Counter[Row]:
        return peek_rows_of(response, self.settings)

    def _probe(self) -> None:
        from tests.controller_fixture import append_body

        next_at = time.monotonic()
        append_cid: str | None = None
        while not self._done.is_set():
            for r in self.client.poll(0.2):
                self.ledger.answered(r, time.time(), self.rows_of)
            if not self._sending.is_set():
                due = self.ledger.pending_due()
                with self._wake:
                    queued = bool(self._outbox)
                if not queued and (due is None or time.time() > due):
                    return
                continue
            if time.monotonic() < next_at:
                continue
            with self._wake:
                if self._outbox:
                    continue  # the sender is held up (the broker unreachable): no pile-up
            if self.ledger.unanswered() >= MAX_IN_FLIGHT:
                continue  # the controller is held up: a user would wait too
            next_at = time.monotonic() + self.every_s
            head = self.recorder.states.get(max(self.recorder.states, default=-1))
            if head is not None and head.upper.time:
                upper, since = int(head.upper.time), int(head.since.time or 0)
                as_of = max(since, upper - 1 - self.rng.randrange(min(upper, 3 * STEP_TIMES)))
                self._queue("peek", "Peek", {"collection_id": self.collection, "as_of": as_of, "limit": None,
                                             "max_inline_bytes": None}, as_of)
            # One append at a time: the next once the last is answered (or past its due time),
            # at the side collection's upper as the checker reads it.
            last = self.ledger.records.get(append_cid) if append_cid else None
            if append_cid is None or last is not None and (
                    last.told_at() is not None or time.time() > self.ledger.due(last)):
                try:
                    slot = int(self.side.refresh().upper.time or 0)
                except Exception as e:  # noqa: BLE001 - the checker's S3 path is not faulted; try again
                    log(f"prober: reading the side collection's upper failed: {e!r}")
                    continue
                row = side_row(slot, self.appends)
                self.appends += 1
                append_cid = self._queue("append", "Append", append_body(
                    self.side.shard_id, [({"k": row[0], "v": row[1]}, slot, 1)], slot + 1, slot), slot, row[1])

    def _queue(self, kind: str, command: str, body: dict[str, Any], as_of: int, tag: str | None = None) -> str:
        cid, value = self.client.encode(command, body)
        with self._wake:
            self._outbox.append((kind, cid, value, as_of, tag))
            self._wake.notify()
        return cid

    def _send(self) -> None:
        from shared.errors import ShardsinkError

        while True:
            with self._wake:
                while not self._outbox and not self._done.is_set():
                    self._wake.wait(1.0)
                if self._done.is_set():
                    return
                kind, cid, value, as_of, tag = self._outbox[0]
            self.ledger.sent(kind, cid, time.time(), as_of, tag)
            try:
                self.client.send_raw(value)
            except ShardsinkError as e:  # a typed error of the client (KafkaTimeoutError)
                self.ledger.send_failed(cid, e, time.time())
            with self._wake:
                self._outbox.pop(0)


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
    ap.add_argument("--probe-every-s", type=float, help="seconds between the command prober's peeks and appends through the controller, from the kills to the last network fault (default 4, quick 2; 0: no prober)")
    ap.add_argument("--answer-bound-s", type=float, help=f"seconds after a heal within which every command must be answered (default {FULL_ANSWER_BOUND_S:.0f}, quick {QUICK_ANSWER_BOUND_S:.0f})")
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
    probe_every_s = args.probe_every_s if args.probe_every_s is not None else (2.0 if args.quick else 4.0)
    answer_bound_s = args.answer_bound_s or (QUICK_ANSWER_BOUND_S if args.quick else FULL_ANSWER_BOUND_S)
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
    from tests.controller_fixture import SCHEMA, check_progress_order, changes_of, create_body, read_subscribe

    summary: dict[str, Any] = {"seed": args.seed, "layout": layout, "faults": args.faults, "quick": args.quick,
                               "cluster": args.cluster}
    divergences: list[str] = []
    t_run = time.monotonic()
    with EmbeddedStack(net_faults=net_wanted > 0, net_loss=loss_planned) as stack, contextlib.ExitStack() as on_cluster:
        cluster = driver_path = None
        if args.cluster:
            cluster = on_cluster.enter_context(SparkStandalone(workers=2, cores=1, log_dir=work / "logs" / "spark"))
            driver_path = on_cluster.enter_context(DriverFaultPath(loss_path=loss_planned))
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
        # The command prober's record (its thread starts with the kills): faults are noted in
        # it as they begin and heal, a kill of the controller among them.
        ledger = CommandLedger(lambda: workload.sent, answer_bound_s)
        prober: CommandProber | None = None
        side = f"chaos-{run}-side"
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
            ledger.fault_began(time.time())
            # The driver's path is faulted as a whole (DriverFaultPath: both of its proxies),
            # the others proxy by proxy; both answer the same five calls.
            targets: list[Any] = [driver_path] if path == "driver" else list(proxies)
            for target in targets:
                assert target is not None
                if fault == "partition":
                    target.partition()
                elif fault == "blackhole":
                    target.blackhole()
                elif fault == "loss":
                    target.loss(LOSS_PERCENT)
                else:
                    target.latency(LATENCY_MS, LATENCY_JITTER_MS)
            while time.monotonic() - t0 < seconds:
                reap()
                time.sleep(0.1)
            at_heal = recorder.reached[-1][1] if recorder.reached else 0
            for target in targets:
                target.heal()
            t_heal = time.monotonic()
            ledger.fault_healed(time.time())
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
            # The prober's side collection, asked for now: the answer is awaited when it starts.
            side_cid = client.send("CreateCollection", create_body(side)) if probe_every_s > 0 else None
            producer_thread.start()
            if not wait_upper(2 * STEP_TIMES, 600, "first appends"):
                raise TimeoutError("the sink never started")
            # The shard holds a's rows by now; b reads the same topic, the whole truth.
            catalog.create_sink(SinkDef(sink_b, topic, collection, read_only=True, replace_contents=True))
            log(f"in step (upper {recorder.upper()}); read-only replica {sink_b} created; starting the kills")
            if side_cid is not None:
                prober = start_prober(clean, client, side_cid, commands, responses, side, collection, ledger,
                                      recorder, random.Random(rng.random()), probe_every_s, reap)
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
                if victim == "controller":  # no answers until it is back: a fault for the prober
                    ledger.fault_began(time.time())
                s.kill()
                s.kills += 1
                time.sleep(rng.uniform(0.0, 1.5))
                s.start()
                if victim == "controller":
                    ledger.fault_healed(time.time())
                kills.append(at)
                if (i + 1) % 10 == 0 or args.quick:
                    log(f"{i + 1}/{len(order)} kills; last {victim}; upper {recorder.upper()}, frontier {workload.frontier}")
            if switched_at is None:
                catalog.allow_writes(sink_b)
                switched_at = recorder.upper()
            for j, (fault, path, seconds) in enumerate(network_plan(net_wanted, args.quick, rng, args.cluster)):
                no_loss = stack.loss_unavailable or (
                    next((p.loss_unavailable for p in driver_path.proxies if p.loss_unavailable), None)
                    if path == "driver" and driver_path is not None else None)
                if fault == "loss" and no_loss:
                    net_skipped.append({"fault": fault, "path": path, "reason": no_loss})
                    continue
                wait_upper(workload.frontier, 300, f"progress before network fault {j}")
                net_faults.append(network_fault(fault, path, seconds))
                log(f"{j + 1}/{net_wanted} network faults")
            if prober is not None:  # the answers of the commands sent are still awaited
                prober.stop_sending()
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
            if prober is not None:
                due = ledger.pending_due()
                prober.finish(min(900.0, max(0.0, (due or 0.0) - time.time()) + 5.0))
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
            if prober is not None:
                prober.finish(0.0)
                prober.client.close()
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
        if prober is not None:
            report_commands(summary, divergences, ledger, prober, clean, side, work / "commands.jsonl")
            if prober.errors and exit_code == 0:
                summary["error"] = f"the command prober failed: {prober.errors[0]!r}"
                exit_code = 2
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
        f"{summary.get('subscribe_changes', 0)} subscribe changes, {summary.get('commands_sent', 0)} commands "
        f"({summary.get('peek_mismatches', 0)} wrong peeks, {summary.get('commands_unanswered_after_heal', 0)} "
        f"unanswered after a heal), {len(divergences)} divergences",
        file=sys.stderr,
    )
    print(json.dumps(summary, default=str))
    return exit_code or (0 if ok else 1)


def start_prober(clean: Any, client: Any, cid: str, commands: str, responses: str, side: str, collection: str,
                 ledger: CommandLedger, recorder: StateRecorder, rng: random.Random, every_s: float,
                 reap: Any) -> CommandProber:
    """Await the side collection (``CreateCollection`` ``cid``, sent on ``client``; the same
    definition is acknowledged again, so a try that failed is simply sent again), then start
    the prober on a client of its own."""
    from shared.io.controller_client import ControllerClient, body_kind
    from shared.shard import Shard
    from tests.controller_fixture import create_body

    deadline = time.monotonic() + 600
    while True:
        while not client.responses(cid) and time.monotonic() < deadline:
            reap()
            client.poll(0.5)
        got = client.responses(cid)
        if got and body_kind(got[0]) == "Ack":
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected the side collection {side!r} created within 600 s, found {got}")
        log(f"CreateCollection {side}: {got[0] if got else 'no answer'}; sending it again")
        cid = client.send("CreateCollection", create_body(side))
    own = ControllerClient(clean.kafka, commands_topic=commands, responses_topic=responses)
    prober = CommandProber(ledger, own, collection, Shard.open(clean.store(), side), recorder, clean, rng, every_s)
    log(f"side collection {side} created; the command prober starts (every {every_s} s)")
    return prober.start()


def report_commands(summary: dict[str, Any], divergences: list[str], ledger: CommandLedger, prober: CommandProber,
                    clean: Any, side: str, path: Path) -> None:
    """The prober's figures and divergences (see :class:`CommandLedger`), the side
    collection's contents against its appends' answers, and every command in ``path``."""
    from shared.shard import Shard

    figures, found = ledger.judge(time.time())
    summary.update(figures)
    divergences += found
    try:
        shard = Shard.open(clean.store(), side)
        head = shard.refresh()
        landed, wrong = ledger.check_side(table_updates(shard.updates_between(head, 0, head.upper)))
        summary.update(side_appends_landed=landed, side_upper=int(head.upper.time or 0))
        divergences += wrong
    except Divergence as e:
        divergences.append(f"the side collection: {e}")
    except Exception as e:  # noqa: BLE001 - the run's own error, if any, is the one reported
        log(f"reading the side collection failed: {e!r}")
    with open(path, "w") as out:
        t0 = min((r.sent_at for r in ledger.records.values()), default=0.0)
        for cid in ledger.order:
            rec = ledger.records[cid].to_json()
            for k in ("sent_at", "answered_at", "client_error_at"):
                if k in rec:
                    rec[k] = round(rec[k] - t0, 3)
            out.write(json.dumps(rec) + "\n")
    summary["commands_log"] = str(path)


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
