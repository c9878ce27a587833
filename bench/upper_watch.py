"""A shard's upper watched from a thread, for the benchmarks that time when it moves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class UpperWatch:
    """Polls a shard's upper in a thread; remembers when it first reached each value.

    ``on_error`` is told about a failed poll (a transient S3 error: the next poll goes on)."""

    def __init__(self, shard: Any, poll_s: float = 0.02, on_error: Callable[[str], None] | None = None) -> None:
        self.shard = shard
        self.poll_s = poll_s
        self.on_error = on_error
        self.upper = 0
        self.reached: list[tuple[float, int]] = []  # (monotonic, upper) at each advance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="upper-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                u = self.shard.refresh().upper.time or 0
            except Exception as e:  # noqa: BLE001 - a transient S3 error: poll again
                if self.on_error is not None:
                    self.on_error(f"upper poll failed: {e}")
                u = self.upper
            if u > self.upper:
                self.upper = u
                self.reached.append((time.monotonic(), u))
            self._stop.wait(self.poll_s)

    def when(self, frontier: int) -> float | None:
        for t, u in self.reached:
            if u >= frontier:
                return t
        return None

    def wait(self, frontier: int, timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        while self.upper < frontier:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected the upper to reach {frontier} within {timeout_s}s ({what}), found {self.upper}")
            time.sleep(0.01)
        return self.when(frontier) or time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
