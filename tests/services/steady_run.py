"""The services under a steady workload, watched from S3, for the fault tests
(``test_sink_network_faults.py``, ``test_write_cluster.py``).

One :class:`SteadyRun` starts the services (one process, ``bench/chaos.py``'s ``Service``),
records every state of the shard (``StateRecorder``: each upper and when it was first seen)
and produces a step of inserts and retractions with a progress statement every 0.5 s
(``Workload``) on a thread. The fault tests wait on the upper, inject their fault, heal it and
call :meth:`SteadyRun.finish`: the last step converges, then the history checker of
``bench/chaos.py`` runs and the shard is compared with the model at every upper it had.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import chaos  # noqa: E402

#: Seconds between the workload's steps.
STEP_EVERY_S = 0.5


class SteadyRun:
    """Services ``argv`` with ``env`` (logs in ``logs``), the shard ``shard`` recorded, and a
    workload of ``per_step`` updates a step produced by ``producer`` (seeded by ``seed``)."""

    def __init__(self, argv: list[str], env: dict[str, str], logs: Path, shard: Any, producer: Any,
                 seed: int, per_step: int) -> None:
        self.logs = logs
        self.shard = shard
        self.producer = producer
        self.services = chaos.Service("services", argv, env, logs)
        self.recorder = chaos.StateRecorder(shard)
        self.workload = chaos.Workload(producer, random.Random(seed), per_step)
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._produce, name="workload", daemon=True)

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self.workload.step()
                self._stop.wait(max(0.0, STEP_EVERY_S - (time.monotonic() - t0)))
        except BaseException as e:  # noqa: BLE001 - surfaced by check_running
            self._errors.append(e)

    def start(self) -> SteadyRun:
        """The recorder, the services, then the workload."""
        self.recorder.start()
        self.services.start()
        self._thread.start()
        return self

    def tail(self, lines: int = 60) -> str:
        """The last lines of the services' log."""
        try:
            text = (self.logs / "services.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def check_running(self, what: str) -> None:
        """The services still run and the workload still produces."""
        code = self.services.exited()
        assert code is None, f"expected the services to keep running ({what}), found them exited with {code}:\n{self.tail()}"
        assert not self._errors, f"expected the workload to keep going ({what}), found {self._errors[0]!r}"

    def hold(self, seconds: float, what: str) -> None:
        """Let ``seconds`` pass, checking that everything still runs."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.check_running(what)
            time.sleep(0.2)

    def upper(self) -> int:
        """The highest upper the recorder has seen."""
        return self.recorder.reached[-1][1] if self.recorder.reached else 0

    def wait_upper(self, target: int, timeout_s: float, what: str) -> float:
        """Wait until the shard's upper reaches ``target``; the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while self.upper() < target:
            self.check_running(what)
            assert time.monotonic() < deadline, (
                f"expected the shard's upper to reach {target} within {timeout_s}s ({what}), found "
                f"{self.upper()}\n{self.tail()}"
            )
            time.sleep(0.1)
        return self.recorder.when(target) or time.monotonic()

    def finish(self, timeout_s: float, summary: dict[str, Any]) -> list[str]:
        """Stop the workload, produce a last step and wait until the shard reaches it, then
        check the history: ``summary`` gains the checker's figures (appends, doubled and lost
        updates, ...), ``query_restarts``, ``updates`` and ``every_upper_checked``; the
        divergences found come back (none when the shard equals the model at every upper)."""
        self._stop.set()
        self._thread.join(timeout=60)
        self.check_running("after the faults")
        final = self.workload.step()
        self.wait_upper(final, timeout_s, "final convergence")
        self.check_running("at the end")
        time.sleep(2.0)  # late appends, if any, land now and are checked too
        self.recorder.stop()
        self.recorder.poll_once()
        service_log = (self.logs / "services.log").read_text(errors="replace")
        summary["query_restarts"] = len(re.findall(r"query failed, restarting", service_log))
        summary["updates"] = len(self.workload.sent)
        divergences: list[str] = []
        chaos.check(summary, divergences, self.shard, self.recorder, self.workload, final, None, None, None, True)
        divergences += self.diverging_uppers(summary)
        return divergences

    def diverging_uppers(self, summary: dict[str, Any]) -> list[str]:
        """The shard at every upper it had against the model (the checker samples them)."""
        from shared.shard import DIFF, TIME

        head = self.shard.refresh()
        everything = self.shard.updates_between(head, 0, head.upper)
        uppers = sorted({int(s.upper.time) for s in self.recorder.states.values() if s.upper.time})
        out = []
        for u in uppers:
            at = everything.filter(pc.less(everything[TIME], pa.scalar(u, pa.uint64())))
            got = chaos.table_rows(at.select(["k", "v", DIFF]))
            want = chaos.model_at(self.workload.sent, u - 1)
            if got != want:
                out.append(f"expected the shard at upper {u} to equal the model: {chaos.differ(got, want)}")
        summary["every_upper_checked"] = len(uppers)
        return out

    def stop(self) -> None:
        """End everything (in a ``finally``): the workload, the recorder, the services."""
        self._stop.set()
        self.recorder.stop()
        self.services.kill()
        self.producer.close()
