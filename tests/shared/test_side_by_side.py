"""``side_by_side``: results in the items' order; calls that wait overlap on the threads."""

from __future__ import annotations

import threading

from shared.side_by_side import side_by_side


def test_results_keep_the_order_and_waiting_calls_overlap() -> None:
    inside, most = [0], [0]
    lock = threading.Lock()
    gate = threading.Barrier(4, timeout=30)

    def call(x: int) -> int:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        if x < 4:
            gate.wait()  # the first four meet: they run at the same time or the wait times out
        with lock:
            inside[0] -= 1
        return x * x

    assert side_by_side(call, list(range(10)), 4) == [x * x for x in range(10)]
    assert most[0] == 4
    assert side_by_side(call, [], 4) == [] and side_by_side(lambda x: x + 1, [1], 4) == [2]


def test_a_kept_pool_orders_results_overlaps_calls_and_reuses_its_threads() -> None:
    from shared.side_by_side import SideBySide

    pool = SideBySide(3, "test-side")
    gate = threading.Barrier(3, timeout=30)
    names: list[set[str]] = []

    def call(x: int) -> int:
        if x < 3:
            gate.wait()  # the first three meet: they run at the same time or the wait times out
        names[-1].add(threading.current_thread().name)
        return x + 100

    for _ in range(3):
        names.append(set())
        assert pool.map(call, list(range(8))) == [x + 100 for x in range(8)]
    assert len(names[0]) == 3 and all(n.startswith("test-side") for n in names[0])
    assert names[1] == names[2] == names[0]  # the same threads, kept between calls
    assert pool.map(lambda x: threading.current_thread().name, ["one"]) == [threading.current_thread().name]


def test_a_kept_pool_raises_only_after_every_call_ended() -> None:
    import time

    import pytest

    from shared.side_by_side import SideBySide

    ended: list[int] = []

    def call(x: int) -> int:
        if x == 0:
            raise ValueError("first")
        time.sleep(0.2)
        ended.append(x)
        return x

    with pytest.raises(ValueError, match="first"):
        SideBySide(3, "test-raise").map(call, [0, 1, 2])
    assert sorted(ended) == [1, 2]  # the others ended before the error reached the caller
