"""The controller's maintenance worker (compaction and gc off the command loop) and its
recovery from transient S3 failures.

The worker is tested on the in-memory store (pure core); the recovery on the embedded stack
with S3 calls failing (injected) while the controller recovers.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
import time
from typing import Any

import pytest

from services.controller.service import Controller, Maintenance
from shared.devstack.embedded import EmbeddedStack
from shared.devstack.faults import FaultPlan, FaultyObjectStore
from shared.io.controller_client import body_kind
from shared.objectstore import MemoryObjectStore
from shared.shard import Shard
from shared.state import below_since, plan_merge
from tests.controller_fixture import (
    append_body,
    client_for,
    controller_settings,
    create_body,
    ok,
    peek_rows,
    read_subscribe,
)

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}


def _wait(pred: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _shard_with_batches(store: Any, n: int) -> Shard:
    shard = Shard.create(store, "m", SCHEMA)
    for t in range(n):
        shard.compare_and_append([({"k": t}, t, 1), ({"k": 1000 + t}, t, 1)], t, t + 1)
    shard.compare_and_append([], n, n + 1)  # so that the shard is readable at n
    return shard


def _below_since(shard: Shard) -> int:
    return below_since(shard.refresh())


def _since_moved(store: Any, shard: Shard, since: int) -> None:
    """Since moved to ``since`` (a critical reader's hold): the worker's job for it, done
    without errors."""
    shard.register_reader("r", kind="critical")
    shard.downgrade_since("r", since)
    m = Maintenance(store, grace_ms=600_000)
    try:
        m.request(shard.shard_id, below_since=True, compact=True)
        _wait(lambda: m.idle() and m.jobs_done >= 1)
        assert m.errors == 0
    finally:
        m.stop()


def _contents(shard: Shard, as_of: int) -> list[tuple[int, int]]:
    tab = shard.snapshot(as_of)
    return sorted(zip(tab["k"].to_pylist(), tab["_diff"].to_pylist(), strict=True))


def test_worker_collapses_history_below_since_and_keeps_contents() -> None:
    store = MemoryObjectStore()
    shard = _shard_with_batches(store, 12)
    before = _contents(shard, 12)
    _since_moved(store, shard, 12)
    assert _below_since(shard) == 1, f"expected one batch below since 12, found {_below_since(shard)}"
    assert shard.refresh().batches[0].since.time == 12
    assert _contents(shard, 12) == before


def test_worker_leaves_a_heavy_old_batch_alone_when_since_passes_a_few_light_ones() -> None:
    """A since move merges only a balanced run below since (shared.state.plan_since_merge):
    the light batches appended since the last collapse merge, the heavy one is not rewritten
    (it would be at every move: all history below since, each time)."""
    store = MemoryObjectStore()
    shard = Shard.create(store, "m", SCHEMA)
    shard.compare_and_append([({"k": 10_000 + i}, 0, 1) for i in range(1000)], 0, 1)
    for t in range(1, 4):
        shard.compare_and_append([({"k": t}, t, 1), ({"k": 1000 + t}, t, 1)], t, t + 1)
    shard.compare_and_append([], 4, 5)
    before = _contents(shard, 4)
    heavy = shard.refresh().batches[0]
    _since_moved(store, shard, 4)
    st = shard.refresh()
    assert st.batches[0] == heavy, "expected the heavy batch left as it was"
    assert _below_since(shard) == 2 and st.batches[1].since.time == 4 and st.batches[1].rows == 6
    assert _contents(shard, 4) == before


def test_worker_merges_batches_appended_by_others_since_its_last_job() -> None:
    """The tiered compaction plans from the head the loop saw, not from the worker's cached
    head (confirmed only every half grace period): appends by the sink since the worker's
    last job are merged at once."""
    store = MemoryObjectStore()
    shard = _shard_with_batches(store, 1)
    m = Maintenance(store, grace_ms=600_000)
    try:
        m.request("m", compact=True)  # the worker's handle now caches a head of 1 batch
        _wait(lambda: m.idle() and m.jobs_done >= 1)
        for t in range(2, 18):
            shard.compare_and_append([({"k": t}, t, 1), ({"k": 1000 + t}, t, 1)], t, t + 1)
        assert len(shard.refresh().batches) == 17
        m.request("m", compact=True)
        _wait(lambda: m.idle() and m.jobs_done >= 2)
        st = shard.refresh()
        assert len(st.batches) < 17 and plan_merge(st) is None, f"expected the appends merged, found {len(st.batches)}"
        assert _contents(shard, 17) == sorted([(0, 1), (1000, 1)] + [(t, 1) for t in range(2, 18)]
                                              + [(1000 + t, 1) for t in range(2, 18)])
    finally:
        m.stop()


def test_worker_retries_a_failed_job_until_it_succeeds() -> None:
    inner = MemoryObjectStore()
    shard = _shard_with_batches(inner, 6)
    shard.register_reader("r", kind="critical")
    shard.downgrade_since("r", 6)
    faulty = FaultyObjectStore(inner, FaultPlan(error_p=1.0))
    m = Maintenance(faulty, grace_ms=600_000)
    try:
        m.request("m", below_since=True, compact=True)
        _wait(lambda: m.errors >= 2)
        assert _below_since(shard) == 6, "expected nothing merged while every S3 call fails"
        faulty.enabled = False
        _wait(lambda: _below_since(shard) == 1, timeout_s=60)
        assert _contents(shard, 6) == sorted([(t, 1) for t in range(6)] + [(1000 + t, 1) for t in range(6)])
    finally:
        m.stop()


def test_worker_forgets_a_dropped_shard_and_keeps_serving_others() -> None:
    store = MemoryObjectStore()
    dropped = Shard.create(store, "gone", SCHEMA)
    dropped.drop()
    shard = _shard_with_batches(store, 5)
    shard.register_reader("r", kind="critical")
    shard.downgrade_since("r", 5)
    m = Maintenance(store, grace_ms=600_000)
    try:
        m.request("gone", below_since=True, compact=True, gc=True)
        m.request("m", below_since=True, compact=True)
        _wait(lambda: m.idle() and m.jobs_done >= 2)
        assert _below_since(shard) == 1
        assert m.errors == 0
    finally:
        m.stop()


@pytest.mark.timeout(180)
def test_controller_recovers_by_itself_when_s3_fails_during_recovery(stack: EmbeddedStack) -> None:
    cs = controller_settings(stack)
    ctl = Controller(cs)
    faulty = FaultyObjectStore(ctl.store, FaultPlan(error_p=1.0))
    ctl.store = faulty  # type: ignore[assignment]
    started = threading.Event()
    threading.Thread(target=lambda: (ctl.start(), started.set()), daemon=True).start()
    client = client_for(cs)
    try:
        _wait(lambda: faulty.counters.errors >= 3, timeout_s=60)
        assert ctl.alive() and ctl.error is None, f"expected the controller to keep trying, found {ctl.error!r}"
        assert not started.is_set(), "expected the controller not to serve before it recovered"
        faulty.enabled = False
        assert started.wait(60), "expected the controller to recover once S3 answers"
        ok(client.call("CreateCollection", create_body("after")))
        ok(client.call("Append", append_body("after", [({"k": 1, "v": "a"}, 0, 1)], 1, expected=0)))
        r = client.call("Peek", {"collection_id": "after", "as_of": 0})
        assert body_kind(r) == "PeekResult", r
        assert peek_rows(r) == Counter({(1, "a"): 1})
    finally:
        ctl.stop()
        client.close()
    assert ctl.error is None


@pytest.mark.timeout(300)
def test_a_response_whose_delivery_fails_makes_the_controller_recover_not_stop(stack: EmbeddedStack) -> None:
    """Every delivery of the responses producer fails (the broker refuses them) while a command
    is served: the controller does not stop; it recovers with a new producer, answers the
    command from its log, and serves the next ones."""
    from confluent_kafka import Producer

    from services.sinkio import ControlProducer
    from shared.devstack.faults import _FaultyProducer

    cs = controller_settings(stack)
    ctl = Controller(cs).start()
    client = client_for(cs)
    try:
        ok(client.call("CreateCollection", create_body("before")))
        ctl.producer = ControlProducer(_FaultyProducer(Producer(cs.service.kafka.config()), 1.0, 0.0))
        ok(client.call("CreateCollection", create_body("during"), timeout_s=120))
        assert ctl.alive() and ctl.error is None, f"expected the controller to keep serving, found {ctl.error!r}"
        ok(client.call("Append", append_body("during", [({"k": 1, "v": "a"}, 0, 1)], 1, expected=0)))
        r = client.call("Peek", {"collection_id": "during", "as_of": 0})
        assert peek_rows(r) == Counter({(1, "a"): 1})
    finally:
        ctl.stop()
        client.close()
    assert ctl.error is None


@pytest.mark.timeout(300)
def test_a_large_subscribe_step_completes_exactly_once_under_delivery_faults(stack: EmbeddedStack) -> None:
    """Subscribe output goes out in chunks; a failed chunk is counted on the topic and
    production goes on after what landed: a 12k-message step completes with 0.5% of
    deliveries failing (and 0.5% landing but reported failed), no message lost or doubled,
    in order, and other subscribes' messages on the same topic are left alone."""
    from confluent_kafka import Producer

    from shared.devstack.faults import _FaultyProducer
    from services.sinkio import ControlProducer
    from shared.io.kafka_admin import ensure_topic

    cs = controller_settings(stack)
    ctl = Controller(cs)
    topic = f"sub-step-{uuid.uuid4().hex[:8]}"
    ensure_topic(cs.service.kafka, topic, 1)
    enc = ctl.sub_codec.encode

    def msgs_of(sid: str, n: int) -> list[bytes]:
        return [bytes(enc({"subscribe_id": sid, "time": i, "progressed": False, "diff": 1, "row": b"r%d" % i}))
                for i in range(n)]

    real = Producer(cs.service.kafka.config(**{"enable.idempotence": True}))
    # Another subscribe's messages first, then the first 700 of ours (a step resumed after a crash).
    ctl.producer = ControlProducer(real)
    ours = msgs_of("ours", 12_000)
    for m in msgs_of("other", 300) + ours[:700]:
        real.produce(topic, value=m, key=b"k", partition=0)
    real.flush()
    ctl.rooms.subscribes.new_output_producer = lambda: _FaultyProducer(
        Producer(cs.service.kafka.config(**{"enable.idempotence": True})), 0.005, 0.005)
    ctl.rooms.subscribes.settle_s = 0.05  # a hundred ambiguous chunks: keep the test short
    ctl._produce_step("ours", topic, ours, ctl._count_on_topic(topic, "ours", 300))
    ctl.rooms.subscribes.close()
    got = read_subscribe(stack, topic, "ours", until_final=False, timeout_s=10)
    assert [m["time"] for m in got] == list(range(12_000)), "expected every message once, in order"
    assert len(read_subscribe(stack, topic, "other", until_final=False, timeout_s=5)) == 300
