"""A log of sequence-numbered state objects with one atomic primitive: the conditional PUT.

Shards and catalogs both keep their state this way: state ``n + 1`` is written with
``If-None-Match: *``, so exactly one writer wins each seqno, and the newest seqno is the head.
No database, no lock service.

Layout under ``prefix``::

    state/00000000000000000042.json    the states (full states: each one is a roll-up)
    hint                               the seqno of a recent state

Finding the head never LISTs the history: a handle caches the head it last saw; a fresh one
reads the hint, then probes forward (GET n+1, then HEAD n+2, n+4, n+8, ... then a binary
search: the first probe is a GET because most refreshes find exactly one new state, whose body
they need anyway, so they take two requests, GET n+1 and HEAD n+2, where probing by HEAD alone
took four: HEAD n+1, n+3 and n+2, then GET n+1). Only when
the hint is missing or points at a collected state does it LIST the (small, collected) state
prefix.

Commit order (:meth:`VersionedLog.commit`):

1. load the head (cached and confirmed within ``max_cache_age_s``, else probed);
2. apply the pure transition -> state n+1 (it may raise a typed error: nothing is written);
3. ``before_put()`` (a last precondition check, e.g. a staged batch's age);
4. PUT state n+1 with If-None-Match: *. On 412/409 read state n+1: if it carries our change
   token it is ours (an earlier attempt landed), else re-probe and go to 2. On an unknown
   outcome (timeout) PUT the same bytes again until the answer is known;
5. every ``HINT_EVERY`` states, rewrite the hint.

Deleted seqnos are never written again: collection deletes only states older than the grace
period, and a writer re-probes when its cached head is older than half of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from shared.errors import (
    ConflictRetryError,
    IndeterminateError,
    ObjectNotFoundError,
    ObjectStoreError,
    PreconditionFailedError,
    ShardNotFoundError,
)
from shared.objectstore import ObjectStore

HINT_EVERY = 16
#: States :meth:`VersionedLog.refresh` reads one by one for a caller with ``enough``.
ENOUGH_GETS = 4


class VersionedState(Protocol):
    @property
    def seqno(self) -> int: ...

    @property
    def change_token(self) -> str: ...

    def encode(self) -> bytes: ...


S = TypeVar("S", bound=VersionedState)


class AlreadyApplied(Exception):  # noqa: N818 - control flow, never escapes commit()
    """Raised by a transition to say "nothing to do: this change is in ``state`` already"."""

    def __init__(self, state: object) -> None:
        self.state = state


class VersionedLog(Generic[S]):
    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        decode: Callable[[bytes], S],
        *,
        max_cache_age_s: float,
        name: str = "",
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.decode = decode
        self.max_cache_age_s = max_cache_age_s
        self.name = name or prefix
        self._lock = threading.RLock()
        self._head: S | None = None
        self._confirmed = 0.0

    # -- keys ------------------------------------------------------------------------------
    def state_key(self, seqno: int) -> str:
        return f"{self.prefix}state/{seqno:020d}.json"

    @property
    def hint_key(self) -> str:
        return f"{self.prefix}hint"

    # -- head ------------------------------------------------------------------------------
    def set_head(self, state: S) -> None:
        with self._lock:
            if self._head is None or state.seqno >= self._head.seqno:
                self._head = state
                self._confirmed = time.monotonic()

    def get_state(self, seqno: int) -> S:
        return self.decode(self.store.get(self.state_key(seqno)))

    def _newest_by_list(self) -> int:
        best: int | None = None
        for info in self.store.list(f"{self.prefix}state/"):
            name = info.key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                try:
                    n = int(name[:-5])
                except ValueError:
                    continue
                best = n if best is None else max(best, n)
        if best is None:
            raise ShardNotFoundError(f"expected state objects under {self.prefix!r}, found none", name=self.name)
        return best

    def _start_seqno(self) -> int:
        if self._head is not None:
            return self._head.seqno
        try:
            n = int(self.store.get(self.hint_key).decode())
        except (ObjectNotFoundError, ValueError):
            return self._newest_by_list()
        if not self.store.exists(self.state_key(n)):
            return self._newest_by_list()
        return n

    def refresh(self, *, enough: Callable[[S], bool] | None = None, start_at: int | None = None) -> S:
        """Find the head: from the cached seqno or the hint, probe forward (galloping).
        ``enough``: a caller that needs only a state that passes it (not the newest) reads the
        next states one by one (up to :data:`ENOUGH_GETS`) and takes the first that passes,
        with no probe beyond it (one GET per state instead of HEADs and a GET), or the head
        when none does. ``start_at``: a seqno heard of elsewhere (another process read it),
        read first when it is beyond the cached head: with ``enough``, taken when it passes;
        otherwise the search goes on from it. A seqno the store does not hold is ignored: a
        state object is immutable once written, so whatever is read is this log's."""
        with self._lock:
            if start_at is not None and (self._head is None or start_at > self._head.seqno):
                try:
                    heard = self.get_state(start_at)
                except ObjectNotFoundError:
                    heard = None
                if heard is not None:
                    self.set_head(heard)
                    if enough is not None and enough(heard):
                        return heard
            lo = self._start_seqno()
            step, hi = 1, None
            fetched: tuple[int, bytes] | None = None
            try:
                fetched = (lo + 1, self.store.get(self.state_key(lo + 1)))
                lo = lo + 1  # then HEAD n+2, n+4, n+8, ...: one new state costs GET n+1, HEAD n+2
            except ObjectNotFoundError:
                hi = lo + 1
            decoded: S | None = None
            if fetched is not None and enough is not None:
                # The next states one by one while they do not pass (a caller's cached head is
                # a state or two behind): a GET each, where galloping costs HEADs and a GET.
                decoded = self.decode(fetched[1])
                gets = 0
                while not enough(decoded):
                    if gets == ENOUGH_GETS:
                        decoded = None  # still short of it: find the head as usual
                        break
                    try:
                        fetched = (lo + 1, self.store.get(self.state_key(lo + 1)))
                    except ObjectNotFoundError:
                        break  # ``lo`` is the head
                    lo, decoded, gets = lo + 1, self.decode(fetched[1]), gets + 1
                if decoded is not None:
                    self.set_head(decoded)
                    return decoded
            while hi is None:
                if self.store.exists(self.state_key(lo + step)):
                    lo += step
                    step *= 2
                else:
                    hi = lo + step
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.store.exists(self.state_key(mid)):
                    lo = mid
                else:
                    hi = mid
            if self._head is not None and self._head.seqno == lo:
                state = self._head
            elif fetched is not None and fetched[0] == lo:
                state = decoded if decoded is not None else self.decode(fetched[1])
            else:
                state = self.get_state(lo)
            self._head = None
            self.set_head(state)
            return state

    def head(self, *, max_age_s: float | None = None) -> S:
        """The cached head if confirmed recently enough, else a refreshed one."""
        limit = self.max_cache_age_s if max_age_s is None else max_age_s
        with self._lock:
            if self._head is not None and time.monotonic() - self._confirmed <= limit:
                return self._head
        return self.refresh()

    def cached(self) -> S | None:
        return self._head

    # -- writes ----------------------------------------------------------------------------
    def put_initial(self, state: S) -> bool:
        """Write state 0. False if it exists already."""
        try:
            self.store.put(self.state_key(state.seqno), state.encode(), if_absent=True)
        except PreconditionFailedError:
            return False
        self.write_hint(state.seqno)
        self.set_head(state)
        return True

    def commit(
        self,
        transition: Callable[[S], S],
        token: str,
        *,
        before_put: Callable[[], None] | None = None,
        on_mismatch: tuple[type[Exception], ...] = (),
        max_attempts: int = 64,
    ) -> S:
        """Run the commit order of the module docstring until the transition commits.

        ``transition(head)`` returns the next state, the head itself (nothing to do), or
        raises: :class:`AlreadyApplied` ends with its state; an error in ``on_mismatch`` is
        re-checked once against a freshly probed head before it reaches the caller.
        """
        head = self.head()
        refreshed = False
        for _ in range(max_attempts):
            try:
                new = transition(head)
            except AlreadyApplied as done:
                return done.state  # type: ignore[return-value]
            except on_mismatch:
                if refreshed:
                    raise
                head, refreshed = self.refresh(), True
                continue
            if new is head:
                return head
            if before_put is not None:
                before_put()
            if self._put_state(new, token):
                self.set_head(new)
                if new.seqno % HINT_EVERY == 0:
                    self.write_hint(new.seqno)
                return new
            head, refreshed = self.refresh(), True
        raise ConflictRetryError(
            f"expected to commit to {self.name!r} within {max_attempts} attempts, found constant contention",
            name=self.name,
        )

    def _put_state(self, new: S, token: str, tries: int = 8) -> bool:
        """True if state ``new.seqno`` now holds our change, False if another writer's."""
        data = new.encode()
        key = self.state_key(new.seqno)
        last: Exception | None = None
        # Once a PUT's outcome is unknown, our state may be there: from then on a determinate
        # failure of a later request says nothing about that PUT, so it must not reach the
        # caller as "definitely not applied". Keep asking until the answer is known.
        uncertain = False
        for _ in range(tries):
            try:
                self.store.put(key, data, if_absent=True)
                return True
            except (PreconditionFailedError, ConflictRetryError) as e:
                last = e
                try:
                    other = self.get_state(new.seqno)
                except (ObjectNotFoundError, IndeterminateError):
                    continue  # 409 with nothing written, or a flaky read: try again
                except ObjectStoreError:
                    if not uncertain:
                        raise  # none of our PUTs can have landed: nothing was applied
                    continue
                return other.change_token == token
            except IndeterminateError as e:
                last = e
                uncertain = True
                time.sleep(0.01)
            except ObjectStoreError as e:
                if not uncertain:
                    raise
                last = e
                time.sleep(0.01)
        raise IndeterminateError(
            f"expected to learn whether state {new.seqno} of {self.name!r} was written, "
            f"found the store failing: {last}",
            name=self.name,
            seqno=new.seqno,
        )

    def write_hint(self, seqno: int) -> None:
        try:
            self.store.put(self.hint_key, str(seqno).encode())
        except Exception:  # noqa: BLE001 - the hint is only a hint
            pass

    # -- collection ------------------------------------------------------------------------
    def collect_states(self, head_seqno: int, cutoff_ms: int) -> int:
        """Delete states below the head older than ``cutoff_ms`` (hint moved to the head first)."""
        self.write_hint(head_seqno)
        head_key = self.state_key(head_seqno)
        old = [
            info.key
            for info in self.store.list(f"{self.prefix}state/")
            if info.key < head_key and info.last_modified_ms <= cutoff_ms
        ]
        if old:
            self.store.delete_many(old)
        return len(old)
