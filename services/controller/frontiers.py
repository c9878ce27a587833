"""Frontier reporting: ``FrontierUpper`` responses when a collection's upper advances.

Contract:

- inputs: each tick's shard heads and the catalog (dropped collections);
- state: ``reported[collection_id]`` in the catalog's controller section (the last upper
  reported; ``null`` for the empty frontier);
- outputs: one ``FrontierUpper`` per advance on ``responses`` (keyed by the collection id),
  the empty frontier once for a dropped collection;
- invariants: uppers are reported only forward, each advance once (sent, flushed, then
  recorded; a crash in between reports the same upper again, never a smaller one). The
  decisions are pure (:func:`shared.controller_state.upper_reports`, ``record_reports``).
"""

from __future__ import annotations

from services.controller.context import ControllerContext
from services.controller.model import Tick
from shared.catalog import CatalogState
from shared.controller_state import ControllerSection, record_reports, upper_reports


class FrontiersRoom:
    """The controller's frontier reporting room (see the module docstring)."""

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx

    # -- frontier reporting ---------------------------------------------------------------------
    def report_uppers(self, tick: Tick) -> None:
        """Tick step: report every upper that advanced (and a dropped collection's end)."""
        ctx = self.ctx
        dropped = [cid for cid, c in tick.catalog.collections.items() if c.dropped]
        changes = upper_reports(ctx.section.reported, {cid: st.upper for cid, st in tick.heads.items()}, dropped)
        if not changes:
            return
        for cid, up in changes.items():
            ctx.send(ctx.encode_response(None, "FrontierUpper", {"collection_id": cid, "upper": up}), cid)
        ctx.flush()

        def t(s: CatalogState, sec: ControllerSection) -> None:
            record_reports(sec.reported, changes)

        ctx.commit(t)
