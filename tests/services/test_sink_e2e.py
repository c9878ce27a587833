"""End-to-end tests of the sink (issue 4, section 4: tests 1, 2, 3, 5 and 6).

The real embedded stack (Tansu broker, moto S3) and real Spark: one :class:`Services`
(mint, write and append in one application, as the embedded default runs them) is started
per module, before any sink exists; every test registers its own collection, desired topic
and sink(s) in the catalog at runtime, and the supervisors pick them up (catalog poll
300 ms). A test drops its sinks when it ends, so their queries stop.

The reference model is the list of desired updates ``(row, time, diff)`` the test produced:
at a shard upper ``u`` the shard's snapshot at ``u - 1`` must equal the updates with
``time < u``, consolidated. Every wait is a poll with a deadline that fails with the sink's
metrics in the message; nothing asserts on elapsed time.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from shardsink.cli.catalog import create_collection
from services.runtime.settings import ServiceSettings
from services.runner import Services
from shared.catalog import SinkDef
from shared.codec import RowCodec
from shared.desired import encode_update
from shared.devstack.embedded import EmbeddedStack
from shared.errors import UpperMismatchError
from shared.io.desired_producer import DesiredProducer
from shared.io.kafka_admin import ensure_topic
from shared.shard import DIFF, ERROR, Shard

SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
#: A second collection's schema (test 6: sinks of different shapes side by side).
ITEM_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Item",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "n", "type": "long"},
        {"name": "tag", "type": ["null", "string"], "default": None},
    ],
}
#: How long one condition may take before the test fails (generous: a shared 2-core box).
DEADLINE_S = 90.0
#: How long a new sink's queries may take to start. Each start spawns a Python source
#: process that Spark gives 10 s (hard-coded) to connect back; on an overloaded machine the
#: supervisors restart the failed queries until one start fits, so allow for a few rounds.
STARTUP_DEADLINE_S = 180.0
POLL_S = 0.1

Row = tuple[Any, ...]


# -- the model --------------------------------------------------------------------------------


def consolidate_model(updates: list[tuple[Row, int, int]], upper: int) -> dict[Row, int]:
    """The desired collection at ``upper - 1``: updates with ``time < upper``, consolidated."""
    acc: Counter[Row] = Counter()
    for row, t, d in updates:
        if t < upper:
            acc[row] += d
    return {r: n for r, n in acc.items() if n != 0}


@dataclass
class Contents:
    upper: int
    rows: dict[Row, int]
    errors: dict[str, int]


def shard_contents(shard: Shard, as_of: int) -> Contents:
    """The shard's snapshot at ``as_of``: good rows ``{row: diff}`` and error rows
    ``{error: diff}`` (the snapshot is consolidated, so every diff is non-zero)."""
    snap = shard.snapshot(as_of)
    cols = shard.row_columns
    rows: dict[Row, int] = {}
    errors: dict[str, int] = {}
    for rec in snap.to_pylist():
        if rec[ERROR] is not None:
            errors[rec[ERROR]] = errors.get(rec[ERROR], 0) + rec[DIFF]
        else:
            row = tuple(rec[c] for c in cols)
            assert row not in rows, f"expected a consolidated snapshot, found {row} twice"
            rows[row] = rec[DIFF]
    return Contents(as_of + 1, rows, errors)


def describe_diff(actual: dict[Row, int], expected: dict[Row, int]) -> str:
    keys = set(actual) | set(expected)
    wrong = sorted(
        (
            (k, expected.get(k, 0), actual.get(k, 0))
            for k in keys
            if actual.get(k, 0) != expected.get(k, 0)
        ),
        key=repr,
    )
    shown = ", ".join(f"{k}: expected {e}, found {a}" for k, e, a in wrong[:10])
    return f"{len(wrong)} rows differ ({shown}{', ...' if len(wrong) > 10 else ''})"


# -- a random workload ------------------------------------------------------------------------


@dataclass
class Workload:
    """Random inserts and retractions of one desired collection, with the model kept beside.

    Within a step, times are non-decreasing in production order and a retraction only takes
    back copies present at that moment, so the collection is a true multiset at every time.
    """

    producer: DesiredProducer
    fields: list[str]
    make_row: Callable[[random.Random], Row]
    rng: random.Random
    updates: list[tuple[Row, int, int]] = field(default_factory=list)
    present: Counter[Row] = field(default_factory=Counter)
    #: Every desired frontier promised so far, in order.
    promised: list[int] = field(default_factory=list)

    @property
    def frontier(self) -> int:
        t = self.producer.frontier.time
        assert t is not None, "expected an open desired frontier"
        return t

    def send(self, row: Row, t: int, d: int) -> None:
        self.producer.send(dict(zip(self.fields, row, strict=True)), t, d)
        self.updates.append((row, t, d))
        self.present[row] += d
        if self.present[row] == 0:
            del self.present[row]

    def step(self, *, n: int = 30, length: int = 3) -> int:
        """Produce ``n`` updates at several times in ``[frontier, frontier + length)``, then
        advance the desired frontier to ``frontier + length``. Returns the new frontier."""
        lo = self.frontier
        times = sorted(self.rng.randrange(lo, lo + length) for _ in range(n))
        for t in times:
            if self.present and self.rng.random() < 0.4:
                row = self.rng.choice(sorted(self.present, key=repr))
                self.send(row, t, -self.rng.randint(1, self.present[row]))
            else:
                self.send(self.make_row(self.rng), t, self.rng.choice((1, 1, 1, 2)))
        self.producer.advance_to(lo + length)
        self.promised.append(lo + length)
        return lo + length

    def model(self, upper: int) -> dict[Row, int]:
        return consolidate_model(self.updates, upper)


def kv_row(rng: random.Random) -> Row:
    return (rng.randrange(40), rng.choice("abc"))


def item_row(rng: random.Random) -> Row:
    return (f"item-{rng.randrange(30)}", rng.randrange(5), rng.choice((None, "red", "blue")))


# -- the harness ------------------------------------------------------------------------------


@dataclass
class Harness:
    settings: ServiceSettings
    services: Services
    sinks: list[str] = field(default_factory=list)

    def collection(
        self, collection_id: str, schema: dict[str, Any], topic: str, partitions: int
    ) -> Shard:
        create_collection(self.settings, collection_id, schema)
        ensure_topic(self.settings.kafka, topic, partitions)
        return Shard.open(self.settings.store(), collection_id)

    def sink(
        self, sink_id: str, topic: str, collection_id: str, *, read_only: bool = False,
        replace_contents: bool = False,
    ) -> None:
        """Register a sink in the catalog while the services run, and wait until every
        service has picked it up and its query has initialized its sources (one sink at a
        time: each query start spawns a Python source process, which Spark gives 10 s to
        connect back; starting them one sink at a time keeps that within reach on a busy
        2-core machine)."""
        self.settings.catalog().create_sink(
            SinkDef(sink_id, topic, collection_id, read_only=read_only, replace_contents=replace_contents)
        )
        self.sinks.append(sink_id)

        def started() -> bool:
            if self.services.fleets:  # shared queries: a member of every service's query
                return all(
                    f.member(sink_id) is not None and f.query is not None and f.query.isActive
                    and f.query.status["message"] != "Initializing sources"
                    for f in self.services.fleets.values()
                )
            for sup in self.services.supervisors:
                runner = sup.running.get(sink_id)
                if runner is None or not runner.query.isActive:
                    return False
                if runner.query.status["message"] == "Initializing sources":
                    return False
            return True

        self.wait_for(
            f"sink {sink_id} picked up by every service",
            started,
            [sink_id],
            deadline_s=STARTUP_DEADLINE_S,
        )

    def workload(
        self,
        topic: str,
        schema: dict[str, Any],
        make_row: Callable[[random.Random], Row],
        seed: int,
    ) -> Workload:
        producer = DesiredProducer(self.settings.kafka, topic, schema)
        return Workload(
            producer, [f["name"] for f in schema["fields"]], make_row, random.Random(seed)
        )

    def diagnostics(self, sink_ids: list[str]) -> str:
        svc = self.services
        out = []
        for sid in sink_ids:
            m = svc.minters.get(sid)
            w = svc.writers.get(sid)
            a = svc.appenders.get(sid)
            out.append(
                f"sink {sid}: minted={getattr(m, 'minted', None)} "
                f"desired_frontier={m.state.desired_frontier if m else None} "
                f"writer={getattr(w, 'metrics', None)} appender={getattr(a, 'metrics', None)}"
            )
        out.append(
            "supervisor restarts: " + ", ".join(f"{s.name}={s.restarts}" for s in svc.supervisors)
            + ", ".join(f"{n}={f.restarts}" for n, f in svc.fleets.items())
        )
        if svc.fleets:
            out.append(f"failing: {svc.failing()}")
        return "; ".join(out)

    def converge(
        self,
        shard: Shard,
        work: Workload,
        sink_ids: list[str],
        *,
        check_above: int = 0,
        expected_errors: Callable[[int], dict[str, int] | None] | None = None,
    ) -> Contents:
        """Poll the shard until its upper reaches the desired frontier. At every upper seen
        beyond ``check_above`` (the upper of a test's own tampering), the snapshot at
        ``upper - 1`` must equal the model and the upper must not exceed the desired
        frontier. ``expected_errors(upper)`` gives the error rows expected there (None: do
        not check them; default: none). Returns the final contents."""
        target = work.frontier
        deadline = time.monotonic() + DEADLINE_S
        seen: int | None = None
        contents = Contents(0, {}, {})
        while True:
            upper = shard.refresh().upper
            assert upper.time is not None, f"expected an open shard upper, found {upper}"
            if upper.time > check_above:
                assert upper.time <= work.frontier, (
                    f"expected the shard upper at or below the desired frontier {work.frontier}, found {upper.time}"
                )
            if upper.time != seen and upper.time > max(0, check_above):
                seen = upper.time
                contents = shard_contents(shard, upper.time - 1)
                expected = work.model(upper.time)
                assert contents.rows == expected, (
                    f"expected the snapshot at {upper.time - 1} to equal the desired collection: "
                    + describe_diff(contents.rows, expected)
                )
                want_errors = expected_errors(upper.time) if expected_errors else {}
                if want_errors is not None:
                    assert contents.errors == want_errors, (
                        f"expected error rows {want_errors}, found {contents.errors}"
                    )
            if upper.time >= target:
                return contents
            if time.monotonic() > deadline:
                pytest.fail(
                    f"expected the shard upper to reach the desired frontier {target} within {DEADLINE_S}s, "
                    f"found {upper.time}; {self.diagnostics(sink_ids)}"
                )
            time.sleep(POLL_S)

    @staticmethod
    def verify_uppers(shard: Shard, work: Workload) -> list[int]:
        """The shard's append history (its recent append records): a contiguous chain of
        uppers from 0, each one a desired frontier the producer had promised, so the upper
        never went beyond the desired frontier, also between the polls. Returns the uppers."""
        records = sorted(shard.refresh().recent, key=lambda r: r.seqno)
        assert records, "expected appends on the shard"
        chain: list[int | None] = [0, *(r.new_upper.time for r in records)]
        lowers = [r.expected_upper.time for r in records]
        assert lowers == chain[:-1], (
            f"expected a contiguous chain of uppers, found {list(zip(lowers, chain[1:]))}"
        )
        uppers = [u for u in chain[1:] if u is not None]
        stray = [u for u in chain[1:] if u not in work.promised]
        assert not stray, (
            f"expected every upper to be a promised desired frontier {work.promised}, found {stray}"
        )
        return uppers

    @staticmethod
    def verify_history(shard: Shard, work: Workload, since: int = 0) -> int:
        """Every time below the shard's upper (from ``since``), not only the uppers a poll
        happened to see: the shard at ``t`` equals the desired collection at ``t`` (the sink
        writes each update at its own time). Returns how many times were checked."""
        upper = shard.refresh().upper.time
        assert upper is not None
        for t in range(since, upper):
            contents = shard_contents(shard, t)
            expected = work.model(t + 1)
            assert contents.rows == expected, (
                f"expected the shard at time {t} (upper {upper}) to equal the desired collection: "
                + describe_diff(contents.rows, expected)
            )
        return upper - since

    def wait_no_orphans(self, shard: Shard, sink_ids: list[str]) -> None:
        """Every data object of the shard is referenced by its head: staged parts that were
        never appended (lost races, outdated descriptions) have been deleted."""
        last: list[str] = []

        def none_left() -> bool:
            nonlocal last
            protected = shard.refresh().protected_keys()
            last = [
                o.key for o in shard.store.list(f"{shard.prefix}data/") if o.key not in protected
            ]
            return not last

        self.wait_for(
            "no unreferenced data objects", none_left, sink_ids, detail=lambda: f"left: {last}"
        )

    def wait_for(
        self,
        what: str,
        cond: Callable[[], bool],
        sink_ids: list[str],
        *,
        detail: Callable[[], str] = lambda: "",
        deadline_s: float = DEADLINE_S,
    ) -> None:
        deadline = time.monotonic() + deadline_s
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"expected {what} within {deadline_s}s {detail()}; {self.diagnostics(sink_ids)}"
                )
            time.sleep(POLL_S)


@contextlib.contextmanager
def services_harness(
    stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory, **extra_env: str
) -> Iterator[Harness]:
    """One Services (mint, write, append), started before any sink exists, on control topics
    of its own (no backlog of other tests to read); ``extra_env`` adds settings."""
    from shared.spark.kafka_connector import register_kafka_source

    register_kafka_source(spark)
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        **stack.env(),
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path_factory.mktemp("sink-e2e-checkpoints")),
        "SHARDSINK_CATALOG_POLL_MS": "300",
        "SHARDSINK_TOPIC_DESCS": f"descs-{tag}",
        "SHARDSINK_TOPIC_BATCHES": f"batches-{tag}",
        "SHARDSINK_TOPIC_FRONTIERS": f"frontiers-{tag}",
        **extra_env,
    }
    settings = ServiceSettings.from_env_and_args(None, env)
    services = Services(settings, spark, ("mint", "write", "append")).start()
    try:
        yield Harness(settings, services)
    finally:
        services.stop()


@pytest.fixture(scope="module")
def running(
    stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    """One Services (mint, write, append) for the module, started before any sink exists."""
    with services_harness(stack, spark, tmp_path_factory) as harness:
        yield harness


@pytest.fixture
def h(running: Harness) -> Iterator[Harness]:
    """The module's harness; the sinks a test creates are dropped when it ends."""
    running.sinks = []
    yield running
    catalog = running.settings.catalog()
    for sid in running.sinks:
        catalog.drop_sink(sid)
    running.sinks = []


# -- 1. contents --------------------------------------------------------------------------------


def test_snapshot_at_every_upper_equals_the_consolidated_desired_collection(
    h: Harness, unique_id: str
) -> None:
    cid, sid, topic = f"c-{unique_id}", f"s-{unique_id}", f"desired-{unique_id}"
    shard = h.collection(cid, SCHEMA, topic, partitions=3)
    h.sink(sid, topic, cid)
    work = h.workload(topic, SCHEMA, kv_row, seed=1)
    for i in range(8):
        work.step(n=40, length=2 + i % 3)
        if i % 2 == 1:  # every other step is produced while the sink is still busy
            h.converge(shard, work, [sid])
    assert shard.refresh().upper.time == work.frontier
    # The uppers the polls saw were checked as they appeared; the history covers them all.
    assert h.verify_uppers(shard, work)[-1] == work.frontier
    assert h.verify_history(shard, work) == work.frontier
    assert shard_contents(shard, work.frontier - 1).errors == {}, "expected no error rows"
    parts = {
        work.producer.partition_of(
            work.producer.rows.encode(dict(zip(work.fields, r, strict=True)))
        )
        for r, _t, _d in work.updates
    }
    assert parts == {0, 1, 2}, f"expected updates in every partition, found {parts}"
    assert any(d < 0 for _r, _t, d in work.updates), "expected the workload to retract rows"
    assert work.model(work.frontier), "expected a non-empty collection at the end"
    h.wait_no_orphans(shard, [sid])


# -- 2. self-correction -------------------------------------------------------------------------


def append_at_upper(shard: Shard, rows: list[tuple[dict[str, Any], int]]) -> int:
    """Append ``(row, diff)`` at the shard's current upper ``u`` as the batch ``[u, u + 1)``,
    retrying when a sink appends first. Returns ``u``."""
    while True:
        u = shard.refresh().upper.time
        assert u is not None
        try:
            shard.compare_and_append([(row, u, d) for row, d in rows], u, u + 1)
            return u
        except UpperMismatchError:
            continue


def test_junk_appended_to_the_shard_is_removed_and_missing_rows_are_restored(
    h: Harness, unique_id: str
) -> None:
    cid, sid, topic = f"c-{unique_id}", f"s-{unique_id}", f"desired-{unique_id}"
    shard = h.collection(cid, SCHEMA, topic, partitions=3)
    h.sink(sid, topic, cid)
    work = h.workload(topic, SCHEMA, kv_row, seed=2)
    work.step(n=40)
    h.converge(shard, work, [sid])

    # While the sink is idle (shard upper == desired frontier): junk rows, a junk error row
    # and the deletion of a real row, appended directly through the storage API.
    junk = {"k": 1000, "v": "junk"}
    real_row = sorted(work.model(work.frontier), key=repr)[0]
    real = dict(zip(work.fields, real_row, strict=True))
    u = work.frontier
    shard.compare_and_append([(junk, u, 3), (None, u, 1, "junk error")], u, u + 1)
    shard.compare_and_append([(real, u + 1, -work.model(u)[real_row])], u + 1, u + 2)
    tampered = shard_contents(shard, u + 1)
    assert tampered.rows.get((1000, "junk")) == 3 and real_row not in tampered.rows, tampered
    assert tampered.errors == {"junk error": 1}

    # The next progress step: the sink corrects the shard at a later time.
    work.step(n=20, length=5)  # beyond the tampered upper u + 2
    contents = h.converge(shard, work, [sid], check_above=u + 2)
    assert (1000, "junk") not in contents.rows and contents.errors == {}
    assert contents.rows[real_row] == work.model(work.frontier)[real_row]

    # Junk appended while the sink is busy, racing the sink's own appends: every upper beyond
    # the last junk batch must be correct again.
    last_junk_upper = 0
    for i in range(2):
        work.step(n=20, length=3)
        last_junk_upper = append_at_upper(shard, [({"k": 2000 + i, "v": "race"}, 1)]) + 1
    work.step(n=10, length=3)
    contents = h.converge(shard, work, [sid], check_above=last_junk_upper)
    assert not [r for r in contents.rows if r[0] >= 2000]
    h.wait_no_orphans(shard, [sid])


# -- 3. two replicas on one shard ---------------------------------------------------------------


def test_two_replicas_one_read_only_then_both_writing_keep_contents_without_doubles(
    h: Harness, unique_id: str
) -> None:
    cid, topic = f"c-{unique_id}", f"desired-{unique_id}"
    first, second = f"s1-{unique_id}", f"s2-{unique_id}"
    shard = h.collection(cid, SCHEMA, topic, partitions=3)
    h.sink(first, topic, cid)
    h.sink(second, topic, cid, read_only=True)
    svc = h.services
    work = h.workload(topic, SCHEMA, kv_row, seed=3)
    both = [first, second]
    h.wait_for(
        "both replicas' queries running",
        lambda: all(s in svc.minters and s in svc.writers and s in svc.appenders for s in both),
        both,
    )

    # Only the first writes: the read-only replica observes and writes nothing.
    for _ in range(2):
        work.step(n=30)
        h.converge(shard, work, both)
    h.wait_for(
        "the read-only writer to process micro-batches",
        lambda: svc.writers[second].metrics.micro_batches > 0,
        both,
    )
    assert svc.minters[second].minted == 0, (
        f"expected no descriptions from a read-only sink, found {svc.minters[second].minted}"
    )
    w2, a2 = svc.writers[second].metrics, svc.appenders[second].metrics
    assert (w2.batches_staged, w2.reports_sent) == (0, 0), (
        f"expected a read-only writer to stage nothing, found {w2}"
    )
    assert (a2.appends, a2.bumps) == (0, 0), (
        f"expected a read-only appender to append nothing, found {a2}"
    )
    assert svc.minters[first].minted > 0 and svc.appenders[first].metrics.appends > 0

    # Writes allowed on the second: both replicas mint, write and race to append. Steps come
    # in pairs, the first produced while the sink is busy, until the second replica's appender
    # has decided on its own descriptions: appended, lost a compare_and_append, or (when the
    # first replica always got there first, so its descriptions were outdated before they were
    # complete) deleted their staged parts. At least twice, at most six pairs.
    h.settings.catalog().allow_writes(second)

    def second_decided() -> int:
        m = svc.appenders[second].metrics
        return m.appends + m.upper_mismatches + m.staged_deleted

    pairs = 0
    while pairs < 2 or second_decided() == 0:
        assert pairs < 6, (
            f"expected the second replica active within 6 steps pairs of allow_writes; {h.diagnostics(both)}"
        )
        work.step(n=30)
        work.step(n=30)
        h.converge(shard, work, both)
        pairs += 1
    assert svc.minters[second].minted > 0
    assert svc.writers[second].metrics.batches_staged > 0, "expected the second replica to write"
    a2 = svc.appenders[second].metrics
    assert second_decided() > 0, f"expected the second replica's appender active, found {a2}"
    # No doubled data at any time of the shard's history, and the loser's parts are gone.
    assert h.verify_uppers(shard, work)[-1] == work.frontier
    assert h.verify_history(shard, work) == work.frontier
    h.wait_no_orphans(shard, both)


# -- 5. bad rows land in the error collection ---------------------------------------------------


def test_bad_rows_and_contract_violations_land_in_the_error_collection(
    h: Harness, unique_id: str
) -> None:
    from confluent_kafka import Producer

    cid, sid, topic = f"c-{unique_id}", f"s-{unique_id}", f"desired-{unique_id}"
    shard = h.collection(cid, SCHEMA, topic, partitions=3)
    h.sink(sid, topic, cid)
    work = h.workload(topic, SCHEMA, kv_row, seed=5)
    work.step(n=30)
    h.converge(shard, work, [sid])

    # At desired frontier f, hand-made messages go after the progress statement of their
    # partition: (a) a row encoded with another schema, at a valid time; (b) bytes that are no
    # desired message at all (they land at the partition's frontier); (c) a well-formed update
    # in its own partition at a time below that partition's progress (a contract violation).
    f = work.frontier
    other = {"type": "record", "name": "Other", "fields": [{"name": "x", "type": "double"}]}
    good_row = work.producer.rows.encode({"k": 7, "v": "late"})
    raw = Producer(h.settings.kafka.config())
    raw.produce(
        topic, value=encode_update(RowCodec(other).encode({"x": 1.5}), f + 1, 1), partition=0
    )
    raw.produce(topic, value=b"\x00not a desired message\xff", partition=1)
    raw.produce(
        topic,
        value=encode_update(good_row, f - 1, 1),
        partition=work.producer.partition_of(good_row),
    )
    assert raw.flush(30) == 0

    work.step(n=30, length=3)
    contents = h.converge(shard, work, [sid], expected_errors=lambda _u: None)  # checked below
    assert sum(contents.errors.values()) == 3 and len(contents.errors) == 3, (
        f"expected 3 error rows, found {contents.errors}"
    )
    kinds = sorted(contents.errors)
    assert sum("does not match the collection schema" in e for e in kinds) == 1, kinds
    assert sum("undecodable desired message" in e for e in kinds) == 1, kinds
    assert (
        sum("beyond the partition's progress" in e and f"time {f - 1}" in e for e in kinds) == 1
    ), kinds
    # Each error keeps what it was about: the late update its source offset, diff and row; the
    # others their bytes.
    late = next(e for e in kinds if "beyond the partition's progress" in e)
    assert f"(update at {topic}/{work.producer.partition_of(good_row)}@" in late, late
    assert late.endswith(', diff 1: row {"k": 7, "v": "late"})'), late
    other_row = RowCodec(other).encode({"x": 1.5})
    assert sum(e.endswith(f"row bytes {other_row.hex()}") for e in kinds) == 1, kinds
    not_a_message = b"\x00not a desired message\xff"
    assert sum(e.endswith(f"message bytes {not_a_message.hex()}") for e in kinds) == 1, kinds
    assert (7, "late") not in contents.rows, "expected the late update in the error collection only"
    m = h.services.writers[sid].metrics
    assert (m.decode_errors, m.contract_violations) == (2, 1), (
        f"expected 2 decode errors and 1 contract violation, found {m}"
    )

    # The errors stay exactly once while the sink goes on (the loop does not rewrite them).
    work.step(n=20)
    again = h.converge(shard, work, [sid], expected_errors=lambda _u: contents.errors)
    assert again.errors == contents.errors


# -- 6. several sinks in the same services ------------------------------------------------------


def test_several_sinks_served_by_the_same_running_services_all_converge(
    h: Harness, unique_id: str
) -> None:
    a_cid, a_sid, a_topic = f"ca-{unique_id}", f"sa-{unique_id}", f"desired-a-{unique_id}"
    b_cid, b_sid, b_topic = f"cb-{unique_id}", f"sb-{unique_id}", f"desired-b-{unique_id}"
    a_shard = h.collection(a_cid, SCHEMA, a_topic, partitions=2)
    b_shard = h.collection(b_cid, ITEM_SCHEMA, b_topic, partitions=4)
    h.sink(a_sid, a_topic, a_cid)
    h.sink(b_sid, b_topic, b_cid)
    a_work = h.workload(a_topic, SCHEMA, kv_row, seed=61)
    b_work = h.workload(b_topic, ITEM_SCHEMA, item_row, seed=62)
    for i in range(3):
        a_work.step(n=25, length=2)
        b_work.step(n=25, length=3 + i % 2)
        h.converge(a_shard, a_work, [a_sid, b_sid])
        h.converge(b_shard, b_work, [a_sid, b_sid])
    assert a_work.frontier != b_work.frontier, "expected the two sinks at different frontiers"
    for shard, work in ((a_shard, a_work), (b_shard, b_work)):
        assert h.verify_uppers(shard, work)[-1] == work.frontier
        assert h.verify_history(shard, work) == work.frontier
    for sup in h.services.supervisors:
        assert {a_sid, b_sid} <= set(sup.running), (
            f"expected {sup.name} to run both sinks, found {sorted(sup.running)}"
        )
