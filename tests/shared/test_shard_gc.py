"""Garbage collection and compaction of shards on the moto S3 server (issue 2, section 3.6).

Time is an injected clock (``Clock``) that the test moves forward, so grace periods pass
without sleeping. Every test checks contents (snapshots against a naive model) and the
object listing, not only that calls return.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.errors import (
    ObjectStoreError,
    ShardDroppedError,
    SinceViolationError,
    StagedBatchExpiredError,
    UpperMismatchError,
)
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.devstack.faults import FaultPlan, FaultyObjectStore
from shared.objectstore import now_ms
from shared.shard import Shard

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
GRACE_MS = 60_000


class Clock:
    """Wall-clock milliseconds plus an offset the test advances (S3's LastModified stays real)."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self) -> int:
        return now_ms() + self.offset

    def advance(self, ms: int) -> None:
        self.offset += ms


@pytest.fixture
def store(stack: EmbeddedStack) -> S3ObjectStore:
    return S3ObjectStore(
        S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing")
    )


def model_at(updates: list[tuple[dict[str, Any], int, int]], as_of: int) -> dict[tuple[int, str], int]:
    """The naive reference: sum diffs of updates at times <= as_of, drop zeros."""
    acc: Counter[tuple[int, str]] = Counter()
    for row, t, d in updates:
        if t <= as_of:
            acc[(row["k"], row["v"])] += d
    return {k: v for k, v in acc.items() if v != 0}


def snap(sh: Shard, as_of: int) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for r in sh.snapshot(as_of).to_pylist():
        assert r["_error"] is None
        key = (r["k"], r["v"])
        assert key not in out, f"snapshot not consolidated: {key} twice"
        out[key] = r["_diff"]
    return out


def data_keys(sh: Shard) -> set[str]:
    return {k for k in sh.list_objects() if "/data/" in k}


def random_updates(rng: random.Random, lo: int, hi: int, n: int) -> list[tuple[dict[str, Any], int, int]]:
    return [
        ({"k": rng.randrange(6), "v": rng.choice("ab")}, rng.randrange(lo, hi), rng.choice([-1, 1, 1, 2]))
        for _ in range(n)
    ]


def test_orphans_of_failed_appends_are_removed_after_the_grace_period_and_not_before(
    store: S3ObjectStore, unique_id: str
) -> None:
    clock = Clock()
    sid = f"gc-orphans-{unique_id}"
    sh = Shard.create(store, sid, SCHEMA, since=0, grace_ms=GRACE_MS, clock=clock)
    model: list[tuple[dict[str, Any], int, int]] = []
    rng = random.Random(1)
    for t in range(0, 30, 10):
        ups = random_updates(rng, t, t + 10, 5)
        sh.compare_and_append(ups, t, t + 10)
        model += ups

    # Orphan 1: staged and never appended.
    never = sh.stage(random_updates(rng, 30, 40, 4))
    # Orphan 2: staged, then the append lost on the upper (the caller keeps its staged batch).
    lost = sh.stage(random_updates(rng, 30, 40, 4))
    with pytest.raises(UpperMismatchError) as mismatch:
        sh.compare_and_append_staged([lost], 20, 40, token="lost")
    assert mismatch.value.current.time == 30
    # Orphan 3: the data object was written, the state PUT failed (a determinate error).
    faulty = FaultyObjectStore(
        store, FaultPlan(error_p=1.0, applies_to=lambda k: "/state/" in k), enabled=False
    )
    failing = Shard.open(faulty, sid, grace_ms=GRACE_MS, clock=clock)
    faulty.enabled = True
    with pytest.raises(ObjectStoreError):
        failing.compare_and_append(random_updates(rng, 30, 40, 4), 30, 40, token="failed")
    faulty.enabled = False
    # A young staged batch that will be appended later: GC within grace must spare it.
    keeper_updates = random_updates(rng, 30, 40, 3)
    keeper = sh.stage(keeper_updates)

    head = sh.refresh()
    referenced = head.referenced_keys()
    orphans = {p.key for s in (never, lost) for p in s.parts}
    all_data = data_keys(sh)
    failed_orphans = all_data - referenced - orphans - {p.key for p in keeper.parts}
    assert len(failed_orphans) == 1, f"expected one data object of the failed append, found {failed_orphans}"
    orphans |= failed_orphans
    assert orphans <= all_data and not orphans & referenced
    assert head.upper.time == 30

    # Before the grace period: nothing goes.
    clock.advance(GRACE_MS // 4)
    report = sh.gc()
    assert report.data_deleted == 0
    assert data_keys(sh) == all_data

    # The young staged batch is still appendable (it is within grace / 2).
    sh.compare_and_append_staged([keeper], 30, 40, token="keeper")
    model += keeper_updates

    # After the grace period: exactly the orphans go, everything referenced stays.
    clock.advance(GRACE_MS)
    report = sh.gc()
    assert report.data_deleted == len(orphans)
    head = sh.refresh()
    remaining = data_keys(sh)
    assert remaining == head.referenced_keys()
    assert not remaining & orphans
    for t in range(0, 40):
        assert snap(sh, t) == model_at(model, t)
    # Old state objects went too (all older than grace now); a fresh handle still finds the head.
    states = [k for k in sh.list_objects() if "/state/" in k]
    assert states == [sh.state_key(head.seqno)]
    reopened = Shard.open(store, sid)
    assert reopened.refresh().upper.time == 40
    assert snap(reopened, 39) == model_at(model, 39)


def test_reader_holding_since_reads_correct_data_through_compaction_and_gc(
    store: S3ObjectStore, unique_id: str
) -> None:
    clock = Clock()
    sid = f"gc-reader-{unique_id}"
    sh = Shard.create(store, sid, SCHEMA, since=0, grace_ms=GRACE_MS, clock=clock)
    rng = random.Random(2)
    model: list[tuple[dict[str, Any], int, int]] = []
    sh.register_reader("controller", kind="critical")
    sh.register_reader("peek", kind="leased", lease_ms=10 * GRACE_MS)
    upper = 0
    for _ in range(24):
        new = upper + rng.randint(1, 4)
        ups = random_updates(rng, upper, new, rng.randint(1, 3))
        sh.compare_and_append(ups, upper, new)
        model += ups
        upper = new
    hold = upper // 2
    # The peek holds since at `hold`; the controller wants to move on to upper - 1.
    sh.downgrade_since("peek", hold)
    sh.downgrade_since("controller", upper - 1)
    state = sh.refresh()
    assert state.since.time == hold, "since must be the meet of the holds"
    expected_at_hold = model_at(model, hold)
    assert snap(sh, hold) == expected_at_hold

    before = sh.refresh()
    assert sh.compact_below_since() is True
    collapsed = sh.refresh()
    below = [b for b in collapsed.batches if b.upper.less_equal(collapsed.since)]
    assert len(below) == 1 and below[0].since.time == hold, "history below since collapses into one batch"
    assert snap(sh, hold) == expected_at_hold
    assert sh.compact() >= 1  # the tiered policy merges the small batches above since too
    after = sh.refresh()
    assert len(after.batches) < len(collapsed.batches) < len(before.batches)
    retired = {r.key for r in after.retired}
    # Every part that left the head is retired (kept for grace), none that is still in it.
    assert before.referenced_keys() - after.referenced_keys() <= retired
    assert not retired & after.referenced_keys()

    # The reader keeps reading correct data; GC within grace keeps retired parts readable.
    assert snap(sh, hold) == expected_at_hold
    sh.gc()
    for k in retired:
        assert store.exists(k), f"retired part {k} deleted within grace"
    assert snap(sh, hold) == expected_at_hold

    # After grace the retired parts go, the referenced ones stay, contents are unchanged.
    clock.advance(GRACE_MS + 1)
    sh.heartbeat("peek")
    report = sh.gc()
    assert report.retired_forgotten == len(retired)
    head = sh.refresh()
    assert head.retired == ()
    assert data_keys(sh) == head.referenced_keys()
    for k in retired:
        assert not store.exists(k)
    for t in range(hold, upper):
        assert snap(sh, t) == model_at(model, t)
    with pytest.raises(SinceViolationError):
        sh.snapshot(hold - 1)

    # Releasing the peek lets since move up to the controller's hold.
    sh.expire_reader("peek")
    assert sh.refresh().since.time == upper - 1
    assert snap(sh, upper - 1) == model_at(model, upper - 1)


def test_staged_batch_older_than_half_the_grace_period_is_refused(
    store: S3ObjectStore, unique_id: str
) -> None:
    clock = Clock()
    sh = Shard.create(store, f"gc-expired-{unique_id}", SCHEMA, since=5, grace_ms=GRACE_MS, clock=clock)
    staged = sh.stage([({"k": 1, "v": "a"}, 5, 1)])
    clock.advance(GRACE_MS // 2 + 1)
    with pytest.raises(StagedBatchExpiredError):
        sh.compare_and_append_staged([staged], 5, 6, token="late")
    state = sh.refresh()
    assert state.upper.time == 5 and state.batches == () and state.find_token("late") is None
    # A fresh stage of the same updates is accepted.
    sh.compare_and_append_staged([sh.stage([({"k": 1, "v": "a"}, 5, 1)])], 5, 6, token="fresh")
    assert snap(sh, 5) == {(1, "a"): 1}


def test_drop_then_gc_leaves_only_the_tombstone_and_open_reports_dropped(
    store: S3ObjectStore, unique_id: str
) -> None:
    clock = Clock()
    sid = f"gc-drop-{unique_id}"
    sh = Shard.create(store, sid, SCHEMA, since=0, grace_ms=GRACE_MS, clock=clock)
    for t in range(5):
        sh.compare_and_append([({"k": t, "v": "a"}, t, 1)], t, t + 1)
    sh.stage([({"k": 9, "v": "z"}, 5, 1)])  # an orphan too
    sh.register_reader("r", kind="leased", lease_ms=GRACE_MS)
    dropped = sh.drop()
    assert dropped.dropped and dropped.upper.is_empty() and dropped.since.is_empty()
    assert dropped.batches == () and dropped.readers == ()
    assert len(data_keys(sh)) == 6, "drop itself deletes nothing; gc reclaims after grace"
    with pytest.raises(ShardDroppedError):
        sh.snapshot(0)

    sh.gc()  # within grace: data stays
    assert len(data_keys(sh)) == 6

    clock.advance(GRACE_MS + 1)
    sh.gc()
    objects = sh.list_objects()
    assert len(objects) == 1 and "/state/" in objects[0], f"expected only the tombstone, found {objects}"

    reopened = Shard.open(store, sid)
    state = reopened.refresh()
    assert state.dropped and state.upper.is_empty() and state.since.is_empty()
    assert objects[0] == reopened.state_key(state.seqno)
    with pytest.raises(ShardDroppedError):
        reopened.snapshot(0)
    with pytest.raises(ShardDroppedError):
        reopened.compare_and_append([({"k": 1, "v": "a"}, 7, 1)], 7, 8)


def test_batch_count_stays_logarithmic_with_auto_compaction_and_snapshots_are_unchanged(
    store: S3ObjectStore, unique_id: str
) -> None:
    n = 300
    sh = Shard.create(store, f"gc-log-{unique_id}", SCHEMA, since=0, auto_compact=True)
    rng = random.Random(3)
    model: list[tuple[dict[str, Any], int, int]] = []
    max_batches = 0
    for t in range(n):
        ups = random_updates(rng, t, t + 1, rng.randint(1, 3))
        sh.compare_and_append(ups, t, t + 1)
        model += ups
        max_batches = max(max_batches, len(sh.refresh().batches))
    bound = 2 * math.log2(n) + 1
    state = sh.refresh()
    assert state.upper.time == n and state.appends == n
    assert len(state.batches) <= bound, f"{len(state.batches)} batches after {n} appends"
    assert max_batches <= bound, f"peaked at {max_batches} batches"
    for t in sorted({0, 1, 63, 64, 150, 255, 256, n - 1, *rng.sample(range(n), 8)}):
        assert snap(sh, t) == model_at(model, t), f"snapshot at {t} differs from the model"
