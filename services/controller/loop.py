"""The controller's command loop: dispatch through a table of handlers, the command log, recovery,
the tick as a list of steps.

Contract:

- inputs: ``commands`` (assign()ed partitions, offsets kept in the catalog), the catalog,
  the shards' heads, and the upper announcements on ``frontiers`` (read from its end, by the
  same consumer), which say whose head to read again;
- state: the catalog's controller section (:class:`shared.controller_state.ControllerSection`:
  offsets, command log, reported uppers, subscribes, pending reclaims), fenced by the
  controller epoch; in memory the open collections and the waiting peeks, rebuilt by
  :meth:`CommandLoop.recover`;
- outputs: one response per command on ``responses`` (answered from the command log when an
  id is replayed, never applied twice);
- invariants: every catalog write carries the epoch (a newer controller fences this one out);
  a command's offset is committed together with its logged response.

The loop (one iteration)::

    consume a few commands (and announcements: their collections' heads are read at the tick)
    for each: answer from the command log (a replayed id) or apply it (the handler of its
              kind in the loop's table: a bound method of a room, see service.py)
    tick: read the heads that are due (waited on, announced, or head_refresh_ms old), then
          run the tick steps in order (service.py): report upper advances (frontiers.py),
          retire waiting peeks (peeks.py), advance subscribes (subscribes.py), move sinces
          (capabilities.py; then the maintenance worker compacts and gcs), reclaim dropped
          collections and the routine gc (maintenance.py); then commit idle offsets

Commit order of a command (every catalog write is fenced by the controller epoch; steps 2 and
3 are :meth:`services.controller.context.ControllerContext.answer`):

1. idempotent effects outside the catalog, if any (create the shard; append with a token
   derived from the command id: a retry finds the token and is not applied twice);
2. one catalog commit: the command's catalog change, its response in the command log, and
   the command offset (``offsets[p] = o``: everything *before* o is answered);
3. produce the response, flush;
4. the next commit (or an idle commit) moves the offset past o.

After a crash between 2 and 4 the command at o is read again, found in the log, and its logged
response is sent again (identical bytes; applied once). A crash before 2 reapplies the command,
which is safe because the effects of step 1 are idempotent. A drop is committed first (the id
is dead at once) and its storage reclaimed by the tick from the ``reclaim`` list, so a crash
after the commit is finished by the next controller. Waiting peeks are logged as ``pending``
and restarted on recovery.

The loop is handed the context the rooms share, its table of handlers, its tick steps and the
two recovery steps that belong to rooms (restart the waiting peeks, start the maintenance
worker); it imports no room. :class:`services.controller.service.Controller` puts them
together and runs this loop in its process (start, serve, recover again after a transient
failure, stop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import TopicPartition

from services.controller.context import AnswerUndelivered, ControllerContext, log
from services.controller.model import Tick, heads_due
from services.sinkio import ControlProducer
from shared.catalog import Catalog, CatalogState, CollectionDef, FencedError
from shared.codec import kind_of, message_codec
from shared.controller_state import CommandRejected, ControllerSection
from shared.errors import (
    ConflictRetryError,
    DecodeError,
    IndeterminateError,
    KafkaDeliveryError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    ObjectStoreError,
    ShardsinkError,
)
from shared.io.kafka import OffsetProbe, new_consumer
from shared.io.kafka_admin import ensure_topic
from shared.state import ShardState

#: Failures the controller recovers from by itself (re-running recovery with backoff).
_TRANSIENT: tuple[type[BaseException], ...] = (
    ObjectStoreError, IndeterminateError, ConflictRetryError, KafkaUnavailableError, KafkaTimeoutError,
    KafkaDeliveryError, ConnectionError, TimeoutError,
)

#: A command's handler: ``(command_id, body, where, (partition, offset), raw command bytes)``.
#: It answers the command (through :meth:`ControllerContext.answer`) or raises: the loop
#: answers the exception as a typed ``Error``.
Handler = Callable[[str, dict[str, Any], str, tuple[int, int], bytes], None]

#: One step of the tick, run in order after the heads are read.
TickStep = Callable[[Tick], None]


class CommandLoop:
    """The command loop (see the module docstring): ``handlers`` maps a command kind to its
    handler, ``tick_steps`` are run in order at every tick; ``resume_peeks`` and
    ``start_maintenance`` are the rooms' parts of :meth:`recover`."""

    def __init__(
        self,
        ctx: ControllerContext,
        handlers: Mapping[str, Handler],
        tick_steps: Sequence[TickStep],
        *,
        resume_peeks: Callable[[], None],
        start_maintenance: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.handlers = dict(handlers)
        self.tick_steps = tuple(tick_steps)
        self.resume_peeks = resume_peeks
        self.start_maintenance = start_maintenance
        self.cmd_codec = message_codec("command")
        self.frontier_codec = message_codec("frontier_update")
        #: Shard heads the ticks read (:meth:`_heads`).
        self.head_reads = 0
        self.next_offsets: dict[int, int] = {}
        self._last_activity = time.monotonic()
        self.consumer: Any = None

    # ==============================================================================================
    # recovery (reconciliation with what the catalog and the shards say)
    # ==============================================================================================
    def recover(self) -> None:
        ctx = self.ctx
        s = ctx.settings
        k = s.service.kafka
        ctx.collections = {}
        ctx.peeks = {}
        ensure_topic(k, s.commands_topic, 1)
        ensure_topic(k, s.responses_topic, 1)
        # Every topic it writes exists first (responses above, a subscribe's output at its
        # Subscribe); one deleted later (tail deletes its own) is not brought back by a
        # metadata refresh of this producer, which would re-create it on brokers that create
        # topics on demand.
        ctx.producer = ControlProducer.create(k, "controller", auto_create_topics=False)
        if ctx.spark_jobs is not None:
            ctx.spark_jobs.start()  # in the background: the first job waits for it
        ctx.catalog = Catalog(ctx.store)
        # 1. fence out any older controller: from now on its catalog writes fail.
        ctx.epoch = ctx.catalog.claim_controller_epoch()
        state = ctx.catalog.state()
        ctx.section = ControllerSection.from_extra(state.extra)
        log.info("controller epoch %d, catalog seqno %d", ctx.epoch, state.seqno)
        # 2. every live collection: open its shard (creating it if a crash left only the
        #    catalog entry) and make sure the controller's critical hold is there.
        for c in state.live_collections():
            ctx.open_collection(c)
        # 3. waiting peeks are restarted from their logged command (peeks.py).
        self.resume_peeks()
        # 4. subscribes with an unfinished output step and dropped collections not yet
        #    reclaimed are finished by the tick. Commands sent while down are read from the
        #    recorded offsets.
        #    The same consumer reads ``frontiers`` from its end: an upper announced there is
        #    read at the next tick (every head was just read above).
        ensure_topic(k, s.service.frontiers_topic, 1)
        with OffsetProbe(k) as probe:
            parts = probe.partitions_of(s.commands_topic)
            fparts = probe.partitions_of(s.service.frontiers_topic)
            fends = probe.ends([(s.service.frontiers_topic, p) for p in fparts])
        self.consumer = new_consumer(k, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "20"})
        self.next_offsets = {p: int(ctx.section.offsets.get(str(p), 0)) for p in parts}
        self.consumer.assign([TopicPartition(s.commands_topic, p, o) for p, o in self.next_offsets.items()]
                             + [TopicPartition(t, p, o) for (t, p), o in fends.items()])
        self.start_maintenance()

    def close(self) -> None:
        """Close the commands consumer (at the end of a run; recovery opens a new one)."""
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # noqa: BLE001
                pass
            self.consumer = None

    # ==============================================================================================
    # the command loop
    # ==============================================================================================
    def note_announcement(self, value: bytes | None) -> None:
        """An upper announced on ``frontiers``: the tick reads that collection's head."""
        try:
            shard_id = str(self.frontier_codec.decode(value or b"")["shard_id"])
        except (DecodeError, KeyError, TypeError) as e:
            log.warning("frontiers: skipped an undecodable announcement: %s", e)
            return
        col = self.ctx.collections.get(shard_id)
        if col is not None:
            col.announced = True

    def handle_message(self, partition: int, offset: int, value: bytes | None) -> None:
        ctx = self.ctx
        self._last_activity = time.monotonic()
        where = f"{partition}:{offset}"
        self.next_offsets[partition] = offset + 1
        try:
            cmd = self.cmd_codec.decode(value or b"")
            command_id = str(cmd["command_id"])
            body = cmd["body"]
            kind = kind_of(body)
        except (DecodeError, KeyError, TypeError) as e:
            err = DecodeError(f"expected a Command message, found undecodable bytes at commands {where}: {e}")
            ctx.send(ctx.error_for("unknown", err), "unknown")
            ctx.flush()
            return
        # A replayed id is answered from the log, never applied again.
        entry = ctx.section.log.get(command_id)
        if entry is not None:
            if "pending" in entry:
                return  # a waiting peek: its answer comes when it is retired
            logged = ctx.logged_response(entry)
            if logged is not None:
                ctx.send(logged, command_id)
                ctx.flush()
                return
        handler = self.handlers.get(kind)
        off = (partition, offset)
        try:
            if handler is None:
                raise CommandRejected("InvalidUsage", f"expected a known command kind, found {kind!r}")
            handler(command_id, body[1], where, off, value or b"")
        except (FencedError, AnswerUndelivered):
            raise  # fenced; or the command took effect and its answer is sent again after recovery
        except Exception as e:  # noqa: BLE001 - every failure is a typed Error response
            if not isinstance(e, (ShardsinkError, CommandRejected, ValueError)):
                log.error("command %s (%s) failed: %r", command_id, kind, e, exc_info=True)
            ctx.answer(command_id, ctx.error(e), where=where, offset=off)

    # ==============================================================================================
    # the tick
    # ==============================================================================================
    def tick(self) -> None:
        ctx = self.ctx
        catalog = ctx.catalog.state(fresh=False)
        # Fencing: a newer controller's claim is seen within the catalog cache age.
        fresh = ctx.catalog.state()
        if fresh.controller_epoch != ctx.epoch:
            raise FencedError(f"expected controller epoch {ctx.epoch}, found {fresh.controller_epoch}")
        catalog = fresh
        live = {c.collection_id: c for c in catalog.live_collections()}
        for cid in list(ctx.collections):
            if cid not in live:
                ctx.collections.pop(cid, None)
        for cid, c in live.items():
            if cid not in ctx.collections:
                ctx.open_collection(c)
        tick = Tick(catalog, live, self._heads(live))
        for step in self.tick_steps:
            step(tick)
        self._idle_offsets()

    def _heads(self, live: dict[str, CollectionDef]) -> dict[str, ShardState]:
        """Each live collection's head: read again when someone waits on it (a peek, a running
        subscribe) or its appender announced an upper, and about every ``head_refresh_ms``
        otherwise (:func:`services.controller.model.heads_due`); else the last one read (by a
        tick or a command). An idle controller then reads each quiet head about once a second,
        not at every tick: that was an S3 request per collection every 50 ms, and with many
        collections ticks as long as the reads (100 collections: 213 ms a tick)."""
        ctx = self.ctx
        urgent = {p.collection_id for p in ctx.peeks.values()}
        urgent |= {sub["collection_id"] for sub in ctx.section.subs.values() if sub.get("state") != "done"}
        urgent |= {cid for cid in live if ctx.collections[cid].announced}
        now = time.monotonic()
        due = heads_due({cid: ctx.collections[cid].refreshed_at for cid in live}, urgent, now,
                        ctx.settings.head_refresh_ms / 1000.0, ctx.settings.tick_ms / 1000.0)
        heads: dict[str, ShardState] = {}
        for cid in due:
            col = ctx.collections[cid]
            col.announced = False
            heads[cid] = col.shard.refresh()
            col.refreshed_at = now
            self.head_reads += 1
        for cid in live:
            if cid not in heads:
                heads[cid] = ctx.collections[cid].shard.head(max_age_s=1e9)
        return heads

    def _idle_offsets(self) -> None:
        """Commit the offsets past answered commands once the loop is idle."""
        ctx = self.ctx
        if time.monotonic() - self._last_activity < ctx.settings.idle_commit_ms / 1000.0:
            return
        behind = {str(p): o for p, o in self.next_offsets.items() if ctx.section.offsets.get(str(p), 0) < o}
        if not behind:
            return

        def t(s: CatalogState, sec: ControllerSection) -> None:
            for p, o in behind.items():
                sec.offsets[p] = max(sec.offsets.get(p, 0), o)

        ctx.commit(t)
