"""The history checker of bench/chaos.py on a history made in memory: silent on a correct
history, and it reports a doubled update and a lost subscribe message (so a passing campaign
means something)."""

from __future__ import annotations

import random
from collections import Counter
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


# -- the command prober's rules (CommandLedger), on answers made in memory ----------------------


def _peek_result(cid: str, as_of: int, rows: Any) -> dict[str, Any]:
    inline = [{"row": ROWS.encode({"k": r[0], "v": r[1]}), "count": n} for r, n in rows.items()]
    return {"command_id": cid, "body": ("io.shardsink.v1.PeekResult", {
        "collection_id": "c", "as_of": as_of, "result": ("io.shardsink.v1.InlineRows", {"rows": inline})})}


def _ack(cid: str) -> dict[str, Any]:
    return {"command_id": cid, "body": ("io.shardsink.v1.Ack", {"results": {}})}


def _error(cid: str, kind: str) -> dict[str, Any]:
    return {"command_id": cid, "body": ("io.shardsink.v1.Error", {"kind": kind, "message": "m", "fields": {}})}


def _ledger() -> tuple[Any, Any]:
    """A ledger over a workload of 5 steps (times 0-49), with one fault from 100 s to 110 s
    and a bound of 30 s."""
    wl = chaos.Workload(_NoProducer(), random.Random(2), 30)
    for _ in range(5):
        wl.step()
    ledger = chaos.CommandLedger(lambda: wl.sent, 30.0)
    ledger.fault_began(100.0)
    ledger.fault_healed(110.0)
    return wl, ledger


def test_answer_due_is_the_bound_after_the_heal_of_every_fault_within_it() -> None:
    assert chaos.answer_due(50.0, [(100.0, 110.0)], 30.0) == 80.0  # no fault in its 30 s
    assert chaos.answer_due(105.0, [(100.0, 110.0)], 30.0) == 140.0  # sent during it
    # a fault that begins before the bound is up pushes it again
    assert chaos.answer_due(105.0, [(100.0, 110.0), (130.0, 160.0)], 30.0) == 190.0
    assert chaos.answer_due(90.0, [(100.0, 110.0)], 30.0) == 140.0


def test_command_ledger_is_silent_on_right_answers_late_or_with_a_transient_error() -> None:
    wl, ledger = _ledger()
    rows = chaos.peek_rows_of
    ledger.sent("peek", "p1", 90.0, 19)
    ledger.answered(_peek_result("p1", 19, chaos.model_at(wl.sent, 19)), 91.0, rows)
    ledger.sent("peek", "p2", 105.0, 39)  # during the fault, answered 25 s after its heal
    ledger.answered(_peek_result("p2", 39, chaos.model_at(wl.sent, 39)), 135.0, rows)
    ledger.sent("peek", "p3", 106.0, 9)
    ledger.answered(_error("p3", "Internal"), 107.0, rows)
    ledger.sent("peek", "p4", 107.0, 9)  # the send timed out in the client, never answered
    ledger.send_failed("p4", TimeoutError("not delivered"), 137.0)
    # appends: a0 acknowledged; a1's outcome unknown (Internal) but it landed at 1, so a2,
    # sent at 1 before it, is refused with UpperMismatch
    ledger.sent("append", "a0", 91.0, 0, "probe-0")
    ledger.answered(_ack("a0"), 92.0, rows)
    ledger.sent("append", "a1", 101.0, 1, "probe-1")
    ledger.answered(_error("a1", "Internal"), 104.0, rows)
    ledger.sent("append", "a2", 105.0, 1, "probe-2")
    ledger.answered(_error("a2", "UpperMismatch"), 115.0, rows)
    ledger.answered(_ack("a0"), 120.0, rows)  # a replayed answer counts once

    figures, divergences = ledger.judge(500.0)
    assert divergences == []
    assert figures["commands_sent"] == 7 and figures["commands_answered"] == 6
    assert figures["commands_unanswered_after_heal"] == 0 and figures["commands_client_errors"] == 1
    assert figures["peeks_checked"] == 2 and figures["peek_mismatches"] == 0
    assert figures["commands_during_faults"] == 5 and figures["command_heal_to_answer_max_s"] == 25.0
    assert figures["command_answer_max_s"] == 30.0
    landed, wrong = ledger.check_side(Counter({((0, "probe-0"), 0): 1, ((1, "probe-1"), 1): 1}))
    assert (landed, wrong) == (2, [])


def test_command_ledger_reports_a_wrong_peek_a_wrong_error_and_a_command_unanswered_after_the_heal() -> None:
    wl, ledger = _ledger()
    rows = chaos.peek_rows_of
    wrong = chaos.model_at(wl.sent, 29)
    wrong[next(iter(wrong))] += 1  # a row counted twice
    ledger.sent("peek", "p1", 90.0, 29)
    ledger.answered(_peek_result("p1", 29, wrong), 91.0, rows)
    ledger.sent("peek", "p2", 92.0, 29)
    ledger.answered(_error("p2", "NotReadableYet"), 93.0, rows)  # at a time the shard has reached
    ledger.sent("peek", "p3", 105.0, 9)  # during the fault, never answered
    figures, divergences = ledger.judge(139.0)  # its 30 s after the heal are not over yet
    assert figures["commands_pending_at_end"] == 1 and figures["commands_unanswered_after_heal"] == 0
    figures, divergences = ledger.judge(141.0)
    assert figures["peek_mismatches"] == 1 and figures["commands_wrong_errors"] == 1
    assert figures["commands_unanswered_after_heal"] == 1
    assert [d.split(":")[0] for d in divergences] == [
        "expected the peek p1 at as_of 29 to equal the model",
        "expected the peek p2 answered rightly or with a transient error, found NotReadableYet",
        "expected every command answered within 30 s of the heal of the faults around it, found 1 not",
    ]


def test_command_ledger_reports_an_acknowledged_append_lost_and_a_refused_one_applied() -> None:
    _, ledger = _ledger()
    rows = chaos.peek_rows_of
    ledger.sent("append", "a0", 91.0, 0, "probe-0")
    ledger.answered(_ack("a0"), 92.0, rows)
    ledger.sent("append", "a1", 93.0, 0, "probe-1")
    ledger.answered(_error("a1", "UpperMismatch"), 94.0, rows)
    # a0's row is missing; a1, refused, wrote its row
    _, wrong = ledger.check_side(Counter({((0, "probe-1"), 0): 1}))
    assert any("refused with error:UpperMismatch to have no effect" in w for w in wrong), wrong
    assert any("acknowledged append a0 to have landed at 0" in w for w in wrong), wrong
