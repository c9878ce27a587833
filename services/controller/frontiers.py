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

from services.controller.loop import CommandLoop
from shared.catalog import CatalogState
from shared.controller_state import ControllerSection, record_reports, upper_reports
from shared.state import ShardState


class FrontiersRoom(CommandLoop):
    """The controller's frontier reporting room (see the module docstring)."""

    # -- frontier reporting ---------------------------------------------------------------------
    def _report_uppers(self, catalog: CatalogState, heads: dict[str, ShardState]) -> None:
        dropped = [cid for cid, c in catalog.collections.items() if c.dropped]
        changes = upper_reports(self.section.reported, {cid: st.upper for cid, st in heads.items()}, dropped)
        if not changes:
            return
        for cid, up in changes.items():
            self._send(self._encode_response(None, "FrontierUpper", {"collection_id": cid, "upper": up}), cid)
        self._flush()

        def t(s: CatalogState, sec: ControllerSection) -> None:
            record_reports(sec.reported, changes)

        self._commit(t)
