"""``shardsink sink create`` on a collection that already holds rows (issue 32), end to end on
the embedded stack: the real broker and S3 server, a controller in this process and the sink
services (mint, write, append) running in the session's Spark.

A sink corrects its collection to its desired topic, so a sink created on a collection that
holds rows must say what the topic holds:

- without a flag, ``sink create`` (either ``--via``) and the controller's ``CreateSink`` are
  refused with ``SinkBaselineRequiredError`` naming the collection, its rows and both flags,
  and the catalog gains nothing; both flags at once is a usage error; an empty collection
  needs neither;
- ``--replace-contents`` (the topic is the whole truth): the collection converges to equal
  the topic, the rows the topic does not hold retracted;
- ``--adopt-shard`` (the topic holds the changes from the collection's upper on): nothing of
  the collection is retracted, and the topic's older records are not applied twice.

The topic of every case is the trial's: it holds only part of the history behind the
collection's rows (20 of 60), plus new rows after the collection's upper.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.controller.service import Controller, ControllerSettings
from shardsink.cli.main import main
from shared.catalog import CatalogState
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient
from shared.shard import Shard
from tests.controller_fixture import SCHEMA, client_for, error_kind_of
from tests.services.test_sink_e2e import Harness, Row, services_harness, shard_contents

#: The collection's rows before any sink: (k, "held") at time 0, upper 1.
HELD = 60
#: The part of that history the topic holds (at time 0), and its new rows (at time 1).
ON_TOPIC = 20
NEW = 10
#: The topic's desired frontier: the sink is caught up when the shard's upper reaches it.
FRONTIER = 3
#: Waits for a sink (its queries start, then write): generous, for a loaded 2-core machine.
DEADLINE_S = 300.0


@dataclass
class World:
    harness: Harness
    controller: ControllerSettings
    client: ControllerClient


@pytest.fixture(scope="module")
def world(stack: EmbeddedStack, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The sink services and a controller on one S3 prefix of their own, for the module."""
    tag = uuid.uuid4().hex[:8]
    with services_harness(stack, spark, tmp_path_factory, SHARDSINK_S3_PREFIX=f"baseline-{tag}") as harness:
        cs = ControllerSettings(harness.settings, commands_topic=f"commands-{tag}", responses_topic=f"responses-{tag}")
        controller = Controller(cs).start()
        client = client_for(cs)
        try:
            yield World(harness, cs, client)
        finally:
            client.close()
            controller.stop()
        assert controller.error is None, controller.error


@pytest.fixture
def env(stack: EmbeddedStack, world: World, monkeypatch: pytest.MonkeyPatch) -> World:
    """The environment a user's shell would have: the stack, the S3 prefix, the topics."""
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SHARDSINK_S3_PREFIX", world.controller.service.s3.prefix)
    monkeypatch.setenv("SHARDSINK_TOPIC_COMMANDS", world.controller.commands_topic)
    monkeypatch.setenv("SHARDSINK_TOPIC_RESPONSES", world.controller.responses_topic)
    return world


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _jsonl(path: Path, lines: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def held_rows() -> dict[Row, int]:
    return {(k, "held"): 1 for k in range(HELD)}


def new_rows() -> dict[Row, int]:
    return {(1000 + i, "new"): 1 for i in range(NEW)}


def topic_rows() -> dict[Row, int]:
    """The desired collection on the topic at its frontier: part of the history, new rows."""
    return {**{(k, "held"): 1 for k in range(ON_TOPIC)}, **new_rows()}


def a_collection_with_rows_and_a_topic(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cid: str, topic: str
) -> str:
    """Collection ``cid`` holding :func:`held_rows` at time 0 (upper 1), appended through the
    CLI; ``topic`` holding :func:`topic_rows`, produced through the CLI, progress at
    :data:`FRONTIER`. Returns the schema file."""
    schema = tmp_path / "row.avsc"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = run(capsys, "collection", "create", cid, "--schema", str(schema))
    assert code == 0, err
    held = [{"row": {"k": k, "v": v}, "time": 0, "diff": d} for (k, v), d in held_rows().items()]
    code, out, err = run(capsys, "append", cid, "--input", _jsonl(tmp_path / "held.jsonl", held), "--advance-to", "1")
    assert (code, json.loads(out)["upper"]) == (0, 1), err
    on_topic = [{"row": {"k": k, "v": "held"}, "time": 0, "diff": 1} for k in range(ON_TOPIC)]
    on_topic += [{"row": {"k": k, "v": v}, "time": 1, "diff": d} for (k, v), d in new_rows().items()]
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", str(schema), "--partitions", "2",
                         "--input", _jsonl(tmp_path / "topic.jsonl", on_topic), "--advance-to", str(FRONTIER))
    assert code == 0, err
    return str(schema)


