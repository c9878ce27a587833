"""Retention safety of the write service (issue 11, test 1), on the real broker, S3 server and
Spark.

The desired topic's oldest records become unavailable after the sink has caught up. Tansu
rejects DeleteRecords, so the test uses the source's ``simulatedLowWatermarksFile``: the
source then sees the partitions' low watermarks where a real broker's retention would put
them (ListOffsets(earliest) above 0, the records below unreadable), and never reads below
them. Everything else is real: the mint and append services run throughout, the write
service is stopped and started again as an operator or a crash would.

- case a: the writer restarts with its checkpoint: it resumes from the checkpoint's offsets
  (above the low watermark), the shard keeps every row and equals the model at every later
  upper, retractions of rows whose inserts are gone included;
- case b: the writer restarts without its checkpoint: it cannot prove it saw the history
  behind the shard, so it writes nothing: the shard loses no row, its upper stays, and the
  typed error shows in the metric, the sink's health and ``shardsink status``;
- case c: after ``shardsink sink adopt``, the sink corrects again from the adopted baseline
  and the shard equals the model (which includes the lost history).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardsink.cli.catalog import create_collection
from services.runtime.settings import ServiceSettings
from services.runner import Services
from shared.catalog import SinkDef, sink_health
from shared.devstack.embedded import EmbeddedStack
from shared.io.desired_producer import DesiredProducer
from shared.io.kafka import OffsetProbe
from shared.io.kafka_admin import ensure_topic
from shared.shard import DIFF, ERROR, Shard

SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
PARTITIONS = 2
DEADLINE_S = 180.0
REPO = Path(__file__).resolve().parents[2]

Row = tuple[int, str]


class Work:
    """Updates and progress on the desired topic, and the model: every update produced."""

    def __init__(self, settings: ServiceSettings, topic: str, seed: int) -> None:
        self.producer = DesiredProducer(settings.kafka, topic, SCHEMA)
        self.rng = random.Random(seed)
        self.updates: list[tuple[Row, int, int]] = []
        self.frontier = 0
        self.live: list[Row] = []
        self.next_k = 0

    def step(self, inserts: int, retract: list[Row] | None = None) -> int:
        t = self.frontier
        for _ in range(inserts):
            row = (self.next_k, f"v{self.rng.randrange(1000)}")
            self.next_k += 1
            self.send(row, t, 1)
            self.live.append(row)
        for row in retract or []:
            self.send(row, t, -1)
            self.live.remove(row)
        self.frontier = t + 1
        self.producer.advance_to(self.frontier)
        self.producer.flush()
        return self.frontier

    def send(self, row: Row, t: int, d: int) -> None:
        self.producer.send({"k": row[0], "v": row[1]}, t, d)
        self.updates.append((row, t, d))

    def model(self, upper: int) -> Counter[Row]:
        c: Counter[Row] = Counter()
        for row, t, d in self.updates:
            if t < upper:
                c[row] += d
        return Counter({r: n for r, n in c.items() if n})


def contents(shard: Shard, upper: int) -> Counter[Row]:
    table = shard.snapshot(upper - 1)
    out: Counter[Row] = Counter()
    for k, v, e, d in zip(
        table["k"].to_pylist(), table["v"].to_pylist(), table[ERROR].to_pylist(), table[DIFF].to_pylist(), strict=True
    ):
        assert e is None, f"expected no error rows, found {e}"
        out[(k, v)] += d
    return Counter({r: n for r, n in out.items() if n})


def wait_for(pred: Callable[[], bool], what: str, detail: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"expected {what} within {DEADLINE_S}s; {detail()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def env(stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from shared.spark.kafka_connector import register_kafka_source

    register_kafka_source(spark)
    tag = uuid.uuid4().hex[:8]
    root = tmp_path_factory.mktemp("retention")
    lows = root / "low-watermarks.json"
    environ = {
        **os.environ,
        **stack.env(),
        "SHARDSINK_CHECKPOINT_DIR": str(root / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "300",
        "SHARDSINK_TOPIC_DESCS": f"descs-{tag}",
        "SHARDSINK_TOPIC_BATCHES": f"batches-{tag}",
        "SHARDSINK_TOPIC_FRONTIERS": f"frontiers-{tag}",
        "SHARDSINK_TEST_LOW_WATERMARKS_FILE": str(lows),
    }
    settings = ServiceSettings.from_env_and_args(None, environ)
    base = Services(settings, spark, ("mint", "append")).start()
    try:
        yield {"settings": settings, "spark": spark, "lows": lows, "env": environ, "root": root}
    finally:
        base.stop()


def write_state(settings: Any, sink_id: str, epoch: int) -> Path:
    """Where the writer keeps a sink epoch's state: its query's checkpoint, or its folder beside
    the shared query's (``SHARDSINK_QUERIES=shared``)."""
    if settings.queries == "shared":
        return Path(settings.checkpoint_dir) / "write-shared" / f"{sink_id}-e{epoch}"
    return Path(settings.checkpoint_dir) / "write" / f"{sink_id}-e{epoch}"


