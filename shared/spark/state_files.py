"""Each writer partition's state, versioned by micro-batch under the write query's checkpoint.

The task that processes writer partition ``p`` in micro-batch ``N`` (on an executor) loads the
newest version of ``p``'s state written by a batch before ``N``, processes its input, and
writes version ``N``: ``<checkpoint>/writer-state/<p>/<N>``. The driver commits batch ``N``
(``commits/N``) only after every task succeeded and the reports went out. So:

- the live state of a partition is its newest version at or below the last committed batch:
  a version above it was written by an attempt of a batch that did not commit, and Spark
  re-runs that batch (same id, same offsets) from the version below, overwriting it;
- a task attempt that failed and is retried (a lost executor, a failed micro-batch) loads the
  same version as the first attempt did, so a retry never sees half of an earlier attempt;
- a partition without input in a batch writes no version: its newest one stays live.

This is Spark's own state store protocol (versions by batch id, made live by the commit log),
kept in files the task reads and writes itself, so that a writer partition's step runs in the
one Python pass that reads its Kafka range (no shuffle to a stateful operator, no pandas
conversion): :mod:`services.write.source`. Speculative execution must stay off (Spark's
default): two attempts of one task at once would both write version ``N``.

The checkpoint must be reachable by every executor, as Spark's state store requires: a local
or mounted path (a shared volume on a cluster), or an ``s3a://bucket/prefix`` (also ``s3://``)
URI, written with the services' S3 credentials and endpoint. Versions older than the newest
:data:`KEEP` are deleted as new ones are written.

A process keeps the partition states it wrote last (:data:`_CACHE`): a task that lands in the
same Python worker as the partition's previous one, with no newer version written elsewhere
since, skips reading and decoding the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

#: Versions kept per partition (the newest is the live one or the one a re-run replaces).
KEEP = 3
_DIR = "writer-state"

#: Per process: (checkpoint, partition) -> (version, state object) of the last version saved.
_CACHE: dict[tuple[str, int], tuple[int, Any]] = {}


class WriterStateFiles:
    """The versions of every writer partition's state under one checkpoint."""

    def __init__(self, checkpoint: str, s3: Any = None) -> None:
        self.checkpoint = checkpoint.rstrip("/")
        u = urlparse(self.checkpoint)
        self._local: Path | None = None
        self._store: Any = None
        self._prefix = ""
        #: per partition, ``(batch_id, versions)``: what the last load for that batch listed,
        #: which that batch's save prunes from instead of listing again (an S3 LIST request on
        #: an ``s3a://`` checkpoint)
        self._listed: dict[int, tuple[int, list[int]]] = {}
        if u.scheme in ("", "file"):
            self._local = Path(u.path if u.scheme == "file" else self.checkpoint) / _DIR
        elif u.scheme in ("s3a", "s3"):
            from dataclasses import replace

            from shared.io.s3 import S3ObjectStore

            if s3 is None:
                raise ValueError(f"expected S3 settings for the checkpoint {checkpoint!r}, found none")
            self._store = S3ObjectStore(replace(s3, bucket=u.netloc, prefix=""))
            self._prefix = f"{u.path.strip('/')}/{_DIR}".lstrip("/")
        else:
            raise ValueError(
                f"expected a local path, file:, s3a: or s3: checkpoint for the writer state, found {checkpoint!r}"
            )

    # -- storage --------------------------------------------------------------------------
    def versions(self, wp: int) -> list[int]:
        """The versions of partition ``wp`` on storage, sorted."""
        if self._local is not None:
            try:
                return sorted(int(n) for n in os.listdir(self._local / str(wp)) if n.isdigit())
            except FileNotFoundError:
                return []
        base = f"{self._prefix}/{wp}/"
        names = (o.key[len(base):] for o in self._store.list(base))
        return sorted(int(n) for n in names if n.isdigit())

    def _read(self, wp: int, version: int) -> bytes:
        if self._local is not None:
            return (self._local / str(wp) / str(version)).read_bytes()
        data: bytes = self._store.get(f"{self._prefix}/{wp}/{version}")
        return data

    def _write(self, wp: int, version: int, data: bytes) -> None:
        if self._local is not None:
            d = self._local / str(wp)
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{version}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, d / str(version))
            return
        self._store.put(f"{self._prefix}/{wp}/{version}", data)  # a PUT replaces atomically

    def _delete(self, wp: int, version: int) -> None:
        if self._local is not None:
            (self._local / str(wp) / str(version)).unlink(missing_ok=True)
            return
        self._store.delete(f"{self._prefix}/{wp}/{version}")

    # -- versions -------------------------------------------------------------------------
    def load(self, wp: int, batch_id: int, decode: Any) -> tuple[int, Any] | None:
        """``(version, state)`` of the newest version of ``wp`` written before ``batch_id``
        (``decode(bytes)`` builds the state), None when there is none (a new partition)."""
        listed = self.versions(wp)
        self._listed[wp] = (batch_id, listed)
        older = [v for v in listed if v < batch_id]
        if not older:
            return None
        version = older[-1]
        cached = _CACHE.pop((self.checkpoint, wp), None)
        if cached is not None and cached[0] == version:
            return cached
        return version, decode(self._read(wp, version))

    def discard(self, wp: int, batch_id: int) -> None:
        """Delete version ``batch_id`` of ``wp``: an attempt of that micro-batch failed for the
        partition, and a version an earlier attempt of the same micro-batch wrote (before the
        driver's step failed and the batch ran again) must not become the live one: the
        partition's next step starts from the version before the batch, with its input again."""
        self._listed.pop(wp, None)
        if batch_id in self.versions(wp):
            self._delete(wp, batch_id)
        cached = _CACHE.get((self.checkpoint, wp))
        if cached is not None and cached[0] == batch_id:
            _CACHE.pop((self.checkpoint, wp), None)

    def save(self, wp: int, batch_id: int, data: bytes, state: Any) -> None:
        """Write version ``batch_id`` of ``wp`` (replacing one a failed attempt wrote) and
        delete versions beyond the newest :data:`KEEP`. ``state`` is what ``data`` encodes:
        kept for the next task of this partition in this process."""
        self._write(wp, batch_id, data)
        _CACHE[(self.checkpoint, wp)] = (batch_id, state)
        # One task at a time runs a partition's batch, so what this batch's load listed, with
        # the version just written, is what storage holds (a version gone since only makes the
        # delete below a no-op; one written since is newer, so never one deleted here).
        listed = self._listed.pop(wp, None)
        versions = sorted({*listed[1], batch_id}) if listed is not None and listed[0] == batch_id else self.versions(wp)
        for v in versions[:-KEEP]:
            self._delete(wp, v)
