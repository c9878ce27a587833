"""Concurrent writers on one shard on the moto S3 server (issue 2, section 3.3).

Threads (some sharing a handle, some with their own) and processes (multiprocessing 'spawn',
each with its own handle) race ``compare_and_append`` on one shard, each retrying from the
current upper that UpperMismatchError carries. Each writer records its successful commits;
the test then checks that every upper was committed exactly once, that the history is
linearizable (a chain of uppers, consistent with real time and with the state objects on S3),
and that the final contents are exactly the winners' updates.

The whole protocol rests on one primitive: a conditional PUT (``If-None-Match: *``) has
exactly one winner per key. The first test checks that moto keeps that promise under
concurrency, so that a failure further down is not blamed on the wrong layer.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shared.devstack.embedded import EmbeddedStack
from shared.errors import PreconditionFailedError, UpperMismatchError
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.shard import Shard
from shared.state import ShardState

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
THREADS = 4  # handles: two threads share one, two have their own
PROCESSES = 3
COMMITS_PER_WRITER = 8


def _store(endpoint: str, bucket: str) -> S3ObjectStore:
    return S3ObjectStore(S3Settings(bucket=bucket, endpoint=endpoint, access_key="testing", secret_key="testing"))


@dataclass(frozen=True)
class Commit:
    writer: str
    expected: int
    new: int
    token: str
    updates: tuple[tuple[int, str, int, int], ...]  # (k, v, time, diff)
    started: float  # time.monotonic(): system-wide on Linux, comparable across processes
    finished: float


def writer_loop(
    endpoint: str, bucket: str, shard_id: str, name: str, commits: int, seed: int, go: Any, shard: Shard | None = None
) -> tuple[list[Commit], int]:
    """Append until ``commits`` appends succeeded; on a mismatch, retry from the current upper.

    Returns the successful commits and the number of lost races. Module-level so that a
    'spawn' child can import it.
    """
    sh = shard if shard is not None else Shard.open(_store(endpoint, bucket), shard_id)
    rng = random.Random(seed)
    expected = sh.upper().time
    assert expected is not None
    go.wait()
    done: list[Commit] = []
    lost = 0
    attempt = 0
    while len(done) < commits:
        attempt += 1
        new = expected + rng.randint(1, 3)
        token = f"{name}-{attempt}"
        ups = tuple(
            (rng.randrange(50), f"{token}-{i}", rng.randrange(expected, new), rng.choice([1, 1, 2, -1]))
            for i in range(rng.randint(1, 4))
        )
        started = time.monotonic()
        try:
            sh.compare_and_append([({"k": k, "v": v}, t, d) for k, v, t, d in ups], expected, new, token)
        except UpperMismatchError as e:
            lost += 1
            assert e.current.time is not None and e.current.time != expected
            expected = e.current.time
            continue
        done.append(Commit(name, expected, new, token, ups, started, time.monotonic()))
        expected = new
    return done, lost


def _process_writer(endpoint: str, bucket: str, shard_id: str, name: str, commits: int, seed: int, go: Any, ready: Any) -> tuple[list[Commit], int]:
    sh = Shard.open(_store(endpoint, bucket), shard_id)
    sh.upper()
    ready.put(name)
    return writer_loop(endpoint, bucket, shard_id, name, commits, seed, go, shard=sh)


def _all_states(sh: Shard, head: ShardState) -> list[ShardState]:
    return [ShardState.decode(sh.store.get(sh.state_key(n))) for n in range(head.seqno + 1)]


def test_conditional_put_has_exactly_one_winner_per_key_under_concurrency(
    stack: EmbeddedStack, unique_id: str
) -> None:
    """The primitive itself: 6 threads race If-None-Match PUTs on the same 60 keys."""
    store = _store(stack.s3_endpoint, stack.bucket)
    keys, writers = 60, 6
    wins: Counter[int] = Counter()
    winner_of: dict[int, list[int]] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(writers)

    def race(w: int) -> None:
        for k in range(keys):
            barrier.wait()
            try:
                store.put(f"race-{unique_id}/{k}", f"writer-{w}".encode() * 64, if_absent=True)
            except PreconditionFailedError:
                continue
            with lock:
                wins[k] += 1
                winner_of.setdefault(k, []).append(w)

    with ThreadPoolExecutor(writers) as ex:
        list(ex.map(race, range(writers)))
    doubles = {k: winner_of[k] for k, n in wins.items() if n != 1}
    assert not doubles, (
        f"moto let several conditional PUTs win the same key: {doubles}. The S3 server does not "
        "serialise If-None-Match: * and no compare-and-append built on it can be correct there."
    )
    assert sorted(wins) == list(range(keys))
    for k in range(keys):
        body = store.get(f"race-{unique_id}/{k}")
        assert body == f"writer-{winner_of[k][0]}".encode() * 64, "the stored object is not the winner's"


def test_racing_threads_and_processes_commit_each_upper_exactly_once(
    stack: EmbeddedStack, unique_id: str
) -> None:
    store = _store(stack.s3_endpoint, stack.bucket)
    sid = f"race-{unique_id}"
    since = 100
    main = Shard.create(store, sid, SCHEMA, since=since)
    shared_handle = Shard.open(store, sid)
    thread_handles = [shared_handle, shared_handle, Shard.open(store, sid), Shard.open(store, sid)]

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as mgr:
        go = mgr.Event()
        ready = mgr.Queue()
        with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as procs, ThreadPoolExecutor(THREADS) as threads:
            pfuts = [
                procs.submit(
                    _process_writer, stack.s3_endpoint, stack.bucket, sid, f"p{i}", COMMITS_PER_WRITER, 1000 + i, go, ready
                )
                for i in range(PROCESSES)
            ]
            tfuts = [
                threads.submit(
                    writer_loop, stack.s3_endpoint, stack.bucket, sid, f"t{i}", COMMITS_PER_WRITER, i, go, thread_handles[i]
                )
                for i in range(THREADS)
            ]
            for _ in range(PROCESSES):
                ready.get(timeout=120)  # every process has its handle open: start the race
            go.set()
            results = [f.result(timeout=300) for f in pfuts + tfuts]

    commits = sorted((c for done, _ in results for c in done), key=lambda c: c.expected)
    lost = sum(n for _, n in results)
    total = (THREADS + PROCESSES) * COMMITS_PER_WRITER
    assert len(commits) == total
    assert lost > 0, "expected the writers to actually race (some lost an upper)"
    print(f"{total} commits, {lost} lost races")

    # 1. Each upper is committed exactly once: no two winners for one expected upper.
    dup = [u for u, n in Counter(c.expected for c in commits).items() if n > 1]
    assert not dup, (
        f"several writers were told they committed at expected upper(s) {dup}: "
        f"{[(c.writer, c.expected, c.new) for c in commits if c.expected in dup]}"
    )

    # 2. Linearizable: a chain of uppers from since to the final upper ...
    assert commits[0].expected == since
    for prev, cur in zip(commits, commits[1:], strict=False):
        assert cur.expected == prev.new, f"{cur.writer}'s commit at {cur.expected} does not follow {prev.new}"
    head = main.refresh()
    assert head.upper.time == commits[-1].new
    # ... consistent with real time (a commit that finished before another started is earlier) ...
    for a in commits:
        for b in commits:
            if a.finished < b.started:
                assert a.expected < b.expected, f"{a.token} finished before {b.token} started but is ordered after it"
    # ... and with the shard's own record: the recent tokens and the state objects on S3.
    assert [(r.token, r.expected_upper.time, r.new_upper.time) for r in head.recent] == [
        (c.token, c.expected, c.new) for c in commits
    ]
    states = _all_states(main, head)
    appended = [
        (s.change_token, s.recent[-1].expected_upper.time, s.recent[-1].new_upper.time)
        for prev, s in zip(states, states[1:], strict=False)
        if s.appends == prev.appends + 1
    ]
    assert appended == [(c.token, c.expected, c.new) for c in commits]
    assert all(s.seqno == n for n, s in enumerate(states))

    # 3. The final contents are exactly the winners' updates.
    expected_rows: Counter[tuple[int, str]] = Counter()
    for c in commits:
        for k, v, _t, d in c.updates:
            expected_rows[(k, v)] += d
    got = {(r["k"], r["v"]): r["_diff"] for r in main.snapshot(head.upper.time - 1).to_pylist()}
    assert got == {k: d for k, d in expected_rows.items() if d != 0}
    # Losers cleaned up after themselves: every data object is referenced by the head.
    data = {k for k in main.list_objects() if "/data/" in k}
    assert data == head.referenced_keys()
