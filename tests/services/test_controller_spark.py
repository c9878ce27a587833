"""The controller's data-heavy work as Spark jobs on a standalone cluster (issue 13).

One controller process (``python -m services.controller``, as deployed) runs with
``SHARDSINK_CONTROLLER_SPARK_MASTER`` pointing at a master and two one-core workers started
from the pyspark wheel, and a threshold of 0 bytes, so that every merge, gc sweep, peek and
subscribe snapshot is a Spark job; its metrics say that they ran there (none fell back to the
controller's process). A collection with retractions, multiplicities and error rows:

- compaction on the cluster keeps the snapshot at every readable time equal to the one before
  compaction and to a model, with the batch count logarithmic in the appends;
- gc sweeps on the cluster delete what no state references (retired parts past their grace,
  a stray object) and nothing the head references;
- a peek answered by Spark (a folder of Parquet objects) equals the in-process snapshot, with
  ``limit`` and with rows inline;
- a subscribe's snapshot computed by Spark gives the very messages, in the very order, that
  the in-process step gives.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.runtime.settings import ServiceSettings
from services.controller.subscribes import SubscribesRoom, encode_changes
from shared.codec import RowCodec, message_codec
from shared.devstack.embedded import EmbeddedStack, SparkStandalone, late_bound_port
from shared.frontier import Frontier
from shared.io.controller_client import ControllerClient, body_kind
from shared.io.kafka_admin import ensure_topic
from shared.shard import DIFF, ERROR, Shard
from shared.state import FANOUT, check_invariants, plan_merge
from tests.controller_fixture import create_body, lag, read_subscribe, valid_from

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "record",
    "name": "Order",
    "fields": [{"name": "k", "type": "long"}, {"name": "s", "type": ["null", "string"]},
               {"name": "x", "type": "double"}],
}
ROWS = RowCodec(SCHEMA)
APPENDS = 16
GRACE_MS = 4000


@dataclass
class SparkController:
    proc: subprocess.Popen[bytes]
    client: ControllerClient
    settings: ServiceSettings
    metrics_port: int
    log: Path

    def jobs(self) -> Counter[tuple[str, str]]:
        """``shardsink_controller_spark_jobs_total`` by (kind, outcome), from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: Counter[tuple[str, str]] = Counter()
        for kind, outcome, n in re.findall(
            r'^shardsink_controller_spark_jobs_total\{kind="(\w+)",outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M
        ):
            out[(kind, outcome)] = int(float(n))
        return out

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.poll() is None, f"expected the controller running, found it exited:\n{self.tail()}"
        r = self.client.call(kind, body, timeout_s=180)
        assert body_kind(r) != "Error", f"{r}\n{self.tail()}"
        return r


@pytest.fixture(scope="module")
def controller(stack: EmbeddedStack, standalone_cluster: SparkStandalone,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkController]:
    u = uuid.uuid4().hex[:10]
    port = late_bound_port()
    env = {
        **os.environ,
        **stack.env(),
        "SHARDSINK_S3_PREFIX": f"ctl-spark-{u}",
        "SHARDSINK_TOPIC_COMMANDS": f"commands-{u}",
        "SHARDSINK_TOPIC_RESPONSES": f"responses-{u}",
        "SHARDSINK_CONTROLLER_SPARK_MASTER": standalone_cluster.master_url,
        "SHARDSINK_CONTROLLER_SPARK_MIN_BYTES": "0",
        "SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS": "0",
        "SHARDSINK_GC_INTERVAL_MS": "5000",
        "SHARDSINK_STAGED_GRACE_MS": str(GRACE_MS),
        "SHARDSINK_METRICS_PORT": str(port),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    settings = ServiceSettings.from_env_and_args(None, env)
    ensure_topic(settings.kafka, env["SHARDSINK_TOPIC_COMMANDS"], 1)
    ensure_topic(settings.kafka, env["SHARDSINK_TOPIC_RESPONSES"], 1)
    log = tmp_path_factory.mktemp("controller") / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.controller"], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    client = ControllerClient(settings.kafka, commands_topic=env["SHARDSINK_TOPIC_COMMANDS"],
                              responses_topic=env["SHARDSINK_TOPIC_RESPONSES"])
    try:
        yield SparkController(proc, client, settings, port, log)
    finally:
        client.close()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def row(k: int, s: str | None = "apple", x: float = 1.0) -> dict[str, Any]:
    return {"k": k, "s": s, "x": x}


