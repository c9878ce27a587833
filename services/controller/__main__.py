"""``python -m services.controller``: run the controller until SIGTERM/SIGINT.

Settings: those of :class:`services.runtime.settings.ServiceSettings` plus the controller's own
(the rows of :data:`services.runtime.settings.SETTINGS` owned by the controller: variable,
flag, default and meaning; docs/operations.md renders them).

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

from services.runtime.settings import ServiceSettings, add_controller_arguments, controller_values
from services.runtime.logs import configure_logging
from services.runtime.metrics import start_controller_metrics
from services.controller.service import Controller, ControllerSettings
from services.controller.spark_jobs import SparkJobSettings


def settings_from(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ControllerSettings:
    e = dict(os.environ if env is None else env)
    values = controller_values(vars(args), e)
    spark = {k.removeprefix("spark."): v for k, v in values.items() if k.startswith("spark.")}
    own = {k: v for k, v in values.items() if not k.startswith("spark.")}
    return ControllerSettings(service=ServiceSettings.from_env_and_args(args, e), spark=SparkJobSettings(**spark), **own)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardsink-controller", description="run the controller")
    ServiceSettings.add_arguments(p)
    add_controller_arguments(p)
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
