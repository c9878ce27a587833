"""The history checker of bench/chaos.py on a history made in memory: silent on a correct
history, and it reports a doubled update and a lost subscribe message (so a passing campaign
means something)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.avro_arrow import parse_row_schema
from shared.objectstore import MemoryObjectStore
from shared.shard import Shard
from tests.controller_fixture import ROWS, SCHEMA, changes_of, check_progress_order

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import chaos  # noqa: E402


class _NoProducer:
    def send(self, row: Any, t: int, d: int) -> None:
        pass

    def advance_to(self, f: int) -> None:
        pass


def _msg(t: int | None, row: tuple[int, str] | None = None, d: int | None = None) -> dict[str, Any]:
    if row is None:
        return {"progressed": True, "time": t, "row": None, "diff": None}
    return {"progressed": False, "time": t, "row": ROWS.encode({"k": row[0], "v": row[1]}), "diff": d}


def _history(bug: str | None) -> tuple[dict[str, Any], list[str]]:
    """20 appends of a workload's steps (as the sink would make them), recorded as they land,
    and the subscribe output the controller would emit; ``bug`` spoils one of them."""
    shard = Shard.create(MemoryObjectStore(), "c", parse_row_schema(SCHEMA))
    wl = chaos.Workload(_NoProducer(), random.Random(1), 30)
    recorder = chaos.StateRecorder(shard)
    upper = 0
    for i in range(20):
        n0 = len(wl.sent)
        f = wl.step()
        ups = [({"k": r[0], "v": r[1]}, t, d) for r, t, d in wl.sent[n0:]]
        if bug == "doubled_update" and i == 7:
            ups = ups + ups[:1]
        shard.compare_and_append(ups, upper, f)
        upper = f
        recorder.poll_once()
    msgs = [_msg(0, r, d) for r, d in chaos.model_at(wl.sent, 0).items()] + [_msg(1)]
    changes = chaos.model_between(wl.sent, 1, upper)
    for t in range(1, upper):
        msgs += [_msg(t, r, d) for (r, tt), d in sorted(changes.items()) if tt == t]
        msgs.append(_msg(t + 1))
    if bug == "lost_subscribe_message":
        del msgs[3]
    msgs.append(_msg(None))
    summary: dict[str, Any] = {}
    divergences: list[str] = []
    chaos.check(summary, divergences, shard, recorder, wl, upper, msgs, check_progress_order, changes_of, True)
    return summary, divergences


def test_checker_accepts_a_correct_history() -> None:
    summary, divergences = _history(None)
    assert divergences == []
    assert summary["appends"] == 20 and summary["append_contents_checked"] == 20
    assert summary["subscribe_last_progress"] == summary["final_upper"] == 200


@pytest.mark.parametrize(
    ("bug", "found"),
    [
        ("doubled_update", "expected the shard's updates to equal the model's (none lost or doubled)"),
        ("lost_subscribe_message", "expected the subscribe's output to equal the model's change stream"),
    ],
)
def test_checker_reports_a_divergence(bug: str, found: str) -> None:
    _, divergences = _history(bug)
    assert any(d.startswith(found) for d in divergences), divergences