def workload() -> list[list[tuple[Any, ...]]]:
    """Updates per time: inserts, retractions of earlier rows, multiplicities, error rows."""
    out: list[list[tuple[Any, ...]]] = []
    for t in range(APPENDS):
        ups: list[tuple[Any, ...]] = [(row(t * 50 + i, f"s-{(t * 50 + i) % 13}", i * 0.25), t, 1) for i in range(50)]
        if t:
            ups += [(row((t - 1) * 50 + i, f"s-{((t - 1) * 50 + i) % 13}", i * 0.25), t, -1) for i in range(0, 50, 3)]
        ups += [(row(100_000 + t % 5, None, -0.0), t, 2), (row(100_000 + (t + 2) % 5, None, -0.0), t, -1)]
        if t % 4 == 1:
            ups.append((None, t, 1, f"bad: field k at time {t}"))
        if t % 4 == 3:
            ups.append((None, t, -1, f"bad: field k at time {t - 2}"))
            ups.append((None, t, 3, "bad: always the same"))
        out.append(ups)
    return out


def model_at(updates: list[list[tuple[Any, ...]]], as_of: int) -> Counter[Any]:
    acc: Counter[Any] = Counter()
    for ups in updates:
        for u in ups:
            if u[1] <= as_of:
                key = ("err", u[3]) if u[0] is None else ("ok", u[0]["k"], u[0]["s"], repr(u[0]["x"]))
                acc[key] += u[2]
    return Counter({k: v for k, v in acc.items() if v})


def as_counter(table: pa.Table) -> Counter[Any]:
    out: Counter[Any] = Counter()
    for r in table.to_pylist():
        key = ("err", r[ERROR]) if r.get(ERROR) is not None else ("ok", r["k"], r["s"], repr(r["x"]))
        assert key not in out, f"expected consolidated rows, found {key} twice"
        assert r[DIFF] != 0
        out[key] = r[DIFF]
    return out