def test_lost_history_never_retracts_and_the_adopted_baseline_corrects_again(
    env: dict[str, Any], unique_id: str
) -> None:
    settings: ServiceSettings = env["settings"]
    spark = env["spark"]
    cid, sid, topic = f"ret-{unique_id}", f"ret-{unique_id}", f"desired-ret-{unique_id}"
    create_collection(settings, cid, SCHEMA)
    ensure_topic(settings.kafka, topic, PARTITIONS)
    settings.catalog().create_sink(SinkDef(sid, topic, cid))
    shard = Shard.open(settings.store(), cid)
    work = Work(settings, topic, seed=11)
    writer = Services(settings, spark, ("write",)).start()

    def upper() -> int:
        return int(shard.refresh().upper.time or 0)

    def caught_up() -> bool:
        return upper() == work.frontier

    def detail() -> str:
        w = writer.writers.get(sid)
        return f"upper {upper()}, frontier {work.frontier}, writer {getattr(w, 'metrics', None)}"

    def check_every_upper(since: int) -> None:
        """The shard equals the model at every upper it passed since ``since``."""
        for u in range(max(since, 1), upper() + 1):
            assert contents(shard, u) == work.model(u), f"at upper {u}"

    try:
        # History: two early steps (their records will be lost), then two more.
        early = [work.step(40), work.step(40)]
        assert early == [1, 2]
        with OffsetProbe(settings.kafka) as probe:
            lost_below = probe.end_offsets(topic)  # everything produced so far will expire
        work.step(30)
        work.step(30)
        wait_for(caught_up, "the sink in step before history expires", detail)
        check_every_upper(1)
        early_rows = [r for r in work.live if r[0] < 80]

        # -- case a: the oldest records expire; the writer restarts with its checkpoint --------
        env["lows"].write_text(json.dumps({topic: {str(p): o for p, o in lost_below.items()}}))
        assert all(o > 0 for o in lost_below.values()), lost_below
        writer.stop()
        writer = Services(settings, spark, ("write",)).start()
        a_from = upper()
        work.step(20, retract=early_rows[:10])  # retractions of rows whose inserts are gone
        work.step(20, retract=early_rows[10:15])
        wait_for(caught_up, "the sink in step after a restart with its checkpoint", detail)
        check_every_upper(a_from)
        assert contents(shard, upper()) == work.model(upper())
        assert writer.writers[sid].metrics.history_unproven_partitions == 0

        # -- case b: the checkpoint is lost too -------------------------------------------------
        writer.stop()
        epoch = settings.catalog().state().sink(sid).epoch
        ckpt = write_state(settings, sid, epoch)
        assert ckpt.is_dir(), f"expected the durable write checkpoint at {ckpt}"
        shutil.rmtree(ckpt)
        held_upper, held = upper(), contents(shard, upper())
        writer = Services(settings, spark, ("write",)).start()
        work.step(20, retract=early_rows[15:25])
        wait_for(
            lambda: sid in writer.writers and writer.writers[sid].metrics.history_unproven_partitions == PARTITIONS,
            "every writer partition to refuse to write",
            detail,
        )
        health = sink_health(settings.store(), sid)
        assert health is not None and health["state"] == "refusing", health
        assert health["epoch"] == epoch and sorted(health["partitions"]) == list(range(PARTITIONS))
        assert "HistoryUnproven" in health["message"] or "history" in health["message"], health
        status = subprocess.run(
            [sys.executable, "-m", "shardsink", "status", "--output", "json"],
            cwd=REPO, env={**env["env"]}, capture_output=True, text=True, timeout=120,
        )
        assert status.returncode == 0, status.stderr
        entries = [json.loads(line) for line in status.stdout.splitlines() if line.startswith("{")]
        mine = [e for e in entries if e.get("collection") == cid]
        assert mine and sid in mine[0].get("refusing", {}), status.stdout
        time.sleep(5)  # several micro-batches: still nothing written
        assert upper() == held_upper, "expected the refusing sink to write nothing"
        assert contents(shard, held_upper) == held, "expected the shard to lose no row"

        # -- case c: the operator adopts the shard's contents as the baseline -------------------
        adopt = subprocess.run(
            [sys.executable, "-m", "shardsink", "sink", "adopt", sid],
            cwd=REPO, env={**env["env"]}, capture_output=True, text=True, timeout=120,
        )
        assert adopt.returncode == 0, adopt.stderr
        new_epoch = settings.catalog().state().sink(sid).epoch
        assert new_epoch > epoch
        work.step(20, retract=early_rows[25:30])
        wait_for(caught_up, "the sink in step after the adopted baseline", detail)
        check_every_upper(held_upper + 1)
        assert contents(shard, upper()) == work.model(upper())
        assert all(r not in contents(shard, upper()) for r in early_rows[:30])
        assert writer.writers[sid].metrics.history_unproven_partitions == 0
        status = subprocess.run(
            [sys.executable, "-m", "shardsink", "status", "--output", "json"],
            cwd=REPO, env={**env["env"]}, capture_output=True, text=True, timeout=120,
        )
        mine = [json.loads(line) for line in status.stdout.splitlines() if f'"{cid}"' in line]
        assert mine and "refusing" not in mine[0], status.stdout
        # The old epoch's checkpoint is gone; the new one exists.
        wait_for(lambda: not ckpt.exists(), "the old epoch's write checkpoint removed")
        assert write_state(settings, sid, new_epoch).is_dir()
    finally:
        writer.stop()
        settings.catalog().drop_sink(sid)
