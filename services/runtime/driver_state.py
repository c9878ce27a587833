"""The small state a query keeps on its driver, checkpointed with the query's offsets, and
the query's own logs read back from its checkpoint.

Mint and append keep their state in the driver (``foreachBatch``): the desired progress per
partition, the description in flight and its reports. Rebuilding it by reading ``descs``,
``batches`` and the desired topic from their first offset at every start grows with history
(and the topics' retention would cut that history short). Instead the state is kept next to
the query's own checkpoint, in step with Spark's commit protocol:

1. ``foreachBatch(batch N)`` does its work, then :meth:`DriverStateLog.save` writes the state
   as ``<checkpoint>/driver-state/<N>`` (a temporary file renamed into place);
2. Spark then commits batch N (``commits/N``);
3. on start, :meth:`DriverStateLog.restore` loads the state saved for the last committed batch.
   Spark re-runs a batch it planned and did not commit (``offsets/N+1`` without
   ``commits/N+1``) with the same offsets, from that state; a snapshot that batch may have
   saved before the crash is overwritten.

So the state always reflects exactly the offsets Spark resumes from, and a restart reads only
what came after them. Snapshots older than the last :data:`KEEP` batches are deleted.

:class:`CheckpointFiles` reads and writes under a checkpoint: with plain file operations for
a local or mounted path (Hadoop's local file system costs 5-20 ms a call through py4j), and
through Hadoop's FileSystem for any other scheme (``s3a://`` with hadoop-aws), like the rest
of the checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

#: Snapshots kept behind the newest (a re-run needs only the last committed one).
KEEP = 3
_DIR = "driver-state"


class CheckpointFiles:
    """Files under one query's checkpoint root (relative names with ``/``)."""

    def __init__(self, spark: Any, root: str) -> None:
        scheme = urlparse(root).scheme
        self.root = root
        self._local: Path | None = None
        if scheme in ("", "file"):
            self._local = Path(urlparse(root).path if scheme == "file" else root)
            return
        from services.runtime.checkpoints import hadoop_path

        self._jvm = spark.sparkContext._jvm
        self._fs, self._root = hadoop_path(spark, root)

    def _hpath(self, rel: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self._root, rel)

    def read(self, rel: str) -> bytes | None:
        """The file's bytes, None if it does not exist."""
        if self._local is not None:
            try:
                return (self._local / rel).read_bytes()
            except FileNotFoundError:
                return None
        p = self._hpath(rel)
        if not self._fs.exists(p):
            return None
        stream = self._fs.open(p)
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a temporary file, then rename it over ``rel``."""
        parent, _, name = rel.rpartition("/")
        tmp = f"{parent}/.{name}.tmp" if parent else f".{name}.tmp"
        if self._local is not None:
            path, tmp_path = self._local / rel, self._local / tmp
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp_path.write_bytes(data)
            os.replace(tmp_path, path)
            return
        final, tmp_h = self._hpath(rel), self._hpath(tmp)
        out = self._fs.create(tmp_h, True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()
        if self._fs.exists(final):
            self._fs.delete(final, False)
        if not self._fs.rename(tmp_h, final):
            raise OSError(f"expected to rename {tmp_h.toString()} to {final.toString()}, the file system refused")

    def ids(self, sub: str) -> list[int]:
        """The numeric file names under ``sub`` (batch ids of ``offsets``, ``commits``...), sorted."""
        if self._local is not None:
            try:
                return sorted(int(p.name) for p in (self._local / sub).iterdir() if p.name.isdigit())
            except FileNotFoundError:
                return []
        d = self._hpath(sub)
        if not self._fs.exists(d):
            return []
        return sorted(int(st.getPath().getName()) for st in self._fs.listStatus(d) if st.getPath().getName().isdigit())

    def delete(self, rel: str) -> None:
        if self._local is not None:
            (self._local / rel).unlink(missing_ok=True)
            return
        self._fs.delete(self._hpath(rel), False)

    def delete_all(self) -> None:
        """Remove the whole checkpoint."""
        if self._local is not None:
            import shutil

            shutil.rmtree(self._local, ignore_errors=True)
            return
        self._fs.delete(self._root, True)


def batch_ids(spark: Any, checkpoint: str, sub: str) -> list[int]:
    """The batch ids logged under ``<checkpoint>/<sub>`` (``offsets``, ``commits``), sorted."""
    return CheckpointFiles(spark, checkpoint).ids(sub)


def planned_offsets(files: CheckpointFiles, batch_id: int, source: int = 0) -> dict[str, Any] | None:
    """The end offsets Spark logged for micro-batch ``batch_id`` of the query's ``source``-th
    source (``offsets/<id>``: a version line, the batch's metadata, then one line per source),
    None if not logged."""
    data = files.read(f"offsets/{batch_id}")
    if data is None:
        return None
    lines = data.decode().splitlines()
    if len(lines) < 3 + source or lines[2 + source].strip() in ("", "-"):
        return None
    offsets: dict[str, Any] = json.loads(lines[2 + source])
    return offsets


class DriverStateLog:
    """Snapshots of one query's driver state, one per batch, under its checkpoint."""

    def __init__(self, spark: Any, checkpoint: str) -> None:
        self.files = CheckpointFiles(spark, checkpoint)

    def restore(self) -> dict[str, Any] | None:
        """The state saved for the last committed batch; None for a checkpoint without
        committed batches (a new query). A committed batch without its snapshot (a checkpoint
        written before snapshots existed, or damaged) raises :class:`FileNotFoundError`."""
        committed = self.files.ids("commits")
        if not committed:
            return None
        data = self.files.read(f"{_DIR}/{committed[-1]}")
        if data is None:
            raise FileNotFoundError(
                f"expected the driver state of committed batch {committed[-1]} under "
                f"{self.files.root}/{_DIR}, found none"
            )
        state: dict[str, Any] = json.loads(data.decode())
        return state

    def save(self, batch_id: int, state: dict[str, Any] | bytes) -> None:
        """Write batch ``batch_id``'s state (a JSON-able dict, or its JSON), before Spark
        commits the batch, and delete snapshots more than :data:`KEEP` batches older."""
        data = state if isinstance(state, bytes) else json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
        self.files.write_atomic(f"{_DIR}/{batch_id}", data)
        for old in self.files.ids(_DIR):
            if old < batch_id - KEEP:
                self.files.delete(f"{_DIR}/{old}")

    def reset(self) -> None:
        """Remove the whole checkpoint (the query then starts as new)."""
        self.files.delete_all()
