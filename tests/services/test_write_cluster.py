"""The sink on a Spark standalone cluster (issue 11, test 3): a master and two workers (one
core each) started from the pyspark wheel's ``spark-class`` on 127.0.0.1, the services
(``python -m services``: mint, write and append in one application) attached in client mode
with ``SHARDSINK_SPARK_MASTER=spark://...``, the real broker and S3 server.

A workload with retractions runs; the shard equals the model at every upper the test saw.
Then one executor is SIGKILLed mid-run: the master gives the application a new executor,
Spark reruns the lost tasks (the writer partitions' state comes back from the checkpoint),
and the shard still equals the model at every upper, with no update doubled or lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.devstack.embedded import EmbeddedStack, SparkStandalone
from shared.io.desired_producer import DesiredProducer
from shared.shard import Shard
from tests.services.test_sink_crash import SCHEMA, UpperWatch, as_counter, diff_summary
from tests.services.test_write_recovery import SteadyWork

REPO = Path(__file__).resolve().parents[2]
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
