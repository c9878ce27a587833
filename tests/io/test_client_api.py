"""The public Python read API (``shardsink``, implemented in shared.io.client) against the embedded stack, with a controller
running in this process as the writer: snapshots and subscribes equal to a reference model,
the reader hold keeping since back while a subscribe runs, and the storage layer's errors."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from services.controller.service import Controller, ControllerSettings
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient
from shared.io.s3 import S3Settings
from shared.shard import Shard
from shardsink import (
    Change,
    NotReadableYetError,
    Progress,
    ShardDroppedError,
    ShardNotFoundError,
    SinceViolationError,
    open_collection,
)
from tests.controller_fixture import Model, append_body, client_for, controller_settings, create_body, lag, ok


@pytest.fixture(scope="module")
def ctl(stack: EmbeddedStack) -> Iterator[tuple[Controller, ControllerClient, ControllerSettings]]:
    cs = controller_settings(stack)
    controller = Controller(cs).start()
    client = client_for(cs)
    yield controller, client, cs
    controller.stop()
    client.close()
    assert controller.error is None, controller.error


def _updates(rng: random.Random, t: int, live: set[int]) -> list[tuple[dict[str, Any], int, int]]:
    """Some inserts and some retractions of live rows at time t."""
    out = []
    for _ in range(rng.randint(0, 6)):
        k = rng.randint(0, 40)
        if k in live:
            live.discard(k)
            out.append(({"k": k, "v": f"v{k}"}, t, -1))
        else:
            live.add(k)
            out.append(({"k": k, "v": f"v{k}"}, t, 1))
    return out


def _counter(table: Any) -> Counter[tuple[Any, ...]]:
    return Counter({(r["k"], r["v"]): r["_diff"] for r in table.to_pylist()})


def test_snapshot_and_pandas_equal_the_model(ctl: Any) -> None:
    _, client, cs = ctl
    ok(client.call("CreateCollection", create_body("api1")))
    rng, live, model = random.Random(7), set[int](), Model()
    for t in range(12):
        ups = _updates(rng, t, live)
        model.add(ups)
        ok(client.call("Append", append_body("api1", ups, t + 1)))
    c = open_collection("api1", cs.service)  # ServiceSettings
    assert (c.upper, c.since) == (12, 0)
    for as_of in range(12):
        table = c.snapshot(as_of)
        assert table.column_names == ["k", "v", "_diff"]
        assert _counter(table) == model.at(as_of), as_of
    assert _counter(c.snapshot()) == model.at(11)  # default: the latest readable time
    df = c.to_pandas(5)
    assert Counter({(int(k), v): int(d) for k, v, d in zip(df["k"], df["v"], df["_diff"], strict=True)}) == model.at(5)
    # The same through S3Settings (what open_collection reads from the environment by default).
    assert _counter(open_collection("api1", S3Settings(**{**_s3_kw(cs)})).snapshot(3)) == model.at(3)


def _s3_kw(cs: ControllerSettings) -> dict[str, Any]:
    s = cs.service.s3
    return {"bucket": s.bucket, "endpoint": s.endpoint, "prefix": s.prefix, "region": s.region,
            "access_key": s.access_key, "secret_key": s.secret_key}


def test_subscribe_equals_the_model_while_appends_run(ctl: Any) -> None:
    _, client, cs = ctl
    ok(client.call("CreateCollection", create_body("api2")))
    rng, live, model = random.Random(11), set[int](), Model()
    for t in range(5):
        ups = _updates(rng, t, live)
        model.add(ups)
        ok(client.call("Append", append_body("api2", ups, t + 1)))
    c = open_collection("api2", cs.service)
    events: list[Change | Progress] = []
    with c.subscribe(as_of=2, up_to=15) as sub:
        hold = Shard(cs.service.store(), "api2").refresh().reader(sub.reader_id)
        assert hold is not None and hold.since.time == 2

        def writer() -> None:  # appends while the subscribe runs
            for t in range(5, 16):
                ups = _updates(rng, t, live)
                model.add(ups)
                ok(client.call("Append", append_body("api2", ups, t + 1)))

        th = threading.Thread(target=writer)
        th.start()
        events = list(sub)
        th.join(60)
    changes = sorted((e.time, (e.row["k"], e.row["v"]), e.diff) for e in events if isinstance(e, Change))
    assert changes == model.subscribe(2, 15)
    # Progress: increasing, the last is up_to; every change is below the progress after it.
    progress = [e.frontier for e in events if isinstance(e, Progress)]
    assert progress[-1] == 15 and progress == sorted(set(progress))
    frontier = 2
    for e in events:
        if isinstance(e, Progress):
            assert e.frontier is not None and e.frontier > frontier
            frontier = e.frontier
        else:
            assert frontier <= e.time < 15
    # The hold is released at the end.
    assert Shard(cs.service.store(), "api2").refresh().reader(sub.reader_id) is None


def test_a_running_subscribe_holds_since_back_and_releases_it(ctl: Any) -> None:
    _, client, cs = ctl
    ok(client.call("CreateCollection", create_body("api3")))
    for t in range(10):
        ok(client.call("Append", append_body("api3", [({"k": t, "v": "x"}, t, 1)], t + 1)))
    c = open_collection("api3", cs.service)
    shard = Shard(cs.service.store(), "api3")
    sub = c.subscribe(as_of=3)
    first = [next(sub) for _ in range(11)]  # the snapshot at 3 (4 rows), 6 changes, Progress(10)
    assert first[-1] == Progress(10)
    # Changes come in time order, within one time (the snapshot at 3) in row order.
    assert [(e.time, e.row["k"]) for e in first[:-1] if isinstance(e, Change)] == [
        (3, 0), (3, 1), (3, 2), (3, 3), (4, 4), (5, 5), (6, 6), (7, 7), (8, 8), (9, 9)]
    # A policy of lag 1 wants since = upper - 1; the subscribe's hold (progress - 1 = 9)
    # keeps since at 9 while the subscribe is not read further, whatever the upper does.
    ok(client.call("SetReadPolicy", {"collection_id": "api3", "policy": lag(1)}))
    ok(client.call("Append", append_body("api3", [({"k": 10, "v": "x"}, 10, 1)], 12)))
    ok(client.call("Append", append_body("api3", [], 20)))
    _wait(lambda: shard.refresh().reader("controller").since.time == 19)  # type: ignore[union-attr]
    assert shard.refresh().since.time == 9
    assert next(sub) == Change(10, 1, {"k": 10, "v": "x"})
    assert next(sub) == Progress(20)
    _wait(lambda: shard.refresh().since.time == 19)  # the hold moved to 19 with the step
    sub.close()
    assert shard.refresh().reader(sub.reader_id) is None


def test_the_storage_layer_errors(ctl: Any) -> None:
    _, client, cs = ctl
    with pytest.raises(ShardNotFoundError):
        open_collection("api-none", cs.service)
    ok(client.call("CreateCollection", create_body("api4", since=2)))
    ok(client.call("Append", append_body("api4", [({"k": 1, "v": "a"}, 3, 1)], 5)))
    c = open_collection("api4", cs.service)
    with pytest.raises(SinceViolationError):
        c.snapshot(1)
    with pytest.raises(SinceViolationError):
        c.subscribe(as_of=1)
    with pytest.raises(NotReadableYetError):
        c.snapshot(5)
    # A snapshot beyond the upper waits (timeout_s) for it to pass.
    threading.Timer(0.3, lambda: ok(client.call("Append", append_body("api4", [], 8)))).start()
    assert _counter(c.snapshot(6, timeout_s=60)) == Counter({(1, "a"): 1})
    # A subscribe of a dropped collection ends with the empty frontier.
    sub = c.subscribe(as_of=4)
    assert [next(sub) for _ in range(2)] == [Change(4, 1, {"k": 1, "v": "a"}), Progress(8)]
    ok(client.call("DropCollection", {"collection_id": "api4"}))
    assert list(sub) == [Progress(None)]
    with pytest.raises(ShardDroppedError):
        c.snapshot(6)


def _wait(pred: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
