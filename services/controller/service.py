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
                       again after a transient failure, stop) put together from the rooms:
                       the table from command kind to handler, the list of tick steps
``loop.py``            command dispatch through that table, the commit order of a command,
                       recovery, the tick
``context.py``         the one context the rooms share: settings, store, catalog, section,
                       open collections, waiting peeks, producer; catalog commits, answers
``model.py``           settings and the in-memory records the rooms share
``collections_sinks``  collections, sinks, read policies, drops, ``Append``
``peeks.py``           ``Peek`` / ``CancelPeek``: snapshots answered inline or on S3
``subscribes.py``      ``Subscribe`` / ``CancelSubscribe``: chunked output, resume counting
``capabilities.py``    read capabilities and since (holds, ``downgrade_since``)
``frontiers.py``       ``FrontierUpper`` reports
``maintenance.py``     the compaction/gc worker thread, reclaiming dropped collections
``spark_jobs.py``      merges, gc sweeps, peeks and snapshots as Spark jobs (large work)
=====================  ======================================================================

Each room is an object handed the context (and, where it needs another room's behaviour,
that room: capabilities asks maintenance for merges); none imports the loop, and the loop
imports no room. The client side (send a command, wait for its response) is
:mod:`shared.io.controller_client`.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Self

from services.controller.capabilities import CapabilitiesRoom
from services.controller.collections_sinks import CollectionsRoom
from services.controller.context import AnswerUndelivered, ControllerContext, log
from services.controller.frontiers import FrontiersRoom
from services.controller.loop import _TRANSIENT, CommandLoop, Handler, TickStep
from services.controller.maintenance import Maintenance, MaintenanceRoom
from services.controller.model import READER_ID, ControllerSettings, OpenCollection, PendingPeek
from services.controller.peeks import PeeksRoom
from services.controller.spark_jobs import ControllerSpark
from services.controller.subscribes import SubscribesRoom
from services.sinkio import ControlProducer
from shared.catalog import Catalog, FencedError
from shared.controller_state import ControllerSection
from shared.io.kafka import consume_available
from shared.io.s3 import S3ObjectStore

__all__ = [
    "READER_ID",
    "CommandLoop",
    "Controller",
    "ControllerSettings",
    "Maintenance",
    "PendingPeek",
    "Rooms",
    "command_handlers",
    "new_command_id",
    "tick_steps",
]


@dataclass(frozen=True, slots=True)
class Rooms:
    """The controller's rooms, each handed the one context."""

    collections_sinks: CollectionsRoom
    peeks: PeeksRoom
    subscribes: SubscribesRoom
    capabilities: CapabilitiesRoom
    frontiers: FrontiersRoom
    maintenance: MaintenanceRoom

    @staticmethod
    def of(ctx: ControllerContext) -> Rooms:
        maintenance = MaintenanceRoom(ctx)
        return Rooms(
            collections_sinks=CollectionsRoom(ctx),
            peeks=PeeksRoom(ctx),
            subscribes=SubscribesRoom(ctx),
            capabilities=CapabilitiesRoom(ctx, maintenance),
            frontiers=FrontiersRoom(ctx),
            maintenance=maintenance,
        )


def command_handlers(r: Rooms) -> dict[str, Handler]:
    """The command loop's table: each command kind (schemas/command.avsc) and its handler."""
    return {
        "CreateCollection": r.collections_sinks.create_collection,
        "AlterCollection": r.collections_sinks.alter_collection,
        "SetReadPolicy": r.collections_sinks.set_read_policy,
        "DropCollection": r.collections_sinks.drop_collection,
        "CreateSink": r.collections_sinks.create_sink,
        "DropSink": r.collections_sinks.drop_sink,
        "AllowWrites": r.collections_sinks.allow_writes,
        "Append": r.collections_sinks.append,
        "Peek": r.peeks.peek,
        "CancelPeek": r.peeks.cancel_peek,
        "Subscribe": r.subscribes.subscribe,
        "CancelSubscribe": r.subscribes.cancel_subscribe,
    }


def tick_steps(r: Rooms) -> list[TickStep]:
    """The steps of a tick, in order, after the loop read the heads that are due (the loop
    then commits the offsets of an idle loop)."""
    return [
        r.frontiers.report_uppers,  # report upper advances
        r.peeks.retire_peeks,  # answer waiting peeks now readable, dropped or timed out
        r.subscribes.advance_subscribes,  # the next output step of each running subscribe
        r.capabilities.move_sinces,  # move sinces; ask the maintenance worker to merge
        r.maintenance.reclaim,  # delete the storage of dropped collections
        r.maintenance.maybe_gc,  # the routine gc
    ]


