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

from services.controller.loop import CommandLoop
from services.controller.model import READER_ID
from shared.catalog import CatalogState
from shared.controller_state import collection_holds
from shared.read_policy import policy_from_json
from shared.state import ShardState


class CapabilitiesRoom(CommandLoop):
    """The controller's read capabilities room (see the module docstring)."""

    # -- read capabilities ----------------------------------------------------------------------
    def _move_sinces(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        for cid, st in heads.items():
            if st.dropped:
                continue
            col = self.collections[cid]
            c = catalog.collections[cid]
            policy = policy_from_json(c.read_policy, default_since=c.since)
            holds = collection_holds(
                cid,
                ((p.command_id, p.collection_id, p.as_of) for p in self.peeks.values()),
                self.section.subs,
                (s.sink_id for s in catalog.live_sinks() if s.collection_id == cid),
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
                assert self.maintenance is not None
                self.maintenance.request(cid, below_since=moved, compact=True)
                col.batches_seen = len(st.batches)
