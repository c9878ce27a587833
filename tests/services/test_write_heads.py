"""A write task on a Python worker that missed a sink's last steps reads back from the shard
state another worker of the executor told of (services/write/heads.py): one GET of a state,
not one per state it missed; against the embedded S3 server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.runtime.settings import ServiceSettings
from services.write import heads
from services.write.context import ShardContext
from services.write.job import WriteJob
from shared.catalog import SinkDef
from shared.devstack.embedded import EmbeddedStack
from shared.frontier import Frontier
from shared.shard import Shard
from shared.write_state import WriteState

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}


def store_gets(ctx: ShardContext, monkeypatch: pytest.MonkeyPatch, holding: str = "") -> list[str]:
    """The keys holding ``holding`` that ``ctx``'s store GETs from now on (every key: "")."""
    store = ctx.shard.store
    got: list[str] = []
    real = store.get

    def get(key: str, *a: Any, **k: Any) -> bytes:
        if holding in key:
            got.append(key)
        return real(key, *a, **k)

    monkeypatch.setattr(store, "get", get)
    return got


def _state_gets(ctx: ShardContext, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the shard states ``ctx`` GETs from now on."""
    return store_gets(ctx, monkeypatch, "/state/")


def test_a_worker_behind_on_a_sinks_steps_reads_the_state_another_worker_told_of(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = ServiceSettings.from_env_and_args(None, stack.env())
    cid = f"heads-{unique_id}"
    shard = Shard.create(settings.store(), cid, SCHEMA)
    job = WriteJob(SinkDef(cid, f"desired-{cid}", cid), settings, 2, json.dumps(SCHEMA), "descs", str(tmp_path / "ckpt"))
    # two Python workers of one executor, each with its view of the shard
    a, b = ShardContext(job), ShardContext(job)
    wa, wb = WriteState(cid, 0, 2), WriteState(cid, 1, 2)
    a.start(wa)
    b.start(wb)
    shard.compare_and_append([({"k": i, "v": "x"}, 0, 1) for i in range(6)], 0, 1)
    a.read_back(wa, at_least=Frontier.at(1))
    b.read_back(wb, at_least=Frontier.at(1))

    # the sink's next three steps all run on worker a
    for t in (1, 2, 3):
        shard.compare_and_append([({"k": 10 * t + i, "v": "y"}, t, 1) for i in range(6)], t, t + 1)
        a.read_back(wa, at_least=Frontier.at(t + 1))
    head = shard.refresh()
    assert heads.heard(a.heads_key) == head.seqno

    # then one on worker b: the state a told of serves, one GET
    gets = _state_gets(b, monkeypatch)
    b.read_back(wb, at_least=Frontier.at(4))
    assert gets == [shard.state_key(head.seqno)]
    assert wb.persist_frontier == wa.persist_frontier == Frontier.at(4)
    # every row read back once, negated, by the writer partition it routes to
    held = [w.correction.updates_before(Frontier.at(5)) for w in (wa, wb)]
    assert sum(len(u) for u in held) == 24
    assert all(d == -1 for u in held for d in u.diffs.tolist())

    # the same catch-up without the hint walks the states b missed
    c = ShardContext(job)
    wc = WriteState(cid, 1, 2)
    c.start(wc)
    shard.compare_and_append([({"k": 100 + i, "v": "z"}, 4, 1) for i in range(2)], 4, 5)
    shard.compare_and_append([({"k": 200 + i, "v": "z"}, 5, 1) for i in range(2)], 5, 6)
    gets_c = _state_gets(c, monkeypatch)
    monkeypatch.setattr(heads, "heard", lambda key: None)
    c.read_back(wc, at_least=Frontier.at(6))
    assert len(gets_c) == 2 and wc.persist_frontier == Frontier.at(6)


def test_a_told_seqno_the_shard_does_not_hold_is_replaced_by_the_one_found(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    """A stale hint (another deployment's shard of the same name) costs one GET that finds
    nothing; the worker tells the state it found instead."""
    settings = ServiceSettings.from_env_and_args(None, stack.env())
    cid = f"heads-{unique_id}"
    shard = Shard.create(settings.store(), cid, SCHEMA)
    job = WriteJob(SinkDef(cid, f"desired-{cid}", cid), settings, 2, json.dumps(SCHEMA), "descs", str(tmp_path / "ckpt"))
    ctx = ShardContext(job)
    ws = WriteState(cid, 0, 2)
    ctx.start(ws)
    heads.tell(ctx.heads_key, 500)
    shard.compare_and_append([({"k": 1, "v": "x"}, 0, 1)], 0, 1)
    ctx.read_back(ws, at_least=Frontier.at(1))
    assert ws.persist_frontier == Frontier.at(1)
    assert heads.heard(ctx.heads_key) == shard.refresh().seqno


def test_a_workers_first_context_of_a_sink_starts_at_the_state_another_worker_told_of(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Python worker makes a sink's context once (every one of them after a restart): with
    the seqno another worker told, it finds the head in fewer requests than from the shard's
    hint, and reads the same head."""
    from shared.io.s3 import S3ObjectStore

    settings = ServiceSettings.from_env_and_args(None, stack.env())
    cid = f"heads-{unique_id}"
    shard = Shard.create(settings.store(), cid, SCHEMA)
    job = WriteJob(SinkDef(cid, f"desired-{cid}", cid), settings, 2, json.dumps(SCHEMA), "descs", str(tmp_path / "ckpt"))
    for t in range(6):
        shard.compare_and_append([({"k": t, "v": "x"}, t, 1)], t, t + 1)
    head = shard.refresh()
    first = ShardContext(job)
    assert first.shard.cached() is not None and first.shard.cached().seqno == head.seqno
    assert heads.heard(first.heads_key) == head.seqno  # told to the other workers

    requests: list[str] = []
    for name in ("get", "exists", "list"):
        real = getattr(S3ObjectStore, name)

        def counted(self: Any, key: str, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            if shard.prefix in key:
                requests.append(f"{_name} {key}")
            return _real(self, key, *a, **k)

        monkeypatch.setattr(S3ObjectStore, name, counted)
    told = ShardContext(job)
    with_told, requests[:] = list(requests), []
    monkeypatch.setattr(heads, "heard", lambda key: None)
    untold = ShardContext(job)
    assert told.shard.cached().seqno == untold.shard.cached().seqno == head.seqno  # type: ignore[union-attr]
    assert told.schema == untold.schema == SCHEMA
    assert len(with_told) == 2 and len(requests) > len(with_told), (with_told, requests)
