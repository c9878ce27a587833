"""The object-store interface the shard layer is written against, with an in-memory version
for unit tests of the pure core and a fault-injecting wrapper for tests of the real one.

The S3 implementation lives in :mod:`shared.io.s3`; it translates botocore errors into the
errors below at its boundary. Semantics every implementation keeps:

- ``put(key, data, if_absent=True)`` is S3's ``PUT`` with ``If-None-Match: *``: it succeeds
  for exactly one writer of a key and raises :class:`PreconditionFailedError` for the others.
- ``get`` of a missing key raises :class:`ObjectNotFoundError`.
- A failure whose outcome is unknown (timeout, connection reset after sending) raises
  :class:`IndeterminateError`; every other failure is determinate (:class:`ObjectStoreError`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast

from shared.errors import (
    IndeterminateError,
    ObjectNotFoundError,
    ObjectStoreError,
    PreconditionFailedError,
)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    last_modified_ms: int


class ObjectStore(Protocol):
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None: ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def delete_many(self, keys: list[str]) -> None: ...

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]: ...


def now_ms() -> int:
    return int(time.time() * 1000)


class MemoryObjectStore:
    """A thread-safe in-memory object store with S3's conditional-PUT semantics."""

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, int]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with self._lock:
            if if_absent and key in self._objects:
                raise PreconditionFailedError(
                    f"expected no object at {key!r}, found one", key=key
                )
            self._objects[key] = (bytes(data), now_ms())

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._objects[key][0]
            except KeyError:
                raise ObjectNotFoundError(f"expected an object at {key!r}, found none", key=key) from None

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._objects

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def delete_many(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._objects.pop(k, None)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted(
                (k, len(v), ts) for k, (v, ts) in self._objects.items() if k.startswith(prefix)
            )
        for k, size, ts in items:
            if start_after is None or k > start_after:
                yield ObjectInfo(k, size, ts)


@dataclass
class RetryingObjectStore:
    """Retries a call that failed transiently when retrying it is safe, so that a blip of the
    object store does not fail a whole micro-batch or command.

    - ``get``, ``exists``, ``list``, ``delete``, ``delete_many`` and unconditional ``put``
      are idempotent: retried on :class:`ObjectStoreError` and :class:`IndeterminateError`;
    - a conditional ``put`` (``if_absent=True``) is retried only on :class:`ObjectStoreError`
      (determinate: it was not performed). After an :class:`IndeterminateError` it may have
      landed, so a retry could report :class:`PreconditionFailedError` for the caller's own
      write: that error goes to the caller, whose protocol resolves it (the versioned log
      looks for its token).

    Other errors (not found, precondition failed, ...) are answers, never retried. The last
    error is raised when ``attempts`` are used up and, with ``budget_s``, that much time has
    passed since the first failure: an outage of the store (a network partition, a restarting
    server) shorter than the budget then holds the call, retried every ``max_backoff_s`` at
    most, and it goes on soon after the store answers again, instead of failing a micro-batch
    whose query would take far longer to restart.
    """

    inner: ObjectStore
    attempts: int = 4
    backoff_s: float = 0.05
    #: Retry for at least this long (seconds since the first failure), beyond ``attempts``.
    budget_s: float = 0.0
    max_backoff_s: float = 1.0
    retried: int = 0
    _rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def _call(self, fn: Callable[[], object], transient: tuple[type[BaseException], ...]) -> object:
        failures = 0
        first = 0.0
        while True:
            try:
                return fn()
            except transient:
                failures += 1
                now = self.clock()
                if failures == 1:
                    first = now
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1)) * (0.5 + self._rng.random())
                if failures >= self.attempts and now + delay - first > self.budget_s:
                    raise
                self.retried += 1
                self.sleep(delay)

    _ANY = (ObjectStoreError, IndeterminateError)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._call(lambda: self.inner.put(key, data, if_absent=if_absent),
                   (ObjectStoreError,) if if_absent else self._ANY)

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.inner.get(key), self._ANY)  # type: ignore[return-value]

    def exists(self, key: str) -> bool:
        return self._call(lambda: self.inner.exists(key), self._ANY)  # type: ignore[return-value]

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key), self._ANY)

    def delete_many(self, keys: list[str]) -> None:
        self._call(lambda: self.inner.delete_many(keys), self._ANY)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        items = self._call(lambda: list(self.inner.list(prefix, start_after)), self._ANY)
        return iter(cast("list[ObjectInfo]", items))

    def __getattr__(self, name: str) -> object:
        # Anything else (e.g. the S3 adapter's boto3 client) is the wrapped store's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)
