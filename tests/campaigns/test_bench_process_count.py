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

from shared.devstack.embedded import process_stat  # noqa: E402

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


def test_the_machine_s_cpu_is_split_between_the_tree_the_stack_the_load_and_the_rest() -> None:
    """A stack server that spins shows as ``broker``, the benchmark's own spinning as ``load``,
    and an idle one as none of it; the shares are of the whole machine (wall x cores)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        def stack_cpu() -> dict[str, float]:
            st = process_stat(spin.pid)
            assert st is not None
            return {"kafka": st.cpu_s, "s3": 0.0}

        before, w0 = bench_sinks.machine_cpu(stack_cpu), time.monotonic()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # this process spins as well: the load
            pass
        after, wall = bench_sinks.machine_cpu(stack_cpu), time.monotonic() - w0
        split = bench_sinks.cpu_split(before, after, "services", 0.0, wall, 2)
        assert split["services"] == 0.0 and split["s3_server"] == 0.0
        # each spinner takes at most one of the two cores (much less on a loaded machine), and
        # an idle process's share is 0 (the CPU clock counts 10 ms ticks)
        assert 0.02 < split["broker"] <= 0.55, split
        assert 0.02 < split["load"] <= 0.55, split
        assert split["other"] >= 0.0 and set(split) == {"services", "broker", "s3_server", "load", "other"}
    finally:
        spin.kill()
        spin.wait(timeout=30)
