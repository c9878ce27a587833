"""The appender starts a micro-batch from the shard head it committed last, without reading
the store, and a head another replica moved meanwhile still ends in the right shard: the
compare-and-append probes the head on a mismatch, and the appender adopts the upper it finds
(real S3 server and broker of the embedded stack)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from shared.devstack.embedded import EmbeddedStack
from shared.shard import DIFF, Shard

SCHEMA = {
    "type": "record",
    "name": "Row",
    "namespace": "appendhead",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}


class _CountingStore:
    """The appender's store, counting the requests that read (GET, HEAD, LIST)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("get", "exists", "list", "head", "get_range") and callable(attr):
            def counted(*a: Any, **k: Any) -> Any:
                self.reads.append(f"{name} {a[0] if a else ''}")
                return attr(*a, **k)
            return counted
        return attr


def test_an_appender_starts_from_its_own_head_and_adopts_an_upper_another_replica_moved(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.append.service import SinkAppender
    from services.runtime.settings import ServiceSettings
    from services.sinkio import KIND_CONTROL
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.codec import message_codec
    from shared.frontier import Frontier
    from shared.sink_messages import BatchDescription, BatchReport

    env = {**os.environ, **stack.env(), "SHARDSINK_CHECKPOINT_DIR": str(tmp_path)}
    settings = ServiceSettings.from_env_and_args(None, env)
    collection = f"head-{unique_id}"
    create_collection(settings, collection, SCHEMA)
    sink = SinkDef(collection, f"desired-{collection}", collection)
    appender = SinkAppender.create(sink, settings)
    counting = _CountingStore(appender.shard.store)
    for holder in (appender.shard, appender.shard._log):
        monkeypatch.setattr(holder, "store", counting)
    writer = Shard.open(settings.store(), collection)  # the writers' staging, and the other replica
    desc_codec, report_codec = message_codec("batch_description"), message_codec("written_batch")

    def step(lower: int, upper: int, rows: list[tuple[int, str]]) -> Any:
        """A description of ``[lower, upper)`` and its one writer's report, as one micro-batch."""
        d = BatchDescription(sink.sink_id, Frontier.at(lower), Frontier.at(upper), 1, f"{collection}:{lower}", 0, 1)
        staged = writer.stage([({"k": k, "v": v}, lower, 1) for k, v in rows])
        report = BatchReport.for_description(d, 0, json.dumps(staged.to_json(), sort_keys=True))
        appender.process(pa.table({
            "kind": [KIND_CONTROL] * 2,
            "topic": [settings.descs_topic, settings.batches_topic],
            "value": [desc_codec.encode(d.to_dict()), report_codec.encode(report.to_dict())],
        }))
        return staged

    def contents(as_of: int) -> Counter[tuple[int, str]]:
        t = Shard.open(settings.store(), collection).snapshot(as_of)
        out: Counter[tuple[int, str]] = Counter()
        for k, v, d in zip(t["k"].to_pylist(), t["v"].to_pylist(), t[DIFF].to_pylist(), strict=True):
            out[(k, v)] += d
        return out

    def upper() -> int | None:
        return Shard.open(settings.store(), collection).refresh().upper.time

    step(0, 10, [(1, "a")])  # the first micro-batch reads the head: the appender has none yet
    assert upper() == 10
    state_reads: Callable[[], list[str]] = lambda: [r for r in counting.reads if "/state/" in r]  # noqa: E731
    counting.reads.clear()
    step(10, 20, [(2, "b")])
    assert upper() == 20, "expected the second description appended"
    assert state_reads() == [], (
        "expected a micro-batch to start from the head the appender committed moments ago, without "
        f"reading the shard's state, found {state_reads()}"
    )

    # Another replica appends [20, 30): the appender's head is behind, and its next description
    # (lower 20, as it was minted before the other append) must not land.
    writer.refresh()
    other = writer.stage([({"k": 3, "v": "c"}, 20, 1)])
    writer.compare_and_append_staged([other], 20, 30, token=f"{collection}:other")
    mine = step(20, 30, [(4, "d")])
    assert upper() == 30
    assert contents(29) == Counter({(1, "a"): 1, (2, "b"): 1, (3, "c"): 1}), "expected the other replica's batch alone"
    data = {i.key for i in writer.store.list(f"{writer.prefix}data/")}
    assert not {p.key for p in mine.parts} & data, "expected the refused batch's parts deleted"
    assert appender.state.known_upper == Frontier.at(30), "expected the appender to adopt the upper it was refused on"

    step(30, 40, [(5, "e")])  # and it goes on from there
    assert upper() == 40
    assert contents(39) == Counter({(1, "a"): 1, (2, "b"): 1, (3, "c"): 1, (5, "e"): 1})
