"""Injected S3 faults (issue 2, section 3.4): errors, latency, timeouts and lost acks.

A :class:`FaultyObjectStore` wraps the moto S3 store. Writers append through it with the
discipline the API documents:

- IndeterminateError: the outcome is unknown; retry with the SAME token, updates and uppers;
- UpperMismatchError: definitely not applied (someone else holds that upper); move on from
  the current upper it carries;
- ObjectStoreError (any other determinate error): this call definitely did not apply it; move
  on, unless an earlier call with the same token was indeterminate: a determinate failure of a
  retry says nothing about the earlier attempt, so keep retrying until the answer is known
  (success, or an upper mismatch, which is definite because a landed token is always found).

Then, reading through a clean handle: the shard holds exactly the appends the writers were
told succeeded (zero losses), each once (zero double applies, and no token of an append that
was reported as failed), and no other exception type ever escaped.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.errors import IndeterminateError, ObjectStoreError, UpperMismatchError
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.devstack.faults import FaultPlan, FaultyObjectStore
from shared.shard import Shard

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}
MAX_RETRIES = 200


def _state_key(key: str) -> bool:
    return "/state/" in key


@dataclass(frozen=True)
class Scenario:
    name: str
    plan: dict[str, Any]
    writers: int = 1
    appends: int = 30
    auto_compact: bool = False
    #: which fault counters must be non-zero for the scenario to have tested anything
    expect: tuple[str, ...] = ()
    #: whether some append must have succeeded only on a retry after IndeterminateError (lost
    #: acks on state objects alone never reach the caller: the layer re-PUTs and recognises
    #: its own state by its change token)
    expect_retries: bool = False


SCENARIOS = [
    Scenario("determinate errors", {"error_p": 0.15}, expect=("errors",)),
    Scenario("timeouts without effect", {"timeout_p": 0.15}, expect=("timeouts",), expect_retries=True),
    Scenario("lost acks on every put", {"lost_ack_p": 0.3}, expect=("lost_acks",), expect_retries=True),
    Scenario(
        "lost acks on state objects",
        {"lost_ack_p": 0.5, "applies_to": _state_key},
        expect=("lost_acks",),
    ),
    Scenario(
        "lost acks and errors on state objects",
        {"lost_ack_p": 0.3, "error_p": 0.25, "applies_to": _state_key},
        appends=40,
        expect=("lost_acks", "errors"),
    ),
    Scenario(
        "latency and a mix of everything",
        {"latency_s": (0.0, 0.004), "error_p": 0.08, "timeout_p": 0.08, "lost_ack_p": 0.15},
        expect=("errors", "timeouts", "lost_acks"),
        expect_retries=True,
    ),
    Scenario(
        "a mix with auto compaction",
        {"error_p": 0.08, "timeout_p": 0.08, "lost_ack_p": 0.15},
        appends=40,
        auto_compact=True,
        expect=("errors", "timeouts", "lost_acks"),
        expect_retries=True,
    ),
    Scenario(
        "two racing writers and a mix",
        {"error_p": 0.08, "timeout_p": 0.08, "lost_ack_p": 0.15},
        writers=2,
        expect=("errors", "timeouts", "lost_acks"),
        expect_retries=True,
    ),
]


@dataclass
class WriterLog:
    name: str
    succeeded: list[tuple[str, int, int, list[tuple[int, str, int, int]]]] = field(default_factory=list)
    failed_tokens: list[str] = field(default_factory=list)
    retried_to_success: list[str] = field(default_factory=list)
    indeterminate: int = 0
    mismatches: int = 0
    determinate: int = 0
    escaped: list[str] = field(default_factory=list)


def run_writer(sh: Shard, log: WriterLog, appends: int, seed: int) -> None:
    rng = random.Random(seed)
    expected = sh.head(max_age_s=1e9).upper.time
    assert expected is not None
    for i in range(appends):
        new = expected + rng.randint(1, 3)
        token = f"{log.name}-{i}"
        ups = [
            (rng.randrange(20), f"{token}-{j}", rng.randrange(expected, new), rng.choice([1, 1, 2, -1]))
            for j in range(rng.randint(1, 4))
        ]
        rows = [({"k": k, "v": v}, t, d) for k, v, t, d in ups]
        was_indeterminate = False
        history: list[str] = []
        for _ in range(MAX_RETRIES):
            try:
                sh.compare_and_append(rows, expected, new, token)
            except IndeterminateError as e:
                history.append(f"{type(e).__name__}: {e}")
                log.indeterminate += 1
                was_indeterminate = True
                continue  # same token, same updates, same uppers
            except UpperMismatchError as e:
                log.mismatches += 1
                log.failed_tokens.append(token)
                assert e.current.time is not None
                expected = e.current.time
                break
            except ObjectStoreError as e:
                history.append(f"{type(e).__name__}: {e}")
                log.determinate += 1
                if was_indeterminate:
                    continue  # the earlier attempt may have landed: still unknown
                log.failed_tokens.append(token)
                break
            except Exception as e:  # noqa: BLE001 - the test reports what escaped
                log.escaped.append(f"{type(e).__name__}: {e}")
                log.failed_tokens.append(token)
                break
            log.succeeded.append((token, expected, new, ups))
            if was_indeterminate:
                log.retried_to_success.append(token)
            expected = new
            break
        else:
            log.escaped.append(f"{token}: outcome still unknown after {MAX_RETRIES} retries: {history[-5:]}")
            return


def run_writer_reporting(sh: Shard, log: WriterLog, appends: int, seed: int) -> None:
    """run_writer in a thread: whatever it raises is reported to the test, never lost."""
    try:
        run_writer(sh, log, appends, seed)
    except BaseException as e:  # noqa: BLE001
        log.escaped.append(f"writer crashed: {type(e).__name__}: {e}")


@pytest.fixture
def s3(stack: EmbeddedStack) -> S3ObjectStore:
    return S3ObjectStore(
        S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing")
    )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_faults_cause_no_double_applies_no_losses_and_only_typed_errors(
    s3: S3ObjectStore, unique_id: str, scenario: Scenario
) -> None:
    sid = f"faults-{unique_id}"
    clean = Shard.create(s3, sid, SCHEMA, since=0)
    faulties, handles, logs = [], [], []
    for w in range(scenario.writers):
        faulty = FaultyObjectStore(s3, FaultPlan(seed=zlib.crc32(f"{scenario.name}/{w}".encode()), **scenario.plan), enabled=False)
        sh = Shard.open(faulty, sid, auto_compact=scenario.auto_compact)
        faulty.enabled = True
        faulties.append(faulty)
        handles.append(sh)
        logs.append(WriterLog(f"w{w}"))

    threads = [
        threading.Thread(target=run_writer_reporting, args=(handles[w], logs[w], scenario.appends, 7 * w + 1))
        for w in range(scenario.writers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Typed errors only.
    escaped = [e for log in logs for e in log.escaped]
    assert not escaped, f"untyped or unexpected errors escaped: {escaped}"
    # The scenario did inject what it is about.
    counters = Counter()
    for f in faulties:
        counters.update({"errors": f.counters.errors, "timeouts": f.counters.timeouts, "lost_acks": f.counters.lost_acks})
    for kind in scenario.expect:
        assert counters[kind] > 0, f"expected some injected {kind}, found {dict(counters)}"

    head = clean.refresh()
    succeeded = sorted((s for log in logs for s in log.succeeded), key=lambda s: s[1])
    assert succeeded, "expected some appends to succeed"
    if scenario.writers == 1:
        # A lone writer never loses a race: a mismatch would mean a "failed" append landed.
        assert logs[0].mismatches == 0, "a single writer saw an upper mismatch: an append reported failed had landed"

    # Zero double applies, zero losses: the recorded history is exactly the acknowledged appends.
    assert [(r.token, r.expected_upper.time, r.new_upper.time) for r in head.recent] == [
        (tok, exp, new) for tok, exp, new, _ in succeeded
    ]
    failed = {t for log in logs for t in log.failed_tokens}
    assert not failed & {r.token for r in head.recent}, "an append reported as failed was applied"
    retried = [t for log in logs for t in log.retried_to_success]
    assert Counter(r.token for r in head.recent) == Counter({tok: 1 for tok, *_ in succeeded})
    assert set(retried) <= {tok for tok, *_ in succeeded}
    if scenario.expect_retries:
        assert retried, "expected some appends to succeed only after an indeterminate outcome"
    assert head.upper.time == succeeded[-1][2]
    for prev, cur in zip(succeeded, succeeded[1:], strict=False):
        assert cur[1] == prev[2], "the acknowledged appends must chain"

    # The contents are exactly the model of the acknowledged appends.
    model: Counter[tuple[int, str]] = Counter()
    for _tok, _exp, _new, ups in succeeded:
        for k, v, _t, d in ups:
            model[(k, v)] += d
    got = {(r["k"], r["v"]): r["_diff"] for r in clean.snapshot(head.upper.time - 1).to_pylist()}
    assert got == {k: d for k, d in model.items() if d != 0}
    # Every referenced data object is really there.
    present = set(clean.list_objects())
    assert head.referenced_keys() <= present


# -- scripted faults: one regression test per hole the random scenarios found ---------------


class ScriptedStore:
    """Delegates to ``inner``; state-object PUTs consume ``script`` in order:
    "ok", "lost_ack" (the PUT lands, the client sees a timeout) or "error" (determinate)."""

    def __init__(self, inner: Any, script: list[str], *, fail_deletes: bool = False) -> None:
        self.inner = inner
        self.script = list(script)
        self.fail_deletes = fail_deletes

    def delete_many(self, keys: list[str]) -> None:
        if self.fail_deletes:
            raise ObjectStoreError(f"scripted error on delete of {len(keys)} objects")
        self.inner.delete_many(keys)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        fault = self.script.pop(0) if _state_key(key) and self.script else "ok"
        if fault == "error":
            raise ObjectStoreError(f"scripted error on put {key!r}", key=key)
        self.inner.put(key, data, if_absent=if_absent)
        if fault == "lost_ack":
            raise IndeterminateError(f"scripted timeout after the PUT of {key!r} landed", key=key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_determinate_error_after_a_lost_ack_is_not_reported_as_not_applied(
    s3: S3ObjectStore, unique_id: str
) -> None:
    """The state PUT lands but its ack is lost; the re-PUT fails determinately. The append did
    land, so the caller must hear success (or 'indeterminate'), never a determinate error."""
    sid = f"faults-lostack-{unique_id}"
    Shard.create(s3, sid, SCHEMA, since=0)
    scripted = ScriptedStore(s3, ["lost_ack", "error"])
    sh = Shard.open(scripted, sid)
    state = sh.compare_and_append([({"k": 1, "v": "a"}, 0, 1)], 0, 1, token="once")
    assert scripted.script == [], "expected both scripted faults to have been hit"
    assert state.upper.time == 1
    head = Shard.open(s3, sid).refresh()
    assert [r.token for r in head.recent] == ["once"]
    assert head.upper.time == 1 and head.appends == 1


def test_a_failed_auto_compaction_does_not_fail_the_committed_append(s3: S3ObjectStore, unique_id: str) -> None:
    """Four appends fill level 0; the fourth triggers a merge whose state PUT fails. The
    append committed before that, so it must be reported as a success."""
    sid = f"faults-compact-{unique_id}"
    Shard.create(s3, sid, SCHEMA, since=0)
    scripted = ScriptedStore(s3, ["ok", "ok", "ok", "ok", "error"])
    sh = Shard.open(scripted, sid, auto_compact=True)
    for t in range(4):
        state = sh.compare_and_append([({"k": t, "v": "a"}, t, 1)], t, t + 1, token=f"a{t}")
        assert state.upper.time == t + 1
    assert scripted.script == [], "expected the merge's state PUT to have failed"
    clean = Shard.open(s3, sid)
    head = clean.refresh()
    assert [r.token for r in head.recent] == ["a0", "a1", "a2", "a3"]
    assert len(head.batches) == 4, "the failed merge must not have been swapped in"
    assert {(r["k"], r["_diff"]) for r in clean.snapshot(3).to_pylist()} == {(0, 1), (1, 1), (2, 1), (3, 1)}


def test_a_failed_cleanup_does_not_hide_the_upper_mismatch(s3: S3ObjectStore, unique_id: str) -> None:
    """A refused append deletes the data it staged; when that best-effort cleanup fails, the
    caller must still get the UpperMismatchError (with the current upper) it has to act on."""
    sid = f"faults-cleanup-{unique_id}"
    Shard.create(s3, sid, SCHEMA, since=0).compare_and_append([({"k": 1, "v": "a"}, 0, 1)], 0, 3)
    sh = Shard.open(ScriptedStore(s3, [], fail_deletes=True), sid)
    with pytest.raises(UpperMismatchError) as err:
        sh.compare_and_append([({"k": 2, "v": "b"}, 1, 1)], 1, 2, token="late")
    assert err.value.current.time == 3
    head = Shard.open(s3, sid).refresh()
    assert head.upper.time == 3 and [r.token for r in head.recent] != ["late"]
    assert head.find_token("late") is None
