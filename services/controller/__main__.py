"""``python -m services.controller``: run the controller until SIGTERM/SIGINT.

Settings: those of :class:`services.runtime.settings.ServiceSettings` plus

=================================  =====================  =========
variable                           flag                   default
=================================  =====================  =========
SHARDSINK_TOPIC_COMMANDS           --commands-topic       commands
SHARDSINK_TOPIC_RESPONSES          --responses-topic      responses
SHARDSINK_CONTROLLER_TICK_MS       --tick-ms              50
SHARDSINK_PEEK_TIMEOUT_MS          --peek-timeout-ms      30000
SHARDSINK_PEEK_MAX_INLINE_BYTES    --max-inline-bytes     65536
SHARDSINK_RECLAIM_GRACE_MS         --reclaim-grace-ms     0
SHARDSINK_GC_INTERVAL_MS           --gc-interval-ms       30000
=================================  =====================  =========

Spark jobs (variable, flag, default):

- ``SHARDSINK_CONTROLLER_SPARK_MASTER``, ``--spark-master``, '' (none: all in-process);
- ``SHARDSINK_CONTROLLER_SPARK_MIN_BYTES``, ``--spark-min-bytes``, 67108864 (64 MiB);
- ``SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS``, ``--spark-gc-min-objects``, 10000;
- ``SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS``, ``--spark-timeout-ms``, 600000.

With ``SHARDSINK_CONTROLLER_SPARK_MASTER`` set, merges, peeks and subscribe snapshots reading
at least ``SHARDSINK_CONTROLLER_SPARK_MIN_BYTES`` of parts, and gc sweeps of shards of at
least ``SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS`` data objects, run as Spark jobs
(:mod:`services.controller.spark_jobs`); the controller is their driver in client mode, with
the Spark options of ``PYSPARK_SUBMIT_ARGS`` (``spark.driver.host``, ``spark.cores.max``, ...).
It is not ``SHARDSINK_SPARK_MASTER`` (the sink services' master, default ``local[2]``): the
controller stays one small process unless told otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence

from services.runtime.settings import ServiceSettings
from services.runtime.logs import configure_logging
from services.runtime.metrics import start_controller_metrics
from services.controller.service import Controller, ControllerSettings
from services.controller.spark_jobs import SparkJobSettings


def settings_from(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ControllerSettings:
    e = dict(os.environ if env is None else env)
    a = vars(args)

    def pick(flag: str, var: str, default: str) -> str:
        v = a.get(flag)
        return str(v) if v not in (None, "") else e.get(var, default)

    return ControllerSettings(
        service=ServiceSettings.from_env_and_args(args, e),
        commands_topic=pick("commands_topic", "SHARDSINK_TOPIC_COMMANDS", "commands"),
        responses_topic=pick("responses_topic", "SHARDSINK_TOPIC_RESPONSES", "responses"),
        tick_ms=int(pick("tick_ms", "SHARDSINK_CONTROLLER_TICK_MS", "50")),
        peek_timeout_ms=int(pick("peek_timeout_ms", "SHARDSINK_PEEK_TIMEOUT_MS", "30000")),
        max_inline_bytes=int(pick("max_inline_bytes", "SHARDSINK_PEEK_MAX_INLINE_BYTES", "65536")),
        reclaim_grace_ms=int(pick("reclaim_grace_ms", "SHARDSINK_RECLAIM_GRACE_MS", "0")),
        gc_interval_ms=int(pick("gc_interval_ms", "SHARDSINK_GC_INTERVAL_MS", "30000")),
        head_refresh_ms=int(pick("head_refresh_ms", "SHARDSINK_CONTROLLER_HEAD_REFRESH_MS", "1000")),
        spark=SparkJobSettings(
            master=pick("spark_master", "SHARDSINK_CONTROLLER_SPARK_MASTER", "") or None,
            min_bytes=int(pick("spark_min_bytes", "SHARDSINK_CONTROLLER_SPARK_MIN_BYTES", str(64 * 1024 * 1024))),
            gc_min_objects=int(pick("spark_gc_min_objects", "SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS", "10000")),
            timeout_ms=int(pick("spark_timeout_ms", "SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS", "600000")),
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardsink-controller", description="run the controller")
    ServiceSettings.add_arguments(p)
    p.add_argument("--commands-topic")
    p.add_argument("--responses-topic")
    p.add_argument("--tick-ms", type=int)
    p.add_argument("--peek-timeout-ms", type=int)
    p.add_argument("--max-inline-bytes", type=int)
    p.add_argument("--reclaim-grace-ms", type=int)
    p.add_argument("--gc-interval-ms", type=int)
    p.add_argument("--head-refresh-ms", type=int,
                   help="read the head of a collection nobody waits on at least this often "
                        "(SHARDSINK_CONTROLLER_HEAD_REFRESH_MS)")
    p.add_argument("--spark-master", help="Spark master of the controller's jobs (SHARDSINK_CONTROLLER_SPARK_MASTER)")
    p.add_argument("--spark-min-bytes", type=int)
    p.add_argument("--spark-gc-min-objects", type=int)
    p.add_argument("--spark-timeout-ms", type=int)
    args = p.parse_args(argv)
    configure_logging("controller")
    controller = Controller(settings_from(args))
    stop = threading.Event()
    controller.start()
    start_controller_metrics(controller)

    def _h(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _h)
    signal.signal(signal.SIGINT, _h)
    while not stop.is_set() and controller.alive():
        time.sleep(0.2)
    controller.stop()
    return 2 if controller.fenced else (1 if controller.error else 0)


if __name__ == "__main__":
    raise SystemExit(main())