def wait_for(pred: Any, what: str, ctl: SparkController, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert ctl.proc.poll() is None, f"expected the controller running, found it exited:\n{ctl.tail()}"
        assert time.monotonic() < deadline, f"expected {what} within {timeout_s} s\n{ctl.tail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def orders(controller: SparkController) -> tuple[Shard, list[list[tuple[Any, ...]]], dict[int, Counter[Any]]]:
    """The collection, appended; its snapshots at every time before since moves."""
    controller.call("CreateCollection", create_body("orders", schema=SCHEMA))
    shard = Shard.open(controller.settings.store(), "orders")
    updates = workload()
    for t, ups in enumerate(updates):
        shard.compare_and_append(ups, t, t + 1)

    def quiet() -> bool:
        st = shard.refresh()
        return plan_merge(st) is None and len(st.batches) < APPENDS

    wait_for(quiet, "the tiered compaction to settle", controller)
    before = {t: as_counter(shard.snapshot(t)) for t in range(APPENDS)}
    for t in range(APPENDS):
        assert before[t] == model_at(updates, t), f"at {t} before compaction"
    return shard, updates, before


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compaction_as_a_spark_job_keeps_every_readable_snapshot_and_batches_logarithmic(
    controller: SparkController, orders: Any
) -> None:
    shard, updates, before = orders
    st = shard.refresh()
    bound = (FANOUT - 1) * (math.log(max(st.total_rows(), 1), FANOUT) + 1)
    assert len(st.batches) <= bound, f"{len(st.batches)} batches after {APPENDS} appends (bound {bound:.1f})"
    assert controller.jobs()[("merge", "spark")] >= 1, "expected the tiered merges to run on Spark"

    # since moves to upper - 4: the balanced run below it (here all of it, see
    # shared.state.plan_since_merge) merges into one batch, on the cluster.
    controller.call("SetReadPolicy", {"collection_id": "orders", "policy": lag(4)})

    def merged() -> bool:
        s = shard.refresh()
        return s.since.time == APPENDS - 4 and len([b for b in s.batches if b.upper.less_equal(s.since)]) <= 1 \
            and plan_merge(s) is None

    wait_for(merged, "since at upper - 4 and the history below it merged", controller)
    st = shard.refresh()
    check_invariants(st)
    assert len(st.batches) <= bound
    for t in range(APPENDS - 4, APPENDS):
        got = as_counter(shard.snapshot(t))
        assert got == before[t] == model_at(updates, t), f"at {t} after compaction"
    # The merged parts are plain Parquet in the part schema.
    low = [b for b in st.batches if b.upper.less_equal(st.since)]
    assert low and low[0].since == st.since
    for p in low[0].parts:
        t = pq.read_table(io.BytesIO(shard.store.get(p.key)))
        assert t.schema.names == shard.part_schema.names and t.num_rows == p.rows
        assert set(t["_time"].to_pylist()) <= {APPENDS - 4}, "times below since advanced to it"
    jobs = controller.jobs()
    assert jobs[("merge", "spark")] >= 2 and jobs[("merge", "fallback")] == 0, jobs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gc_sweeps_on_spark_delete_only_what_no_state_references(controller: SparkController, orders: Any) -> None:
    shard, _, before = orders
    stray = f"{shard.prefix}data/{uuid.uuid4().hex}.parquet"
    shard.store.put(stray, b"not referenced by any state")

    def swept() -> bool:
        keys = {i.key for i in shard.store.list(f"{shard.prefix}data/")}
        return keys == shard.refresh().referenced_keys()

    wait_for(swept, "unreferenced data objects deleted after their grace", controller)
    jobs = controller.jobs()
    assert jobs[("sweep", "spark")] >= 1 and jobs[("sweep", "fallback")] == 0, jobs
    t = max(before)
    assert as_counter(shard.snapshot(t)) == before[t]


def stored_table(ctl: SparkController, res: dict[str, Any]) -> pa.Table:
    """A peek's ``parquet-dataset`` answer read back: every object under its folder."""
    assert res["format"] == "parquet-dataset", res
    prefix = ctl.settings.s3.prefix.rstrip("/") + "/"
    assert res["key"].startswith(prefix) and res["key"].endswith("/")
    store = ctl.settings.store()
    keys = sorted(i.key for i in store.list(res["key"][len(prefix):]))
    assert keys, res
    return pa.concat_tables([pq.read_table(io.BytesIO(store.get(k))) for k in keys])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peek_as_a_spark_job_equals_the_in_process_snapshot(controller: SparkController, orders: Any) -> None:
    shard, _, before = orders
    as_of = APPENDS - 1
    want = as_counter(shard.snapshot(as_of))
    assert want == before[as_of]
    n0 = controller.jobs()[("peek", "spark")]

    r = controller.call("Peek", {"collection_id": "orders", "as_of": as_of, "max_inline_bytes": 0})
    kind, res = r["body"][1]["result"]
    assert kind.endswith("StoredRows")
    table = stored_table(controller, res)
    assert table.column_names == ["k", "s", "x", ERROR, DIFF]
    assert res["row_count"] == table.num_rows == len(want)
    assert as_counter(table) == want

    r = controller.call("Peek", {"collection_id": "orders", "as_of": as_of, "limit": 7, "max_inline_bytes": 0})
    res = r["body"][1]["result"][1]
    table = stored_table(controller, res)
    assert res["row_count"] == table.num_rows == 7
    assert all(want[k] == v for k, v in as_counter(table).items())

    # Few rows without errors come back inline, as the in-process peek answers them.
    controller.call("CreateCollection", create_body("small", schema=SCHEMA))
    small = Shard.open(controller.settings.store(), "small")
    small.compare_and_append([(row(i, "s", 0.5), 0, 1 + i % 2) for i in range(20)] + [(row(3, "s", 0.5), 0, -2)], 0, 1)
    r = controller.call("Peek", {"collection_id": "small", "as_of": 0})
    kind, res = r["body"][1]["result"]
    assert kind.endswith("InlineRows")
    got = Counter({("ok", *[ROWS.decode(rc["row"])[c] for c in ("k", "s")], repr(0.5)): rc["count"] for rc in res["rows"]})
    assert got == as_counter(small.snapshot(0))
    jobs = controller.jobs()
    assert jobs[("peek", "spark")] == n0 + 3 and jobs[("peek", "fallback")] == 0, jobs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_subscribe_snapshot_as_a_spark_job_gives_the_in_process_messages(
    controller: SparkController, stack: EmbeddedStack, orders: Any
) -> None:
    shard, _, _ = orders
    as_of = shard.refresh().since.time or 0
    topic = f"sub-spark-{uuid.uuid4().hex[:8]}"
    r = controller.call("Subscribe", {"collection_id": "orders", "output_topic": topic, "as_of": as_of,
                                      "up_to": APPENDS, "with_snapshot": True})
    sid = r["command_id"]
    msgs = read_subscribe(stack, topic, sid, timeout_s=240)

    # The in-process answer: the snapshot's changes and the later ones, encoded and sorted as
    # the controller's step does without Spark.
    col = SimpleNamespace(shard=shard, row_codec=ROWS)
    changes = SubscribesRoom._changes(col, shard.snapshot(as_of), as_of)  # type: ignore[arg-type]
    changes += SubscribesRoom._changes(col, shard.updates_between(shard.refresh(), as_of + 1, Frontier.at(APPENDS)),  # type: ignore[arg-type]
                                       None)
    codec = message_codec("subscribe_output")
    want = [codec.decode(m) for m in encode_changes(codec, sid, changes)]
    got = [m for m in msgs if not m["progressed"]]
    assert len(got) == len(want) and got == want
    assert any(m["error"] is not None for m in got) and any(m["diff"] > 1 for m in got)
    assert [m["time"] for m in msgs if m["progressed"]][-2:] == [APPENDS, None]
    jobs = controller.jobs()
    assert jobs[("snapshot", "spark")] >= 1 and jobs[("snapshot", "fallback")] == 0, jobs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compaction_on_spark_across_an_alter_writes_the_merged_parts_in_the_current_schema(
    controller: SparkController,
) -> None:
    """Parts written under v1 (``x`` an int) and v2 (``x`` promoted to long, a nullable ``note``
    added) merge on the cluster into parts of v2: every readable snapshot is the model's in
    v2's schema (old rows with ``note`` null), and the merged parts say v2."""
    from shared.shard import SCHEMA_META_KEY, schema_view

    v1 = {"type": "record", "name": "Evolving", "fields": [{"name": "k", "type": "long"}, {"name": "x", "type": "int"}]}
    v2 = {"type": "record", "name": "Evolving", "fields": [
        {"name": "k", "type": "long"}, {"name": "x", "type": "long"},
        {"name": "note", "type": ["null", "string"], "default": None}]}
    controller.call("CreateCollection", create_body("evolving", schema=v1))
    shard = Shard.open(controller.settings.store(), "evolving")
    model: Counter[tuple[int, int, str | None]] = Counter()
    snapshots: dict[int, Counter[Any]] = {}
    for t in range(9):
        if t == 4:
            controller.call("AlterCollection", {"collection_id": "evolving", "row_schema": json.dumps(v2)})
            shard.refresh()
        ups = [({"k": t * 10 + i, "x": i, **({"note": f"n{i}"} if t >= 4 else {})}, t, 1) for i in range(10)]
        if t:
            ups.append(({"k": (t - 1) * 10, "x": 0, **({"note": "n0"} if t - 1 >= 4 else {})}, t, -1))
        shard.compare_and_append(ups, t, t + 1)
        for r, _, d in ups:
            model[(r["k"], r["x"], r.get("note"))] += d
        snapshots[t] = +model

    def counter(table: pa.Table) -> Counter[Any]:
        return Counter({(r["k"], r["x"], r["note"]): r[DIFF] for r in table.to_pylist()})

    # since moves to 8: every batch below it, v1 and v2 parts alike, merges into one, which
    # holds rows appended after the alter, so it is written in v2 whatever the tiered merges
    # did before.
    controller.call("SetReadPolicy", {"collection_id": "evolving", "policy": valid_from(8)})

    def merged() -> bool:
        s = shard.refresh()
        return s.since.time == 8 and len([b for b in s.batches if b.upper.less_equal(s.since)]) == 1 \
            and plan_merge(s) is None

    wait_for(merged, "since at 8 and the history below it merged into one batch", controller)
    st = shard.refresh()
    check_invariants(st)
    for t in (8,):
        snap = shard.snapshot(t)
        assert snap.schema.field("x").type == pa.int64() and "note" in snap.schema.names
        assert counter(snap) == snapshots[t], f"at {t} after compaction"
    v2_fingerprint = schema_view(v2).fingerprint
    (low,) = [b for b in st.batches if b.upper.less_equal(st.since)]
    assert low.lower.time == 0 and low.upper.time == 8
    for p in low.parts:
        t = pq.read_table(io.BytesIO(shard.store.get(p.key)))
        assert t.schema.metadata[SCHEMA_META_KEY].decode() == v2_fingerprint
        assert t.schema.field("x").type == pa.int64() and t.num_rows == p.rows
    assert controller.jobs()[("merge", "fallback")] == 0
