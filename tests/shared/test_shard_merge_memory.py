"""A process that consolidates a large table keeps the memory it freed for its next arrays.

:func:`shared.shard_merge.keep_freed_memory` sets glibc's ``mallopt`` so that freed blocks up
to 32 MB stay in the heap (up to 64 MB of it): a merge's temporaries reuse the pages the
previous merge freed instead of faulting fresh ones in. Each check runs in a fresh Python
process (the setting is the process's, and this one's may already hold it): the page faults
of allocating again 48 MB of 8 MB arrays just freed, before and after the setting; the first
consolidation of a large table sets it; a process started with glibc's own environment
variables keeps them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's (the images and CI run on glibc)",
)

_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    import pyarrow as pa
    import shared.shard_merge as shard_merge

    def refaults():
        # 48 MB of 8 MB arrays, touched and freed; then the page faults of doing it again.
        def cycle():
            arrays = [np.ones(1 << 20, dtype=np.uint64) for _ in range(6)]
            del arrays
        cycle()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cycle()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    out = {"default": refaults()}
    if sys.argv[1] == "consolidate":
        n = 1 << 16
        table = pa.table({"k": pa.array(np.arange(n) % 1000), "_diff": pa.array(np.ones(n, dtype=np.int64))})
        out["rows"] = shard_merge.consolidate(table, ["k"]).num_rows
    else:
        out["set"] = shard_merge.keep_freed_memory()
    out["calls"] = shard_merge.keep_freed_memory.cache_info().misses
    out["kept"] = refaults()
    print(json.dumps(out))
    """
)


def _probe(mode: str, **env: str) -> dict[str, int]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=root, env=environ,
                          capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_freed_arrays_are_reused_without_page_faults_once_set() -> None:
    got = _probe("set")
    assert got["set"] is True
    # 48 MB is 12,288 pages of 4 KB: by default thousands fault in again (2,600-3,000 here;
    # fewer than 12,288 as glibc keeps some and the kernel may map huge pages); kept, few do.
    assert got["default"] > 1_000, got
    assert got["kept"] < got["default"] / 4, got


def test_the_first_large_consolidation_sets_it() -> None:
    got = _probe("consolidate")
    assert got["rows"] == 1000
    assert got["calls"] == 1
    assert got["default"] > 1_000, got
    assert got["kept"] < got["default"] / 4, got


def test_glibcs_own_environment_is_left_as_it_is() -> None:
    got = _probe("set", MALLOC_TRIM_THRESHOLD_="131072")
    assert got["set"] is False
    assert got["default"] > 1_000, got
    assert got["kept"] > got["default"] / 2, got
