"""Shared queries survive a SIGKILL (issue 34, test 4): ``python -m services`` with
``SHARDSINK_QUERIES=shared`` serving 10 sinks is killed (its whole process group: driver, JVM,
Python workers) in the middle of a workload and started again. Every sink then equals its
model at every upper seen, with a contiguous chain of uppers (no update lost or doubled), and
the write query resumed from its checkpoint: no micro-batch after the restart starts any sink
below the offsets of the last micro-batch committed before the kill, and the offsets log goes
on instead of starting over. A SIGTERM to the process group then stops it with exit code 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.runtime.settings import ServiceSettings
from shared.catalog import SinkDef
from shared.devstack.embedded import EmbeddedStack
from tests.services.test_shared_queries import Sink
from tests.services.test_sink_e2e import Harness

REPO = Path(__file__).resolve().parents[2]
SINKS = 10
START_TIMEOUT_S = 300.0
CONVERGE_S = 300.0


class AllInOne:
    """``python -m services`` in its own process group."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []

    def start(self) -> None:
        log = self.log_dir / f"services.{len(self.logs) + 1}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "services"], cwd=REPO, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        needles = [f'"msg": "started the shared {n} query"' for n in ("mint", "write", "append")]
        while not all(n in self.logs[-1].read_text(errors="replace") for n in needles):
            assert self.proc is not None and self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"expected the three shared queries within {START_TIMEOUT_S}s: {self.tail()}"
            time.sleep(0.2)

    def kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)

    def terminate(self) -> int:
        """SIGTERM to the whole process group (driver, JVM and Python workers at once, as
        ``kill -- -<pgid>`` or a service manager's control group stop sends it): the exit code."""
        p, self.proc = self.proc, None
        assert p is not None
        os.killpg(p.pid, signal.SIGTERM)
        return p.wait(timeout=120)

    def tail(self) -> str:
        return "\n".join(self.logs[-1].read_text(errors="replace").splitlines()[-30:]) if self.logs else ""


def offsets_log(checkpoint: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for f in (checkpoint / "offsets").iterdir():
        if f.name.isdigit():
            out[int(f.name)] = json.loads(f.read_text().splitlines()[2])
    return out


def committed(checkpoint: Path) -> int:
    return max(int(f.name) for f in (checkpoint / "commits").iterdir() if f.name.isdigit())


@pytest.fixture
def services(stack: EmbeddedStack, tmp_path: Path, unique_id: str) -> Iterator[tuple[AllInOne, ServiceSettings]]:
    env = {
        **os.environ, **stack.env(),
        "SHARDSINK_QUERIES": "shared",
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "SHARDSINK_CATALOG_POLL_MS": "300",
        "SHARDSINK_TOPIC_DESCS": f"descs-{unique_id}",
        "SHARDSINK_TOPIC_BATCHES": f"batches-{unique_id}",
        "SHARDSINK_TOPIC_FRONTIERS": f"frontiers-{unique_id}",
    }
    proc = AllInOne(env, tmp_path)
    try:
        yield proc, ServiceSettings.from_env_and_args(None, env)
    finally:
        proc.kill()


def converge(sinks: list[Sink], proc: AllInOne) -> None:
    deadline = time.monotonic() + CONVERGE_S
    while True:
        behind = [s for s in sinks if s.check() < s.work.frontier]
        if not behind:
            return
        assert time.monotonic() < deadline, (
            f"expected every sink at its frontier within {CONVERGE_S}s, found "
            f"{[(s.sid, s.seen[-1:], s.work.frontier) for s in behind][:4]}:\n{proc.tail()}")
        time.sleep(0.1)


@pytest.mark.timeout(1500)
def test_ten_sinks_survive_a_sigkill_of_the_shared_services_and_resume_from_the_checkpoint(
    services: tuple[AllInOne, ServiceSettings], unique_id: str
) -> None:
    proc, settings = services
    h = Harness(settings, None)  # type: ignore[arg-type]  # collections and workloads only
    sinks = [Sink(h, f"{unique_id}-{i}", seed=500 + i) for i in range(SINKS)]
    catalog = settings.catalog()
    for s in sinks:
        catalog.create_sink(SinkDef(s.sid, s.topic, s.cid))
    proc.start()
    proc.wait_started()
    for s in sinks:
        s.work.step(n=40, length=2)
    converge(sinks, proc)

    # Kill in the middle of a workload: steps produced, some in flight.
    for _ in range(2):
        for s in sinks:
            s.work.step(n=40, length=2)
    time.sleep(0.5)
    proc.kill()
    ckpt = Path(settings.checkpoint_dir) / "write-shared" / "query-0of1"
    last = committed(ckpt)
    before = offsets_log(ckpt)
    keys = {s.sid: f"{s.sid}@{catalog.state().sink(s.sid).epoch}" for s in sinks}
    resume_from = {k: before[last].get(k, {}) for k in keys.values()}
    assert all(sum(v.values()) > 0 for v in resume_from.values()), resume_from

    for s in sinks:  # more while the services are down
        s.work.step(n=40, length=2)
    proc.start()
    proc.wait_started()
    for s in sinks:
        s.work.step(n=40, length=2)
    converge(sinks, proc)

    for s in sinks:
        assert s.seen[-1] == s.work.frontier
        Harness.verify_uppers(s.shard, s.work)
        assert Harness.verify_history(s.shard, s.work) > 0
    after = offsets_log(ckpt)
    assert set(before) <= set(after) and max(after) > last, "expected the offsets log to go on, not start over"
    for b in sorted(after):
        if b <= last:
            assert after[b] == before[b], f"expected batch {b} unchanged by the restart"
            continue
        start = after[b - 1]
        for key, resumed in resume_from.items():
            low = {p: o for p, o in start.get(key, {}).items() if o < resumed.get(p, 0)}
            assert not low, f"expected batch {b} to start {key} at or above {resumed}, found {start.get(key)}"

    # Stopped by a SIGTERM to its process group, the JVM ends with the driver: the services
    # still stop their queries and exit 0.
    assert proc.terminate() == 0, proc.tail()
