"""A writer partition reads an appended batch back from what the append announced (the
description carries it, ``BatchDescription.appended``) instead of the shard's state: no GET,
and the same correction buffer as a read of the state; anything the announcement cannot stand
for falls back to the read. Against the embedded S3 server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from services.append.service import appended_batch
from services.runtime.settings import ServiceSettings
from services.write.context import ShardContext
from services.write.job import WriteJob
from shared.catalog import SinkDef
from shared.devstack.embedded import EmbeddedStack
from shared.frontier import Frontier
from shared.shard import Shard, StagedBatch
from shared.sink_messages import AppendedBatch, BatchDescription
from shared.write_state import Stage, WriteState
from tests.services.test_write_heads import store_gets

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}


def _buffer(ws: WriteState) -> list[tuple[bytes, int, int]]:
    u = ws.correction.updates_before(Frontier.empty())
    return sorted(zip(u.keys.to_pylist(), u.times.tolist(), u.diffs.tolist(), strict=True))


def _written_step(stack: EmbeddedStack, unique_id: str, tmp_path: Path) -> tuple[Any, ...]:
    """Two writer partitions write a description [0, 3) (updates at 1 and 2, and some at 4
    beyond it), its staged parts are appended, and what the append added is taken from the
    committed state as the appender announces it."""
    settings = ServiceSettings.from_env_and_args(None, stack.env())
    cid = f"appended-{unique_id}"
    shard = Shard.create(settings.store(), cid, SCHEMA)
    job = WriteJob(SinkDef(cid, f"desired-{cid}", cid), settings, 2, json.dumps(SCHEMA), "descs", str(tmp_path / "ckpt"))
    desc = BatchDescription(sink_id=cid, lower=0, upper=3, epoch=1, token="1:0:x", partition_count=2)
    ctxs, states, staged = [], [], []
    for wp in (0, 1):
        ctx, ws = ShardContext(job), WriteState(cid, wp, 2)
        ctx.start(ws)
        rows = [{"k": 10 * wp + i, "v": "x"} for i in range(6)]
        assert ws.absorb_desired_updates([ctx.codec.encode(r) for r in rows], [1, 2, 1, 2, 4, 4], [1, 1, 2, 1, 1, -1]) == 0
        ws.absorb_desired_progress(5)
        decision = ws.maybe_write(desc)
        assert isinstance(decision, Stage)
        staged.append(StagedBatch.from_json(json.loads(ctx.stage(ws, decision))))
        ctxs.append(ctx)
        states.append(ws)
    committed = shard.compare_and_append_staged(staged, 0, 3, token=desc.token)
    appended = appended_batch(committed, desc)
    assert appended is not None
    return job, shard, ctxs, states, appended, staged, desc


def test_a_writer_follows_an_announced_append_without_reading_the_shard(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, shard, ctxs, states, appended, staged, _ = _written_step(stack, unique_id, tmp_path)
    # what the appender announces: every object of the batch, from the description's lower
    assert appended == AppendedBatch(Frontier.at(0), tuple(p.key for s in staged for p in s.parts), 1)
    # a twin of partition 0 (same buffer, same staged parts) reads back from the shard's state
    twin_ctx, twin = ShardContext(job), WriteState.from_checkpoint(states[0].to_checkpoint())

    gets = [store_gets(ctx, monkeypatch) for ctx in ctxs]
    for ctx, ws in zip(ctxs, states, strict=True):
        ctx.read_back(ws, at_least=Frontier.at(3), appended=appended)
    assert gets == [[], []], "expected no GET: own parts from memory, the other partition's skipped by their tag"

    twin_ctx.read_back(twin, at_least=Frontier.at(3))
    for ws in (*states, twin):
        assert ws.persist_frontier == Frontier.at(3)
    assert _buffer(states[0]) == _buffer(twin)
    # what is left is the updates beyond the description (at 4): the batch cancelled exactly
    # what was staged
    for ws in states:
        assert sorted((t, d) for _, t, d in _buffer(ws)) == [(4, -1), (4, 1)]


def test_an_announcement_that_cannot_stand_for_the_state_leaves_the_read_to_it(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, shard, ctxs, states, appended, _, _ = _written_step(stack, unique_id, tmp_path)
    ctx, ws = ctxs[0], states[0]
    before = ws.to_checkpoint()
    for other in (
        dataclasses.replace(appended, lower=Frontier.at(1)),  # starts elsewhere than the persist frontier
        dataclasses.replace(appended, schema_versions=2),  # a state with a schema version this writer lacks
        dataclasses.replace(appended, parts=(*appended.parts, f"{shard.prefix}data/merged.parquet")),  # untagged
    ):
        assert not ctx.follow_appended(ws, Frontier.at(3), other)
        assert ws.to_checkpoint() == before and ws.persist_frontier == Frontier.at(0)
    # read_back then reads the state, with the same outcome
    gets = store_gets(ctx, monkeypatch)
    ctx.read_back(ws, at_least=Frontier.at(3), appended=dataclasses.replace(appended, lower=Frontier.at(1)))
    assert any("/state/" in k for k in gets)
    assert ws.persist_frontier == Frontier.at(3)
    assert sorted((t, d) for _, t, d in _buffer(ws)) == [(4, -1), (4, 1)]


def test_the_appender_announces_nothing_when_the_state_is_past_the_description(
    stack: EmbeddedStack, unique_id: str, tmp_path: Path
) -> None:
    """A head that already holds a later append (a retry that found its token applied, after
    another append landed) cannot say what this one added."""
    job, shard, _, _, _, _, desc = _written_step(stack, unique_id, tmp_path)
    later = shard.compare_and_append([({"k": 99, "v": "y"}, 3, 1)], 3, 4)
    assert appended_batch(later, desc) is None
    # an append without updates adds no object
    empty = shard.compare_and_append(None, 4, 6)
    assert appended_batch(empty, BatchDescription(sink_id=job.sink.sink_id, lower=4, upper=6, epoch=1, token="t",
                                                  partition_count=2)) == AppendedBatch(Frontier.at(4), (), 1)
