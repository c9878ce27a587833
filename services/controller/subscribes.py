"""Subscribes: a snapshot as of a time, then every change, with progress statements, to a
Kafka topic the subscriber names (``as_of`` inclusive, ``up_to`` exclusive).

Contract:

- inputs: ``Subscribe`` and ``CancelSubscribe`` commands; the shards' heads on every tick;
- state: ``subs[subscribe_id]`` in the catalog's controller section: definition,
  ``progress`` (the frontier output so far), ``state`` (active, closing, done) and
  ``emitting`` (the intent of a step that may be partly on the topic); a running subscribe
  holds its collection's since at its progress (capabilities.py);
- outputs: per step, the changes in ``[lower, frontier)`` sorted (deterministic), then a
  progress statement at the frontier; a final empty progress statement when the subscribe
  ends (``up_to`` reached, cancelled, collection dropped);
- invariants: no gap and no duplicate on the output topic across failures and restarts; a
  subscribe whose output topic was deleted (its subscriber is gone) ends, and its topic is
  never re-created (the controller's producer does not create topics on demand).

Subscribe output (per step):

1. commit the intent ``emitting = {to, offset}`` (``offset``: the output partition's end);
2. produce the step's messages (sorted: deterministic) in chunks, each flushed; a tick
   produces for about :data:`_SUB_TICK_S` (at least one chunk), then the step pauses between
   two chunks delivered in full and the controller serves its commands: the next tick goes on
   where it stopped (the rest is kept in memory); chunks shrink after one that was not
   delivered in full and grow back after those that were;
3. commit ``progress = to``.

On recovery a subscribe with an intent counts its messages already on the topic after
``offset`` and produces only the rest of the (re-computed, identical) step: no gap, no
duplicate. Its hold keeps since at or below its progress, so the step re-computes the same.
The pure decisions (the next step, the hold, finality) are in
:mod:`shared.controller_state`.

Counting is exact only when nothing produced earlier can still land. A Kafka producer can
report a message failed (a timeout) or still hold it when a flush gives up while the message
is in flight: it lands later, after the count, and the re-sent copy doubles it (behind a
progress statement already out). So subscribe output has its own producer (not the one of
``responses``), idempotent (on a broker that checks producer sequences, what one producer
writes to the partition is a prefix of what it was given, never reordered or doubled by its
retries) and without a message timeout (no message is failed by a timeout while it may
still be sent, which would also bump the producer's epoch and allow a gap). A chunk that is
not delivered in full within ``flush_timeout_s`` is *ambiguous*; then, in this order:

a. the producer is purged and closed (librdkafka's threads and connections end: nothing it
   was given is sent afterwards), and forgotten: the next chunk gets a new producer;
b. the partition's end is re-read until it holds still (bytes already on the wire land);
c. the messages of the subscribe from the chunk's start are counted, and production goes on
   after them.

A chunk that failed *definitely* skips a and b: every message has its delivery report (none
pending) and every error is one the broker or the client gives for a message it did not
append (:data:`_NOT_APPENDED`: rejected by the broker, or never sent). Nothing of it is in
flight, so the same producer goes on after the count (c), which a message delivered before
the error still needs. A report that may hide an append (a timeout, a purge in flight, a fatal
error, any code not in that set) takes the whole path.

(Transactions would fence the old producer on the broker's side, but the embedded broker,
Tansu, shows aborted and open transactions to ``read_committed`` readers: no fence there.)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import KafkaError, TopicPartition

from services.controller.context import ControllerContext, log
from services.controller.model import OpenCollection, Tick
from services.sinkio import ControlProducer
from shared.avro_arrow import arrow_to_rows
from shared.catalog import CatalogState, FencedError
from shared.codec import message_codec
from shared.controller_state import (
    CommandRejected,
    ControllerSection,
    is_final_step,
    subscribe_step,
)
from shared.errors import DecodeError, KafkaAdapterError, KafkaTimeoutError, SinceViolationError, UnknownTopicError
from shared.frontier import Frontier
from shared.io.kafka import OffsetProbe, consume_available, new_consumer_own_wait
from shared.io.kafka_admin import ensure_topic
from shared.shard import DIFF, ERROR, TIME
from shared.state import ShardState

#: Subscribe output is produced in chunks of this many messages (see produce_step), and a
#: step gives up for this tick after this many failed chunks in a row that landed nothing.
_SUB_CHUNK = 1000
#: After a chunk that was not delivered in full the next ones are a quarter as large (down
#: to this), and each one delivered in full doubles the size again (up to ``_SUB_CHUNK``):
#: when messages fail one by one now and then, a large chunk almost never goes through whole
#: (1 in 1,000 failing: 37 % of chunks of 1,000 do), and each failure costs a settle and a
#: count of the topic.
_SUB_MIN_CHUNK = 16
_SUB_FAILURES = 100
#: A tick produces a step's output for about this long (at least one chunk), then the
#: controller serves its commands and the step goes on at the next tick where it stopped: a
#: large step (a subscribe catching up after a restart or a fault) never holds the commands
#: back for long.
_SUB_TICK_S = 1.0
#: How long a chunk may take to be delivered in full before it counts as ambiguous.
_SUB_FLUSH_S = 30.0
#: After an ambiguous chunk, the partition's end must hold still this long (at most
#: ``_SUB_SETTLE_MAX_S``) before it is counted.
_SUB_SETTLE_S = 0.5
_SUB_SETTLE_MAX_S = 10.0
#: Delivery errors for a message that was not appended: the broker rejected it, or it was
#: never sent (see the module docstring: a chunk failed only by these has nothing in flight).
_NOT_APPENDED = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_REQUIRED_ACKS, KafkaError._PURGE_QUEUE, KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
})
#: The subscribe output producer's own options over the controller's producer defaults.
_SUB_PRODUCER_CONFIG = {"enable.idempotence": True, "message.timeout.ms": 0}


def encode_changes(codec: Any, sid: str, changes: list[tuple[int, bytes | None, int, str | None]]) -> list[bytes]:
    """Changes ``(time, row bytes, diff, error)`` as the subscribe messages of ``sid``, sorted
    by (time, error?, row or error bytes, diff): the deterministic order of a step."""
    changes = sorted(changes, key=lambda c: (c[0], c[3] is not None, c[1] or (c[3] or "").encode(), c[2]))
    return [bytes(codec.encode({"subscribe_id": sid, "time": t, "progressed": False, "diff": d, "row": row,
                                "error": err})) for t, row, d, err in changes]


class _StepPaused(Exception):
    """A step stopped at its tick's budget, between two chunks, every chunk before delivered in
    full: ``rest`` are its messages not produced yet, ``pos`` the offset after the last one."""

    def __init__(self, rest: Iterator[bytes], pos: int) -> None:
        super().__init__("paused")
        self.rest = rest
        self.pos = pos


class SubscribesRoom:
    """The controller's subscribes room (see the module docstring)."""

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx
        self.sub_codec = message_codec("subscribe_output")
        self._probe: OffsetProbe | None = None  # long-lived: the output partitions' ends
        self._counter: Any = None  # long-lived: reads the output after an ambiguous chunk
        #: The producer of subscribe output (a raw confluent_kafka producer, made on first use
        #: by ``new_output_producer``; tests hand a faulty one), the wait for one chunk and
        #: the time the end must hold still after an ambiguous one.
        self._out: Any = None
        self.new_output_producer: Callable[[], Any] = self._new_output_producer
        self.flush_timeout_s = _SUB_FLUSH_S
        self.settle_s = _SUB_SETTLE_S
        #: A step's output per tick (:data:`_SUB_TICK_S`).
        self.tick_budget_s = _SUB_TICK_S
        #: Steps paused at a tick's budget: per subscribe, the step's recorded intent, its
        #: messages not produced yet and the offset after the last delivered (kept in memory:
        #: a restarted controller counts what is on the topic instead, as after a failure).
        self._paused: dict[str, tuple[dict[str, Any], Iterator[bytes], int]] = {}

    def _new_output_producer(self) -> Any:
        return ControlProducer.create(
            self.ctx.settings.service.kafka, "controller-subscribes", auto_create_topics=False,
            config=_SUB_PRODUCER_CONFIG,
        ).producer

    def close(self) -> None:
        """Close the offset probe and the output producer (at the end of a run)."""
        self._paused.clear()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._counter is not None:
            self._counter.close()
            self._counter = None
        if self._out is not None:
            self._out.flush(5)  # a step that returned left nothing pending: this is quick
            self._end_output_producer()

    # -- subscribes -------------------------------------------------------------------------------
    def subscribe(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = b["collection_id"]
        self.ctx.catalog.state().collection(collection_id)
        col = self.ctx.collections[collection_id]
        state = col.shard.refresh()
        topic = str(b["output_topic"])
        if not topic or len(topic) > 249:
            raise CommandRejected("InvalidUsage", f"expected an output topic name, found {topic!r}")
        as_of = b.get("as_of")
        as_of = (state.since.time or 0) if as_of is None else int(as_of)
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(
                f"expected as_of >= since {state.since!r}, found {as_of}",
                collection_id=collection_id, as_of=as_of, since=state.since,
            )
        up_to = b.get("up_to")
        ensure_topic(self.ctx.settings.service.kafka, topic, 1)
        sub = {
            "collection_id": collection_id,
            "topic": topic,
            "as_of": as_of,
            "up_to": None if up_to is None else int(up_to),
            "with_snapshot": bool(b.get("with_snapshot", True)),
            "progress": None,
            "state": "active" if up_to is None or int(up_to) > as_of else "closing",
            "emitting": None,
        }

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.subs[cid] = sub

        self.ctx.answer(
            cid, self.ctx.ack(cid, subscribe_id=cid, output_topic=topic, as_of=as_of),
            where=where, offset=off, change=t,
        )

    def cancel_subscribe(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        target = b["subscribe_command_id"]
        sub = self.ctx.section.subs.get(target)
        if sub is None:
            raise CommandRejected("IdentifierMissing", f"expected a subscribe {target!r}, found none", subscribe_id=target)
        active = sub.get("state") == "active"

        def t(s: CatalogState, sec: ControllerSection) -> None:
            if sec.subs.get(target, {}).get("state") == "active":
                sec.subs[target]["state"] = "closing"

        self.ctx.answer(cid, self.ctx.ack(cid, subscribe_id=target, canceled=active), where=where, offset=off, change=t)

    # -- subscribes ------------------------------------------------------------------------------
    def advance_subscribes(self, tick: Tick) -> None:
        """Tick step: the next output step of every running subscribe."""
        heads = tick.heads
        for sid in [k for k in self._paused if k not in self.ctx.section.subs]:
            del self._paused[sid]
        for sid in list(self.ctx.section.subs):
            sub = self.ctx.section.subs[sid]
            if sub.get("state") == "done":
                continue
            try:
                self._advance_subscribe(sid, sub, heads)
            except FencedError:
                raise
            except UnknownTopicError:
                # Its subscriber deleted the output topic (tail does, at the end): nobody reads
                # it any more, and writing would only re-create it. The subscribe ends.
                log.info("subscribe %s: its output topic %r is gone: the subscribe ends", sid, sub["topic"])
                self._finish_step(sid, Frontier.empty(), True)
            except Exception as e:  # noqa: BLE001 - one failing subscribe must not stop the others
                log.error("subscribe %s failed: %r", sid, e, exc_info=True)

    def _advance_subscribe(self, sid: str, sub: dict[str, Any], heads: dict[str, ShardState]) -> None:
        cid = sub["collection_id"]
        emitting = sub.get("emitting")
        if emitting is not None:
            to = Frontier.from_json(emitting["to"])
            paused = self._paused.pop(sid, None)
            if paused is not None and paused[0] == emitting:
                # Paused at the last tick's budget: the rest of the step, from where it stopped.
                if self._produce(sid, sub["topic"], paused[1], (0, paused[2]), emitting):
                    self._finish_step(sid, to, bool(emitting.get("final")))
                return
            # Recovery: a step was intended and may be partly on the topic (if it still exists).
            if self._probe is None:
                self._probe = OffsetProbe(self.ctx.settings.service.kafka)
            self._probe.partitions_of(sub["topic"])
            msgs = self._step_messages(sid, sub, to, bool(emitting.get("final")), emitting.get("lower_kind"))
            start = int(emitting["offset"])
            end = self._settle_end(sub["topic"])  # what an earlier producer left on the wire lands first
            if self._produce(sid, sub["topic"], msgs, self.count_on_topic(sub["topic"], sid, start, end), emitting):
                self._finish_step(sid, to, bool(emitting.get("final")))
            return
        st = heads.get(cid)
        if st is None or sub.get("state") == "closing":
            # Dropped collection or cancelled: the final progress statement only.
            to = Frontier.empty()
            self._emit_step(sid, sub, to, True, "final")
            return
        step = subscribe_step(sub, st.upper)
        if step is None:
            return
        _, to, _ = step
        up_to = sub.get("up_to")
        final = is_final_step(to, None if up_to is None else int(up_to))
        self._emit_step(sid, sub, to, final, "step")

    def _emit_step(self, sid: str, sub: dict[str, Any], to: Frontier, final: bool, lower_kind: str) -> None:
        msgs = self._step_messages(sid, sub, to, final, lower_kind)
        if self._probe is None:
            self._probe = OffsetProbe(self.ctx.settings.service.kafka)
        self._probe.partitions_of(sub["topic"])  # UnknownTopicError when it was deleted (creates nothing)
        offset = self._probe.ends([(sub["topic"], 0)])[(sub["topic"], 0)]
        intent = {"to": to.to_json(), "final": final, "offset": offset, "lower_kind": lower_kind}

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.subs[sid]["emitting"] = intent

        self.ctx.commit(t)
        if self._produce(sid, sub["topic"], msgs, (0, offset), intent):
            self._finish_step(sid, to, final)

    def _produce(self, sid: str, topic: str, msgs: Iterable[bytes], known: tuple[int, int], intent: dict[str, Any]) -> bool:
        """:meth:`produce_step` within a tick's budget: True when the step is on the topic,
        False when it paused (the next tick goes on from where it stopped)."""
        try:
            self.produce_step(sid, topic, msgs, known, budget_s=self.tick_budget_s)
        except _StepPaused as p:
            self._paused[sid] = (intent, p.rest, p.pos)
            return False
        return True

    def _finish_step(self, sid: str, to: Frontier, final: bool) -> None:
        def t(s: CatalogState, sec: ControllerSection) -> None:
            sub = sec.subs[sid]
            sub["emitting"] = None
            if not to.is_empty():
                sub["progress"] = to.time
            if final:
                sub["state"] = "done"

        self.ctx.commit(t)

    def produce_step(self, sid: str, topic: str, msgs: Iterable[bytes], known: tuple[int, int],
                     budget_s: float | None = None) -> None:
        """Make ``msgs`` the messages of subscribe ``sid`` on ``topic`` after the step's start.

        ``known = (n, pos)``: the first ``n`` of ``msgs`` are on the topic, all before offset
        ``pos``. The rest go out in chunks, each delivered in full before the next. A chunk
        that is not (an error or a timeout: ambiguous, some of it may have landed or may
        still land) ends its producer, then the messages of ``sid`` from ``pos`` on are
        counted and production goes on after them (the module docstring's a-c; a chunk that
        failed definitely keeps its producer and is only counted). So a failure
        costs a re-count of one chunk, not of the whole step, and a large step still completes
        when deliveries fail now and then. After ``_SUB_FAILURES`` ambiguous chunks in a row
        that landed nothing the error is raised; the next tick resumes from the recorded intent. Whenever this returns or
        raises, nothing it produced is still in flight. With ``budget_s``, once that long has
        passed after a chunk delivered in full, :class:`_StepPaused` is raised with the rest.
        """
        n, pos = known
        failures = 0
        it = iter(msgs)
        for _ in itertools.islice(it, n):  # already on the topic
            pass
        chunk: list[bytes] = []
        deadline = None if budget_s is None else time.monotonic() + budget_s
        delivered = False
        size = _SUB_CHUNK
        try:
            while True:
                if not chunk:
                    chunk = list(itertools.islice(it, size))
                    if not chunk:
                        return
                if delivered and deadline is not None and time.monotonic() >= deadline:
                    raise _StepPaused(itertools.chain(chunk, it), pos)
                last, problem, definite = self._deliver_chunk(topic, sid, chunk)
                if problem is None:
                    chunk = []
                    pos = max(pos, last + 1)
                    delivered = True
                    failures = 0
                    size = min(_SUB_CHUNK, size * 2)
                    continue
                if not definite:
                    self._end_output_producer()  # a. nothing of the chunk lands after this
                    # The next producer readies itself (an idempotent producer's first delivery
                    # waits about 0.5 s for its producer id) while b and c run.
                    self._out = self.new_output_producer()
                failures += 1
                if failures >= _SUB_FAILURES:
                    raise KafkaAdapterError(
                        f"expected subscribe {sid} output delivered to {topic}, found {failures} failed chunks in a row, "
                        f"the last: {problem}", topic=topic, subscribe_id=sid,
                    )
                log.warning("subscribe %s: a chunk to %s was not delivered in full (%s): counting what landed",
                            sid, topic, problem)
                settled = self._settle_end(topic) if not definite else None  # b.
                landed, pos = self.count_on_topic(topic, sid, pos, settled)  # c.
                if landed:
                    failures = 0  # progress: only chunks in a row that land nothing give up
                chunk = chunk[landed:]
                size = max(_SUB_MIN_CHUNK, size // 4)
                if len(chunk) > size:  # the rest of the chunk goes out in smaller ones, in order
                    it = itertools.chain(chunk[size:], it)
                    chunk = chunk[:size]
        except _StepPaused:
            raise  # between chunks: nothing in flight, the producer goes on at the next tick
        except BaseException:
            self._end_output_producer()  # an error between produce and delivery leaves nothing in flight
            raise

    def _deliver_chunk(self, topic: str, sid: str, chunk: list[bytes]) -> tuple[int, str | None, bool]:
        """Produce ``chunk`` and wait up to ``flush_timeout_s`` for all of it: ``(the last
        offset delivered, None, True)``, or ``(.., what went wrong, definite)`` when any
        message failed or is still pending (the chunk is then ambiguous; ``definite`` when none
        is pending and every error is in :data:`_NOT_APPENDED`: nothing of it is in flight)."""
        if self._out is None:
            self._out = self.new_output_producer()
        out = self._out
        last = [-1]
        errors: list[Any] = []

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)
            elif msg is not None and msg.offset() is not None:
                last[0] = max(last[0], int(msg.offset()))

        deadline = time.monotonic() + self.flush_timeout_s
        key = sid.encode()
        for m in chunk:
            while True:
                try:
                    out.produce(topic, value=m, key=key, partition=0, on_delivery=on_delivery)
                    break
                except BufferError:
                    if time.monotonic() > deadline:
                        return last[0], f"the producer's queue stayed full for {self.flush_timeout_s} s", False
                    out.poll(0.05)
        pending = int(out.flush(0.5))
        while pending > 0 and time.monotonic() < deadline:
            pending = int(out.flush(0.5))
        if pending > 0:
            return last[0], f"{pending} messages pending after {self.flush_timeout_s} s", False
        if errors:
            definite = all(e.code() in _NOT_APPENDED for e in errors)
            return last[0], f"{len(errors)} delivery errors, the first {errors[0]}", definite
        return last[0], None, True

    def _end_output_producer(self) -> None:
        """Purge and close the output producer: once this returns, nothing it was given is sent
        (its threads and connections are gone); the next chunk gets a new one."""
        out, self._out = self._out, None
        if out is None:
            return
        try:
            out.purge(in_queue=True, in_flight=True, blocking=True)
            out.poll(0)  # serve the purged messages' delivery reports
        finally:
            out.close()

    def _settle_end(self, topic: str) -> int:
        """Wait until the end of ``topic``/0 holds still for ``settle_s`` (at most
        ``_SUB_SETTLE_MAX_S``): a request already on the wire when its producer closed lands
        before the count. Returns the end last read (the count's, which need not read it
        again)."""
        if self._probe is None:
            self._probe = OffsetProbe(self.ctx.settings.service.kafka)
        deadline = time.monotonic() + _SUB_SETTLE_MAX_S
        end = self._probe.ends([(topic, 0)])[(topic, 0)]
        while time.monotonic() < deadline:
            time.sleep(self.settle_s)
            again = self._probe.ends([(topic, 0)])[(topic, 0)]
            if again == end:
                return end
            end = again
        return end

    def _step_messages(self, sid: str, sub: dict[str, Any], to: Frontier, final: bool,
                       lower_kind: str | None) -> Iterable[bytes]:
        """The (deterministic) messages of one step: sorted changes, progress, final.

        A snapshot of a large collection, with a Spark master set, is computed and sorted by
        Spark's executors and streamed from them (``spark_jobs.py``); its times are all
        ``as_of``, before every later change, so it comes first in the same order."""
        enc = self.sub_codec.encode
        out: list[bytes] = []
        head: Iterable[bytes] = ()
        cid = sub["collection_id"]
        if lower_kind != "final" and cid in self.ctx.collections:
            col = self.ctx.collections[cid]
            state = col.shard.refresh()
            progress = sub.get("progress")
            as_of = int(sub["as_of"])
            changes: list[tuple[int, bytes | None, int, str | None]] = []
            if progress is None:
                lower = as_of + 1
                if sub.get("with_snapshot", True):
                    def here() -> list[bytes]:
                        return self._encoded(sid, self._changes(col, col.shard.snapshot(as_of), as_of))

                    if self.ctx.spark_jobs is None:
                        head = here()
                    else:
                        head = self.ctx.spark_jobs.snapshot_messages(col.shard, as_of, sid, col.row_codec.schema, here)
            else:
                lower = int(progress)
            if to.is_empty() or lower < (to.time or 0):
                table = col.shard.updates_between(state, lower, to)
                changes += self._changes(col, table, None)
            out += self._encoded(sid, changes)
            if not to.is_empty():
                out.append(bytes(enc({"subscribe_id": sid, "time": to.time, "progressed": True, "diff": None,
                                      "row": None})))
        if final:
            out.append(bytes(enc({"subscribe_id": sid, "time": None, "progressed": True, "diff": None, "row": None})))
        return itertools.chain(head, out)

    def _encoded(self, sid: str, changes: list[tuple[int, bytes | None, int, str | None]]) -> list[bytes]:
        return encode_changes(self.sub_codec, sid, changes)

    @staticmethod
    def _changes(col: OpenCollection, table: pa.Table, at: int | None) -> list[tuple[int, bytes | None, int, str | None]]:
        """``(time, encoded row, diff, None)`` per change and ``(time, None, diff, reason)`` per
        error row (it has no row to send: the message says why)."""
        if table.num_rows == 0:
            return []
        is_ok = pc.is_null(table[ERROR])
        ok = table.filter(is_ok)
        rows = arrow_to_rows(ok.select(col.shard.row_columns), col.row_codec.schema)
        diffs = ok[DIFF].to_pylist()
        times = [at] * ok.num_rows if at is not None else ok[TIME].to_pylist()
        out: list[tuple[int, bytes | None, int, str | None]] = [
            (int(t), col.row_codec.encode(r), int(d), None) for t, r, d in zip(times, rows, diffs, strict=True)
        ]
        if ok.num_rows < table.num_rows:
            bad = table.filter(pc.invert(is_ok))
            bad_times = [at] * bad.num_rows if at is not None else bad[TIME].to_pylist()
            out += [(int(t), None, int(d), str(e)) for t, d, e in
                    zip(bad_times, bad[DIFF].to_pylist(), bad[ERROR].to_pylist(), strict=True)]
        return out

    def count_on_topic(self, topic: str, sid: str, start: int, end: int | None = None) -> tuple[int, int]:
        """How many messages of subscribe ``sid`` partition 0 of ``topic`` holds from offset
        ``start`` up to ``end`` (the partition's end, read now when not given), and the offset
        up to which they were counted.

        Each offset counts once, and only from ``start`` on: a message the consumer hands back
        from below ``start`` or again (one fetched for an earlier count, a rewind) would make
        the caller skip as many messages of the step, a gap on the topic. (So a consumer that
        resets to the partition's start, its position out of range, only reads further.)"""
        if end is None:
            if self._probe is None:
                self._probe = OffsetProbe(self.ctx.settings.service.kafka)
            end = self._probe.ends([(topic, 0)])[(topic, 0)]
        if end <= start:
            return 0, start
        if self._counter is None:  # kept: a count after each ambiguous chunk, often many a minute
            # Fetches wait 10 ms at most, below the settings' least wait too: one in flight when
            # ``tail`` deletes the topic would crash the controller (see shared/io/kafka.py, "a
            # fetch that outlives its topic").
            self._counter = new_consumer_own_wait(
                self.ctx.settings.service.kafka, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "10"}
            )
        c = self._counter
        n = 0
        behind = 0  # messages handed back from below the position reached (not counted)
        try:
            c.assign([TopicPartition(topic, 0, start)])
            pos = start
            deadline = time.monotonic() + 60
            while pos < end and time.monotonic() < deadline:
                for m in consume_available(c, 1000, 0.2):
                    if m.error() is not None:
                        continue
                    off = int(m.offset() or 0)
                    if off < pos:  # below start, or counted already
                        behind += 1
                        continue
                    pos = off + 1
                    try:
                        if self.sub_codec.decode(m.value() or b"")["subscribe_id"] == sid:
                            n += 1
                    except DecodeError:
                        continue
        except BaseException:
            self._counter = None  # a consumer in an unknown state is not kept
            c.close()
            raise
        c.unassign()
        if behind:
            log.warning("subscribe %s: counting %s/0 from %d, the consumer handed back %d messages from below "
                        "its position: not counted", sid, topic, start, behind)
        if pos < end:
            # A partial count would make the caller produce messages already there again.
            raise KafkaTimeoutError(
                f"expected to read {topic}/0 from {start} to {end} within 60 s, reached {pos}", topic=topic
            )
        return n, pos
