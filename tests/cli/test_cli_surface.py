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

from services.controller.service import Controller, ControllerSettings
from shared.desired import DesiredProgress, DesiredUpdate, decode_desired
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient
from shared.io.kafka import new_consumer
from tests.controller_fixture import SCHEMA, client_for, controller_settings

ROOT = Path(__file__).resolve().parents[2]


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
    from services.runtime.settings import ServiceSettings

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
    # An int field carrying 2**31 (Avro's varint could hold it; the field's range cannot).
    ints = _schema_file(tmp_path, {"type": "record", "name": "Ints", "fields": [{"name": "n", "type": "int"}]})
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", ints, "--partitions", "2",
                         "--input", _lines(tmp_path / "int.jsonl", {"row": {"n": 1}, "time": 0}, {"row": {"n": 2**31}, "time": 0}))
    assert (code, out) == (2, "")
    assert err == ("error: EncodeError: expected a row matching the schema on line 2, found a value that does not fit: "
                   "expected an int in [-2**31, 2**31) at Ints.n, found 2147483648 (out of range); nothing was produced "
                   f"to {topic!r}\n"), err
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


def test_produce_failing_half_way_says_what_may_have_landed(
    env: ControllerSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The input was checked whole; a broker that fails the sending half way is one line that
    says how much may be on the topic (re-running would send it again)."""
    from shared.errors import KafkaDeliveryError
    from shared.io.desired_producer import DesiredProducer

    topic = f"surface-half-{uuid.uuid4().hex[:8]}"
    real_flush = DesiredProducer.flush
    flushes: list[int] = []

    def failing_flush(self: DesiredProducer) -> None:
        flushes.append(1)
        if len(flushes) == 2:  # the first progress line's promise (advance_to flushes before and after it)
            raise KafkaDeliveryError("expected the records delivered, found broker down")
        real_flush(self)

    monkeypatch.setattr(DesiredProducer, "flush", failing_flush)
    data = _lines(tmp_path / "half.jsonl", {"row": {"k": 1, "v": "a"}, "time": 0}, {"progress": 1},
                  {"row": {"k": 2, "v": "b"}, "time": 1}, {"row": {"k": 3, "v": "c"}, "time": 2}, {"progress": 3})
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", _schema_file(tmp_path), "--partitions", "1",
                         "--input", data)
    assert (code, out) == (2, "")
    assert err == ("error: KafkaDeliveryError: expected the records delivered, found broker down; up to 1 of the "
                   f"input's 3 updates and 1 progress statements may be on {topic!r}: the sink counts each update "
                   "as often as it lands\n"), err


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


# ==================================================================================================
# 1: append is all or nothing, also for an input of several staged chunks
# ==================================================================================================
def _data_objects(cs: ControllerSettings, cid: str) -> list[str]:
    from shared.shard import Shard

    return sorted(k for k in Shard.open(cs.service.store(), cid).list_objects() if "/data/" in k)


def _contents(cs: ControllerSettings, cid: str) -> tuple[Any, list[tuple[Any, ...]]]:
    """The collection's upper and its consolidated rows at upper - 1 (if readable)."""
    from shared.shard import Shard

    shard = Shard.open(cs.service.store(), cid)
    st = shard.refresh()
    if st.upper.time in (None, 0):
        return st.upper.time, []
    snap = shard.snapshot(st.upper.time - 1)
    return st.upper.time, sorted(zip(snap["k"].to_pylist(), snap["v"].to_pylist(), snap["_diff"].to_pylist(), strict=True))


def test_an_append_of_several_chunks_lands_whole_or_not_at_all(
    env: ControllerSettings, ctl: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shared.shard import Shard
    from tests.controller_fixture import append_body, ok

    _, client, cs = ctl
    cid = f"whole{uuid.uuid4().hex[:6]}"
    assert run(capsys, "collection", "create", cid, "--schema", _schema_file(tmp_path))[0] == 0
    ok(client.call("Append", append_body(cid, [({"k": 0, "v": "seed"}, 0, 1)], 1)))
    before = _contents(env, cid)
    objects = _data_objects(env, cid)
    # 10 updates at times 2..6 with a progress line in the middle, in chunks of 3: 4 staged objects.
    lines = [{"row": {"k": i, "v": f"v{i}"}, "time": 2 + i // 2} for i in range(6)] + [{"progress": 5}]
    lines += [{"row": {"k": i, "v": f"v{i}"}, "time": 2 + i // 2} for i in range(6, 10)]
    data = _lines(tmp_path / "ten.jsonl", *lines)
    argv = ["append", cid, "--input", data, "--chunk-rows", "3", "--advance-to", "9"]

    # Interrupted while staging the third chunk: exit 130, nothing appended, nothing left.
    real_stage = Shard.stage
    calls: list[int] = []

    def interrupted(self: Shard, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_stage(self, *a, **kw)

    monkeypatch.setattr(Shard, "stage", interrupted)
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (130, "", f"interrupted; nothing was appended to {cid!r}\n")
    assert (_contents(env, cid), _data_objects(env, cid)) == (before, objects)

    # Another writer moves the upper (1 -> 2) after the check, while the chunks are staged: the
    # one command is refused as a whole, and the staged objects go.
    calls.clear()

    def raced(self: Shard, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            ok(client.call("Append", append_body(cid, [({"k": 99, "v": "other"}, 1, 1)], 2)))
        return real_stage(self, *a, **kw)

    monkeypatch.setattr(Shard, "stage", raced)
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    _one_error(err, "error: UpperMismatchError: ")
    assert err.endswith(f"; nothing was appended to {cid!r}\n"), err
    raced_state = _contents(env, cid)
    assert raced_state == (2, [(0, "seed", 1), (99, "other", 1)])
    left = set(_data_objects(env, cid)) - set(objects)
    assert len(left) == 1, left  # the other writer's one batch; none of the four staged objects

    # Unhindered: the input lands once, as one batch with the four objects, at the final upper.
    monkeypatch.setattr(Shard, "stage", real_stage)
    shard = Shard.open(env.service.store(), cid)
    batches = len(shard.refresh().batches)
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out) == {"collection": cid, "updates": 10, "appends": 1, "staged_parts": 4, "upper": 9}
    state = shard.refresh()
    assert len(state.batches) == batches + 1 and len(state.batches[-1].parts) == 4
    assert _contents(env, cid) == (9, sorted([(0, "seed", 1), (99, "other", 1)] + [(i, f"v{i}", 1) for i in range(10)]))
    # Run again: every time is now below the upper, refused before anything is staged.
    objects = _data_objects(env, cid)
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("error: ContractViolationError: ") and "nothing was appended" in err, err
    assert _data_objects(env, cid) == objects

    # A sink defined on the collection: the controller refuses the command; the staged objects go.
    assert run(capsys, "sink", "create", f"{cid}-sink", "--topic", f"{cid}-desired", "--collection", cid,
               "--replace-contents")[0] == 0
    more = _lines(tmp_path / "more.jsonl", *[{"row": {"k": 20 + i, "v": "x"}, "time": 9} for i in range(7)])
    code, out, err = run(capsys, "append", cid, "--input", more, "--chunk-rows", "3")
    assert (code, out) == (2, "")
    _one_error(err, "error: InvalidUsageError: expected no sink on collection")
    assert err.endswith("; nothing was appended\n") and err.count("nothing was appended") == 1, err
    assert (_contents(env, cid)[0], _data_objects(env, cid)) == (9, objects)


def test_the_controller_checks_the_data_objects_an_append_names(
    env: ControllerSettings, ctl: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """What a client staged is checked before anything references it: under the shard's
    data/, not yet in the shard, present, in the part schema, without error rows."""
    import pyarrow as pa

    from shared.shard import Shard
    from tests.controller_fixture import error_kind_of, ok

    _, client, cs = ctl
    cid = f"staged{uuid.uuid4().hex[:6]}"
    assert run(capsys, "collection", "create", cid, "--schema", _schema_file(tmp_path))[0] == 0
    shard = Shard.open(cs.service.store(), cid)
    good = shard.stage([({"k": 1, "v": "a"}, 0, 1), ({"k": 2, "v": "b"}, 1, 1)])
    errs = shard.stage([(None, 0, 1, "a bad update")])
    wrong = f"{shard.prefix}data/wrong.parquet"
    import io as _io

    import pyarrow.parquet as pq

    buf = _io.BytesIO()
    pq.write_table(pa.table({"k": pa.array(["x"]), "_time": pa.array([0], pa.uint64())}), buf)
    cs.service.store().put(wrong, buf.getvalue())

    def append(keys: list[str], new_upper: int = 2) -> dict[str, Any]:
        return client.call("Append", {"collection_id": cid, "updates": [], "expected_upper": 0,
                                      "new_upper": new_upper, "staged_parts": keys})

    cases = [
        (["shards/elsewhere/data/x.parquet"], "InvalidUsage", "expected staged data objects under"),
        ([f"{shard.prefix}data/missing.parquet"], "InvalidUsage", "found none (never staged"),
        ([good.parts[0].key, good.parts[0].key], "InvalidUsage", "expected distinct staged data objects"),
        ([errs.parts[0].key], "InvalidUsage", "no error rows"),
        ([wrong], "SchemaError", "expected the part schema"),
    ]
    for keys, kind, text in cases:
        r = append(keys)
        assert error_kind_of(r) == kind and text in r["body"][1]["message"], r
    r = append([good.parts[0].key], new_upper=1)  # a time (1) at the new upper
    assert error_kind_of(r) == "InvalidUsage", r
    assert shard.refresh().upper.time == 0
    ok(append([good.parts[0].key]))
    st = shard.refresh()
    assert st.upper.time == 2 and [p.key for b in st.batches for p in b.parts] == [good.parts[0].key]
    r = client.call("Append", {"collection_id": cid, "updates": [], "expected_upper": 2, "new_upper": 3,
                               "staged_parts": [good.parts[0].key]})  # appended already
    assert error_kind_of(r) == "InvalidUsage" and "no batch holds yet" in r["body"][1]["message"], r
    assert shard.refresh().upper.time == 2


def test_a_schema_without_an_exact_mapping_is_refused_at_create_whichever_way(
    env: ControllerSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A type that cannot flow through the sink exactly (here a decimal without a precision,
    or a record with no field inside an array) is refused at ``collection create`` with the
    same typed line through the controller and through the catalog, and nothing is created."""
    from shared.catalog import Catalog
    from shared.shard import Shard

    cases = [
        ({"name": "a", "type": {"type": "bytes", "logicalType": "decimal"}},
         "error: SchemaError: expected a decimal"),
        ({"name": "a", "type": {"type": "array", "items": {"type": "record", "name": "E", "fields": []}}},
         "error: SchemaError: expected a record with at least one field at R.a[], found record 'E'"),
    ]
    for field, prefix in cases:
        schema = _schema_file(tmp_path, {"type": "record", "name": "R", "fields": [field]})
        lines = set()
        for via in ("controller", "catalog"):
            cid = f"inexact{uuid.uuid4().hex[:6]}"
            code, out, err = run(capsys, "collection", "create", cid, "--schema", schema, "--via", via)
            assert (code, out) == (2, ""), (via, err)
            _one_error(err, prefix)
            lines.add(err.replace(cid, "<id>"))
            assert cid not in Catalog(env.service.store()).state().collections
            assert Shard(env.service.store(), cid).list_objects() == []  # no shard either
        assert len(lines) == 1, lines  # the same line whichever way


# ==================================================================================================
# 5: make up on busy ports
# ==================================================================================================
def test_up_refuses_a_busy_port_in_one_line_and_prints_no_environment(stack: EmbeddedStack) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = run_process(["up", "--kafka-port", str(port), "--s3-port", "0"], {}, timeout_s=60)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == (f"error: EmbeddedStackError: expected port {port} (Kafka) free on 127.0.0.1, found it in "
                        f"use; choose another with --kafka-port N (make up ARGS='--kafka-port N')\n")
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VPY) -m shared.devstack $(ARGS)" in makefile
    assert "make up ARGS='--kafka-port" in (ROOT / "README.md").read_text()


def test_embedded_stack_reports_the_cpu_its_servers_use(stack: EmbeddedStack, s3_client: Any) -> None:
    """What bench-controller's compaction_cpu_s adds up: the S3 server's CPU grows with the
    requests it serves, each server's only goes up, and a stopped stack reports none."""
    before = stack.cpu_seconds()
    assert set(before) == {"s3", "kafka"} and all(v >= 0 for v in before.values()), before
    key = f"cpu-{uuid.uuid4().hex}"
    s3_client.put_object(Bucket=stack.bucket, Key=key, Body=os.urandom(1 << 20))
    after = before
    for _ in range(200):  # the kernel counts CPU in clock ticks (10 ms): serve until one passes
        s3_client.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
        after = stack.cpu_seconds()
        if after["s3"] > before["s3"]:
            break
    s3_client.delete_object(Bucket=stack.bucket, Key=key)
    assert after["s3"] > before["s3"] and after["kafka"] >= before["kafka"], (before, after)
    assert EmbeddedStack().cpu_seconds() == {}


# ==================================================================================================
# 6: reading commands create nothing; a missing catalog, bucket or endpoint is one line
# ==================================================================================================
def _broker_topics(stack: EmbeddedStack) -> list[str]:
    from confluent_kafka.admin import AdminClient

    return list(AdminClient({"bootstrap.servers": stack.bootstrap_servers}).list_topics(timeout=10).topics)


def test_reading_commands_never_create_a_catalog_or_a_bucket(
    env: ControllerSettings, stack: EmbeddedStack, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = f"typo-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("SHARDSINK_S3_PREFIX", prefix)
    topics_before = set(_broker_topics(stack))
    empty = _lines(tmp_path / "empty.jsonl", {"progress": 3})
    for argv in (["status"], ["collection", "list"], ["sink", "list"], ["peek", "orders"], ["tail", "orders"],
                 ["append", "orders", "--input", empty]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), (argv, err)
        assert err == (f"error: CatalogNotFoundError: expected a catalog at s3://shardsink/{prefix}/catalog/, "
                       "found none (nothing was created; check --bucket and --s3-prefix)\n"), (argv, err)
    assert s3_client.list_objects_v2(Bucket="shardsink", Prefix=prefix).get("KeyCount", 0) == 0
    assert set(_broker_topics(stack)) == topics_before  # no tail topic, no controller topics
    # A mistyped bucket: one line, and the bucket is not created.
    code, out, err = run(capsys, "status", "--bucket", "no-such-bucket")
    assert (code, out) == (2, "")
    assert err == f"error: ObjectStoreError: expected bucket 'no-such-bucket' at {os.environ['SHARDSINK_S3_ENDPOINT']}, found no such bucket\n"
    assert "no-such-bucket" not in [b["Name"] for b in s3_client.list_buckets()["Buckets"]]
    # An endpoint nobody serves: one line naming it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, out, err = run(capsys, "collection", "list", "--s3-endpoint", dead)
    assert code == 2
    assert err.startswith(f"error: ObjectStoreError: expected bucket 'shardsink' at {dead}, found it unreachable"), err
    assert err.count("\n") == 1


def test_a_command_without_a_controller_is_one_line_at_once_and_sends_or_creates_nothing(
    env: ControllerSettings, stack: EmbeddedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """peek, tail, append and the controller's catalog commands need a controller: with none
    serving the catalog (collections made with --via catalog), or none on the topics given,
    each says so in one line before sending anything, and leaves no topic behind. The same
    commands through either path (--via) print the same fields."""
    prefix = f"noctl-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("SHARDSINK_S3_PREFIX", prefix)
    schema = _schema_file(tmp_path)
    code, out, err = run(capsys, "collection", "create", "c", "--schema", schema, "--since", "2")  # auto: the catalog
    assert (code, json.loads(out)) == (0, {"created": "c", "since": 2, "upper": 2}), err
    code, out, err = run(capsys, "sink", "create", "c-sink", "--topic", "c-desired", "--collection", "c", "--read-only")
    assert (code, json.loads(out)) == (0, {"created": "c-sink", "as_of": 2}), err  # the collection's upper
    code, out, err = run(capsys, "sink", "allow-writes", "c-sink")
    assert (code, json.loads(out)) == (0, {"allowed_writes": ["c-sink"]}), err
    code, out, err = run(capsys, "collection", "alter", "c", "--read-policy", "valid-from:3")
    assert (code, json.loads(out)) == (0, {"altered": "c", "read_policy": {"kind": "valid_from", "frontier": 3},
                                           "since": 2}), err
    topics_before = set(_broker_topics(stack))
    data = _lines(tmp_path / "a.jsonl", {"row": {"k": 1, "v": "a"}, "time": 5})
    expected = ("error: ControllerNotFoundError: expected a controller serving the catalog at "
                f"s3://shardsink/{prefix}/catalog/, found none has claimed it (start one: python -m services.controller); "
                "nothing was sent\n")
    for argv in (["peek", "c"], ["tail", "c"], ["append", "c", "--input", data],
                 ["collection", "create", "d", "--schema", schema, "--via", "controller"]):
        started = time.monotonic()
        code, out, err = run(capsys, *argv)
        assert (code, out, err) == (2, "", expected), argv
        assert time.monotonic() - started < 20, argv  # no wait for an answer that cannot come
    assert set(_broker_topics(stack)) == topics_before
    # status needs Kafka only for the lag: with no broker it shows the rest at once, and says so.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("SHARDSINK_KAFKA_BOOTSTRAP", dead)
    started = time.monotonic()
    code, out, err = run(capsys, "status", "--output", "json")
    assert time.monotonic() - started < 15  # not librdkafka's 30 s timeout
    unreachable = (f"expected a Kafka broker at {dead}, found none reachable (connection refused); check "
                   "--bootstrap or SHARDSINK_KAFKA_BOOTSTRAP")
    assert (code, json.loads(out)) == (0, {"collection": "c", "upper": 2, "since": 2, "lag": None, "batches": 0,
                                           "rows": 0, "errors": 0, "bytes": 0, "sinks": ["c-sink"],
                                           "lag_unknown": unreachable}), err
    code, out, err = run(capsys, "status")
    assert (code, err) == (0, f"warning: no lag shown: {unreachable}\n")
    monkeypatch.setenv("SHARDSINK_KAFKA_BOOTSTRAP", stack.env()["SHARDSINK_KAFKA_BOOTSTRAP"])
    # The controller's own catalog, but topics no controller serves: named, nothing created.
    monkeypatch.setenv("SHARDSINK_S3_PREFIX", env.service.s3.prefix)
    monkeypatch.setenv("SHARDSINK_TOPIC_COMMANDS", "nobody-commands")
    code, out, err = run(capsys, "peek", "c")
    assert (code, out) == (2, "")
    assert err == ("error: ControllerNotFoundError: expected the controller's topics 'nobody-commands' and "
                   f"{env.responses_topic!r}, found no 'nobody-commands' (is the controller running on "
                   "'nobody-commands'? check --commands-topic and --responses-topic); nothing was sent\n"), err
    assert set(_broker_topics(stack)) == topics_before


# ==================================================================================================
# 7, 10, 12: tail deletes its topic; one vocabulary; peek order and timestamps round-trip
# ==================================================================================================
TS_SCHEMA = {"type": "record", "name": "Stamped", "fields": [
    {"name": "k", "type": "long"}, {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "price", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}],
     "default": None},
    {"name": "blob", "type": ["null", "bytes"], "default": None},
    {"name": "tag", "type": {"type": "fixed", "name": "Tag", "size": 2}, "default": "ab"},
]}


def _tail_topics(stack: EmbeddedStack, collection_id: str) -> list[str]:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    return [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"shardsink-tail-{collection_id}-")]


def test_tail_deletes_its_topic_and_printed_values_produce_back(
    env: ControllerSettings, stack: EmbeddedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cid = f"stamped{uuid.uuid4().hex[:6]}"
    schema = _schema_file(tmp_path, TS_SCHEMA)
    assert run(capsys, "collection", "create", cid, "--schema", schema, "--via", "controller")[0] == 0
    # bytes and fixed as Avro's JSON encoding has them: one code point 0-255 per byte
    rows = [{"k": 2, "at": "2024-05-01 12:00:00+00:00", "price": "12.50", "blob": "\u0000\u00ff\\x", "tag": "\u00e9\u0001"},
            {"k": 1, "at": "2024-05-01T12:00:01Z", "tag": "zz"}, {"k": 3, "at": "2024-05-01 12:00:02", "tag": "ab"}]
    code, out, err = run(capsys, "append", cid, "--advance-to", "2",
                         "--input", _lines(tmp_path / "a.jsonl", *[{"row": r, "time": 0} for r in rows]))
    assert code == 0, err
    # peek: row order, so --limit keeps the same rows, and says how many there are.
    code, out, err = run(capsys, "peek", cid, "--limit", "2", "--output", "csv")
    assert code == 0, err
    assert [line.split(",")[0] for line in out.splitlines()] == ["k", "1", "2"]
    assert err == f"2 of 3 rows of {cid} as of 1\n"
    # tail until --up-to: its fresh topic is deleted at the end (after the controller's last
    # message), and the controller goes on serving (its producer had the topic cached).
    code, out, err = run(capsys, "tail", cid, "--as-of", "0", "--up-to", "1")
    assert (code, err) == (0, ""), err
    printed = [json.loads(line.split("\t")[2]) for line in out.splitlines()]
    assert sorted(r["k"] for r in printed) == [1, 2, 3]
    assert _tail_topics(stack, cid) == []
    time.sleep(2)  # a metadata refresh of the controller's producer later: still gone
    assert _tail_topics(stack, cid) == []
    code, out, err = run(capsys, "tail", cid, "--as-of", "0", "--up-to", "1")
    assert code == 0 and len(out.splitlines()) == 3 and _tail_topics(stack, cid) == [], err
    # A topic of the user's own (--topic) is left as it is.
    own = f"own-{cid}"
    code, out, err = run(capsys, "tail", cid, "--as-of", "0", "--up-to", "1", "--topic", own)
    assert (code, err) == (0, "") and len(out.splitlines()) == 3, err
    assert own in _broker_topics(stack)
    # What tail printed is accepted by produce for the same schema, and means the same values.
    topic = f"surface-ts-{uuid.uuid4().hex[:8]}"
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--partitions", "1",
                         "--input", _lines(tmp_path / "back.jsonl", *[{"row": r, "time": 5} for r in printed]))
    assert code == 0, err
    from shared.codec import RowCodec

    codec = RowCodec(TS_SCHEMA)
    got = sorted(tuple(codec.decode(m.row)[f] for f in ("k", "at", "price", "blob", "tag"))
                 for m in _topic_messages(stack, topic, 1, expected=3) if isinstance(m, DesiredUpdate))
    import datetime as dt
    from decimal import Decimal

    base = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    assert got == [(1, base + dt.timedelta(seconds=1), None, None, b"zz"),
                   (2, base, Decimal("12.50"), b"\x00\xff\\x", b"\xe9\x01"),
                   (3, base + dt.timedelta(seconds=2), None, None, b"ab")]
    # A timestamp that does not parse: the line, nothing sent.
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", schema, "--input",
                         _lines(tmp_path / "badts.jsonl", {"row": {"k": 9, "at": "yesterday"}, "time": 6}))
    assert code == 2 and "on line 1" in err and "nothing was produced" in err and err.count("\n") == 1, err
    # The same failure through either --via prints the same kind.
    for via in ("controller", "catalog"):
        code, out, err = run(capsys, "sink", "drop", f"nope-{via}", "--via", via)
        assert code == 2
        _one_error(err, "error: UnknownIdError: ")
    # A failed tail (unknown collection) leaves no topic either.
    code, out, err = run(capsys, "tail", f"{cid}x", "--as-of", "0")
    assert code == 2 and err.startswith("error: UnknownIdError: ") and err.count("\n") == 1, err
    assert _tail_topics(stack, f"{cid}x") == []


def test_a_subscribe_whose_output_topic_was_deleted_ends_and_the_topic_stays_gone(
    env: ControllerSettings, ctl: Any, stack: EmbeddedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from confluent_kafka.admin import AdminClient

    from shared.catalog import Catalog
    from shared.controller_state import ControllerSection
    from tests.controller_fixture import append_body, ok

    _, client, cs = ctl
    cid = f"gone{uuid.uuid4().hex[:6]}"
    assert run(capsys, "collection", "create", cid, "--schema", _schema_file(tmp_path))[0] == 0
    ok(client.call("Append", append_body(cid, [({"k": 1, "v": "a"}, 0, 1)], 1)))
    topic = f"sub-out-{cid}"
    sid = ok(client.call("Subscribe", {"collection_id": cid, "output_topic": topic, "as_of": 0, "up_to": None,
                                       "with_snapshot": True}))["command_id"]

    def sub() -> dict[str, Any]:
        return ControllerSection.from_extra(Catalog(cs.service.store()).state().extra).subs[sid]

    deadline = time.monotonic() + 30
    while sub().get("progress") is None:  # its first step is on the topic
        assert time.monotonic() < deadline
        time.sleep(0.1)
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    admin.delete_topics([topic], operation_timeout=10)[topic].result(10)
    ok(client.call("Append", append_body(cid, [({"k": 2, "v": "b"}, 1, 1)], 2)))  # a step to write
    while sub().get("state") != "done":
        assert time.monotonic() < deadline, sub()
        time.sleep(0.1)
    time.sleep(1.5)
    assert topic not in _broker_topics(stack)
    assert run(capsys, "peek", cid, "--as-of", "1")[0] == 0  # the controller goes on


# ==================================================================================================
# 11: --help
# ==================================================================================================
def _commands(parser: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))
    if prefix:
        yield prefix, parser


def test_help_is_per_command_with_help_on_every_flag_and_client_flags_only(capsys: pytest.CaptureFixture[str]) -> None:
    module, _ = _entry_point()
    parser = importlib.import_module(module).build_parser()
    commands = dict(_commands(parser))
    assert {("produce",), ("append",), ("peek",), ("tail",), ("status",), ("up",), ("collection", "create"),
            ("sink", "list")} <= set(commands)
    descriptions = {}
    for name, sub in commands.items():
        text = sub.format_help()
        for flag in ("--master", "--trigger-ms", "--checkpoint-dir", "--grace-ms", "--sink ", "--catalog-poll-ms",
                     "--descs-topic"):
            assert flag not in text, (name, flag)
        assert "``" not in text and "::" not in text and ":class:" not in text, name
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.dest)
        if sub.description:
            descriptions[name] = sub.description
    # Each leaf command has its own description.
    leaves = [n for n, s in commands.items() if not any(isinstance(a, __import__("argparse")._SubParsersAction)
                                                        for a in s._actions)]
    assert len({descriptions.get(n) for n in leaves}) == len(leaves), descriptions
    # A bad value is one line, not the usage.
    code, out, err = run(capsys, "peek", "orders", "--limit", "many")
    assert (code, out) == (2, "")
    assert err == "error: InvalidUsageError: argument --limit: invalid int value: 'many' (see shardsink peek --help)\n"


# ==================================================================================================
# 9: an unreachable broker is one line naming the address
# ==================================================================================================
def test_an_unreachable_broker_is_one_line_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    schema = _schema_file(tmp_path)
    data = _lines(tmp_path / "a.jsonl", {"row": {"k": 1, "v": "a"}, "time": 0}, {"progress": 1})
    env = {"SHARDSINK_KAFKA_BOOTSTRAP": address}
    for argv in (["produce", "--topic", "t", "--schema", schema, "--input", data], ["peek", "orders"],
                 ["tail", "orders"]):
        p = run_process(argv, env, timeout_s=120)
        assert (p.returncode, p.stdout) == (2, ""), (argv, p.stderr)
        assert p.stderr == (f"error: KafkaUnavailableError: expected a Kafka broker at {address}, found none "
                            "reachable (connection refused); check --bootstrap or SHARDSINK_KAFKA_BOOTSTRAP\n"), argv
