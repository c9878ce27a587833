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
