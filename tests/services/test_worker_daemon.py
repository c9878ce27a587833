"""The Python worker daemon that forks workers with the sink's modules loaded
(``services/runtime/worker_daemon.py``): it may only fork while it has one thread."""

from __future__ import annotations

import os
import subprocess
import sys

from services.runtime import worker_daemon


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in worker_daemon.NO_THREADS}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_preload_leaves_one_thread():
    # every module a sink task imports, loaded in a fresh interpreter: still one thread
    assert _run("from services.runtime.worker_daemon import preload; print(preload())") == "1"


def test_the_thread_check_sees_library_threads():
    # without the settings the daemon applies, Arrow's allocator starts its background thread:
    # the check that sends the daemon back to Spark's own one sees it
    n = int(_run("import pyarrow as pa; pa.array(list(range(100000))); "
                 "from services.runtime.worker_daemon import threads; print(threads())",
                 JE_ARROW_MALLOC_CONF="background_thread:true"))
    assert n > 1


def test_the_data_path_daemon_is_configured():
    from services.runtime.spark import with_service_defaults

    class Builder:
        def __init__(self):
            self.conf = {}

        def config(self, k, v):
            self.conf[k] = v
            return self

    b = with_service_defaults(Builder())
    assert b.conf["spark.python.daemon.module"] == "services.runtime.worker_daemon"
