"""The ``shardsink`` CLI end to end against the embedded stack, with a controller running in
this process: create, append, produce (JSON lines and CSV), peek (table, CSV, Parquet),
tail (a live subscribe, and Ctrl-C cancelling it), status, drop, and the error paths (one
line on stderr, exit code 2)."""

from __future__ import annotations

import _thread
import csv
import io
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from confluent_kafka import TopicPartition

from services.controller.service import Controller, ControllerSettings
from shared.catalog import Catalog
from shardsink.cli.main import main
from shardsink.cli.util import ProgressBar
from shared.codec import RowCodec
from shared.controller_state import ControllerSection
from shared.desired import DesiredProgress, DesiredUpdate, decode_desired
from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import ControllerClient
from shared.io.kafka import new_consumer
from shared.shard import Shard
from tests.controller_fixture import SCHEMA, Model, append_body, client_for, controller_settings, ok


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
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _schema_file(tmp_path: Path) -> str:
    p = tmp_path / "row.avsc"
    p.write_text(json.dumps(SCHEMA))
    return str(p)


def _jsonl(path: Path, updates: list[tuple[dict[str, Any], int, int]], progress: list[int]) -> str:
    """Updates in time order, a progress line after the updates below each progress time."""
    lines = []
    pending = sorted(updates, key=lambda u: u[1])
    for p in progress:
        lines += [json.dumps({"row": r, "time": t, "diff": d}) for r, t, d in pending if t < p]
        pending = [u for u in pending if u[1] >= p]
        lines.append(json.dumps({"progress": p}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _table_rows(out: str) -> Counter[tuple[Any, ...]]:
    """The (k, v) -> count of a peek's table output."""
    lines = out.strip().splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    assert header == ["k", "v", "count"], lines[0]
    got: Counter[tuple[Any, ...]] = Counter()
    for line in lines[2:]:
        k, v, c = (x.strip() for x in line.split("|"))
        got[(int(k), v)] += int(c)
    return got


def _tail_lines(out: str) -> tuple[list[tuple[int, tuple[Any, ...], int]], list[str]]:
    changes, progress = [], []
    for line in out.splitlines():
        cols = line.split("\t")
        if cols[0] == "progress":
            progress.append(cols[1])
        else:
            t, d, row = int(cols[0]), int(cols[1]), json.loads(cols[2])
            changes.append((t, (row["k"], row["v"]), d))
    return changes, progress


def _wait(pred: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_cli_end_to_end_create_append_peek_tail_status_drop(
    env: ControllerSettings, ctl: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, client, cs = ctl
    schema = _schema_file(tmp_path)
    code, out, err = run(capsys, "collection", "create", "cli1", "--schema", schema, "--via", "controller")
    assert (code, json.loads(out)) == (0, {"created": "cli1", "since": 0, "upper": 0}), err
    # The collection exists in the catalog and as a shard.
    assert Catalog(cs.service.store()).state().collection("cli1").schema["name"] == "Row"

    # Table writes from JSON lines: three steps, with retractions.
    model = Model()
    ups = [({"k": i, "v": f"v{i}"}, i % 4, 1) for i in range(12)]
    ups += [({"k": 0, "v": "v0"}, 2, -1), ({"k": 5, "v": "v5"}, 3, -1), ({"k": 100, "v": "x"}, 3, 2)]
    model.add(ups)
    code, out, err = run(capsys, "append", "cli1", "--input", _jsonl(tmp_path / "u.jsonl", ups, [2, 4]),
                         "--chunk-rows", "4")
    assert code == 0, err
    summary = json.loads(out)
    # More updates than --chunk-rows: staged in data objects of 4 updates, appended by one command.
    assert summary == {"collection": "cli1", "updates": len(ups), "appends": 1, "staged_parts": 4, "upper": 4}, summary
    assert len(Shard(cs.service.store(), "cli1").refresh().batches) == 1

    # Peek as a table, for every readable time.
    for as_of in range(4):
        code, out, err = run(capsys, "peek", "cli1", "--as-of", str(as_of))
        assert code == 0, err
        assert _table_rows(out) == model.at(as_of), (as_of, out)
        assert f"as of {as_of}" in err
    # --limit, CSV to a file, and Parquet through the S3 object path (--max-inline-bytes 0).
    code, out, err = run(capsys, "peek", "cli1", "--as-of", "3", "--limit", "2")
    assert code == 0 and len(out.strip().splitlines()) == 2 + 2, out
    f = tmp_path / "peek.csv"
    code, out, err = run(capsys, "peek", "cli1", "--as-of", "3", "--output", "csv", "--file", str(f))
    assert code == 0 and out == "", err
    rows = list(csv.DictReader(io.StringIO(f.read_text())))
    assert Counter({(int(r["k"]), r["v"]): int(r["count"]) for r in rows}) == model.at(3)
    f = tmp_path / "peek.parquet"
    code, out, err = run(capsys, "peek", "cli1", "--as-of", "2", "--output", "parquet", "--file", str(f),
                         "--max-inline-bytes", "0")
    assert code == 0, err
    table = pq.read_table(f)
    assert Counter({(r["k"], r["v"]): r["count"] for r in table.to_pylist()}) == model.at(2)
    # The same Parquet schema when the answer came inline, and the Python snapshot's nullability
    # (its `_diff` is peek's `count`).
    f2 = tmp_path / "peek-inline.parquet"
    code, out, err = run(capsys, "peek", "cli1", "--as-of", "2", "--output", "parquet", "--file", str(f2))
    assert code == 0, err
    inline = pq.read_table(f2)
    assert inline.schema == table.schema and inline.equals(table), (inline.schema, table.schema)
    snap = Shard(cs.service.store(), "cli1").snapshot(2).select(["k", "v", "_diff"])
    assert [(fl.type, fl.nullable) for fl in table.schema] == [(fl.type, fl.nullable) for fl in snap.schema]

    # Tail a live subscribe: it starts while the upper is 4 and ends at up-to 8, after more
    # appends (sent while it runs).
    result: dict[str, Any] = {}

    def tail() -> None:
        result["code"] = main(["tail", "cli1", "--as-of", "1", "--up-to", "8", "--progress"])

    capsys.readouterr()
    th = threading.Thread(target=tail)
    th.start()
    more = [({"k": 200 + i, "v": "late"}, 4 + i % 5, 1) for i in range(10)] + [({"k": 1, "v": "v1"}, 6, -1)]
    model.add(more)
    for t in range(4, 9):
        step = [u for u in more if u[1] == t]
        ok(client.call("Append", append_body("cli1", step, t + 1)))
    th.join(120)
    assert not th.is_alive()
    out, err = capsys.readouterr()
    assert result["code"] == 0, err
    changes, progress = _tail_lines(out)
    assert sorted(changes) == model.subscribe(1, 8)
    assert progress[-2:] == ["8", "closed"] and [int(p) for p in progress[:-1]] == sorted({int(p) for p in progress[:-1]})

    # Status: upper, since, lag (no sink: '-'), batches, rows, bytes.
    def expected() -> dict[str, Any]:
        shard = Shard(cs.service.store(), "cli1").refresh()
        return {"collection": "cli1", "upper": 9, "since": 0, "lag": None, "batches": len(shard.batches),
                "rows": shard.total_rows(), "errors": 0, "bytes": shard.total_bytes(), "sinks": []}

    before = expected()
    code, out, err = run(capsys, "status", "--output", "json")
    assert code == 0, err
    st = {json.loads(line)["collection"]: json.loads(line) for line in out.splitlines()}["cli1"]
    assert st in (before, expected())  # the controller may compact in between
    code, out, err = run(capsys, "status")
    assert code == 0 and out.splitlines()[0].split()[0] == "collection"
    assert any(line.split("|")[0].strip() == "cli1" and line.split("|")[1].strip() == "9" for line in out.splitlines())

    # Alter the read policy, drop; then the collection is gone for every command.
    code, out, err = run(capsys, "collection", "alter", "cli1", "--read-policy", "lag:2")
    assert code == 0, err
    _wait(lambda: Shard(cs.service.store(), "cli1").refresh().since.time == 6)  # 9 - 2, down to a multiple of 2
    code, out, err = run(capsys, "collection", "drop", "cli1")
    assert (code, json.loads(out)) == (0, {"dropped": "cli1", "sinks_dropped": []}), err
    code, out, err = run(capsys, "peek", "cli1", "--as-of", "8")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: UnknownIdError: "), err


def test_cli_sinks_via_controller_and_catalog(env: ControllerSettings, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    schema = _schema_file(tmp_path)
    assert run(capsys, "collection", "create", "cli2", "--schema", schema, "--read-policy", "lag:10")[0] == 0
    code, out, err = run(capsys, "sink", "create", "cli2-sink", "--topic", "cli2-desired", "--collection", "cli2",
                         "--read-only")
    assert (code, json.loads(out)) == (0, {"created": "cli2-sink", "as_of": 0}), err
    catalog = Catalog(env.service.store())
    assert catalog.state().sink("cli2-sink").read_only
    assert run(capsys, "sink", "allow-writes", "cli2-sink")[0] == 0
    assert not catalog.state().sink("cli2-sink").read_only
    code, out, err = run(capsys, "sink", "list")
    assert code == 0 and "cli2-sink" in out
    code, out, err = run(capsys, "status", "--output", "json")
    st = {json.loads(line)["collection"]: json.loads(line) for line in out.splitlines()}["cli2"]
    assert st["sinks"] == ["cli2-sink"] and st["lag"] is None  # the desired topic has no progress yet
    # Once the producer has advanced the desired topic to 7, the lag is 7 - upper (0).
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out, err = run(capsys, "produce", "--topic", "cli2-desired", "--schema", schema, "--input", str(empty),
                         "--partitions", "2", "--advance-to", "7")
    assert code == 0, err
    code, out, err = run(capsys, "status", "--output", "json")
    st = {json.loads(line)["collection"]: json.loads(line) for line in out.splitlines()}["cli2"]
    assert (st["upper"], st["lag"]) == (0, 7), st
    assert run(capsys, "sink", "drop", "cli2-sink")[0] == 0
    assert "cli2-sink" not in [s.sink_id for s in catalog.state().live_sinks()]
    # The same through the catalog directly.
    assert run(capsys, "sink", "create", "cli2-direct", "--topic", "t", "--collection", "cli2", "--via", "catalog")[0] == 0
    assert run(capsys, "sink", "drop", "cli2-direct", "--via", "catalog")[0] == 0
    code, out, err = run(capsys, "sink", "drop", "cli2-direct")
    assert code == 2 and err.startswith("error: UnknownIdError: ") and err.count("\n") == 1, err
    # Collections through the catalog directly: create (with a policy), alter, drop.
    assert run(capsys, "collection", "create", "cli2c", "--schema", schema, "--since", "4", "--read-policy",
               "lag:5", "--via", "catalog")[0] == 0
    assert catalog.state().collection("cli2c").read_policy == {"kind": "lag_writes_by", "lag": 5, "granularity": None}
    assert Shard(env.service.store(), "cli2c").refresh().since.time == 4
    assert run(capsys, "collection", "alter", "cli2c", "--read-policy", "valid-from:7,valid-from:4", "--via", "catalog")[0] == 0
    assert catalog.state().collection("cli2c").read_policy["kind"] == "multiple"
    # A policy below the since is refused there too, as the controller refuses it (a lag
    # policy on this empty collection implies 0), and the policy is left unchanged.
    code, out, err = run(capsys, "collection", "alter", "cli2c", "--read-policy", "valid-from:4,lag:9:3", "--via", "catalog")
    assert code == 2 and err.startswith("error: SinceViolationError: ") and err.count("\n") == 1, err
    code, out, err = run(capsys, "collection", "alter", "cli2c", "--read-policy", "valid-from:2", "--via", "catalog")
    assert code == 2 and err.startswith("error: SinceViolationError: ") and err.count("\n") == 1, err
    assert catalog.state().collection("cli2c").read_policy["kind"] == "multiple"
    code, out, _ = run(capsys, "collection", "alter", "cli2c", "--read-policy", "valid-from:6", "--via", "catalog")
    assert code == 0 and json.loads(out)["since"] == 4, out
    assert catalog.state().collection("cli2c").read_policy == {"kind": "valid_from", "frontier": 6}
    assert run(capsys, "sink", "create", "cli2c-a", "--topic", "t", "--collection", "cli2c", "--via", "catalog")[0] == 0
    code, out, err = run(capsys, "collection", "drop", "cli2c", "--via", "catalog")
    assert (code, json.loads(out)) == (0, {"dropped": "cli2c", "sinks_dropped": ["cli2c-a"]}), err
    assert "sink(s) cli2c-a" in err
    assert catalog.state().collections["cli2c"].dropped and Shard(env.service.store(), "cli2c").refresh().dropped
    assert catalog.state().sinks["cli2c-a"].dropped
    code, out, err = run(capsys, "collection", "list")
    assert code == 0 and "cli2c" not in out and '"collection": "cli2"' in out
    # Through the controller, the sinks that went with the collection are named too.
    assert run(capsys, "sink", "create", "cli2-b", "--topic", "t2", "--collection", "cli2")[0] == 0
    assert run(capsys, "sink", "create", "cli2-a", "--topic", "t3", "--collection", "cli2", "--read-only")[0] == 0
    code, out, err = run(capsys, "collection", "drop", "cli2")
    assert (code, json.loads(out)) == (0, {"dropped": "cli2", "sinks_dropped": ["cli2-a", "cli2-b"]}), err


def test_cli_produce_csv_and_jsonl_to_the_desired_topic(env: ControllerSettings, stack: EmbeddedStack, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], unique_id: str) -> None:
    schema = {"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "long"}, {"name": "total", "type": "double"}, {"name": "paid", "type": "boolean"},
        {"name": "note", "type": ["null", "string"], "default": None},
    ]}
    sf = tmp_path / "order.avsc"
    sf.write_text(json.dumps(schema))
    data = tmp_path / "orders.csv"
    data.write_text("id,total,paid,note,ts,d\n1,9.5,true,,3,1\n2,10,false,hello,4,1\n1,9.5,true,,5,-1\n")
    topic = f"cli-desired-{unique_id}"
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", str(sf), "--input", str(data),
                         "--format", "csv", "--time-column", "ts", "--diff-column", "d", "--advance-to", "6",
                         "--partitions", "2")
    assert code == 0, err
    assert json.loads(out) == {"topic": topic, "partitions": 2, "updates": 3, "progress": 2, "frontier": 6}
    codec = RowCodec(schema)
    got = _read_desired(stack, topic, 2, expected=5)
    updates = sorted((codec.decode(m.row)["id"], codec.decode(m.row)["note"], codec.decode(m.row)["total"],
                      codec.decode(m.row)["paid"], m.time, m.diff) for m in got if isinstance(m, DesiredUpdate))
    assert updates == [(1, None, 9.5, True, 3, 1), (1, None, 9.5, True, 5, -1), (2, "hello", 10.0, False, 4, 1)]
    assert sorted((m.partition, m.frontier.time) for m in got if isinstance(m, DesiredProgress)) == [(0, 6), (1, 6)]
    # A bad cell: one line, exit 2, nothing more.
    bad = tmp_path / "bad.csv"
    bad.write_text("id,total,paid,time\n1,x,true,3\n")
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", str(sf), "--input", str(bad), "--format", "csv")
    assert code == 2 and err.count("\n") == 1 and "column 'total' on line 2" in err, err
    bad.write_text("id,colour,time\n1,red,3\n")
    code, out, err = run(capsys, "produce", "--topic", topic, "--schema", str(sf), "--input", str(bad), "--format", "csv")
    assert code == 2 and "colour" in err and err.count("\n") == 1, err


def _read_desired(stack: EmbeddedStack, topic: str, partitions: int, expected: int) -> list[Any]:
    from services.runtime.settings import ServiceSettings

    c = new_consumer(ServiceSettings.from_env_and_args(None, stack.env()).kafka, **{"auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while len(out) < expected and time.monotonic() < deadline:
            for m in c.consume(num_messages=100, timeout=0.1):
                if m.error() is None:
                    out.append(decode_desired(m.value()))
    finally:
        c.close()
    return out


def test_cli_csv_append_and_tail_cancelled_by_ctrl_c(env: ControllerSettings, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    schema = _schema_file(tmp_path)
    assert run(capsys, "collection", "create", "cli3", "--schema", schema)[0] == 0  # --via auto: the controller
    data = tmp_path / "rows.csv"
    data.write_text("k,v,time\n1,a,0\n2,b,1\n3,\"c,d\",1\n")
    code, out, err = run(capsys, "append", "cli3", "--format", "csv", "--input", str(data), "--advance-to", "3")
    assert code == 0 and json.loads(out)["upper"] == 3, err
    code, out, err = run(capsys, "peek", "cli3", "--output", "csv")  # as of the latest readable time (2)
    assert code == 0 and err.startswith("3 rows of cli3 as of 2")
    assert list(csv.reader(io.StringIO(out))) == [["k", "v", "count"], ["1", "a", "1"], ["2", "b", "1"], ["3", "c,d", "1"]]

    # A tail without --up-to runs until Ctrl-C, which cancels the subscribe (exit 130).
    store = env.service.store()

    def subscribe_running() -> bool:
        subs = ControllerSection.from_extra(Catalog(store).state().extra).subs
        return any(s["collection_id"] == "cli3" and s.get("progress") is not None for s in subs.values())

    seen: list[str] = []

    def printed_snapshot() -> bool:
        seen.append(capsys.readouterr().out)
        return "".join(seen).count("\n") >= 3

    def interrupt() -> None:
        _wait(subscribe_running)
        _wait(printed_snapshot)
        _thread.interrupt_main()

    capsys.readouterr()
    th = threading.Thread(target=interrupt, daemon=True)
    th.start()
    code = main(["tail", "cli3", "--as-of", "0"])
    th.join(10)
    rest = capsys.readouterr()
    out, err = "".join(seen) + rest.out, rest.err
    assert code == 130, err
    assert sorted(_tail_lines(out)[0]) == [(0, (1, "a"), 1), (1, (2, "b"), 1), (1, (3, "c,d"), 1)]
    assert "cancelled subscribe" in err and "left on the broker" not in err, err
    # Its fresh topic went once the controller had ended the subscribe.
    from confluent_kafka.admin import AdminClient

    topics = AdminClient({"bootstrap.servers": env.service.kafka.bootstrap}).list_topics(timeout=10).topics
    assert not [t for t in topics if t.startswith("shardsink-tail-cli3-")], list(topics)

    def cancelled() -> bool:
        subs = ControllerSection.from_extra(Catalog(store).state().extra).subs
        return all(s.get("state") == "done" for s in subs.values() if s["collection_id"] == "cli3")

    _wait(cancelled)


def test_cli_error_paths_are_one_line_and_exit_2(env: ControllerSettings, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    schema = _schema_file(tmp_path)
    cases: list[tuple[list[str], str]] = [
        (["peek", "nope", "--as-of", "0"], "error: UnknownIdError: "),
        (["tail", "nope", "--as-of", "0"], "error: UnknownIdError: "),
        (["collection", "drop", "nope"], "error: UnknownIdError: "),
        (["collection", "alter", "nope", "--read-policy", "lag:5"], "error: UnknownIdError: "),
        (["collection", "create", "x", "--schema", str(tmp_path / "missing.avsc")], "error: SchemaError: "),
        (["collection", "create", "a/b", "--schema", schema], "error: InvalidUsageError: "),
        (["collection", "create", "x", "--schema", schema, "--read-policy", "soon"], "error: InvalidUsageError: "),
        (["peek", "nope", "--output", "parquet"], "error: InvalidUsageError: "),
        (["append", "nope", "--input", str(tmp_path / "missing.jsonl")], "error: UnknownIdError: "),
    ]
    for argv, prefix in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "", (argv, out, err)
        assert err.startswith(prefix) and err.count("\n") == 1, (argv, err)
    # Creating an id again with another definition.
    assert run(capsys, "collection", "create", "cli4", "--schema", schema)[0] == 0
    code, out, err = run(capsys, "collection", "create", "cli4", "--schema", schema, "--since", "3")
    assert code == 2 and err.startswith("error: IdReuseError: "), err
    # Peek below since.
    assert run(capsys, "collection", "alter", "cli4", "--read-policy", "valid-from:2")[0] == 0
    code, out, err = run(capsys, "append", "cli4", "--advance-to", "5", "--input", _jsonl(tmp_path / "e.jsonl", [], []))
    assert code == 0, err
    _wait(lambda: Shard(env.service.store(), "cli4").refresh().since.time == 2)
    code, out, err = run(capsys, "peek", "cli4", "--as-of", "1")
    assert code == 2 and err.startswith("error: SinceViolationError: ") and err.count("\n") == 1, err
    # No controller on these topics: a clear timeout, not a hang.
    monkeypatch.setenv("SHARDSINK_TOPIC_COMMANDS", f"{env.commands_topic}-nobody")
    code, out, err = run(capsys, "peek", "cli4", "--as-of", "3", "--timeout", "1")
    assert code == 2 and err.count("\n") == 1 and "is the controller running" in err, err


def test_error_rows_show_in_tail_subscribe_status_and_snapshot(env: ControllerSettings, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An error row (an update the sink could not write as a row) is visible wherever a user
    reads: ``tail`` prints it as an ``error`` line, the Python subscribe yields it as an
    ``ErrorRow``, ``status`` counts it and warns, ``snapshot(include_errors=True)`` holds it."""
    from shardsink import ErrorRow, Progress, open_collection

    schema = _schema_file(tmp_path)
    assert run(capsys, "collection", "create", "cli-err", "--schema", schema)[0] == 0
    shard = Shard(env.service.store(), "cli-err")
    reason = "update at desired-x/0@41 (time 1, diff 1): expected an int, found 2147483648: row {\"k\": 2147483648}"
    shard.compare_and_append([({"k": 1, "v": "a"}, 0, 1), (None, 1, 1, reason), ({"k": 2, "v": "b"}, 1, 1)], 0, 2)

    code, out, err = run(capsys, "tail", "cli-err", "--as-of", "0", "--up-to", "2", "--progress")
    assert code == 0, err
    lines = out.splitlines()
    assert [line for line in lines if not line.startswith("progress\t")] == [
        '0\t1\t{"k": 1, "v": "a"}', '1\t1\t{"k": 2, "v": "b"}', f"error\t1\t1\t{reason}"], lines
    assert lines[-2:] == ["progress\t2", "progress\tclosed"], lines  # up-to reached: the end

    with open_collection("cli-err", env.service.store()).subscribe(as_of=0, up_to=2) as sub:
        events = list(sub)
    assert [e for e in events if isinstance(e, ErrorRow)] == [ErrorRow(1, 1, reason)]
    assert events[-1] == Progress(2)

    code, out, err = run(capsys, "status", "--output", "json")
    st = {json.loads(line)["collection"]: json.loads(line) for line in out.splitlines()}["cli-err"]
    assert code == 0 and st["errors"] == 1 and st["rows"] == 3, st
    code, out, err = run(capsys, "status")
    assert code == 0 and "warning: cli-err holds 1 error rows" in err, err
    snap = open_collection("cli-err", env.service.store()).snapshot(1, include_errors=True)
    assert snap["_error"].to_pylist().count(reason) == 1
    assert run(capsys, "collection", "drop", "cli-err")[0] == 0


def test_progress_bar_draws_on_request_only() -> None:
    quiet = io.StringIO()
    with ProgressBar("x", 10, stream=quiet) as bar:  # not a terminal: silent
        bar.update(5)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with ProgressBar("append", 10, stream=loud, force=True, interval_s=0) as bar:
        for _ in range(10):
            bar.update()
    text = loud.getvalue()
    assert text.endswith("\n") and "append [" in text and "10/10 rows" in text.splitlines()[-1].split("\r")[-1]


def test_kafka_secrets_from_mounted_files(tmp_path: Path) -> None:
    from shared.errors import KafkaConfigError
    from shared.io.kafka import KafkaSettings, env_options

    pw = tmp_path / "password"
    pw.write_text("s3cret\n")
    env = {
        "SHARDSINK_KAFKA_BOOTSTRAP": "broker:9093",
        "SHARDSINK_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SHARDSINK_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "SHARDSINK_KAFKA_SASL_USERNAME": "app",
        "SHARDSINK_KAFKA_SASL_PASSWORD_FILE": str(pw),
        "SHARDSINK_KAFKA_SSL_CA_LOCATION": "/ca.pem",
    }
    assert env_options(env) == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                "sasl.username": "app", "sasl.password": "s3cret", "ssl.ca.location": "/ca.pem"}
    conf = KafkaSettings.from_env(env).config()
    assert conf["sasl.password"] == "s3cret" and conf["bootstrap.servers"] == "broker:9093"
    # The direct variable wins over the file; an unreadable file is one clear error.
    assert env_options({**env, "SHARDSINK_KAFKA_SASL_PASSWORD": "direct"})["sasl.password"] == "direct"
    with pytest.raises(KafkaConfigError, match="SHARDSINK_KAFKA_SASL_PASSWORD_FILE"):
        env_options({**env, "SHARDSINK_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "missing")})
    assert "s3cret" not in repr(KafkaSettings.from_env(env)) and "sasl.username" in repr(KafkaSettings.from_env(env))
