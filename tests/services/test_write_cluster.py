"""The sink on a Spark standalone cluster (issue 11, test 3): a master and two workers (one
core each) started from the pyspark wheel's ``spark-class`` on 127.0.0.1, the services
(``python -m services``: mint, write and append in one application) attached in client mode
with ``SHARDSINK_SPARK_MASTER=spark://...``, the real broker and S3 server.

A workload with retractions runs; the shard equals the model at every upper the test saw.
Then one executor is SIGKILLed mid-run: the master gives the application a new executor,
Spark reruns the lost tasks (the writer partitions' state comes back from the checkpoint),
and the shard still equals the model at every upper, with no update doubled or lost.

Issue 32, the network fault "on the standalone cluster, between the driver and a worker": the
services' driver binds 127.0.0.1 and advertises 127.0.0.2, where fault proxies forward to it
(:class:`shared.devstack.embedded.DriverFaultPath`), so every connection of the executors to
the driver goes through them. The path is partitioned while the sink runs (the executors'
connections reset: each executor exits, and those the master launches meanwhile cannot
connect), then healed: the driver keeps its application, new executors register, the lost
tasks run again with the writer's state from the checkpoint, and the history checker of
``bench/chaos.py`` finds nothing lost or doubled; the seconds from the heal to the next upper
are printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shared.devstack.embedded import DriverFaultPath, EmbeddedStack, SparkStandalone
from shared.io.desired_producer import DesiredProducer
from shared.shard import Shard
from tests.services.test_sink_crash import SCHEMA, UpperWatch, as_counter, diff_summary
from tests.services.steady_run import REPO, SteadyRun, chaos
from tests.services.test_write_recovery import SteadyWork

WAIT_S = 300.0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_sink_on_a_standalone_cluster_survives_a_killed_executor(
    stack: EmbeddedStack, standalone_cluster: SparkStandalone, unique_id: str, tmp_path: Path
) -> None:
    from services.runtime.settings import ServiceSettings
    from services.runner import ensure_control_topics
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.kafka_admin import ensure_topic

    cluster = standalone_cluster
    env = {
        **os.environ,
        **stack.env(),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SHARDSINK_SPARK_MASTER": cluster.master_url,
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "300",
    }
    settings = ServiceSettings.from_env_and_args(None, env)
    cid = sid = f"cluster-{unique_id}"
    topic = f"desired-cluster-{unique_id}"
    create_collection(settings, cid, SCHEMA)
    ensure_topic(settings.kafka, topic, 3)
    ensure_control_topics(settings)
    settings.catalog().create_sink(SinkDef(sid, topic, cid))
    shard = Shard.open(settings.store(), cid)
    work = SteadyWork(DesiredProducer(settings.kafka, topic, SCHEMA), seed=9)
    log = tmp_path / "services.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", "--sink", sid], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    watch = UpperWatch(shard).start()

    def step_and_wait(what: str) -> int:
        frontier = work.until(len(work.sent) + 400)
        t0 = time.monotonic()
        while watch.upper() < frontier:
            assert proc.poll() is None, f"expected the services running, found them exited:\n{tail()}"
            assert time.monotonic() - t0 < WAIT_S, f"expected the upper at {frontier} ({what}), found {watch.upper()}:\n{tail()}"
            time.sleep(0.1)
        return frontier

    def tail() -> str:
        return "\n".join(log.read_text(errors="replace").splitlines()[-40:])

    def check_every_upper() -> int:
        uppers = sorted({u for _, _, u in watch.seen if u > 0})
        for u in uppers:
            actual = as_counter(shard.snapshot(u - 1))
            assert actual == work.model(u), f"at upper {u}: {diff_summary(actual, work.model(u))}"
        return len(uppers)

    try:
        for i in range(4):
            step_and_wait(f"step {i} on the cluster")
        assert check_every_upper() >= 2
        apps = cluster.status().get("activeapps") or []
        assert apps, "expected the services' application on the standalone master"
        before = cluster.executor_pids()
        assert len(before) == 2, f"expected one executor per worker, found {before}"

        # Kill one executor while updates keep coming.
        frontier = work.until(len(work.sent) + 400)
        os.kill(before[0], signal.SIGKILL)
        for i in range(3):
            step_and_wait(f"step {i} after the executor was killed")
        deadline = time.monotonic() + WAIT_S
        while not (len(cluster.executor_pids()) == 2 and before[0] not in cluster.executor_pids()):
            assert time.monotonic() < deadline, f"expected a new executor, found {cluster.executor_pids()}"
            time.sleep(0.5)
        assert watch.upper() > frontier
        check_every_upper()
        upper = watch.upper()
        assert as_counter(shard.snapshot(upper - 1)) == work.model(upper)
        assert watch.errors == []
    finally:
        watch.stop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


# -- a partition between the driver and the cluster's executors (issue 32) ----------------------

#: How long the partition between the driver and the executors lasts.
DRIVER_PARTITION_S = 12.0
#: The upper must move again within this long of the heal. Wider than the 10 s of the Kafka and
#: S3 partitions (tests/services/test_sink_network_faults.py): the partition ends the executors
#: (an executor that loses its driver exits), so the master must launch new ones, which start a
#: JVM, register with the driver, fork their Python workers and load the writer's state from the
#: checkpoint before a task runs. The env var widens it on a machine known to be overloaded.
DRIVER_HEAL_BOUND_S = float(os.environ.get("SHARDSINK_DRIVER_HEAL_BOUND_S", "60"))
CATCH_UP_S = 180.0


def executor_exit_causes(dirs: list[Path]) -> dict[str, int]:
    """Why the executors in ``dirs`` ended, from their stderr: the driver lost while running
    (``disassociated``), the driver not reachable at start (``could_not_connect``)."""
    causes: Counter[str] = Counter()
    for d in dirs:
        try:
            err = (d / "stderr").read_text(errors="replace")
        except OSError:
            continue
        if "disassociated" in err:
            causes["disassociated"] += 1
        elif re.search(r"Failed to connect to|Connection refused", err):
            causes["could_not_connect"] += 1
    return dict(causes)


def active_app_ids(cluster: SparkStandalone) -> list[str]:
    """The ids of the applications the master runs now."""
    apps = cluster.status().get("activeapps") or []
    assert isinstance(apps, list), f"expected a list of applications, found {apps!r}"
    return [str(a.get("id")) for a in apps]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_sink_on_a_standalone_cluster_resumes_after_a_partition_between_the_driver_and_its_executors(
    stack: EmbeddedStack, standalone_cluster: SparkStandalone, unique_id: str, tmp_path: Path
) -> None:
    """The services' driver advertises an address where fault proxies forward to it
    (:class:`DriverFaultPath`): every executor connection to the driver goes through them. A
    steady workload runs; the path is partitioned for :data:`DRIVER_PARTITION_S` (the
    executors' connections reset, new ones refused), then healed. The services never exit; the
    executors the partition ended are replaced; the upper moves again within
    :data:`DRIVER_HEAL_BOUND_S` of the heal (measured and printed) and catches up; the history
    checker of ``bench/chaos.py`` finds every append linearizable and holding the model's
    updates, none lost or doubled, and the shard equals the model at every upper it had."""
    from services.runner import ensure_control_topics
    from services.runtime.settings import ServiceSettings
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.kafka_admin import ensure_topic

    cluster = standalone_cluster
    path = DriverFaultPath().start()
    base = {
        **os.environ,
        **stack.env(),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "500",
        "SHARDSINK_STAGED_GRACE_MS": str(24 * 3600 * 1000),  # every state kept for the checker
    }
    base.pop("SHARDSINK_FAULTS", None)
    env = {
        **base,
        "SHARDSINK_SPARK_MASTER": cluster.master_url,
        "PYSPARK_SUBMIT_ARGS": path.submit_args(
            os.environ.get("PYSPARK_SUBMIT_ARGS", "--conf spark.python.authenticate.socketTimeout=120s")
        ),
    }
    settings = ServiceSettings.from_env_and_args(None, base)
    cid = sid = f"cluster-net-{unique_id}"
    topic = f"desired-cluster-net-{unique_id}"
    ensure_control_topics(settings)
    ensure_topic(settings.kafka, topic, 2)
    create_collection(settings, cid, SCHEMA)
    settings.catalog().create_sink(SinkDef(sid, topic, cid))

    logs = tmp_path / "logs"
    logs.mkdir()
    shard = Shard.open(settings.store(), cid)
    run_ = SteadyRun([sys.executable, "-m", "services", "--sink", sid], env, logs, shard,
                     DesiredProducer(settings.kafka, topic, SCHEMA), 3233, 40)
    wait_upper, workload = run_.wait_upper, run_.workload
    t_run = time.monotonic()
    ok = False
    fault: dict[str, Any] = {}
    try:
        run_.start()
        wait_upper(2 * chaos.STEP_TIMES, WAIT_S, "first appends on the cluster")
        wait_upper(workload.frontier, CATCH_UP_S, "in step before the partition")
        before = cluster.executor_pids()
        assert len(before) == 2, f"expected one executor per worker, found {before}"
        app_before = active_app_ids(cluster)
        assert len(app_before) == 1, f"expected the services' application alone on the master, found {app_before}"
        carried = path.counters()
        assert all(c["accepted"] > 0 for c in carried.values()), (
            f"expected the executors to reach the driver through both proxies, found {carried}"
        )
        launched_before = len(cluster.executor_dirs())
        resets_before = sum(p.counters.resets for p in path.proxies)

        path.partition()
        t_fault = time.monotonic()
        run_.hold(DRIVER_PARTITION_S, "driver partitioned from the executors")
        upper_at_heal, frontier_at_heal = run_.upper(), workload.frontier
        ended = [pid for pid in before if pid not in cluster.executor_pids()]
        path.heal()
        t_heal = time.monotonic()
        moved = wait_upper(upper_at_heal + 1, CATCH_UP_S, "after the heal")
        caught_up = wait_upper(frontier_at_heal, CATCH_UP_S, "catching up after the heal")
        wait_upper(workload.frontier, CATCH_UP_S, "in step after the heal")

        deadline = time.monotonic() + CATCH_UP_S  # the executors that could not connect are gone
        while len(now := cluster.executor_pids()) != 2 or set(now) & set(before):
            assert time.monotonic() < deadline, f"expected two new executors, found {now} (before: {before})"
            time.sleep(0.5)
        app_after = active_app_ids(cluster)
        dirs = cluster.executor_dirs()
        fault = {
            "fault": "driver_executors_partition",
            "seconds": round(t_heal - t_fault, 1),
            "connections_reset": sum(p.counters.resets for p in path.proxies) - resets_before,
            "executors_ended_by_partition": len(ended),
            "executors_launched": len(dirs) - launched_before,
            "executor_exits": executor_exit_causes(dirs[launched_before - len(before):]),
            "upper_at_heal": upper_at_heal,
            "frontier_at_heal": frontier_at_heal,
            "heal_to_upper_s": round(moved - t_heal, 2),
            "heal_to_caught_up_s": round(caught_up - t_heal, 2),
        }
        summary: dict[str, Any] = {
            "faults": [fault],
            "proxies": path.counters(),
            "executors_now": now,
        }
        divergences = run_.finish(CATCH_UP_S, summary)
        summary["seconds"] = round(time.monotonic() - t_run, 1)
        print(json.dumps(summary, default=str))
        assert divergences == [], divergences
        assert summary["doubled_updates"] == 0 and summary["lost_updates"] == 0
        assert summary["appends"] and summary["append_contents_checked"] == summary["appends"]
        assert fault["connections_reset"], f"expected the partition to reset the executors' connections, found {fault}"
        assert app_after == app_before, (
            f"expected the driver to keep its application on the master, found {app_after} (before: {app_before})"
        )
        assert fault["heal_to_upper_s"] <= DRIVER_HEAL_BOUND_S, (
            f"expected the upper to move within {DRIVER_HEAL_BOUND_S}s of the heal, found {fault}"
        )
        ok = True
    finally:
        run_.stop()
        path.stop()
        if not ok:
            print(f"fault: {fault}\n{run_.tail(200)}", file=sys.stderr)
