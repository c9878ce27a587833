"""Where each service's query keeps its checkpoint, and their clean-up."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from services.runtime.settings import ServiceSettings
from shared.catalog import SinkDef


def checkpoint_path(settings: ServiceSettings, service: str, sink: SinkDef) -> str:
    """The checkpoint of one service's query for one sink: ``<root>/<service>/<sink>-e<epoch>``.

    Durable across restarts for every service: the write query's holds the correction
    buffers (Spark state) with the offsets they reflect; mint's and append's hold their small
    driver state (:mod:`services.runtime.driver_state`) with theirs, so no restart re-reads a topic
    from its start. It must be on a path every executor of the write query reaches (a shared
    volume, or ``s3a://`` with hadoop-aws). A new epoch (re-created or adopted sink) starts
    new checkpoints; :func:`remove_checkpoints` deletes the old ones. One query per
    checkpoint: run one instance of each service per sink.
    """
    return f"{settings.checkpoint_dir.rstrip('/')}/{service}/{sink.sink_id}-e{sink.epoch}"


def hadoop_path(spark: Any, path: str) -> tuple[Any, Any]:
    """``(FileSystem, Path)`` of a checkpoint path through Hadoop (local paths and ``s3a://``)."""
    p = spark.sparkContext._jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), p


def remove_checkpoints(spark: Any, settings: ServiceSettings, service: str, keep: Callable[[str], bool]) -> list[str]:
    """Delete the checkpoints under ``<root>/<service>/`` whose name ``keep`` rejects
    (through Hadoop's FileSystem, so local paths and ``s3a://`` alike). Returns them."""
    fs, root = hadoop_path(spark, f"{settings.checkpoint_dir.rstrip('/')}/{service}")
    if not fs.exists(root):
        return []
    gone = []
    for st in fs.listStatus(root):
        name = st.getPath().getName()
        if not keep(name):
            fs.delete(st.getPath(), True)
            gone.append(name)
    return gone


def checkpoint_owner(name: str) -> tuple[str, int] | None:
    """``(sink id, epoch)`` of a checkpoint folder's name, None for another. (Folders named
    ``<sink>-e<epoch>-r<8 hex>`` are the fresh-per-start checkpoints mint and append had
    before theirs became durable: they belong to no one now.)"""
    m = re.fullmatch(r"(.+)-e(\d+)(-r[0-9a-f]{8})?", name)
    if not m:
        return None
    return (m.group(1), int(m.group(2))) if m.group(3) is None else ("", -1)
