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
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.devstack.netfault import FaultProxy
from tests.services.steady_run import SteadyRun, chaos

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
    from shared.shard import Shard
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
    shard = Shard.open(clean.store(), collection)
    run_ = SteadyRun([sys.executable, "-m", "services"], svc_env, logs, shard,
                     DesiredProducer(clean.kafka, topic, SCHEMA), 3232, PER_STEP)
    wait_upper = run_.wait_upper
    workload = run_.workload

    def partition(proxy: FaultProxy) -> dict[str, Any]:
        """Partition ``proxy`` for PARTITION_S, heal it, and time the sink's recovery. A lead-in
        of latency first keeps requests in flight, so the partition resets some."""
        proxy.latency(LEAD_IN_LATENCY_MS, jitter_ms=LEAD_IN_LATENCY_MS / 2)
        run_.hold(LEAD_IN_S, f"{proxy.name} slowed")
        resets_before = proxy.counters.resets
        proxy.partition()
        t_fault = time.monotonic()
        run_.hold(PARTITION_S, f"{proxy.name} partitioned")
        upper_at_heal, frontier_at_heal = run_.upper(), workload.frontier
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
    t_run = time.monotonic()
    ok = False
    try:
        run_.start()
        wait_upper(2 * chaos.STEP_TIMES, START_TIMEOUT_S, "first appends")
        wait_upper(workload.frontier, CATCH_UP_TIMEOUT_S, "in step before the faults")
        faults.append(partition(stack.s3_proxy))
        faults.append(partition(stack.kafka_proxy))
        summary: dict[str, Any] = {
            "faults": faults,
            "proxies": {p.name: vars(p.counters) for p in (stack.s3_proxy, stack.kafka_proxy)},
        }
        divergences = run_.finish(CATCH_UP_TIMEOUT_S, summary)
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
        run_.stop()
        if not ok:
            print(f"faults so far: {faults}\n{run_.tail(200)}", file=sys.stderr)
