"""The user's surface of the ``shardsink`` CLI, tried as a new user would (issue 15), through
the entry point that ``pyproject.toml`` declares, against the embedded stack with a
controller running in this process: all-or-nothing ``produce``/``append``, late times
refused, busy ports, read-only commands that create nothing, ``tail`` cleaning up its topic,
one error vocabulary, ``--help``, output that round-trips, and a quiet terminal when the
broker is unreachable."""

from __future__ import annotations

import importlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from services.controller.client import ControllerClient
from services.controller.service import Controller, ControllerSettings
from shared.desired import DesiredProgress, DesiredUpdate, decode_desired
from shared.embedded import EmbeddedStack
from shared.io.kafka import new_consumer
from tests.controller_fixture import SCHEMA, client_for, controller_settings

ROOT = Path(__file__).resolve().parent.parent


def _entry_point() -> tuple[str, str]:
    """``(module, function)`` of the ``shardsink`` script in pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        spec = tomllib.load(f)["project"]["scripts"]["shardsink"]
    module, _, func = spec.partition(":")
    return module, func


def _main() -> Callable[[list[str]], int]:
    module, func = _entry_point()
    fn: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return fn


@pytest.fixture(scope="module")
def ctl(stack: EmbeddedStack) -> Iterator[tuple[Controller, ControllerClient, ControllerSettings]]:
    cs = controller_settings(stack)
    controller = Controller(cs).start()
    client = client_for(cs)
    yield controller, client, cs
    controller.stop()
    client.close()
    assert controller.error is None, controller.error


@pytest.fixture
def env(stack: EmbeddedStack, ctl: Any, monkeypatch: pytest.MonkeyPatch) -> ControllerSettings:
    """The environment a user's shell would have: the stack, the S3 prefix, the topics."""
    _, _, cs = ctl
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SHARDSINK_S3_PREFIX", cs.service.s3.prefix)
    monkeypatch.setenv("SHARDSINK_TOPIC_COMMANDS", cs.commands_topic)
    monkeypatch.setenv("SHARDSINK_TOPIC_RESPONSES", cs.responses_topic)
    return cs


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = _main()(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_process(argv: list[str], env: dict[str, str], timeout_s: float = 120, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own (its whole stderr, librdkafka's included)."""
    module, func = _entry_point()
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    return subprocess.run([sys.executable, "-c", code, *argv], env={**os.environ, **env}, input=stdin,
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def _schema_file(tmp_path: Path, schema: dict[str, Any] = SCHEMA) -> str:
    p = tmp_path / f"{schema['name']}.avsc"
    p.write_text(json.dumps(schema))
    return str(p)


def _lines(path: Path, *objs: Any) -> str:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return str(path)


def _topic_messages(stack: EmbeddedStack, topic: str, partitions: int, expected: int, settle_s: float = 1.0) -> list[Any]:
    """Every desired message on the topic (waits for ``expected``, then ``settle_s`` more for extras)."""
    from services.common import ServiceSettings

    c = new_consumer(ServiceSettings.from_env_and_args(None, stack.env()).kafka, **{"auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: list[Any] = []
    deadline = time.monotonic() + 30
    settled: float | None = None
    try:
        while time.monotonic() < deadline:
            for m in c.consume(num_messages=100, timeout=0.1):
                if m.error() is None:
                    out.append(decode_desired(m.value()))
            if len(out) >= expected:
                settled = settled or time.monotonic()
                if time.monotonic() - settled >= settle_s:
                    break
    finally:
        c.close()
    return out


def _one_error(err: str, prefix: str) -> None:
    assert err.count("\n") == 1 and err.startswith(prefix), err


# ==================================================================================================
# 1, 2: produce is all or nothing, and refuses times below the progress the topic has seen
# ==================================================================================================
def test_produce_with_a_bad_line_sends_nothing_and_says_so(
    env: ControllerSettings, stack: EmbeddedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    schema = _schema_file(tmp_path)
    topic = f"surface-produce-{uuid.uuid4().hex[:8]}"
    bad_json = _lines(tmp_path / "bad.jsonl", {"row": {"k": 1, "v": "a"}, "time": 0}, {"row": {"k": 2, "v": "b"}, "time": 0},
                      '{"row": {"k": 3, "v": "c"}, "time": 1', {"progress": 2})
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input", bad_json, "--partitions", "2")
    assert (code, out) == (2, "")
    _one_error(err, "error: EncodeError: expected a JSON object on line 3, found invalid JSON")
    assert err.endswith(f"; nothing was produced to {topic!r}\n"), err
    # A failed produce leaves nothing behind: not even the topic it would have created.
    from shared.io.desired_producer import topic_progress

    assert topic_progress(env.service.kafka, topic) is None

    # A row that does not match the schema: its line number and its field, nothing sent.
    good = [{"row": {"k": 1, "v": "a"}, "time": 0}, {"row": {"k": 2, "v": "b"}, "time": 1}, {"progress": 2}]
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--partitions", "2",
                         "--input", _lines(tmp_path / "schema.jsonl", *good[:2], {"row": {"k": "x", "v": "c"}, "time": 1}))
    assert code == 2
    _one_error(err, "error: EncodeError: expected a row matching the schema on line 3, found ")
    assert "'x'" in err or "k" in err, err
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--partitions", "2",
                         "--input", _lines(tmp_path / "field.jsonl", {"row": {"k": 1, "v": "a", "colour": "red"}, "time": 1}))
    assert code == 2
    _one_error(err, "error: EncodeError: expected fields among ['k', 'v'] on line 1, found ['colour']")
    assert topic_progress(env.service.kafka, topic) is None

    # The corrected file lands once; the bad one again changes nothing.
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--partitions", "2",
                         "--input", _lines(tmp_path / "good.jsonl", *good))
    assert code == 0, err
    assert json.loads(out) == {"topic": topic, "partitions": 2, "updates": 2, "progress": 2, "frontier": 2}
    bad_late = _lines(tmp_path / "bad2.jsonl", {"row": {"k": 5, "v": "e"}, "time": 3}, "not json")
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input", bad_late)
    assert code == 2 and "line 2" in err and "nothing was produced" in err, err
    msgs = _topic_messages(stack, topic, 2, expected=4)
    assert sorted((m.time, m.diff) for m in msgs if isinstance(m, DesiredUpdate)) == [(0, 1), (1, 1)]
    assert sorted((m.partition, m.frontier.time) for m in msgs if isinstance(m, DesiredProgress)) == [(0, 2), (1, 2)]

    # stdin is read twice too (spooled): a bad last line sends nothing.
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"row": {"k": 9, "v": "z"}, "time": 5}) + "\n{}\n"))
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema)
    assert code == 2 and "on line 2" in err, err
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"row": {"k": 9, "v": "z"}, "time": 5}) + "\n"))
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--advance-to", "6")
    assert code == 0 and json.loads(out)["updates"] == 1, err
    msgs = _topic_messages(stack, topic, 2, expected=7)
    assert sorted((m.time, m.diff) for m in msgs if isinstance(m, DesiredUpdate)) == [(0, 1), (1, 1), (5, 1)]