class Controller:
    """The controller process. Construct with :class:`ControllerSettings`; :meth:`start` runs
    it in a thread, :meth:`run` in the calling one.

    It holds the context the rooms share (``ctx``), the rooms and the command loop; the
    context's state is read (and, for tests, replaced) through the properties below."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.ctx = ControllerContext(settings)
        self.rooms = Rooms.of(self.ctx)
        self.loop = CommandLoop(
            self.ctx, command_handlers(self.rooms), tick_steps(self.rooms),
            resume_peeks=self.rooms.peeks.resume_pending, start_maintenance=self.rooms.maintenance.start,
        )
        #: Set once this controller has been fenced out by a newer one (it stopped writing).
        self.fenced = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        #: Answers committed whose delivery failed (:class:`AnswerUndelivered`), sent again
        #: once recovery has a new producer.
        self._unsent: list[tuple[bytes, str | None]] = []

    # -- the context's state ------------------------------------------------------------------
    @property
    def store(self) -> S3ObjectStore:
        return self.ctx.store

    @store.setter
    def store(self, store: S3ObjectStore) -> None:
        self.ctx.store = store

    @property
    def producer(self) -> ControlProducer | None:
        return self.ctx.producer

    @producer.setter
    def producer(self, producer: ControlProducer | None) -> None:
        self.ctx.producer = producer

    @property
    def catalog(self) -> Catalog:
        return self.ctx.catalog

    @property
    def epoch(self) -> int:
        return self.ctx.epoch

    @property
    def section(self) -> ControllerSection:
        return self.ctx.section

    @property
    def collections(self) -> dict[str, OpenCollection]:
        return self.ctx.collections

    @property
    def peeks(self) -> dict[str, PendingPeek]:
        return self.ctx.peeks

    @property
    def spark_jobs(self) -> ControllerSpark | None:
        return self.ctx.spark_jobs

    @property
    def maintenance(self) -> Maintenance | None:
        return self.rooms.maintenance.worker

    @property
    def head_reads(self) -> int:
        return self.loop.head_reads

    @property
    def sub_codec(self) -> Any:
        return self.rooms.subscribes.sub_codec

    def tick(self) -> None:
        self.loop.tick()

    def _produce_step(self, sid: str, topic: str, msgs: Any, known: tuple[int, int]) -> None:
        self.rooms.subscribes.produce_step(sid, topic, msgs, known)

    def _count_on_topic(self, topic: str, sid: str, start: int) -> tuple[int, int]:
        return self.rooms.subscribes.count_on_topic(topic, sid, start)

    # -- the process ----------------------------------------------------------------------------
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
                    if isinstance(e, AnswerUndelivered):
                        self._unsent.extend(e.responses)
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
            if self.ctx.spark_jobs is not None:
                try:
                    self.ctx.spark_jobs.stop()
                except Exception as e:  # noqa: BLE001 - stopping: nothing left to do about it
                    log.warning("controller: stopping the Spark session failed: %r", e)

    def run(self) -> None:
        """Recover, then serve until stopped or fenced."""
        loop, ctx = self.loop, self.ctx
        try:
            loop.recover()
            if self._unsent:  # answers committed before a delivery failure: sent again
                for value, key in self._unsent:
                    ctx.send(value, key)
                ctx.flush()
                self._unsent = []
            self._ready.set()
            tick_s = self.settings.tick_ms / 1000.0
            next_tick = time.monotonic()
            while not self._stop.is_set():
                msgs = consume_available(loop.consumer, 64, max(0.0, next_tick - time.monotonic()))
                commanded = False
                for m in msgs:
                    if m.error() is not None:
                        log.warning("commands consumer: %s", m.error())
                        continue
                    if m.topic() == self.settings.service.frontiers_topic:
                        loop.note_announcement(m.value())
                        continue
                    loop.handle_message(int(m.partition()), int(m.offset()), m.value())
                    commanded = True
                # A command's effects are ticked at once; announcements wait for the tick that
                # is due (each sink appending would otherwise add ticks, each a catalog read).
                if not commanded and time.monotonic() < next_tick:
                    continue
                next_tick = time.monotonic() + tick_s
                try:
                    self.tick()
                except (FencedError, AnswerUndelivered):
                    raise
                except Exception as e:  # noqa: BLE001 - a bad tick must not stop the loop
                    log.error("tick failed: %r", e, exc_info=True)
                    self._stop.wait(0.2)
        except FencedError as e:
            self.fenced = True
            log.error("fenced out by a newer controller: %s", e)
        finally:
            self.rooms.maintenance.stop()
            loop.close()
            self.rooms.subscribes.close()
            if ctx.producer is not None:
                try:
                    ctx.producer.flush(5)
                except Exception:  # noqa: BLE001
                    pass
                ctx.producer = None


def new_command_id() -> str:
    return uuid.uuid4().hex
