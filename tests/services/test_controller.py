"""The controller through Kafka (embedded stack), run in a thread in this process."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from collections.abc import Iterator
from typing import Any

import pytest

from services.controller.service import Controller, ControllerSettings
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient, body_kind
from shared.shard import Shard
from shared.state import plan_merge, plan_since_merge
from tests.controller_fixture import (
    Model,
    append_body,
    changes_of,
    check_progress_order,
    client_for,
    controller_settings,
    create_body,
    error_kind_of,
    lag,
    ok,
    peek_rows,
    read_subscribe,
    results,
    valid_from,
)


@pytest.fixture
def running(stack: EmbeddedStack) -> Iterator[tuple[Controller, ControllerClient, ControllerSettings]]:
    cs = controller_settings(stack)
    ctl = Controller(cs).start()
    client = client_for(cs)
    yield ctl, client, cs
    ctl.stop()
    client.close()
    assert ctl.error is None, ctl.error


def _rows(n: int, t: int, start: int = 0, diff: int = 1) -> list[tuple[dict[str, Any], int, int]]:
    return [({"k": i, "v": f"v{i}"}, t, diff) for i in range(start, start + n)]


def _wait(pred: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_lifecycle_create_append_peek_compact_drop_and_reclaim(running: Any) -> None:
    ctl, client, cs = running
    store = cs.service.store()
    ok(client.call("CreateCollection", create_body("life")))
    model = Model()
    # 20 appends of 5 rows each at times 0..19, some retractions.
    for t in range(20):
        ups = _rows(5, t, start=t * 5)
        if t > 0:
            ups += [({"k": (t - 1) * 5, "v": f"v{(t - 1) * 5}"}, t, -1)]
        model.add(ups)
        assert results(client.call("Append", append_body("life", ups, t + 1)))["upper"] == t + 1
    for as_of in (0, 7, 19):
        assert peek_rows(client.call("Peek", {"collection_id": "life", "as_of": as_of})) == model.at(as_of)
    shard = Shard(store, "life")
    assert shard.refresh().since.time == 0  # the default policy holds since at initial since
    # Alter the policy: since = upper - lag rounded down to a multiple of lag.
    ok(client.call("SetReadPolicy", {"collection_id": "life", "policy": lag(4)}))
    _wait(lambda: shard.refresh().since.time == 16)  # (20 - 4) rounded down to 4
    r = client.call("Peek", {"collection_id": "life", "as_of": 15})
    assert error_kind_of(r) == "ReadBeforeSince"
    for as_of in (16, 19):
        assert peek_rows(client.call("Peek", {"collection_id": "life", "as_of": as_of})) == model.at(as_of)
    # Compaction settles: no tiered merge and no balanced run below since left to merge
    # (shared.state.plan_since_merge); the batch count stays small.
    _wait(lambda: plan_merge(st := shard.refresh()) is None and plan_since_merge(st) is None)
    st = shard.refresh()
    assert len(st.batches) <= 6, [(b.lower, b.upper) for b in st.batches]
    for as_of in (16, 19):
        assert peek_rows(client.call("Peek", {"collection_id": "life", "as_of": as_of})) == model.at(as_of)
    # Upper reports: every advance once, never backwards.
    client.poll(0.3)
    uppers = list(client.frontier_uppers("life"))
    assert uppers == sorted(set(uppers)) and uppers[-1] == 20
    # Drop: readers are told, later commands fail, storage reclaimed but the tombstone.
    ok(client.call("DropCollection", {"collection_id": "life"}))
    assert error_kind_of(client.call("Peek", {"collection_id": "life", "as_of": 19})) == "IdentifierMissing"
    _wait(lambda: len(shard.list_objects()) == 1)
    assert shard.list_objects()[0].startswith("shards/life/state/")

    def dropped_reported() -> bool:
        client.poll(0.05)
        return None in list(client.frontier_uppers("life"))

    _wait(dropped_reported)
    assert list(client.frontier_uppers("life"))[-1] is None
    assert error_kind_of(client.call("CreateCollection", create_body("life"))) == "IdentifierReused"


def test_every_error_path_is_a_typed_response_and_the_loop_keeps_serving(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("e1")))
    ok(client.call("Append", append_body("e1", _rows(3, 0), 5)))
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("Peek", {"collection_id": "nope", "as_of": 0}, "IdentifierMissing"),
        ("Append", append_body("nope", [], 1), "IdentifierMissing"),
        ("DropCollection", {"collection_id": "nope"}, "IdentifierMissing"),
        ("CreateCollection", create_body("e1", since=3), "IdentifierReused"),
        ("CreateCollection", create_body("../escape"), "InvalidUsage"),
        ("CreateCollection", create_body("a/b"), "InvalidUsage"),
        ("CreateCollection", {**create_body("bad"), "row_schema": "{not json"}, "SchemaError"),
        ("SetReadPolicy", {"collection_id": "e1", "policy": ("io.shardsink.v1.Multiple", {"policies": []})}, "InvalidUsage"),
        ("SetReadPolicy", {"collection_id": "e1", "policy": lag(5, 0)}, "InvalidUsage"),
        ("Append", append_body("e1", _rows(1, 7), 7), "UpdateBeyondUpper"),
        ("Append", append_body("e1", _rows(1, 5), 9, expected=3), "UpperMismatch"),
        ("DropSink", {"sink_id": "nosink"}, "IdentifierMissing"),
        ("CancelSubscribe", {"subscribe_command_id": "nosub"}, "IdentifierMissing"),
    ]
    for kind, body, expected in cases:
        r = client.call(kind, body)
        assert error_kind_of(r) == expected, (kind, body, r)
    # Malformed bytes: an Error with id "unknown", then the loop keeps serving.
    client.send_raw(b"\x00garbage")
    client.send_raw(b"")
    _wait(lambda: len([r for r in client.poll(0.05) + client.seen if r["command_id"] == "unknown"]) >= 2)
    unknown = [r for r in client.seen if r["command_id"] == "unknown"]
    assert {error_kind_of(r) for r in unknown} == {"DecodeError"}
    # Peek below since.
    ok(client.call("SetReadPolicy", {"collection_id": "e1", "policy": valid_from(2)}))
    shard = Shard(cs.service.store(), "e1")
    _wait(lambda: shard.refresh().since.time == 2)
    assert error_kind_of(client.call("Peek", {"collection_id": "e1", "as_of": 1})) == "ReadBeforeSince"
    # Nothing of the refused appends was written; the collection still serves.
    assert shard.refresh().upper.time == 5
    assert peek_rows(client.call("Peek", {"collection_id": "e1", "as_of": 4})) == Counter(
        {(i, f"v{i}"): 1 for i in range(3)}
    )
    assert ctl.alive()


def test_duplicate_command_ids_are_answered_the_same_and_applied_once(running: Any) -> None:
    ctl, client, cs = running
    create_id = client.send("CreateCollection", create_body("dup"))
    first = client.wait(create_id)
    append = append_body("dup", _rows(4, 0), 1)
    aid = client.send("Append", append)
    a1 = client.wait(aid)
    # Replays (the same bytes and a re-encoded command with the same id).
    client.send("Append", append, command_id=aid)
    client.send("CreateCollection", create_body("dup"), command_id=create_id)
    a2 = client.wait(aid, count=2)
    client.wait(create_id, count=2)
    assert client.responses(aid)[1]["body"] == a1["body"] == a2["body"]
    assert client.responses(aid)[1]["emitted_at_ms"] == a1["emitted_at_ms"]  # the logged answer
    assert client.responses(create_id)[1]["body"] == first["body"]
    st = Shard(cs.service.store(), "dup").refresh()
    assert st.upper.time == 1 and st.total_rows() == 4
    # The replayed append with a stale expected upper would have failed if applied again.
    assert peek_rows(client.call("Peek", {"collection_id": "dup", "as_of": 0})) == Counter(
        {(i, f"v{i}"): 1 for i in range(4)}
    )


def test_peek_waits_for_the_upper_and_can_be_cancelled_and_large_results_go_to_s3(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("pk")))
    ok(client.call("Append", append_body("pk", _rows(10, 0), 1)))
    waiting = client.send("Peek", {"collection_id": "pk", "as_of": 3})
    to_cancel = client.send("Peek", {"collection_id": "pk", "as_of": 50})
    time.sleep(0.3)
    assert client.responses(waiting) == []
    ok(client.call("Append", append_body("pk", _rows(5, 2, start=100), 4)))
    assert peek_rows(client.wait(waiting)) == Counter({(i, f"v{i}"): 1 for i in [*range(10), *range(100, 105)]})
    cancel = client.call("CancelPeek", {"peek_command_id": to_cancel})
    assert results(cancel)["canceled"] is True
    assert body_kind(client.wait(to_cancel)) == "PeekCanceled"
    # Large: a Parquet object on S3 named in the response (readable with plain pyarrow).
    r = client.call("Peek", {"collection_id": "pk", "as_of": 3, "max_inline_bytes": 16})
    assert r["body"][1]["result"][0].endswith("StoredRows")
    stored = r["body"][1]["result"][1]
    assert stored["row_count"] == 15 and stored["bucket"] == cs.service.s3.bucket
    import boto3
    import io

    import pyarrow.parquet as pq

    env = cs.service.s3
    s3 = boto3.client("s3", endpoint_url=env.endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=stored["bucket"], Key=stored["key"])["Body"].read()))
    assert sorted(table.column("k").to_pylist()) == [*range(10), *range(100, 105)]
    assert set(table.column("_diff").to_pylist()) == {1}
    # A limit caps the pairs; a peek that never becomes readable times out with a typed error.
    assert sum(peek_rows(client.call("Peek", {"collection_id": "pk", "as_of": 3, "limit": 4})).values()) == 4
    r = client.call("Peek", {"collection_id": "pk", "as_of": 99})
    assert error_kind_of(r) == "NotReadableYet" and "3000 ms" in r["body"][1]["message"]


def test_subscribe_output_equals_the_model_change_stream_with_progress(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("sub")))
    model = Model()
    first = [({"k": i, "v": "a"}, i % 3, 1) for i in range(6)]
    model.add(first)
    ok(client.call("Append", append_body("sub", first, 3)))
    topic = f"subout-{cs.commands_topic}"
    sid = client.send("Subscribe", {"collection_id": "sub", "output_topic": topic, "as_of": 2, "up_to": 9,
                                    "with_snapshot": True})
    ok(client.wait(sid))
    # The subscribe holds since: a policy that would compact past it must wait for it.
    ok(client.call("SetReadPolicy", {"collection_id": "sub", "policy": lag(0)}))
    for t in range(3, 12):
        ups = [({"k": 100 + t, "v": "b"}, t, 1), ({"k": t - 3, "v": "a"}, t, -1)] if t < 9 else [
            ({"k": 200 + t, "v": "c"}, t, 1)]
        model.add(ups)
        ok(client.call("Append", append_body("sub", ups, t + 1)))
        if t == 5:
            assert Shard(cs.service.store(), "sub").refresh().since.time <= 6
    msgs = read_subscribe(client_stack(cs), topic, sid)
    check_progress_order(msgs)
    assert changes_of(msgs) == model.subscribe(2, 9)
    progress = [m["time"] for m in msgs if m["progressed"]]
    assert progress[-2:] == [9, None]  # up_to exclusive, then the final statement
    assert all(m["time"] < 9 for m in msgs if not m["progressed"])
    assert min(m["time"] for m in msgs if not m["progressed"]) == 2  # as_of inclusive
    # A subscribe on a collection that is then dropped ends with a final message.
    sid2 = client.send("Subscribe", {"collection_id": "sub", "output_topic": topic, "as_of": None, "up_to": None,
                                     "with_snapshot": False})
    ok(client.wait(sid2))
    ok(client.call("DropCollection", {"collection_id": "sub"}))
    msgs2 = read_subscribe(client_stack(cs), topic, sid2)
    assert msgs2[-1]["progressed"] and msgs2[-1]["time"] is None


def client_stack(cs: ControllerSettings) -> Any:
    class _S:
        def env(self) -> dict[str, str]:
            return {"SHARDSINK_KAFKA_BOOTSTRAP": cs.service.kafka.bootstrap}

    return _S()


def test_sinks_are_created_allowed_and_dropped_through_the_catalog(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("sk")))
    r = results(client.call("CreateSink", {"sink_id": "s1", "collection_id": "sk", "desired_topic": "desired-x",
                                           "as_of": None, "read_only": True, "options": {}}))
    assert r == {"sink_id": "s1", "as_of": 0}
    cat = cs.service.catalog()
    assert cat.state().sink("s1").read_only
    ok(client.call("AllowWrites", {"sink_ids": ["s1"]}))
    assert not cat.state().sink("s1").read_only
    ok(client.call("DropSink", {"sink_id": "s1"}))
    assert cat.state().live_sinks() == []
    assert error_kind_of(client.call("CreateSink", {"sink_id": "s1", "collection_id": "sk", "desired_topic": "d",
                                                    "as_of": 0, "read_only": False, "options": {}})) == "IdentifierReused"


def test_a_direct_append_into_a_collection_with_a_sink_is_refused_and_leaves_nothing(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("sinked")))
    ok(client.call("Append", append_body("sinked", _rows(2, 0), 1)))  # no sink yet: appended
    ok(client.call("CreateSink", {"sink_id": "sinked-s", "collection_id": "sinked", "desired_topic": "desired-sinked",
                                  "as_of": None, "read_only": True, "options": {}, "replace_contents": True}))
    r = client.call("Append", append_body("sinked", _rows(3, 1, start=10), 2))
    assert error_kind_of(r) == "InvalidUsage", r
    body = r["body"][1]
    assert "sinked-s" in body["message"] and "nothing was appended" in body["message"], body
    shard = Shard(cs.service.store(), "sinked")
    assert shard.refresh().upper.time == 1
    assert peek_rows(client.call("Peek", {"collection_id": "sinked", "as_of": 0})) == Counter({(i, f"v{i}"): 1 for i in range(2)})
    ok(client.call("DropSink", {"sink_id": "sinked-s"}))
    assert results(client.call("Append", append_body("sinked", _rows(3, 1, start=10), 2)))["upper"] == 2


def test_a_read_policy_below_the_since_is_refused_and_the_ack_says_the_since(running: Any) -> None:
    ctl, client, cs = running
    ok(client.call("CreateCollection", create_body("pol", since=3)))
    ok(client.call("Append", append_body("pol", _rows(2, 3), 6)))
    shard = Shard(cs.service.store(), "pol")
    r = results(client.call("SetReadPolicy", {"collection_id": "pol", "policy": valid_from(4)}))
    assert r["since"] == 3 and r["policy"]["kind"] == "valid_from", r  # the since when it answered
    _wait(lambda: shard.refresh().since.time == 4)
    for policy in (valid_from(2), lag(5)):  # implies 2 and 6 - 5 = 1: both below since 4
        refused = client.call("SetReadPolicy", {"collection_id": "pol", "policy": policy})
        assert error_kind_of(refused) == "ReadBeforeSince", refused
        assert "was not changed" in refused["body"][1]["message"]
    assert cs.service.catalog().state().collection("pol").read_policy["kind"] == "valid_from"
    assert cs.service.catalog().state().collection("pol").read_policy == r["policy"]
    ok(client.call("SetReadPolicy", {"collection_id": "pol", "policy": lag(2)}))  # implies 4: fine


def test_a_newer_controller_fences_the_older_one(stack: EmbeddedStack) -> None:
    cs = controller_settings(stack)
    old = Controller(cs).start()
    client = client_for(cs)
    try:
        ok(client.call("CreateCollection", create_body("f1")))
        new = Controller(cs).start()
        try:
            _wait(lambda: old.fenced)
            # It stops: its thread ends once it has released its clients (that cleanup runs
            # after the fence is seen, so the thread may still be finishing it just now).
            _wait(lambda: not old.alive())
            ok(client.call("Append", append_body("f1", _rows(2, 0), 1)))
            assert new.catalog.state().controller_epoch == new.epoch == old.epoch + 1
        finally:
            new.stop()
    finally:
        old.stop()
        client.close()


def test_quiet_heads_are_not_read_at_every_tick_but_announced_and_waited_on_ones_are(stack: EmbeddedStack) -> None:
    """An idle controller does not read every collection's shard head at every tick (an S3
    request per collection every 50 ms): a quiet head is read every ``head_refresh_ms`` (here a
    minute, so never during the test), an upper announced on ``frontiers`` is read at the next
    tick, and so is the head of a collection a peek waits on."""
    from services.sinkio import ControlProducer
    from shared.codec import message_codec

    cs = controller_settings(stack, head_refresh_ms=60_000, peek_timeout_ms=60_000)
    # A topic of its own: the undecodable announcement below is for this controller only.
    cs = replace(cs, service=replace(cs.service, frontiers_topic=f"frontiers-{cs.commands_topic}"))
    ctl = Controller(cs).start()
    client = client_for(cs)
    store = cs.service.store()
    announcer = ControlProducer.create(cs.service.kafka, "test-announcer")

    def direct_append(cid: str, lower: int, upper: int) -> None:
        shard = Shard.open(store, cid)
        shard.compare_and_append(shard.to_table(_rows(2, lower, start=lower * 10)), lower, upper)

    def reported(cid: str) -> list[int | None]:
        client.poll(0.05)
        return list(client.frontier_uppers(cid))

    try:
        for cid in ("quiet", "announced", "waited"):
            ok(client.call("CreateCollection", create_body(cid)))
        _wait(lambda: all(0 in reported(c) for c in ("quiet", "announced", "waited")))
        reads = ctl.head_reads
        time.sleep(1.0)  # about 20 ticks
        assert ctl.head_reads == reads, "the heads of quiet collections were read at every tick"

        # Appended directly (no command), announced: reported at once.
        direct_append("announced", 0, 1)
        announcer.send(cs.service.frontiers_topic, b"\x00not an announcement")  # skipped, logged
        announcer.send(cs.service.frontiers_topic, message_codec("frontier_update").encode(
            {"shard_id": "announced", "sink_id": None, "upper": 1, "desc_token": None, "updated_at_ms": 0}))
        announcer.flush()
        # Appended directly, not announced, nobody waiting: not read (until head_refresh_ms).
        direct_append("quiet", 0, 1)
        _wait(lambda: 1 in reported("announced"))
        time.sleep(1.0)
        assert 1 not in reported("quiet")

        # A peek waits on "waited" (as of 1, upper 0): its head is read at every tick, so a
        # direct append nobody announces answers it.
        pid = client.send("Peek", {"collection_id": "waited", "as_of": 1})
        direct_append("waited", 0, 2)
        assert peek_rows(client.wait(pid, timeout_s=30)) == Counter({(0, "v0"): 1, (1, "v1"): 1})
        _wait(lambda: 2 in reported("waited"))
        # An Append command reads the head itself: the next tick reports it without a read.
        ok(client.call("Append", append_body("quiet", _rows(1, 1, start=5), 2, expected=1)))
        _wait(lambda: 2 in reported("quiet"))
    finally:
        ctl.stop()
        client.close()
    assert ctl.error is None, ctl.error


def test_announcements_do_not_add_ticks(stack: EmbeddedStack) -> None:
    """An announcement is read at the tick that is due, not by a tick of its own: sinks that
    announce often do not multiply the controller's ticks (each a catalog read)."""
    from services.sinkio import ControlProducer
    from shared.codec import message_codec

    cs = controller_settings(stack)
    cs = replace(cs, service=replace(cs.service, frontiers_topic=f"frontiers-{cs.commands_topic}"))
    ctl = Controller(cs).start()
    client = client_for(cs)
    announcer = ControlProducer.create(cs.service.kafka, "test-announcer")
    ticks: list[float] = []
    tick = ctl.tick

    def counted() -> None:
        ticks.append(time.monotonic())
        tick()

    try:
        ok(client.call("CreateCollection", create_body("busy")))
        ctl.tick = counted  # type: ignore[method-assign]
        value = message_codec("frontier_update").encode(
            {"shard_id": "busy", "sink_id": None, "upper": 0, "desc_token": None, "updated_at_ms": 0})
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # an announcement every ~10 ms
            announcer.send(cs.service.frontiers_topic, value)
            announcer.flush()
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        during = [t for t in ticks if t0 <= t <= t0 + elapsed]
        assert during, "the controller stopped ticking"
        assert len(during) <= elapsed / (cs.tick_ms / 1000.0) + 3, (len(during), elapsed)
    finally:
        ctl.stop()
        client.close()
    assert ctl.error is None, ctl.error


