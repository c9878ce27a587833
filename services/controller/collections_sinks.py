"""Collections and sinks: the commands that change definitions in the catalog, and Append.

Contract:

- inputs: ``CreateCollection``, ``AlterCollection`` (a compatible new row schema),
  ``SetReadPolicy``, ``DropCollection``,
  ``CreateSink``, ``DropSink``, ``AllowWrites``, ``Append`` commands;
- state: the catalog's collections and sinks (pure transitions in :mod:`shared.catalog`,
  validated against the current catalog before anything is written);
- outputs: an ``Ack`` or a typed ``Error`` per command (through the command log), the
  collection's shard (created before its catalog entry; idempotent), appended batches;
- invariants: identifiers are never reused for another definition; a drop is one catalog
  commit (the id is dead at once) and its storage is reclaimed later by the tick
  (maintenance.py); an Append carries a token derived from the command id, so a replayed
  command is never applied twice; an Append's ``staged_parts`` (data objects a client staged
  for an input too large for one command) are checked and committed with its updates as one
  batch, so a client's append lands whole or not at all; a sink created without ``as_of``
  starts at the collection's upper; a sink created on a collection that holds rows says what
  its topic holds (``adopt_shard`` or ``replace_contents``), else it is refused with
  ``SinkBaselineRequired`` and nothing is written.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from services.controller.context import ControllerContext, log
from services.controller.model import digest
from shared.avro_arrow import parse_row_schema
from shared.catalog import (
    CatalogState,
    CollectionDef,
    HeldRows,
    SinkDef,
    allow_writes_transition,
    alter_collection_schema_transition,
    alter_collection_transition,
    create_collection_transition,
    create_sink_transition,
    drop_collection_transition,
    drop_sink_transition,
)
from shared.controller_state import CommandRejected, ControllerSection
from shared.errors import DecodeError, ShardsinkError
from shared.frontier import Frontier
from shared.objectstore import now_ms
from shared.read_policy import ValidFrom, check_reaches_since, policy_from_avro
from shared.shard import validate_shard_id


class CollectionsRoom:
    """The controller's collections and sinks room (see the module docstring)."""

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx

    # -- collections ---------------------------------------------------------------------------
    def create_collection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = validate_shard_id(b["collection_id"])
        try:
            schema = parse_row_schema(json.loads(b["row_schema"]))
        except json.JSONDecodeError as e:
            raise CommandRejected("SchemaError", f"expected the row schema as JSON text, found: {e}") from None
        since = int(b.get("initial_since") or 0)
        policy = ValidFrom(Frontier.at(since)) if b.get("read_policy") is None else policy_from_avro(b["read_policy"])
        cdef = CollectionDef(collection_id, schema, since, policy.to_json())
        create = create_collection_transition(cdef)
        create(self.ctx.catalog.state())  # validate first: reuse of a dropped or other definition
        # 1. the shard (idempotent: opens it if a crash left it without a catalog entry)
        col = self.ctx.open_collection(cdef)
        st = col.shard.refresh()
        # 2. catalog entry, response, offset in one commit
        self.ctx.answer(
            cid,
            self.ctx.ack(cid, collection_id=collection_id, since=st.since.to_json(), upper=st.upper.to_json()),
            where=where,
            offset=off,
            change=lambda s, sec: create(s),
        )

    def alter_collection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        """A new row schema: accepted iff rows of every earlier version read as it (the shard
        checks, :mod:`shared.schema_evolution`; IncompatibleSchema names the field and the rule,
        and nothing changes). The shard records the version first (what readers and the sink
        follow), then the catalog, with the answer; a replay finds the shard current already."""
        c = self.ctx.catalog.state().collection(b["collection_id"])
        try:
            schema = json.loads(b["row_schema"])
        except json.JSONDecodeError as e:
            raise CommandRejected("SchemaError", f"expected the row schema as JSON text, found: {e}") from None
        # 1. the shard: validates against every version, records the new one from its upper
        st = self.ctx.collections[c.collection_id].shard.alter_schema(schema)
        current = st.versions[-1]
        alter = alter_collection_schema_transition(c.collection_id, st.schema)
        # 2. catalog entry, response, offset in one commit
        self.ctx.answer(
            cid,
            self.ctx.ack(cid, collection_id=c.collection_id, schema_version=len(st.versions) - 1,
                      from_upper=current.from_upper.to_json()),
            where=where, offset=off, change=lambda s, sec: alter(s),
        )

    def set_read_policy(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        policy = policy_from_avro(b["policy"])
        alter = alter_collection_transition(b["collection_id"], policy.to_json())
        alter(self.ctx.catalog.state())
        # A policy that reaches below the since is refused; the answer says what the since is.
        state = self.ctx.collections[b["collection_id"]].shard.refresh()
        check_reaches_since(policy, b["collection_id"], state.since, state.upper)
        self.ctx.answer(
            cid, self.ctx.ack(cid, collection_id=b["collection_id"], policy=policy.to_json(), since=state.since.to_json()),
            where=where, offset=off, change=lambda s, sec: alter(s),
        )

    def drop_collection(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = b["collection_id"]
        state = self.ctx.catalog.state()
        state.collection(collection_id)  # a dropped or unknown id is an error
        # The sinks that write it go with it; the ack names them.
        sinks = [k.sink_id for k in state.live_sinks(collection_id)]
        drop = drop_collection_transition(collection_id)
        due = now_ms() + self.ctx.settings.reclaim_grace_ms

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState:
            sec.reclaim[collection_id] = due
            return drop(s)

        self.ctx.answer(cid, self.ctx.ack(cid, collection_id=collection_id, sinks_dropped=sinks), where=where, offset=off,
                     change=t)
        # Readers are told at once (peeks answered, subscribes closed, upper {} reported) and
        # the storage is reclaimed, by the tick.

    # -- sinks -----------------------------------------------------------------------------------
    def create_sink(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        """A new sink on a collection that holds rows must say what its topic holds
        (``adopt_shard`` or ``replace_contents``; :func:`shared.catalog.check_sink_baseline`):
        the rows come from the shard's head state, checked before anything is written."""
        state = self.ctx.catalog.state()
        c = state.collection(b["collection_id"])
        head = self.ctx.collections[c.collection_id].shard.refresh()
        as_of = b.get("as_of")
        if as_of is None:
            existing = state.sinks.get(b["sink_id"])
            if existing is not None and not existing.dropped:
                as_of = existing.as_of
            else:
                as_of = head.upper.time if head.upper.time is not None else 0
        sink = SinkDef(b["sink_id"], b["desired_topic"], c.collection_id, as_of=int(as_of),
                       read_only=bool(b.get("read_only")), adopt_shard=bool(b.get("adopt_shard")),
                       replace_contents=bool(b.get("replace_contents")))
        create = create_sink_transition(sink, held=HeldRows(head.total_rows(), head.upper.time))
        create(state)
        self.ctx.answer(
            cid, self.ctx.ack(cid, sink_id=sink.sink_id, as_of=sink.as_of),
            where=where, offset=off, change=lambda s, sec: create(s),
        )

    def drop_sink(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        self.ctx.catalog.state().sink(b["sink_id"])
        drop = drop_sink_transition(b["sink_id"])
        self.ctx.answer(cid, self.ctx.ack(cid, sink_id=b["sink_id"]), where=where, offset=off, change=lambda s, sec: drop(s))

    def allow_writes(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        state = self.ctx.catalog.state()
        ids = b.get("sink_ids")
        if ids is None:
            ids = [s.sink_id for s in state.live_sinks()]
        for sid in ids:
            state.sink(sid)
        ts = [allow_writes_transition(sid) for sid in ids]

        def t(s: CatalogState, sec: ControllerSection) -> CatalogState:
            for f in ts:
                s = f(s)
            return s

        self.ctx.answer(cid, self.ctx.ack(cid, sink_ids=list(ids)), where=where, offset=off, change=t)
        # Imported here: services.runner brings the sink services' runtime along, which the
        # controller process does not otherwise load.
        from services.runner import nudge

        for sid in ids:
            try:
                nudge(self.ctx.settings.service, state.sinks[sid])
            except Exception as e:  # noqa: BLE001 - a nudge only speeds things up
                log.warning("nudge failed: %r", e, extra={"sink_id": sid})

    # -- append ----------------------------------------------------------------------------------
    def append(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        collection_id = b["collection_id"]
        self.ctx.catalog.state().collection(collection_id)
        col = self.ctx.collections[collection_id]
        token = f"cmd-{digest(cid)}"
        state = col.shard.refresh()
        if state.find_token(token) is None:
            # A sink corrects its collection to its desired topic: rows appended here would be
            # retracted at its next step, silently. Refused while any sink is defined on it.
            sinks = sorted(k.sink_id for k in self.ctx.catalog.state().live_sinks() if k.collection_id == collection_id)
            if sinks:
                raise CommandRejected(
                    "InvalidUsage",
                    f"expected no sink on collection {collection_id!r} for a direct append, found "
                    f"{sinks}: a sink corrects the collection to its desired topic, so appended rows "
                    f"would be retracted at its next step. Produce them to the sink's desired topic "
                    f"(shardsink produce), or drop the sink first; nothing was appended",
                    collection_id=collection_id, sinks=sinks,
                )
            expected = state.upper if b.get("expected_upper") is None else Frontier.at(int(b["expected_upper"]))
            new = Frontier.from_json(b.get("new_upper"))
            rows = []
            for u in b["updates"]:
                t, d = int(u["time"]), int(u["diff"])
                if new.time is not None and t >= new.time:
                    raise CommandRejected(
                        "UpdateBeyondUpper",
                        f"expected every update's time < new upper {new!r}, found {t}",
                        collection_id=collection_id, time=t, new_upper=new.to_json(),
                    )
                if not expected.is_empty() and t < (expected.time or 0):
                    raise CommandRejected(
                        "InvalidUsage",
                        f"expected every update's time >= expected upper {expected!r}, found {t}",
                        collection_id=collection_id, time=t, expected_upper=expected.to_json(),
                    )
                try:
                    row = col.row_codec.decode(u["row"])
                except DecodeError as e:
                    raise CommandRejected("DecodeError", f"expected rows of the collection's schema, found: {e}") from None
                rows.append((row, t, d))
            if not expected.less_equal(new):
                raise CommandRejected(
                    "InvalidUsage", f"expected new upper >= expected upper {expected!r}, found {new!r}",
                    collection_id=collection_id,
                )
            keys = list(b.get("staged_parts") or [])
            if not keys:
                state = col.shard.compare_and_append(rows or None, expected, new, token=token)
            else:
                # A client's all-or-nothing append: data objects it staged (checked here before
                # anything references them) and the inline updates, committed as one batch.
                # A refusal leaves the client's objects to the client (it deletes them) and
                # to GC; the objects staged here for the inline updates are deleted.
                staged = [col.shard.staged_from_keys(keys)]
                if rows:
                    staged.append(col.shard.stage(rows))
                try:
                    state = col.shard.compare_and_append_staged(staged, expected, new, token=token)
                except ShardsinkError:
                    with contextlib.suppress(ShardsinkError):  # the refusal is what to answer; GC
                        col.shard.delete_staged(staged[1:])  # reclaims what this leaves
                    raise
        self.ctx.answer(cid, self.ctx.ack(cid, collection_id=collection_id, upper=state.upper.to_json()), where=where, offset=off)
