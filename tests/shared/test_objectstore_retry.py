"""RetryingObjectStore: which failures are retried (pure core, in-memory store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shared.errors import IndeterminateError, ObjectNotFoundError, ObjectStoreError, PreconditionFailedError
from shared.objectstore import MemoryObjectStore, ObjectInfo, RetryingObjectStore


class Scripted:
    """An in-memory store that raises the scripted errors, in order, before answering.

    ``landed`` errors are raised after the call was performed (a lost acknowledgement)."""

    def __init__(self, errors: list[BaseException], landed: bool = False) -> None:
        self.inner = MemoryObjectStore()
        self.errors = list(errors)
        self.landed = landed
        self.calls = 0

    def _maybe_fail(self, op: Any) -> Any:
        self.calls += 1
        if self.errors and not self.landed:
            raise self.errors.pop(0)
        out = op()
        if self.errors:
            raise self.errors.pop(0)
        return out

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._maybe_fail(lambda: self.inner.put(key, data, if_absent=if_absent))

    def get(self, key: str) -> bytes:
        return self._maybe_fail(lambda: self.inner.get(key))  # type: ignore[no-any-return]

    def exists(self, key: str) -> bool:
        return self._maybe_fail(lambda: self.inner.exists(key))  # type: ignore[no-any-return]

    def delete(self, key: str) -> None:
        self._maybe_fail(lambda: self.inner.delete(key))

    def delete_many(self, keys: list[str]) -> None:
        self._maybe_fail(lambda: self.inner.delete_many(keys))

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self._maybe_fail(lambda: self.inner.list(prefix, start_after))  # type: ignore[no-any-return]


def _store(s: Scripted) -> RetryingObjectStore:
    return RetryingObjectStore(s, backoff_s=0.001)  # type: ignore[arg-type]


def test_idempotent_calls_are_retried_on_transient_errors() -> None:
    s = Scripted([ObjectStoreError("blip"), IndeterminateError("timeout")])
    s.inner.put("k", b"v")
    r = _store(s)
    assert r.get("k") == b"v"
    assert s.calls == 3 and r.retried == 2
    s.errors = [ObjectStoreError("blip")]
    assert [o.key for o in r.list("")] == ["k"]
    s.errors = [IndeterminateError("timeout")]
    assert r.exists("k") is True
    s.errors = [ObjectStoreError("blip")]
    r.delete_many(["k"])
    assert not s.inner.exists("k")


def test_an_unconditional_put_whose_ack_was_lost_is_retried_and_lands_once() -> None:
    s = Scripted([IndeterminateError("lost ack")], landed=True)
    r = _store(s)
    r.put("k", b"v")
    assert s.inner.get("k") == b"v" and s.calls == 2


def test_a_conditional_put_is_retried_only_when_it_was_not_performed() -> None:
    s = Scripted([ObjectStoreError("refused before sending")])
    r = _store(s)
    r.put("a", b"1", if_absent=True)
    assert s.inner.get("a") == b"1" and s.calls == 2
    # Outcome unknown (it landed): not retried; the caller resolves it (a retry would say
    # PreconditionFailed about its own write).
    s2 = Scripted([IndeterminateError("lost ack")], landed=True)
    r2 = _store(s2)
    with pytest.raises(IndeterminateError):
        r2.put("b", b"2", if_absent=True)
    assert s2.calls == 1 and s2.inner.get("b") == b"2"


def test_answers_are_not_retried_and_the_last_transient_error_is_raised() -> None:
    s = Scripted([])
    r = _store(s)
    with pytest.raises(ObjectNotFoundError):
        r.get("missing")
    assert s.calls == 1
    s.inner.put("k", b"v")
    with pytest.raises(PreconditionFailedError):
        r.put("k", b"w", if_absent=True)
    assert s.calls == 2
    s.errors = [ObjectStoreError(f"down {i}") for i in range(10)]
    with pytest.raises(ObjectStoreError, match="down 3"):
        r.get("k")
    assert s.calls == 2 + 4


def test_other_attributes_are_the_wrapped_stores() -> None:
    s = Scripted([])
    s.client = "boto3-client"  # type: ignore[attr-defined]
    assert _store(s).client == "boto3-client"


def test_with_a_budget_an_outage_shorter_than_it_is_waited_out_with_capped_backoff() -> None:
    """A store that refuses for 12 s (a network partition): with a 30 s budget the call is
    held and answers once the store does, no retry more than ``max_backoff_s`` apart; an
    outage longer than the budget fails after it."""
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    class Down(Scripted):
        def __init__(self, until: float) -> None:
            super().__init__([])
            self.until = until

        def get(self, key: str) -> bytes:
            self.calls += 1
            if now[0] < self.until:
                raise ObjectStoreError("connection refused")
            return self.inner.get(key)

    s = Down(until=12.0)
    s.inner.put("k", b"v")
    r = RetryingObjectStore(s, budget_s=30.0, max_backoff_s=1.0, clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
    assert r.get("k") == b"v"
    assert 12.0 <= now[0] <= 13.5 and max(sleeps) <= 1.5  # 1.0 with up to +50 % jitter
    long = Down(until=100.0)
    now[0] = 0.0
    r = RetryingObjectStore(long, budget_s=30.0, clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
    with pytest.raises(ObjectStoreError):
        r.get("k")
    assert 28.5 <= now[0] <= 30.0

