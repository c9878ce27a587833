"""Read capabilities and since: where each collection's since may move, and moving it.

Contract:

- inputs: each tick's catalog (read policies, live sinks) and shard heads, the waiting
  peeks and running subscribes;
- state: per open collection a :class:`shared.controller_state.Capabilities` (the implied
  capability of its read policy, and the holds); the controller's critical reader hold on
  the shard is the durable since;
- outputs: ``downgrade_since`` of the controller's hold; a maintenance request (the
  balanced merge below since, tiered compaction) when since moved or the batch count changed;
- invariants: since = the meet of the implied capability and every hold (peeks at their
  as-of, subscribes at their progress, sinks at ``upper - 1``), never beyond the upper and
  never backwards. The decisions are pure (:mod:`shared.controller_state`:
  ``Capabilities``, ``collection_holds``); this room performs them.
"""

from __future__ import annotations

from services.controller.context import ControllerContext
from services.controller.maintenance import MaintenanceRoom
from services.controller.model import READER_ID, Tick
from shared.controller_state import collection_holds
from shared.read_policy import policy_from_json


class CapabilitiesRoom:
    """The controller's read capabilities room (see the module docstring); it asks
    ``maintenance`` for the merges a moved since or a new batch calls for."""

    def __init__(self, ctx: ControllerContext, maintenance: MaintenanceRoom) -> None:
        self.ctx = ctx
        self.maintenance = maintenance

    # -- read capabilities ----------------------------------------------------------------------
    def move_sinces(self, tick: Tick) -> None:
        """Tick step: move each live collection's since to the meet of its implied capability
        and its holds."""
        ctx = self.ctx
        for cid, st in tick.heads.items():
            if st.dropped:
                continue
            col = ctx.collections[cid]
            c = tick.catalog.collections[cid]
            policy = policy_from_json(c.read_policy, default_since=c.since)
            holds = collection_holds(
                cid,
                ((p.command_id, p.collection_id, p.as_of) for p in ctx.peeks.values()),
                ctx.section.subs,
                (s.sink_id for s in tick.catalog.live_sinks() if s.collection_id == cid),
                st.upper,
            )
            col.caps = col.caps.advance_implied(policy, st.upper).with_holds(holds)
            target = col.caps.since(st.upper)
            hold = st.reader(READER_ID)
            current = hold.since if hold is not None else st.since
            moved = current.less_than(target)
            if moved:
                st = col.shard.downgrade_since(READER_ID, target)
            if moved or len(st.batches) != col.batches_seen:
                self.maintenance.request(cid, below_since=moved, compact=True)
                col.batches_seen = len(st.batches)
