"""The controller's pure decisions (shared.controller_state), without I/O: holds on since,
readability, upper reports, the command log, subscribe steps."""

from __future__ import annotations

from typing import Any

from shared.controller_state import (
    Capabilities,
    ControllerSection,
    collection_holds,
    is_final_step,
    is_readable,
    record_reports,
    subscribe_hold,
    subscribe_step,
    upper_reports,
)
from shared.frontier import Frontier
from shared.read_policy import ValidFrom


def _sub(collection_id: str, as_of: int, progress: int | None = None, state: str = "active",
         up_to: int | None = None) -> dict[str, Any]:
    return {"collection_id": collection_id, "as_of": as_of, "progress": progress, "state": state, "up_to": up_to}


def test_holds_name_every_holder_of_the_collection_and_skip_finished_subscribes() -> None:
    holds = collection_holds(
        "c",
        [("p1", "c", 7), ("p2", "other", 3)],
        {"s1": _sub("c", 4), "s2": _sub("c", 4, progress=9), "s3": _sub("c", 1, state="done"),
         "s4": _sub("other", 0)},
        ["k1"],
        Frontier.at(20),
    )
    assert holds == {
        "peek:p1": Frontier.at(7),
        "subscribe:s1": Frontier.at(4),
        "subscribe:s2": Frontier.at(9),
        "sink:k1": Frontier.at(19),
    }


def test_since_is_the_meet_of_implied_and_holds_clamped_to_the_upper() -> None:
    caps = Capabilities(Frontier.at(0)).advance_implied(ValidFrom(Frontier.at(15)), Frontier.at(30))
    assert caps.implied == Frontier.at(15)
    holds = collection_holds("c", [("p", "c", 12)], {}, [], Frontier.at(30))
    assert caps.with_holds(holds).since(Frontier.at(30)) == Frontier.at(12)
    assert caps.with_holds({}).since(Frontier.at(10)) == Frontier.at(10)
    # The implied capability never moves back.
    assert caps.advance_implied(ValidFrom(Frontier.at(5)), Frontier.at(30)).implied == Frontier.at(15)


def test_a_time_is_readable_below_the_upper_or_once_the_upper_is_closed() -> None:
    assert is_readable(4, Frontier.at(5))
    assert not is_readable(5, Frontier.at(5))
    assert is_readable(10**9, Frontier.empty())


def test_uppers_are_reported_forward_once_and_dropped_collections_once_as_closed() -> None:
    reported: dict[str, int | None] = {"a": 5, "b": 7, "gone": 3, "never": None}
    uppers = {"a": Frontier.at(5), "b": Frontier.at(9), "new": Frontier.at(1)}
    changes = upper_reports(reported, uppers, ["gone", "never", "unreported"])
    assert changes == {"b": 9, "new": 1, "gone": None}
    record_reports(reported, changes)
    assert reported == {"a": 5, "b": 9, "gone": None, "never": None, "new": 1}
    assert upper_reports(reported, uppers, ["gone"]) == {}
    # A report is never recorded backwards.
    record_reports(reported, {"b": 8})
    assert reported["b"] == 9


def test_the_command_log_evicts_oldest_first_but_never_a_waiting_peek() -> None:
    sec = ControllerSection()
    sec.record("peek", {"o": "0:0", "pending": "x"}, 2)
    sec.record("a", {"o": "0:1", "r": "A"}, 2)
    assert sec.record("b", {"o": "0:2", "r": "B"}, 2) == ["a"]
    assert set(sec.log) == {"peek", "b"}
    again = ControllerSection.from_extra(sec.to_extra({}))
    assert again.log == sec.log and again.order == sec.order


def test_subscribe_steps_stop_at_up_to_and_hold_at_progress() -> None:
    sub = _sub("c", 3, up_to=10)
    assert subscribe_step(sub, Frontier.at(3)) is None  # as_of not readable yet
    assert subscribe_step(sub, Frontier.at(8)) == (None, Frontier.at(8), True)
    assert subscribe_hold(sub) == Frontier.at(3)
    sub["progress"] = 8
    assert subscribe_hold(sub) == Frontier.at(8)
    step = subscribe_step(sub, Frontier.at(50))
    assert step == (8, Frontier.at(10), False)
    assert is_final_step(step[1], 10)
    assert not is_final_step(Frontier.at(9), 10)
    assert is_final_step(Frontier.empty(), None)


def test_heads_due_reads_urgent_heads_at_once_and_spreads_quiet_ones_over_the_refresh_interval() -> None:
    from services.controller.model import heads_due

    every_s, tick_s = 1.0, 0.05
    # 100 collections opened together, then a peek waits on "c7": the first tick reads c7 and
    # ceil(100 * 0.05 / 1) + 1 = 6 of the others, oldest first (ties by id).
    last = {f"c{i}": 0.0 for i in range(100)}
    due = heads_due(last, {"c7"}, 1.0, every_s, tick_s)
    assert due[0] == "c7" and len(due) == 7 and len(set(due)) == 7
    # Ticks go on: every quiet head is read within the interval (and a few ticks), none twice,
    # and the urgent one at every tick.
    now, reads = 1.0, []
    while now < 2.5:
        due = heads_due(last, {"c7"}, now, every_s, tick_s)
        assert "c7" in due and len(due) <= 7
        for cid in due:
            last[cid] = now
        reads += [c for c in due if c != "c7"]
        now += tick_s
    first_pass = reads[: len(last) - 1]
    assert sorted(first_pass) == sorted(c for c in last if c != "c7")
    # A head read less than the interval ago is not read again; an unknown urgent id is ignored.
    assert heads_due({"a": 0.9, "b": 0.0}, {"zz"}, 1.0, every_s, tick_s) == ["b"]
    # head_refresh_ms 0: every head at every tick (the tick before announcements).
    assert sorted(heads_due({"a": 1.0, "b": 1.0}, set(), 1.0, 0.0, tick_s)) == ["a", "b"]
