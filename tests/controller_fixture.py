"""Helpers for the controller tests: per-test settings (own S3 prefix and topics), a
reference model of a collection, and readers of the subscribe output."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from typing import Any

from confluent_kafka import TopicPartition

from services.runtime.settings import ServiceSettings
from services.controller.service import ControllerSettings
from shared.codec import RowCodec, message_codec
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient, body_kind
from shared.io.kafka import new_consumer

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}
ROWS = RowCodec(SCHEMA)


def controller_settings(stack: EmbeddedStack, **kw: Any) -> ControllerSettings:
    u = uuid.uuid4().hex[:10]
    env = {**stack.env(), "SHARDSINK_S3_PREFIX": f"ctl-{u}"}
    svc = ServiceSettings.from_env_and_args(None, env)
    kw.setdefault("peek_timeout_ms", 3000)
    return ControllerSettings(svc, commands_topic=f"commands-{u}", responses_topic=f"responses-{u}", **kw)


def client_for(cs: ControllerSettings) -> ControllerClient:
    return ControllerClient(cs.service.kafka, commands_topic=cs.commands_topic, responses_topic=cs.responses_topic)


def create_body(collection_id: str, since: int = 0, policy: Any = None, schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"collection_id": collection_id, "row_schema": json.dumps(schema), "initial_since": since, "read_policy": policy}


def append_body(collection_id: str, updates: list[tuple[dict[str, Any], int, int]], new_upper: int | None,
                expected: int | None = None) -> dict[str, Any]:
    return {
        "collection_id": collection_id,
        "updates": [{"row": ROWS.encode(r), "time": t, "diff": d} for r, t, d in updates],
        "expected_upper": expected,
        "new_upper": new_upper,
    }


def lag(n: int, g: int | None = None) -> tuple[str, dict[str, Any]]:
    return ("io.shardsink.v1.LagWritesBy", {"lag": n, "granularity": g})


def valid_from(t: int | None) -> tuple[str, dict[str, Any]]:
    return ("io.shardsink.v1.ValidFrom", {"frontier": t})


def ok(r: dict[str, Any]) -> dict[str, Any]:
    assert body_kind(r) != "Error", r
    return r


def error_kind_of(r: dict[str, Any]) -> str:
    assert body_kind(r) == "Error", r
    return str(r["body"][1]["kind"])


def results(r: dict[str, Any]) -> dict[str, Any]:
    assert body_kind(r) == "Ack", r
    return {k: json.loads(v) for k, v in r["body"][1]["results"].items()}


def peek_rows(r: dict[str, Any], store: Any = None) -> Counter[tuple[Any, ...]]:
    """A PeekResult as a Counter of (k, v) -> count."""
    assert body_kind(r) == "PeekResult", r
    kind, res = r["body"][1]["result"]
    out: Counter[tuple[Any, ...]] = Counter()
    if kind.endswith("InlineRows"):
        for rc in res["rows"]:
            row = ROWS.decode(rc["row"])
            out[(row["k"], row["v"])] += rc["count"]
        return out
    import io

    import pyarrow.parquet as pq

    assert store is not None
    key = res["key"]
    table = pq.read_table(io.BytesIO(store.get(key)))
    for row in table.to_pylist():
        out[(row["k"], row["v"])] += row["_diff"]
    return out


class Model:
    """The reference: a list of (row, time, diff)."""

    def __init__(self) -> None:
        self.updates: list[tuple[tuple[Any, ...], int, int]] = []

    def add(self, updates: list[tuple[dict[str, Any], int, int]]) -> None:
        self.updates += [((r["k"], r["v"]), t, d) for r, t, d in updates]

    def at(self, as_of: int) -> Counter[tuple[Any, ...]]:
        c: Counter[tuple[Any, ...]] = Counter()
        for r, t, d in self.updates:
            if t <= as_of:
                c[r] += d
        return Counter({k: v for k, v in c.items() if v != 0})

    def subscribe(self, as_of: int, up_to: int) -> list[tuple[int, tuple[Any, ...], int]]:
        """The consolidated change stream: the snapshot at as_of, then changes in (as_of, up_to)."""
        out = [(as_of, r, d) for r, d in self.at(as_of).items()]
        c: Counter[tuple[int, tuple[Any, ...]]] = Counter()
        for r, t, d in self.updates:
            if as_of < t < up_to:
                c[(t, r)] += d
        out += [(t, r, d) for (t, r), d in c.items() if d != 0]
        return sorted(out)


def read_subscribe(stack: EmbeddedStack, topic: str, sid: str, *, until_final: bool = True,
                   timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every message of subscribe ``sid`` on ``topic`` (until its final progress statement)."""
    codec = message_codec("subscribe_output")
    c = new_consumer(ServiceSettings.from_env_and_args(None, stack.env()).kafka, **{"auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for m in c.consume(num_messages=1000, timeout=0.1):
                if m.error() is not None:
                    continue
                msg = codec.decode(m.value())
                if msg["subscribe_id"] == sid:
                    out.append(msg)
            if until_final and out and out[-1]["progressed"] and out[-1]["time"] is None:
                return out
        if until_final:
            raise AssertionError(f"expected a final progress statement of {sid} on {topic}, found {out[-3:]}")
        return out
    finally:
        c.close()


def changes_of(msgs: list[dict[str, Any]]) -> list[tuple[int, tuple[Any, ...], int]]:
    out = []
    for m in msgs:
        if not m["progressed"]:
            row = ROWS.decode(m["row"])
            out.append((m["time"], (row["k"], row["v"]), m["diff"]))
    return sorted(out)


def check_progress_order(msgs: list[dict[str, Any]]) -> None:
    """Changes come in time order, each beyond the last progress and below the next one."""
    last_progress = -1
    for m in msgs:
        if m["progressed"]:
            if m["time"] is not None:
                assert m["time"] > last_progress, (m, last_progress)
                last_progress = m["time"]
        else:
            assert m["time"] >= max(last_progress, 0), (m, last_progress)
