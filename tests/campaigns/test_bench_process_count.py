"""How ``bench/bench_sinks.py`` counts the services' processes: live descendants only, an
exited child that its parent has not reaped (as Spark's JVM leaves its launcher's ``bash``)
counted apart, with its parent's live processes still counted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_sinks  # noqa: E402

#: A parent that starts a live child (sleeping) and a child that exits at once, and reaps neither.
_PARENT = """
import subprocess, sys, time
live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
done = subprocess.Popen([sys.executable, "-c", "pass"])
print(live.pid, done.pid, flush=True)
time.sleep(60)
"""


def test_an_exited_child_not_reaped_is_counted_apart_from_the_live_processes() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        live, done = (int(x) for x in parent.stdout.readline().split())
        deadline = time.monotonic() + 60
        while not bench_sinks._zombie(done):
            assert time.monotonic() < deadline, "expected the child that exits at once to become a zombie within 60 s"
            time.sleep(0.05)
        assert not bench_sinks._zombie(live) and not bench_sinks._zombie(parent.pid)
        for usage in (bench_sinks._tree_usage_proc(parent.pid), bench_sinks.tree_usage(parent.pid)):
            assert (usage.processes, usage.zombies) == (2, 1), f"expected the parent and its live child, and one zombie, found {usage}"
            assert usage.rss_bytes > 0
    finally:
        parent.kill()
        parent.wait(timeout=30)
