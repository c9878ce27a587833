"""The small state a query keeps on its driver, checkpointed with the query's offsets.

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
what came after them. The files go through Hadoop's FileSystem, so the checkpoint may be a
local or mounted path or an ``s3a://`` URI, like the rest of the checkpoint. Snapshots older
than the last :data:`KEEP` batches are deleted.
"""

from __future__ import annotations

import json
from typing import Any

from services.common import hadoop_path

#: Snapshots kept behind the newest (a re-run needs only the last committed one).
KEEP = 3
_DIR = "driver-state"


def batch_ids(spark: Any, checkpoint: str, sub: str) -> list[int]:
    """The batch ids logged under ``<checkpoint>/<sub>`` (``offsets``, ``commits``), sorted."""
    jvm = spark.sparkContext._jvm
    fs, root = hadoop_path(spark, checkpoint)
    d = jvm.org.apache.hadoop.fs.Path(root, sub)
    if not fs.exists(d):
        return []
    return sorted(int(st.getPath().getName()) for st in fs.listStatus(d) if st.getPath().getName().isdigit())


class DriverStateLog:
    """Snapshots of one query's driver state, one per batch, under its checkpoint."""

    def __init__(self, spark: Any, checkpoint: str) -> None:
        self.spark = spark
        self.checkpoint = checkpoint
        self._jvm = spark.sparkContext._jvm
        self._fs, root = hadoop_path(spark, checkpoint)
        self._dir = self._jvm.org.apache.hadoop.fs.Path(root, _DIR)

    def _path(self, name: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self._dir, name)

    def restore(self) -> dict[str, Any] | None:
        """The state saved for the last committed batch; None for a checkpoint without
        committed batches (a new query). A committed batch without its snapshot (a checkpoint
        written before snapshots existed, or damaged) raises :class:`FileNotFoundError`."""
        committed = batch_ids(self.spark, self.checkpoint, "commits")
        if not committed:
            return None
        path = self._path(str(committed[-1]))
        if not self._fs.exists(path):
            raise FileNotFoundError(
                f"expected the driver state of committed batch {committed[-1]} at {path.toString()}, found none"
            )
        stream = self._fs.open(path)
        try:
            data = bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()
        state: dict[str, Any] = json.loads(data.decode())
        return state

    def save(self, batch_id: int, state: dict[str, Any]) -> None:
        """Write batch ``batch_id``'s state (before Spark commits the batch), and delete
        snapshots more than :data:`KEEP` batches older."""
        data = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
        fs = self._fs
        final, tmp = self._path(str(batch_id)), self._path(f".{batch_id}.tmp")
        out = fs.create(tmp, True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()
        if fs.exists(final):
            fs.delete(final, False)
        if not fs.rename(tmp, final):
            raise OSError(f"expected to rename {tmp.toString()} to {final.toString()}, the file system refused")
        for st in fs.listStatus(self._dir):
            name = st.getPath().getName()
            if name.isdigit() and int(name) < batch_id - KEEP:
                fs.delete(st.getPath(), False)
