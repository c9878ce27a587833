"""Maintenance: compaction and gc off the command loop, and reclaiming dropped collections.

Contract:

- inputs: requests from the tick (capabilities.py asks for compaction when since moved or
  the batch count changed; a routine gc every ``gc_interval_ms``); the ``reclaim`` list of
  the catalog's controller section (dropped collections and when their grace ends);
- state: the :class:`Maintenance` worker's pending jobs (at most one per collection, merged);
  ``reclaim[collection_id]`` in the catalog until a collection's storage is gone;
- outputs: merged batches (conditional state writes), deleted garbage (parts no state
  references, old states, old catalog states), a dropped collection's objects deleted;
  with a Spark master set, large merges and sweeps run as Spark jobs
  (:mod:`services.controller.spark_jobs`: executors read, merge and write parts; the
  merged batch is still swapped in here, by one conditional state write);
- invariants: a merge commits only if its batches are all still there (racing appends,
  other compactors or a drop are safe); gc never deletes what a live reader may still read;
  a failed job is retried after a pause (backoff up to 30 s); a reclaim is finished by the
  next controller after a crash (the list is durable).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from services.controller.context import ControllerContext, log
from services.controller.model import Tick
from services.controller.spark_jobs import ControllerSpark
from shared.catalog import CatalogState
from shared.controller_state import ControllerSection
from shared.errors import ShardDroppedError, ShardNotFoundError
from shared.objectstore import now_ms
from shared.shard import Shard


def shard_jobs(jobs: ControllerSpark | None) -> dict[str, Any]:
    """A shard handle's merger and sweeper: Spark's for large work when a master is set."""
    return {} if jobs is None else {"merger": jobs.merger, "sweeper": jobs.sweeper}


class Maintenance:
    """Compaction and gc of shards in one worker thread, off the command loop.

    The loop asks (:meth:`request`); the worker merges (``compact_since_moved`` when since
    moved, then the tiered ``compact``) and collects garbage. A merge commits only if its
    batches are all still there, so racing appends, other compactors or a drop are safe; a
    failed job is logged and run again after a pause (backoff up to 30 s). At most one job
    per collection is pending: requests for a collection already waiting merge into it.
    """

    def __init__(self, store: Any, grace_ms: int, *, max_merges: int = 8, jobs: ControllerSpark | None = None) -> None:
        self.store = store
        self.grace_ms = grace_ms
        #: Large merges and sweeps go to Spark through it (None: all in this process).
        self.jobs = jobs
        self.max_merges = max_merges
        self._jobs: dict[str, dict[str, bool]] = {}
        self._shards: dict[str, Shard] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self.jobs_done = 0
        self.errors = 0
        self._backoff = 0.5
        self._thread = threading.Thread(target=self._run, name="controller-maintenance", daemon=True)
        self._thread.start()

    def request(self, collection_id: str, *, below_since: bool = False, compact: bool = False, gc: bool = False) -> None:
        with self._cond:
            job = self._jobs.setdefault(collection_id, {"below_since": False, "compact": False, "gc": False})
            job["below_since"] |= below_since
            job["compact"] |= compact
            job["gc"] |= gc
            self._cond.notify()

    def forget(self, collection_id: str) -> None:
        with self._cond:
            self._jobs.pop(collection_id, None)
            self._shards.pop(collection_id, None)

    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                cid = next(iter(self._jobs))
                job = self._jobs.pop(cid)
                shard = self._shards.get(cid)
                if shard is None:
                    shard = self._shards[cid] = Shard(self.store, cid, grace_ms=self.grace_ms, **shard_jobs(self.jobs))
                self._busy = True
            retry = False
            try:
                self._do(cid, shard, job)
            except (ShardDroppedError, ShardNotFoundError):
                self.forget(cid)
            except Exception as e:  # noqa: BLE001 - the job is asked again after a pause
                self.errors += 1
                retry = True
                log.warning("maintenance failed, retrying in %.1fs: %r", self._backoff, e,
                            extra={"collection_id": cid})
            with self._cond:
                self._busy = False
                self.jobs_done += 1
                if retry:
                    self._cond.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, 30.0)
                else:
                    self._backoff = 0.5
            if retry:
                self.request(cid, **job)

    def _do(self, cid: str, shard: Shard, job: dict[str, bool]) -> None:
        # The job was asked for because the loop saw a new head (appends by the sink, a moved
        # since): plan from it, not from this handle's cached head, which is confirmed only
        # every half grace period and would hide those appends from the tiered compaction
        # (compact_since_moved reads the head itself).
        if not job["below_since"]:
            shard.refresh()
        if job["below_since"]:
            shard.compact_since_moved()
        if job["below_since"] or job["compact"]:
            if shard.compact(max_merges=self.max_merges) >= self.max_merges:
                self.request(cid, compact=True)  # more to merge: yield to other collections
        if job["gc"]:
            shard.gc()


class MaintenanceRoom:
    """The controller's maintenance room (see the module docstring): it owns the worker
    (started by each recovery, stopped at the end of each run)."""

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx
        self.worker: Maintenance | None = None
        self._last_gc = 0.0

    def start(self) -> None:
        ctx = self.ctx
        self.worker = Maintenance(ctx.store, ctx.settings.service.grace_ms, jobs=ctx.spark_jobs)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def request(self, collection_id: str, *, below_since: bool = False, compact: bool = False, gc: bool = False) -> None:
        """Ask the worker for a job on ``collection_id`` (:meth:`Maintenance.request`)."""
        assert self.worker is not None
        self.worker.request(collection_id, below_since=below_since, compact=compact, gc=gc)

    # -- drops -----------------------------------------------------------------------------------
    def reclaim(self, tick: Tick) -> None:
        """Tick step: delete the storage of dropped collections (the ``reclaim`` list)."""
        ctx = self.ctx
        done: list[str] = []
        for cid, due in ctx.section.reclaim.items():
            shard = Shard(ctx.store, cid, grace_ms=ctx.settings.service.grace_ms, **shard_jobs(ctx.spark_jobs))
            try:
                shard.drop()
            except ShardNotFoundError:
                done.append(cid)
                continue
            shard.gc(grace_ms=ctx.settings.reclaim_grace_ms)
            if now_ms() >= due and len(shard.list_objects()) <= 1:
                done.append(cid)
        if done:
            def t(s: CatalogState, sec: ControllerSection) -> None:
                for cid in done:
                    sec.reclaim.pop(cid, None)

            ctx.commit(t)

    def maybe_gc(self, tick: Tick) -> None:
        """Tick step: the routine gc of live shards and old catalog states, every
        ``gc_interval_ms``."""
        ctx = self.ctx
        if time.monotonic() - self._last_gc < ctx.settings.gc_interval_ms / 1000.0:
            return
        self._last_gc = time.monotonic()
        for cid in tick.live:
            self.request(cid, gc=True)
        ctx.catalog.collect(ctx.settings.service.grace_ms)
