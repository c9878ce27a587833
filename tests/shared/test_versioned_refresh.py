"""How :class:`shared.versioned.VersionedLog` finds the head, counted in requests on the
in-memory object store (the pure core): a refresh that finds exactly one new state (every
writer task, minter and appender after each append) takes a GET of it and one HEAD past it;
longer runs are found by galloping HEADs and a binary search, and the head is right; a
caller that needs only a state reaching a point reads the next states one by one."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest

from shared.objectstore import MemoryObjectStore
from shared.versioned import VersionedLog


@dataclass(frozen=True)
class _State:
    seqno: int
    change_token: str = ""

    def encode(self) -> bytes:
        return json.dumps({"seqno": self.seqno}).encode()

    @staticmethod
    def decode(data: bytes) -> _State:
        return _State(int(json.loads(data)["seqno"]))


class _Counting(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        return super().get(key)

    def exists(self, key: str) -> bool:
        self.calls["head"] += 1
        return super().exists(key)


def _write(log: VersionedLog[_State], store: MemoryObjectStore, *seqnos: int) -> None:
    for n in seqnos:
        store.put(log.state_key(n), _State(n).encode(), if_absent=True)


@pytest.mark.parametrize("new", [0, 1, 2, 3, 7, 40])
def test_a_refresh_finds_the_head_and_one_new_state_costs_a_get_and_a_head(new: int) -> None:
    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, 0, 1, 2)
    log.write_hint(2)
    assert log.refresh().seqno == 2
    _write(log, store, *range(3, 3 + new))
    store.calls.clear()
    assert log.refresh().seqno == 2 + new
    if new == 0:
        assert store.calls == Counter({"get": 1})  # GET 3: not there, the cached head stands
    elif new == 1:
        assert store.calls == Counter({"get": 1, "head": 1})  # GET 3, HEAD 4
    else:
        # galloping HEADs, a binary search, and the head's GET unless it was the one fetched
        assert store.calls["get"] == 2 and store.calls["head"] <= 2 * new.bit_length() + 1, store.calls


@pytest.mark.parametrize("new", [0, 1, 3])
def test_a_refresh_that_needs_only_a_state_reaching_a_point_stops_at_the_first_that_does(new: int) -> None:
    """``enough``: the next state, when it passes, is taken with one GET and no probe beyond it
    (a writer partition that needs the shard at a description's lower); one that does not pass
    (or none there) leaves the usual search to find the head."""
    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, 0, 1, 2)
    log.write_hint(2)
    log.refresh()
    _write(log, store, *range(3, 3 + new))
    store.calls.clear()
    got = log.refresh(enough=lambda st: st.seqno >= 3)
    if new == 0:
        assert got.seqno == 2 and store.calls == Counter({"get": 1})
    else:
        assert got.seqno == 3 and store.calls == Counter({"get": 1})  # even with newer states beyond it
        assert log.cached() == got
    store.calls.clear()
    assert log.refresh(enough=lambda st: st.seqno >= 99).seqno == 2 + new  # never enough: the head, as a refresh finds it


@pytest.mark.parametrize("behind", [1, 2, 4, 5, 6])
def test_a_refresh_that_needs_a_state_a_few_behind_the_head_reads_the_states_one_by_one(behind: int) -> None:
    """A writer partition whose cached head is a few states behind the one it needs reads the
    next states with a GET each and takes the first that passes (no HEAD); past
    ``ENOUGH_GETS`` states it finds the head as usual."""
    from shared.versioned import ENOUGH_GETS

    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, 0, 1, 2)
    log.write_hint(2)
    log.refresh()
    _write(log, store, *range(3, 3 + behind + 2))  # two more beyond the one needed
    store.calls.clear()
    got = log.refresh(enough=lambda st: st.seqno >= 2 + behind)
    if behind <= ENOUGH_GETS + 1:
        assert got.seqno == 2 + behind and store.calls == Counter({"get": behind})
    else:
        assert got.seqno == 4 + behind  # the head
        assert store.calls["get"] == ENOUGH_GETS + 2 and store.calls["head"] >= 1, store.calls
    assert log.cached() == got


def test_a_seqno_heard_of_elsewhere_is_read_first_and_taken_when_it_is_enough() -> None:
    """``start_at``: a writer task whose cached head is a few states behind (another Python
    worker ran the sink's last steps) reads the state that worker told of: one GET, where the
    states it missed cost a GET each."""
    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, 0, 1)
    log.write_hint(1)
    log.refresh()
    _write(log, store, 2, 3, 4, 5)
    store.calls.clear()
    assert log.refresh(enough=lambda st: st.seqno >= 5, start_at=5).seqno == 5
    assert store.calls == Counter({"get": 1})
    assert log.cached() == _State(5)

    # without the seqno, the same catch-up from 1 walks the missed states
    behind = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    behind.set_head(_State(1))
    store.calls.clear()
    assert behind.refresh(enough=lambda st: st.seqno >= 5).seqno == 5
    assert store.calls == Counter({"get": 4})


def test_a_heard_seqno_that_is_not_enough_is_searched_on_from_and_the_head_is_found() -> None:
    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, *range(0, 7))
    log.set_head(_State(1))
    store.calls.clear()
    assert log.refresh(start_at=5).seqno == 6  # GET 5, GET 6, HEAD 7
    assert store.calls == Counter({"get": 2, "head": 1})


@pytest.mark.parametrize("heard", [2, 9, 50])
def test_a_heard_seqno_behind_the_cached_head_or_missing_from_the_store_changes_nothing(heard: int) -> None:
    """A seqno is a hint: one behind the cached head is not read; one the store does not hold
    (another deployment's, a shard created again) costs one GET that finds nothing, and the
    usual search finds the head."""
    store = _Counting()
    log = VersionedLog(store, "p/", _State.decode, max_cache_age_s=60.0)
    _write(log, store, *range(0, 9))
    log.set_head(_State(7))
    store.calls.clear()
    assert log.refresh(enough=lambda st: st.seqno >= 8, start_at=heard).seqno == 8
    assert store.calls == (Counter({"get": 1}) if heard < 7 else Counter({"get": 2}))
    assert log.cached() == _State(8)
