"""Calls that wait on round trips (S3, Kafka), run side by side on a few threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def side_by_side(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``fn`` of each item, in order, on at most ``threads`` threads (one item: on the
    caller's thread, with no pool). The threads end with the call: for a rare call; a
    step that runs every micro-batch keeps its threads in a :class:`SideBySide`."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as ex:
        return list(ex.map(fn, items))


class SideBySide:
    """:func:`side_by_side` on threads kept between calls. A driver step that runs every
    micro-batch would otherwise start its threads each time, and on a busy machine starting a
    thread waits until the new thread gets the interpreter."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` of each item, in order (one item: on the caller's thread). As with
        :func:`side_by_side`, every call has ended when it returns or raises (the first
        exception in the items' order): none goes on behind the caller's back."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=self.name)
            pool = self._pool
        futures = [pool.submit(fn, x) for x in items]
        wait(futures)
        return [f.result() for f in futures]
