"""The controller: a command loop over ``commands``, answering on ``responses``.

It owns the catalog (collections, sinks, read policies), a critical reader hold on every
collection's shard (so since = the meet of the read policy's implied capability and the
holds of peeks, subscribes and sinks), frontier reporting, peeks, subscribes and drops.
One process, one thread for the loop and one maintenance worker that compacts and
garbage-collects shards off the loop (a merge of many batches must not delay the answer to a
peek). With ``SHARDSINK_CONTROLLER_SPARK_MASTER`` set it is also a Spark driver: large
merges, gc sweeps, peeks and subscribe snapshots run as Spark jobs on the executors
(``spark_jobs.py``), while the loop, the catalog and every shard state write stay here.

Rooms (each module opens with its contract; the pure decisions are in
:mod:`shared.controller_state`):

=====================  ======================================================================
module                 responsibility
=====================  ======================================================================
``service.py``         this file: the :class:`Controller` process (start, serve, recover
                       again after a transient failure, stop) put together from the rooms
``loop.py``            command dispatch, the command log and its commit order, recovery,
                       the tick
``model.py``           settings and the in-memory records the rooms share
``collections_sinks``  collections, sinks, read policies, drops, ``Append``
``peeks.py``           ``Peek`` / ``CancelPeek``: snapshots answered inline or on S3
``subscribes.py``      ``Subscribe`` / ``CancelSubscribe``: chunked output, resume counting
``capabilities.py``    read capabilities and since (holds, ``downgrade_since``)
``frontiers.py``       ``FrontierUpper`` reports
``maintenance.py``     the compaction/gc worker thread, reclaiming dropped collections
``spark_jobs.py``      merges, gc sweeps, peeks and snapshots as Spark jobs (large work)
``client.py``          the client side: send a command, wait for its response
=====================  ======================================================================
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Self

from services.controller.capabilities import CapabilitiesRoom
from services.controller.collections_sinks import CollectionsRoom
from services.controller.frontiers import FrontiersRoom
from services.controller.loop import _TRANSIENT, CommandLoop, log
from services.controller.maintenance import Maintenance, MaintenanceRoom
from services.controller.model import READER_ID, ControllerSettings, PendingPeek
from services.controller.peeks import PeeksRoom
from services.controller.subscribes import SubscribesRoom
from shared.catalog import FencedError
from shared.io.kafka import consume_available

__all__ = [
    "READER_ID",
    "CommandLoop",
    "Controller",
    "ControllerSettings",
    "Maintenance",
    "PendingPeek",
    "new_command_id",
]


class Controller(CollectionsRoom, PeeksRoom, SubscribesRoom, CapabilitiesRoom, FrontiersRoom, MaintenanceRoom):
    """The controller process. Construct with :class:`ControllerSettings`; :meth:`start` runs
    it in a thread, :meth:`run` in the calling one."""

    def start(self) -> Self:
        """Run the loop in a thread; returns once the controller serves commands."""
        self._thread = threading.Thread(target=self._run_guarded, name="controller", daemon=True)
        self._thread.start()
        while not self._ready.wait(0.1):
            if not self._thread.is_alive():
                raise RuntimeError(f"controller failed to start: {self.error!r}")
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run_guarded(self) -> None:
        """Run; a transient failure (S3 or Kafka unreachable, an outcome unknown) while
        recovering or serving restarts from recovery with exponential backoff instead of
        stopping the process. Anything else stops it (recorded in ``error``)."""
        backoff = 0.5
        try:
            while True:
                try:
                    self.run()
                    return
                except _TRANSIENT as e:
                    if self._stop.is_set():
                        return
                    log.warning("controller: transient failure, recovering again in %.1fs: %r", backoff, e)
                    if self._stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, 30.0)
                except BaseException as e:  # noqa: BLE001 - recorded for start()/tests, logged
                    self.error = e
                    log.error("controller stopped: %r", e, exc_info=True)
                    return
        finally:
            self._ready.set()
            if self.spark_jobs is not None:
                try:
                    self.spark_jobs.stop()
                except Exception as e:  # noqa: BLE001 - stopping: nothing left to do about it
                    log.warning("controller: stopping the Spark session failed: %r", e)

    def run(self) -> None:
        """Recover, then serve until stopped or fenced."""
        try:
            self.recover()
            self._ready.set()
            tick_s = self.settings.tick_ms / 1000.0
            next_tick = time.monotonic()
            while not self._stop.is_set():
                msgs = consume_available(self.consumer, 64, max(0.0, next_tick - time.monotonic()))
                commanded = False
                for m in msgs:
                    if m.error() is not None:
                        log.warning("commands consumer: %s", m.error())
                        continue
                    if m.topic() == self.settings.service.frontiers_topic:
                        self._note_announcement(m.value())
                        continue
                    self._handle_message(int(m.partition()), int(m.offset()), m.value())
                    commanded = True
                # A command's effects are ticked at once; announcements wait for the tick that
                # is due (each sink appending would otherwise add ticks, each a catalog read).
                if not commanded and time.monotonic() < next_tick:
                    continue
                next_tick = time.monotonic() + tick_s
                try:
                    self.tick()
                except FencedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a bad tick must not stop the loop
                    log.error("tick failed: %r", e, exc_info=True)
                    self._stop.wait(0.2)
        except FencedError as e:
            self.fenced = True
            log.error("fenced out by a newer controller: %s", e)
        finally:
            if self.maintenance is not None:
                self.maintenance.stop()
                self.maintenance = None
            if self.consumer is not None:
                try:
                    self.consumer.close()
                except Exception:  # noqa: BLE001
                    pass
                self.consumer = None
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            if self.producer is not None:
                try:
                    self.producer.flush(5)
                except Exception:  # noqa: BLE001
                    pass
                self.producer = None


def new_command_id() -> str:
    return uuid.uuid4().hex