def test_produce_refuses_times_below_the_progress_of_the_topic(
    env: ControllerSettings, stack: EmbeddedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = _schema_file(tmp_path)
    topic = f"surface-late-{uuid.uuid4().hex[:8]}"
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--partitions", "3",
                         "--input", _lines(tmp_path / "a.jsonl", {"row": {"k": 1, "v": "a"}, "time": 1}, {"progress": 2}))
    assert code == 0, err
    # Another run (another process: what it has seen is on the topic) with a time below 2.
    late = _lines(tmp_path / "late.jsonl", {"row": {"k": 2, "v": "b"}, "time": 3}, {"row": {"k": 3, "v": "c"}, "time": 1})
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input", late)
    assert (code, out) == (2, "")
    assert err == (f"error: ContractViolationError: expected update times at or beyond the progress of topic "
                   f"{topic!r} 2, found time 1 on line 2; nothing was produced to {topic!r}\n")
    # Progress going backwards, in the input or by --advance-to.
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema,
                         "--input", _lines(tmp_path / "back.jsonl", {"progress": 1}))
    assert code == 2 and "found 1 on line 1" in err and err.count("\n") == 1, err
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema,
                         "--input", _lines(tmp_path / "empty.jsonl"), "--advance-to", "1")
    assert code == 2 and err.startswith("error: ContractViolationError: expected --advance-to at or beyond"), err
    # A time below a progress line of the same input.
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input",
                         _lines(tmp_path / "self.jsonl", {"progress": 5}, {"row": {"k": 4, "v": "d"}, "time": 4}))
    assert code == 2 and "progress of topic" in err and "5, found time 4 on line 2" in err, err
    msgs = _topic_messages(stack, topic, 3, expected=4)
    assert [(m.time, m.diff) for m in msgs if isinstance(m, DesiredUpdate)] == [(1, 1)]
    assert sorted(m.frontier.time for m in msgs if isinstance(m, DesiredProgress)) == [2, 2, 2]
    # At the progress itself, and after closing: closed refuses every time.
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--advance-to", "closed",
                         "--input", _lines(tmp_path / "at.jsonl", {"row": {"k": 2, "v": "b"}, "time": 2}))
    assert code == 0 and json.loads(out)["frontier"] is None, err
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input",
                         _lines(tmp_path / "after.jsonl", {"row": {"k": 2, "v": "b"}, "time": 99}))
    assert code == 2 and "progress of topic" in err and "closed, found time 99" in err, err


def test_produce_to_a_missing_topic_and_from_a_missing_file_is_one_line(
    env: ControllerSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = _schema_file(tmp_path)
    topic = f"surface-missing-{uuid.uuid4().hex[:8]}"
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema,
                         "--input", _lines(tmp_path / "a.jsonl", {"progress": 1}))
    assert code == 2
    assert err == (f"error: UnknownTopicError: expected topic {topic!r} to exist, found none "
                   f"(give --partitions N to create it)\n")
    missing = str(tmp_path / "nope.jsonl")
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input", missing, "--partitions", "1")
    assert err == f"error: InvalidUsageError: expected a readable input file {missing!r}, found no such file or directory\n"
    assert code == 2