def definitions(state: CatalogState) -> tuple[bytes, bytes]:
    """The catalog's collections and sinks (the controller's own section, its command log,
    changes with every answer)."""
    return (json.dumps({k: v.to_json() for k, v in state.collections.items()}, sort_keys=True).encode(),
            json.dumps({k: v.to_json() for k, v in state.sinks.items()}, sort_keys=True).encode())


def wait_caught_up(world: World, shard: Shard, sid: str) -> dict[Row, int]:
    """The shard's contents once its upper reached the topic's frontier (no error rows)."""
    deadline = time.monotonic() + DEADLINE_S
    while (upper := shard.refresh().upper.time or 0) < FRONTIER:
        if time.monotonic() > deadline:
            pytest.fail(f"expected the shard's upper at {FRONTIER} within {DEADLINE_S}s, found {upper}; "
                        f"{world.harness.diagnostics([sid])}")
        time.sleep(0.2)
    assert upper == FRONTIER
    contents = shard_contents(shard, FRONTIER - 1)
    assert contents.errors == {}
    return contents.rows


def test_a_sink_on_a_collection_that_holds_rows_without_a_flag_is_refused_both_ways_and_writes_nothing(
    env: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cid, topic = f"refused-{uuid.uuid4().hex[:6]}", f"desired-refused-{uuid.uuid4().hex[:6]}"
    a_collection_with_rows_and_a_topic(capsys, tmp_path, cid, topic)
    catalog = env.harness.settings.catalog()
    before = catalog.state()
    for via in ("controller", "catalog"):
        code, out, err = run(capsys, "sink", "create", f"{cid}-s", "--topic", topic, "--collection", cid, "--via", via)
        assert (code, out) == (2, ""), (via, out)
        assert err.count("\n") == 1, err
        assert err.startswith(
            f"error: SinkBaselineRequiredError: expected sink '{cid}-s' on collection '{cid}', which holds {HELD} rows "
            f"(upper 1), to say what topic '{topic}' holds: --adopt-shard"), (via, err)
        assert "--replace-contents" in err and err.endswith("found neither; nothing was written\n"), (via, err)
        assert definitions(catalog.state()) == definitions(before), via
    # The controller's command answers with the wire kind and the structured fields.
    r = env.client.call("CreateSink", {"sink_id": f"{cid}-s", "collection_id": cid, "desired_topic": topic,
                                       "as_of": None, "read_only": False, "options": {}})
    assert error_kind_of(r) == "SinkBaselineRequired"
    fields = {k: json.loads(v) for k, v in r["body"][1]["fields"].items()}
    assert fields == {"sink_id": f"{cid}-s", "collection_id": cid, "rows": HELD, "upper": 1}, fields
    assert definitions(catalog.state()) == definitions(before)
    # Both flags at once: a usage error, before anything is sent or written.
    for via in ("controller", "catalog"):
        code, out, err = run(capsys, "sink", "create", f"{cid}-s", "--topic", topic, "--collection", cid, "--via", via,
                             "--adopt-shard", "--replace-contents")
        assert (code, out) == (2, ""), via
        assert err.startswith("error: InvalidUsageError: expected at most one of --adopt-shard"), (via, err)
    assert definitions(catalog.state()) == definitions(before)
    # The shard was not touched either.
    assert shard_contents(Shard(env.harness.settings.store(), cid), 0).rows == held_rows()


def test_an_empty_collection_needs_neither_flag_and_either_flag_is_recorded_both_ways(
    env: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sinks on a topic that does not exist: the services start no query for them."""
    schema = tmp_path / "row.avsc"
    schema.write_text(json.dumps(SCHEMA))
    cid = f"flags-{uuid.uuid4().hex[:6]}"
    assert run(capsys, "collection", "create", cid, "--schema", str(schema))[0] == 0
    catalog = env.harness.settings.catalog()
    for via in ("controller", "catalog"):
        code, out, err = run(capsys, "sink", "create", f"{cid}-{via}", "--topic", "no-such-topic", "--collection", cid,
                             "--via", via)
        assert (code, json.loads(out)) == (0, {"created": f"{cid}-{via}", "as_of": 0}), err
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"row": {"k": 1, "v": "a"}, "time": 0}) + "\n")
    # The collection's sinks refuse appends; drop them, then give it a row.
    for via in ("controller", "catalog"):
        assert run(capsys, "sink", "drop", f"{cid}-{via}")[0] == 0
    assert run(capsys, "append", cid, "--input", str(data), "--advance-to", "1")[0] == 0
    for via in ("controller", "catalog"):
        for flag in ("--adopt-shard", "--replace-contents"):
            sid = f"{cid}-{via}-{flag.strip('-')}"
            code, out, err = run(capsys, "sink", "create", sid, "--topic", "no-such-topic", "--collection", cid,
                                 "--via", via, flag)
            assert (code, json.loads(out)) == (0, {"created": sid, "as_of": 1}), err
            sink = catalog.state().sink(sid)
            assert (sink.adopt_shard, sink.replace_contents) == (flag == "--adopt-shard", flag == "--replace-contents")
            assert run(capsys, "sink", "drop", sid)[0] == 0


@pytest.mark.parametrize("via", ["controller", "catalog"])
def test_replace_contents_converges_the_collection_to_equal_the_topic(
    env: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    cid, topic = f"replace-{via}-{uuid.uuid4().hex[:6]}", f"desired-replace-{uuid.uuid4().hex[:6]}"
    a_collection_with_rows_and_a_topic(capsys, tmp_path, cid, topic)
    sid = f"{cid}-s"
    code, out, err = run(capsys, "sink", "create", sid, "--topic", topic, "--collection", cid, "--via", via,
                         "--replace-contents")
    assert (code, json.loads(out)) == (0, {"created": sid, "as_of": 1}), err
    try:
        rows = wait_caught_up(env, Shard(env.harness.settings.store(), cid), sid)
        # The topic is the whole truth: the 40 rows it does not hold are retracted.
        assert rows == topic_rows()
    finally:
        env.harness.settings.catalog().drop_sink(sid)


@pytest.mark.parametrize("via", ["controller", "catalog"])
def test_adopt_shard_retracts_nothing_of_the_collection(
    env: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    cid, topic = f"adopt-{via}-{uuid.uuid4().hex[:6]}", f"desired-adopt-{uuid.uuid4().hex[:6]}"
    a_collection_with_rows_and_a_topic(capsys, tmp_path, cid, topic)
    sid = f"{cid}-s"
    code, out, err = run(capsys, "sink", "create", sid, "--topic", topic, "--collection", cid, "--via", via,
                         "--adopt-shard")
    assert (code, json.loads(out)) == (0, {"created": sid, "as_of": 1}), err
    try:
        rows = wait_caught_up(env, Shard(env.harness.settings.store(), cid), sid)
        # Every row the collection held stays, once (the topic's records below the adopted
        # upper are not applied again), and the topic's changes from there on are added.
        assert rows == {**held_rows(), **new_rows()}
    finally:
        env.harness.settings.catalog().drop_sink(sid)
