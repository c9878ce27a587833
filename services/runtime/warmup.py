"""Start a service's Python workers while the service starts, before its queries need them.

A query on a Python data source needs Python processes that Spark starts on first use, one
after another: a worker to create the data source at query start, one to plan the read at the
first trigger, and the executors' daemon and workers for the first tasks. Spark creates every
Python worker of an application under one lock (``SparkEnv.createPythonWorker`` is
synchronized), so they also wait for each other. On a restart they are on the critical path:
measured on this project's 2-core machines, 2.8 s from the SparkContext's start to the
services' start, then 1.7 s to start the write query, 3.1 s to its first job and 2.8 s for
that job's first tasks, of a 12.3 s recovery.

:func:`warm_up` reads a one-row batch data source (``shardsink-warmup``) in a background
thread right after the SparkSession exists, while the services read the catalog and set up
their topics and queries (work that needs no Python worker). That read starts the daemons of
the data source's creation, of read planning and of the executors' tasks, and leaves their
workers idle in Spark's pool, where the queries' own planning and first tasks reuse them
(``spark.python.worker.reuse``, Spark's default). Its tasks import what a write task imports
and load the S3 client's service model, which the reused workers then have. Spark stops idle
workers after a minute; nothing else stays behind. A failure only costs the time saved: it is
logged at debug level and the services start as before.

Measured (SIGKILLed write process of the three-process deployment, back in step; 3 kills per
run, 2 runs each, quiet machine): 10.9-12.0 s with the warm-up, 12.3-12.9 s without. Warming
the executors first with an RDD job (it needs no planning worker, so it could start sooner)
measured worse, 13.1-13.3 s: its tasks held the task slots and the creation lock when the
queries wanted them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

log = logging.getLogger("shardsink.warmup")

WARMUP_SOURCE = "shardsink-warmup"

#: What a write task imports (the executors' daemon loads most of it already:
#: services/runtime/worker_daemon.py), imported in the warm-up's tasks.
TASK_MODULES = ("services.write.executor", "services.write.source", "services.sinkio", "shared.shard")


class _WarmupReader(DataSourceReader):
    def __init__(self, tasks: int) -> None:
        self.tasks = tasks

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(i) for i in range(self.tasks)]

    def read(self, partition: Any) -> Iterator[tuple[int]]:
        _prepare_task()
        yield (int(partition.value),)


def _prepare_task() -> None:
    """What a write task needs before its first step, done in a warm-up task's worker."""
    import importlib

    for name in TASK_MODULES:
        importlib.import_module(name)
    import botocore.session

    # The S3 client's service model (a JSON load botocore caches per process).
    botocore.session.get_session().get_service_model("s3")


class WarmupDataSource(DataSource):
    """``shardsink-warmup``: ``tasks`` rows (option, default 2), one per task."""

    @classmethod
    def name(cls) -> str:
        return WARMUP_SOURCE

    def schema(self) -> str:
        return "task int"

    def reader(self, schema: Any) -> DataSourceReader:
        return _WarmupReader(max(1, int(self.options.get("tasks", "2"))))


def warm_up(spark: Any, tasks: int = 2) -> threading.Thread:
    """Read ``shardsink-warmup`` with ``tasks`` tasks in a daemon thread (see the module
    docstring); returns the thread."""

    def run() -> None:
        t0 = time.monotonic()
        try:
            spark.dataSource.register(WarmupDataSource)
            spark.read.format(WARMUP_SOURCE).option("tasks", str(tasks)).load().collect()
            log.debug("Python workers warmed up in %.2f s", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - only the time it would have saved is lost
            log.debug("warming up Python workers failed after %.2f s: %r", time.monotonic() - t0, e)

    th = threading.Thread(target=run, name="python-worker-warmup", daemon=True)
    th.start()
    return th
