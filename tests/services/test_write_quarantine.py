"""A write micro-batch that keeps failing on the same input is quarantined, not retried
forever (issue 17): its desired updates land in the error collection, the sink goes on, and
``status`` and the metrics say so.

The real embedded stack and real Spark, with the harness of ``tests/services/test_sink_e2e.py``. The
failure is injected with ``SHARDSINK_TEST_FAIL_ON_ROW``: the write step raises on any desired
row holding ``POISON`` (a stand-in for a value the code cannot handle), on every retry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.write.quarantine import is_input_failure
from shardsink import ErrorRow, open_collection
from shardsink.cli.data import collection_status
from shared.catalog import SinkDef, sink_failing, sink_quarantine
from shared.devstack.embedded import EmbeddedStack
from shared.io.desired_producer import DesiredProducer
from tests.services.test_sink_e2e import DEADLINE_S, SCHEMA, Harness, services_harness, shard_contents

QUARANTINE_AFTER = 2


@pytest.fixture(scope="module")
def qh(stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with services_harness(
        stack, spark, tmp_path_factory,
        SHARDSINK_TEST_FAIL_ON_ROW="POISON", SHARDSINK_QUARANTINE_AFTER=str(QUARANTINE_AFTER),
    ) as harness:
        yield harness


def wait_upper(h: Harness, shard: Any, sid: str, upper: int, deadline_s: float = DEADLINE_S) -> None:
    h.wait_for(f"the shard's upper at {upper}", lambda: (shard.refresh().upper.time or 0) >= upper, [sid],
               detail=lambda: f"(found {shard.refresh().upper})", deadline_s=deadline_s)


def test_a_batch_that_keeps_failing_is_quarantined_and_the_sink_goes_on(qh: Harness, unique_id: str) -> None:
    cid, sid, topic = f"q-{unique_id}", f"qs-{unique_id}", f"desired-q-{unique_id}"
    shard = qh.collection(cid, SCHEMA, topic, partitions=2)
    qh.sink(sid, topic, cid)
    # A long linger: each step's records (and the progress after them, whose flush sends them)
    # reach the broker in one request. A request's records for one partition become visible
    # together, but the broker appends its partitions one after another, so a micro-batch can be
    # planned between two of them: every update of step 2 (its inserts, the poisoned row and a
    # retraction) goes to one partition, so they are all in the micro-batch that fails.
    producer = DesiredProducer(qh.settings.kafka, topic, SCHEMA, linger_ms=1000)

    def partition_of(row: dict[str, Any]) -> int:
        return producer.partition_of(producer.rows.encode(row))

    step1 = list(range(10))
    target = partition_of({"k": 0, "v": "ok"})  # the retraction of row 0 is in step 2
    step2 = [k for k in range(10, 1000) if partition_of({"k": k, "v": "ok"}) == target][:10]
    poison_k = next(k for k in range(1000, 2000) if partition_of({"k": k, "v": "POISON"}) == target)
    step3 = list(range(2000, 2010))
    later = 3000

    for k in step1:
        producer.send({"k": k, "v": "ok"}, 0, 1)
    producer.advance_to(1)
    wait_upper(qh, shard, sid, 1)
    assert shard_contents(shard, 0).rows == {(k, "ok"): 1 for k in step1}

    # Step 2 holds the poisoned row: every attempt of its micro-batch fails.
    for k in step2:
        assert producer.send({"k": k, "v": "ok"}, 1, 1) == target
    assert producer.send({"k": poison_k, "v": "POISON"}, 1, 1) == target
    assert producer.send({"k": 0, "v": "ok"}, 1, -1) == target  # a retraction in the quarantined batch
    producer.advance_to(2)
    # Step 3 comes later; the sink must get past the poisoned batch to reach it.
    time.sleep(1.0)
    for k in step3:
        producer.send({"k": k, "v": "ok"}, 2, 1)
    producer.advance_to(3)
    wait_upper(qh, shard, sid, 3, deadline_s=3 * DEADLINE_S)

    got = shard_contents(shard, 2)
    quarantined = {e: d for e, d in got.errors.items() if "quarantined at " in e}
    assert got.errors == quarantined, f"expected only quarantine errors, found {got.errors}"
    poison = [e for e in quarantined if '"POISON"' in e]
    assert len(poison) == 1 and quarantined[poison[0]] == 1, quarantined
    assert f"{topic}/" in poison[0] and "(RuntimeError: injected failure" in poison[0], poison[0]
    assert (poison_k, "POISON") not in got.rows
    # Nothing is lost: every good insert is in the shard or quarantined with its row; the
    # rows of step 1 were committed before the failure and stay.
    quarantined_rows = {}
    for e, d in quarantined.items():
        row = json.loads(e.split(": row ", 1)[1])
        quarantined_rows[(row["k"], row["v"])] = quarantined_rows.get((row["k"], row["v"]), 0) + d
    for k in step1 + step2 + step3:
        in_shard = got.rows.get((k, "ok"), 0)
        assert in_shard in (0, 1), (k, in_shard)
        if k == 0:
            # inserted at 0 (committed), its retraction at 1 quarantined (diff -1 in the error)
            assert in_shard == 1 and quarantined_rows.get((0, "ok")) == -1, quarantined_rows
        elif in_shard == 0:
            assert quarantined_rows.get((k, "ok")) == 1, f"row {k} is neither in the shard nor quarantined"
        else:
            assert (k, "ok") not in quarantined_rows
    assert all(got.rows.get((k, "ok")) == 1 for k in step1[1:])
    assert all((k, "ok") in quarantined_rows for k in step2), "the poisoned batch's rows"

    sink = qh.settings.catalog().state().sink(sid)
    ranges = sink_quarantine(qh.settings.store(), sid, sink.epoch)
    assert ranges and all(r["topic"] == topic and r["end"] > r["start"] for r in ranges)
    # Only the partition that failed (the step notes it on what it raises): the other one's
    # range of that batch (its progress statements) went through as usual.
    assert {r["partition"] for r in ranges} == {target}, ranges
    assert sink_failing(qh.settings.store(), sid, sink.epoch) is None  # quarantined: failing no more
    assert all(r["failures"] >= QUARANTINE_AFTER and r["reason"].startswith("RuntimeError: injected failure") for r in ranges)
    assert qh.services.writers[sid].metrics.quarantined_ranges == len(ranges)
    status = next(r for r in collection_status(qh.settings) if r["collection"] == cid)
    assert status["quarantined"][sid] == ranges
    # The error rows are counted where a user looks: status, the metric (a report re-sent
    # after a restart counts again, never less), and a subscribe yields each of them.
    assert status["errors"] == len(quarantined), (status["errors"], quarantined)
    assert qh.services.writers[sid].metrics.error_rows_staged >= len(quarantined) > 0
    with open_collection(cid, qh.settings).subscribe(as_of=0, up_to=3) as sub:
        errs = [e for e in sub if isinstance(e, ErrorRow)]
    assert sorted((e.error, e.diff) for e in errs) == sorted(quarantined.items())
    # Each error row is at the time of its update: step 2's (the poisoned row, the retraction)
    # at 1. On a loaded machine the failing micro-batch can be planned after step 3 reached
    # the broker; its rows on that partition are then in the quarantined range, at 2.
    sent_at = {**{k: 1 for k in [0, poison_k, *step2]}, **{k: 2 for k in step3}}
    assert all(e.time == sent_at[json.loads(e.error.split(": row ", 1)[1])["k"]] for e in errs), errs
    assert any(e.time == 1 and '"POISON"' in e.error for e in errs)

    # The sink keeps working after the quarantine.
    producer.send({"k": later, "v": "ok"}, 3, 1)
    producer.advance_to(4)
    wait_upper(qh, shard, sid, 4)
    assert shard_contents(shard, 3).rows.get((later, "ok")) == 1


def test_the_reason_is_the_python_exception_line() -> None:
    from services.write.quarantine import failure_reason

    exc = (
        "[STREAM_FAILED] Query [id = 1] terminated with exception: Job aborted\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "/x/service.py", line 9, in write_partition\n'
        '    raise RuntimeError(f"injected failure")\n'
        "RuntimeError: injected failure on a row\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n"
    )
    assert failure_reason(exc) == "RuntimeError: injected failure on a row"


def test_only_failures_of_the_python_step_that_are_not_infrastructure_are_quarantined() -> None:
    py = "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
    assert is_input_failure(py + "RuntimeError: injected failure")
    assert is_input_failure(py + "KeyError: 'x'")
    assert not is_input_failure(py + "shared.errors.ObjectStoreError: expected a PUT to succeed")
    assert not is_input_failure(py + "shared.errors.KafkaTimeoutError: expected records")
    assert not is_input_failure(py + "shared.errors.SinkProtocolError: partitions changed")
    assert not is_input_failure("org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)")
    assert not is_input_failure("java.lang.OutOfMemoryError: Java heap space")


def test_failure_counts_survive_a_restart_and_only_the_partition_that_failed_is_quarantined(
    stack: EmbeddedStack, tmp_path: Any, unique_id: str
) -> None:
    """The supervisor's hook against a checkpoint that planned micro-batch 1 and did not commit
    it, and the real S3 server: the count of failures is on S3 (each call could be another
    process: nothing is kept in memory), failures that are not the input's neither count nor
    reset it, and the quarantine takes the ranges of the partition the failure names, or all
    of the batch's when it names none."""
    from services.runtime.settings import ServiceSettings
    from services.write.quarantine import on_write_failure

    def settings() -> ServiceSettings:  # a fresh one per call: as after a restart
        return ServiceSettings.from_env_and_args(None, {
            **stack.env(), "SHARDSINK_S3_PREFIX": f"quarantine-{unique_id}", "SHARDSINK_CHECKPOINT_DIR": str(tmp_path),
            "SHARDSINK_QUARANTINE_AFTER": "3",
        })

    sink = SinkDef("qs", "desired-q", "c", epoch=4)
    root = tmp_path / "write" / "qs-e4"
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "offsets" / "0").write_text('v1\n{}\n{"desired-q": {"0": 3, "1": 5, "2": 7}, "descs": {"0": 1}}\n')
    (root / "commits" / "0").write_text("v1\n{}\n")
    (root / "offsets" / "1").write_text('v1\n{}\n{"desired-q": {"0": 3, "1": 9, "2": 8}, "descs": {"0": 2}}\n')
    py = "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
    failure = py + "RuntimeError: a value the step cannot handle\nin writer partition 1 of write micro-batch 1\n"
    store = settings().store()

    assert on_write_failure(None, settings(), sink, failure) == []
    assert on_write_failure(None, settings(), sink, py + "shared.errors.ObjectStoreError: S3 is down\n") == []
    assert on_write_failure(None, settings(), sink, failure) == []
    failing = sink_failing(store, "qs", 4)
    assert failing is not None and (failing["batch_id"], failing["failures"]) == (1, 2), failing
    assert failing["reason"] == "RuntimeError: a value the step cannot handle"
    ranges = on_write_failure(None, settings(), sink, failure)
    assert [(r["partition"], r["start"], r["end"], r["batch_id"], r["failures"]) for r in ranges] == [(1, 5, 9, 1, 3)]
    assert [{k: v for k, v in q.items() if k != "at_ms"} for q in sink_quarantine(store, "qs", 4)] == ranges
    assert sink_failing(store, "qs", 4) is None

    # The next batch fails with no partition named: all of its ranges with input go.
    (root / "commits" / "1").write_text("v1\n{}\n")
    (root / "offsets" / "2").write_text('v1\n{}\n{"desired-q": {"0": 4, "1": 9, "2": 10}, "descs": {"0": 2}}\n')
    bare = py + "KeyError: 'x'\n"
    assert on_write_failure(None, settings(), sink, bare) == [] and on_write_failure(None, settings(), sink, bare) == []
    ranges = on_write_failure(None, settings(), sink, bare)
    assert [(r["partition"], r["start"], r["end"]) for r in ranges] == [(0, 3, 4), (2, 8, 10)]
    assert [(r["partition"], r["batch_id"]) for r in sink_quarantine(store, "qs", 4)] == [(1, 1), (0, 2), (2, 2)]
