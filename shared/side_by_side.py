"""Calls that wait on round trips (S3, Kafka), run side by side on a few threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def side_by_side(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``fn`` of each item, in order, on at most ``threads`` threads (one item: on the
    caller's thread, with no pool)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as ex:
        return list(ex.map(fn, items))