def test_a_large_subscribe_step_goes_out_over_several_ticks_exactly_once_while_commands_are_answered(running: Any) -> None:
    """A step larger than a tick's budget (here: no budget, one chunk a tick) pauses between
    chunks and goes on at the next tick where it stopped; the output holds every change once,
    in order, then the progress statement; commands sent meanwhile are answered."""
    from services.controller import subscribes

    ctl, client, cs = running
    room = ctl.rooms.subscribes
    room.tick_budget_s = 0.0
    paused: list[int] = []
    real = room.produce_step

    def counted(*a: Any, **kw: Any) -> None:
        try:
            real(*a, **kw)
        except subscribes._StepPaused:
            paused.append(1)
            raise

    room.produce_step = counted  # type: ignore[method-assign]
    n = 3 * subscribes._SUB_CHUNK + 500
    ok(client.call("CreateCollection", create_body("bigsub")))
    ok(client.call("Append", append_body("bigsub", _rows(n, 0), 1)))
    topic = f"bigsub-{cs.commands_topic}"
    sid = client.send("Subscribe", {"collection_id": "bigsub", "output_topic": topic, "as_of": 0, "up_to": 1,
                                    "with_snapshot": True})
    ok(client.wait(sid))
    peek = client.send("Peek", {"collection_id": "bigsub", "as_of": 0, "limit": 5})
    assert sum(peek_rows(client.wait(peek)).values()) == 5
    msgs = read_subscribe(client_stack(cs), topic, sid)
    check_progress_order(msgs)
    changes = [m for m in msgs if not m["progressed"]]
    assert len(changes) == n and sorted(m["diff"] for m in changes) == [1] * n
    assert len({m["row"] for m in changes}) == n  # each change once
    assert len(paused) >= 3  # four chunks: paused after each of the first three
    assert not room._paused
