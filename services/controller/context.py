"""What the controller's rooms share: one :class:`ControllerContext` per controller process.

Every room, and the command loop, is handed the context at construction (``service.py`` puts
them together). It holds:

- the settings, the object store, the catalog (opened by the loop's recovery) and the
  controller epoch that fences every catalog write;
- the catalog's controller section as last committed
  (:class:`shared.controller_state.ControllerSection`: offsets, command log, reported uppers,
  subscribes, pending reclaims);
- the in-memory records rebuilt at recovery: the open collections and the waiting peeks;
- the producer of ``responses`` and the Spark driver of the large work (when a master is set);

and performs the two effects every room performs the same way: one fenced catalog commit
(:meth:`ControllerContext.commit`) and the answer to a command, logged with its offset before
it is sent (:meth:`ControllerContext.answer`; the commit order of a command is in
``loop.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.controller.model import (
    READER_ID,
    ControllerSettings,
    OpenCollection,
    PendingPeek,
    b64,
    digest,
    jdump,
    unb64,
)
from services.controller.spark_jobs import ControllerSpark, controller_session
from services.sinkio import ControlProducer
from shared.catalog import Catalog, CatalogState, CollectionDef
from shared.codec import message_codec, tagged
from shared.controller_state import Capabilities, ControllerSection, error_kind
from shared.errors import KafkaAdapterError, KafkaDeliveryError, ShardsinkError
from shared.frontier import Frontier
from shared.objectstore import now_ms
from shared.shard import Shard
from shared.state import CRITICAL

log = logging.getLogger("shardsink")

#: Logged responses larger than this go to an S3 object named in the log.
_LOG_INLINE_MAX = 4096


class AnswerUndelivered(KafkaDeliveryError):
    """A command's answer is committed (its log entry and its change) but its delivery failed:
    the controller recovers and sends ``responses`` (``(value, key)``) again; the answer is
    never replaced by an error (the command took effect)."""

    def __init__(self, message: str, responses: list[tuple[bytes, str | None]]) -> None:
        super().__init__(message)
        self.responses = responses


class ControllerContext:
    """The state and the effects the controller's rooms share (see the module docstring)."""

    def __init__(self, settings: ControllerSettings) -> None:
        s = settings.service
        self.settings = settings
        self.store = s.store()
        self.catalog: Catalog  # opened by the loop's recovery (it reads S3: a failure there is retried)
        self.epoch = 0
        self.section = ControllerSection()
        self.collections: dict[str, OpenCollection] = {}
        self.peeks: dict[str, PendingPeek] = {}
        self.producer: ControlProducer | None = None
        self.resp_codec = message_codec("response")
        #: The Spark driver of the data-heavy work, when a master is set (spark_jobs.py).
        self.spark_jobs: ControllerSpark | None = None
        if settings.spark.enabled:
            master = settings.spark.master
            assert master is not None
            self.spark_jobs = ControllerSpark(settings.spark, s.s3, lambda: controller_session(s, master))

    def open_collection(self, c: CollectionDef) -> OpenCollection:
        """Open (creating if missing: idempotent) a live collection's shard, with the
        controller's critical reader hold, and record it among the open collections."""
        shard = Shard.create(self.store, c.collection_id, c.schema, since=c.since, grace_ms=self.settings.service.grace_ms)
        st = shard.refresh()
        if not st.dropped and st.reader(READER_ID) is None:
            st = shard.register_reader(READER_ID, kind=CRITICAL)
        col = OpenCollection(shard, Capabilities(st.since))
        self.collections[c.collection_id] = col
        return col

    # ==============================================================================================
    # catalog commits
    # ==============================================================================================
    def commit(self, change: Callable[[CatalogState, ControllerSection], CatalogState | None]) -> CatalogState:
        """One fenced catalog commit of ``change`` (pure: it may run again on a race)."""

        def t(s: CatalogState) -> CatalogState:
            sec = ControllerSection.from_extra(s.extra)
            new = change(s, sec)
            base = s if new is None else new
            return replace(base, extra=sec.to_extra(s.extra))

        state = self.catalog.update(t, epoch=self.epoch)
        self.section = ControllerSection.from_extra(state.extra)
        return state

    # ==============================================================================================
    # responses
    # ==============================================================================================
    def encode_response(self, command_id: str | None, kind: str, body: dict[str, Any]) -> bytes:
        return bytes(
            self.resp_codec.encode({"command_id": command_id, "emitted_at_ms": now_ms(), "body": tagged(kind, body)})
        )

    def ack(self, command_id: str, **results: Any) -> bytes:
        return self.encode_response(command_id, "Ack", {"results": {k: jdump(v) for k, v in results.items()}})

    def error_for(self, command_id: str | None, e: BaseException) -> bytes:
        fields = getattr(e, "fields", None) or {}
        out = {}
        for k, v in fields.items():
            if isinstance(v, Frontier):
                v = v.to_json()
            try:
                out[k] = json.dumps(v)
            except TypeError:
                out[k] = json.dumps(repr(v))
        return self.encode_response(
            command_id, "Error", {"kind": error_kind(e), "message": str(e) or type(e).__name__, "fields": out}
        )

    def error(self, e: BaseException) -> Callable[[str], bytes]:
        return lambda cid: self.error_for(cid, e)

    def send(self, value: bytes, key: str | None = None) -> None:
        assert self.producer is not None
        self.producer.send(self.settings.responses_topic, value, key=None if key is None else key.encode())

    def flush(self) -> None:
        assert self.producer is not None
        self.producer.flush()

    def log_entry(self, command_id: str, response: bytes, where: str) -> dict[str, Any]:
        if len(response) <= _LOG_INLINE_MAX:
            return {"o": where, "r": b64(response)}
        key = f"controller/responses/{digest(command_id)}.avro"
        self.store.put(key, response)
        return {"o": where, "k": key}

    def logged_response(self, entry: dict[str, Any]) -> bytes | None:
        if "r" in entry:
            return unb64(entry["r"])
        if "k" in entry:
            try:
                return self.store.get(entry["k"])
            except ShardsinkError:
                return None
        return None

    def answer(
        self,
        command_id: str,
        response: bytes | Callable[[str], bytes],
        *,
        where: str = "",
        change: Callable[[CatalogState, ControllerSection], CatalogState | None] | None = None,
        offset: tuple[int, int] | None = None,
        extra: list[bytes] | None = None,
    ) -> None:
        """Commit ``change`` with the logged response (and the offset), then send it."""
        resp = response(command_id) if callable(response) else response
        entry = self.log_entry(command_id, resp, where)
        max_entries = self.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState | None:
            new = change(s, sec) if change is not None else None
            evicted = sec.record(command_id, entry, max_entries)
            for old in evicted:
                sec.log.pop(old, None)
            if offset is not None:
                sec.offsets[str(offset[0])] = offset[1]
            return new

        self.commit(t)
        try:
            self.send(resp, command_id)
            for v in extra or ():
                self.send(v)
            self.flush()
        except KafkaAdapterError as e:
            raise AnswerUndelivered(f"the answer to command {command_id} was not delivered: {e}",
                                    [(resp, command_id), *((v, None) for v in extra or ())]) from e
