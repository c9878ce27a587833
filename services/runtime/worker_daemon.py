"""PySpark's Python worker daemon, with the sink's modules loaded before it forks workers.

Spark starts one daemon per executor (``python -m pyspark.daemon pyspark.worker``) and forks a
worker from it for each concurrent Python task; a worker then imports what its function needs.
For the sink that is pyarrow, numpy, pandas, botocore, fastavro, confluent-kafka and the
project's codecs: 1.5 s of CPU per new worker on this project's 2-core machines, and 6 s of
wall time per task on the first micro-batch of a restarted write service, when its workers
are all new (measured: the restarted writer's first tasks ran 6.1 s, 0.4 s of it the write
step). With ``spark.python.daemon.module=services.runtime.worker_daemon`` (set by
:func:`services.runtime.spark.with_service_defaults`), the daemon imports them once and every worker
forked from it starts with them loaded.

Forking is only safe while the process has one thread (a lock held by another thread is held
forever in the child; Spark imports the worker module after the fork for that reason). Two of
these libraries start a thread when they load: Arrow's bundled jemalloc starts its background
thread, and numpy's OpenBLAS its thread pool. The daemon turns both off before importing
(``JE_ARROW_MALLOC_CONF=background_thread:false``, ``OPENBLAS_NUM_THREADS=1``; the sink uses
Arrow's default pool, mimalloc, and no BLAS), then checks that it still has one thread. If it
has more (another library version, another platform), it says so on stderr and replaces itself
with Spark's own daemon (``exec``: the threads go with the old image), which forks as before.

Only the data path's daemon (worker module ``pyspark.worker``) preloads; the short-lived
planning workers (``pyspark.sql.worker.*``) start as usual.
"""

from __future__ import annotations

import os
import sys

#: What a sink task imports (and everything they import).
PRELOAD = (
    "pyspark.worker",
    "numpy",
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.parquet",
    "pandas",
    "fastavro",
    "boto3",
    "confluent_kafka",
    "shared.avro_columns",
    "shared.shard",
    "shared.write_state",
    "shared.spark.kafka_connector",
    "services.sinkio",
    "services.write.executor",
    "services.write.source",
)

#: Libraries' own threads, turned off before they load (see the module docstring).
NO_THREADS = {"JE_ARROW_MALLOC_CONF": "background_thread:false", "OPENBLAS_NUM_THREADS": "1"}


def threads() -> int:
    """The number of threads of this process."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def preload() -> int:
    """Import :data:`PRELOAD` with the libraries' threads off; returns the thread count after."""
    import importlib

    for k, v in NO_THREADS.items():
        os.environ.setdefault(k, v)
    for name in PRELOAD:
        importlib.import_module(name)
    return threads()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "pyspark.worker":
        n = preload()
        if n > 1:
            print(f"shardsink: the worker daemon has {n} threads after loading the sink's modules; "
                  "it runs Spark's own daemon instead (a process with threads cannot fork safely)",
                  file=sys.stderr, flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "pyspark.daemon", *sys.argv[1:]])
        import gc

        gc.freeze()  # the loaded modules are shared with the workers, never collected
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
