"""Issue 32: the sink behind real network faults, healed, resumes by itself with nothing lost
or doubled.

The sink (mint, write and append in one application, ``python -m services``, the embedded
default) runs against an embedded stack whose broker and S3 server sit behind loopback fault
proxies (``EmbeddedStack(net_faults=True)``, :mod:`shared.devstack.netfault`): the broker
advertises its proxy, so every Kafka client of the services goes through it, and the services'
S3 endpoint is the S3 proxy. A steady workload (inserts and retractions on a 2-partition desired
topic, a progress statement every 0.5 s) goes on while

1. S3 is slowed for :data:`LEAD_IN_S` (latency per chunk, so that requests are in flight),
   then partitioned for :data:`PARTITION_S` (the listener closed: connects refused; every open
   connection reset with an RST), then healed;
2. Kafka is partitioned the same way, then healed. The workload's own producer reaches the
   broker through the same proxy (the broker advertises one address), so its records wait in
   its buffer meanwhile (it is idempotent: nothing doubled or reordered by its retries).

The observers (the shard's upper, every state object) read S3 directly, never through the
proxy. Asserted: the application never exits; after each heal the shard's upper moves again
within :data:`HEAL_BOUND_S` (measured and printed) and catches up with the desired frontier;
at the end the history checker of ``bench/chaos.py`` finds every append linearizable, every
append's contents equal to the model's updates in its ``[lower, upper)`` and no update lost
or doubled, and the shard equals the model at every upper it ever had.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.devstack.netfault import FaultProxy

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import chaos  # noqa: E402

#: How long each partition lasts.
PARTITION_S = 12.0
#: Before each partition, this long with this latency per chunk (plus or minus half of it).
LEAD_IN_S, LEAD_IN_LATENCY_MS = 3.0, 300.0
#: The shard's upper must move again within this long after a heal (issue 32); the env var
#: widens it on a machine known to be overloaded.
HEAL_BOUND_S = float(os.environ.get("SHARDSINK_HEAL_BOUND_S", "10"))
#: Generous: a shared 2-core machine may take minutes to start a Spark application.
START_TIMEOUT_S = 300.0
CATCH_UP_TIMEOUT_S = 180.0
PER_STEP = 40


@pytest.fixture
def net_stack() -> Iterator[EmbeddedStack]:
    with EmbeddedStack(net_faults=True) as s:
        yield s


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sink_resumes_by_itself_after_s3_and_kafka_partitions_without_losing_or_doubling(
    net_stack: EmbeddedStack, tmp_path: Path
) -> None:
    from services.runner import ensure_control_topics
    from services.runtime.settings import ServiceSettings
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import DIFF, TIME, Shard
    from tests.controller_fixture import SCHEMA

    stack = net_stack
    assert stack.kafka_proxy is not None and stack.s3_proxy is not None
    run = uuid.uuid4().hex[:6]
    base = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "500",
        "SHARDSINK_STAGED_GRACE_MS": str(24 * 3600 * 1000),  # every state kept for the checker
    }
    base.pop("SHARDSINK_FAULTS", None)
    base.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.python.authenticate.socketTimeout=120s pyspark-shell")
    svc_env = {**base, **stack.env()}  # through both proxies
    clean = ServiceSettings.from_env_and_args(None, {**base, **stack.env(direct_s3=True)})
    collection, topic, sink_id = f"net-{run}", f"desired-net-{run}", f"net-{run}"
    ensure_control_topics(clean)
    ensure_topic(clean.kafka, topic, 2)
    create_collection(clean, collection, SCHEMA)
    clean.catalog().create_sink(SinkDef(sink_id, topic, collection))

    logs = tmp_path / "logs"
    logs.mkdir()
    services = chaos.Service("services", [sys.executable, "-m", "services"], svc_env, logs)
    shard = Shard.open(clean.store(), collection)
    recorder = chaos.StateRecorder(shard).start()  # every state, and when each upper was first seen
    producer = DesiredProducer(clean.kafka, topic, SCHEMA)
    workload = chaos.Workload(producer, random.Random(3232), PER_STEP)
    stop = threading.Event()
    bg_errors: list[BaseException] = []

    def produce() -> None:
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                workload.step()
                stop.wait(max(0.0, 0.5 - (time.monotonic() - t0)))
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            bg_errors.append(e)

    def check_running(what: str) -> None:
        code = services.exited()
        assert code is None, f"expected the services to keep running ({what}), found them exited with {code}:\n{tail()}"
        assert not bg_errors, f"expected the workload to keep going ({what}), found {bg_errors[0]!r}"

    def upper() -> int:
        return recorder.reached[-1][1] if recorder.reached else 0

    def wait_upper(target: int, timeout_s: float, what: str) -> float:
        """Wait until the shard's upper reaches ``target``; the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while upper() < target:
            check_running(what)
            assert time.monotonic() < deadline, (
                f"expected the shard's upper to reach {target} within {timeout_s}s ({what}), found "
                f"{upper()}\n{tail()}"
            )
            time.sleep(0.1)
        return recorder.when(target) or time.monotonic()

    def tail(lines: int = 60) -> str:
        try:
            text = (logs / "services.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def partition(proxy: FaultProxy) -> dict[str, Any]:
        """Partition ``proxy`` for PARTITION_S, heal it, and time the sink's recovery. A lead-in
        of latency first keeps requests in flight, so the partition resets some."""
        proxy.latency(LEAD_IN_LATENCY_MS, jitter_ms=LEAD_IN_LATENCY_MS / 2)
        t_lead_in = time.monotonic()
        while time.monotonic() - t_lead_in < LEAD_IN_S:
            check_running(f"{proxy.name} slowed")
            time.sleep(0.1)
        resets_before = proxy.counters.resets
        proxy.partition()
        t_fault = time.monotonic()
        while time.monotonic() - t_fault < PARTITION_S:
            check_running(f"{proxy.name} partitioned")
            time.sleep(0.2)
        upper_at_heal, frontier_at_heal = upper(), workload.frontier
        proxy.heal()
        t_heal = time.monotonic()
        moved = wait_upper(upper_at_heal + 1, CATCH_UP_TIMEOUT_S, f"after the {proxy.name} heal")
        caught_up = wait_upper(frontier_at_heal, CATCH_UP_TIMEOUT_S, f"catching up after the {proxy.name} heal")
        return {
            "fault": f"{proxy.name}_partition",
            "seconds": round(t_heal - t_fault, 1),
            "connections_reset": proxy.counters.resets - resets_before,
            "upper_at_heal": upper_at_heal,
            "frontier_at_heal": frontier_at_heal,
            "heal_to_upper_s": round(moved - t_heal, 2),
            "heal_to_caught_up_s": round(caught_up - t_heal, 2),
        }

    faults: list[dict[str, Any]] = []
    producer_thread = threading.Thread(target=produce, name="workload", daemon=True)
    t_run = time.monotonic()
    ok = False
    try:
        services.start()
        producer_thread.start()
        wait_upper(2 * chaos.STEP_TIMES, START_TIMEOUT_S, "first appends")
        wait_upper(workload.frontier, CATCH_UP_TIMEOUT_S, "in step before the faults")
        faults.append(partition(stack.s3_proxy))
        faults.append(partition(stack.kafka_proxy))
        stop.set()
        producer_thread.join(timeout=60)
        check_running("after the faults")
        final = workload.step()
        wait_upper(final, CATCH_UP_TIMEOUT_S, "final convergence")
        check_running("at the end")
        time.sleep(2.0)  # late appends, if any, land now and are checked too
        recorder.stop()
        recorder.poll_once()

        restarts = len(re.findall(r"query failed, restarting", (logs / "services.log").read_text(errors="replace")))
        summary: dict[str, Any] = {
            "faults": faults,
            "query_restarts": restarts,
            "updates": len(workload.sent),
            "proxies": {p.name: vars(p.counters) for p in (stack.s3_proxy, stack.kafka_proxy)},
        }
        divergences: list[str] = []
        chaos.check(summary, divergences, shard, recorder, workload, final, None, None, None, True)
        # The shard at every upper it had equals the model (the checker samples them).
        head = shard.refresh()
        everything = shard.updates_between(head, 0, head.upper)
        uppers = sorted({int(s.upper.time) for s in recorder.states.values() if s.upper.time})
        for u in uppers:
            at = everything.filter(pc.less(everything[TIME], pa.scalar(u, pa.uint64())))
            got = chaos.table_rows(at.select(["k", "v", DIFF]))
            want = chaos.model_at(workload.sent, u - 1)
            if got != want:
                divergences.append(f"expected the shard at upper {u} to equal the model: {chaos.differ(got, want)}")
        summary["every_upper_checked"] = len(uppers)
        summary["seconds"] = round(time.monotonic() - t_run, 1)
        print(json.dumps(summary, default=str))
        assert divergences == [], divergences
        assert summary["appends"] > 0 and summary["append_contents_checked"] == summary["appends"]
        for f in faults:
            assert f["heal_to_upper_s"] <= HEAL_BOUND_S, (
                f"expected the upper to move within {HEAL_BOUND_S}s of the heal, found {f}"
            )
        ok = True
    finally:
        stop.set()
        recorder.stop()
        services.kill()
        producer.close()
        if not ok:
            print(f"faults so far: {faults}\n{tail(200)}", file=sys.stderr)
