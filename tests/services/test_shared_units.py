"""How the shared write query packs its units of work into tasks (services/write/shared_source.py):
every unit once, few tasks for many small units, a task per heavy unit so one busy sink's
writer partitions run side by side, and none for no work; how the driver handles the units'
rows (replays, one flush); and how a unit's report goes out from its executor as it ends."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from services.write.shared_source import DESCRIPTION_WEIGHT, WriteUnit, pack_units
from shared.spark.kafka_source import KafkaInputPartition

if TYPE_CHECKING:
    import pyarrow as pa


def unit(key: str, wp: int, records: int, descs: int = 0) -> WriteUnit:
    rng = KafkaInputPartition("t", wp, 100, 100 + records) if records else None
    return WriteUnit(key, wp, None, rng, [(0, i, b"d") for i in range(descs)], [])  # type: ignore[arg-type]


def placed(tasks: list) -> Counter:
    return Counter((u.key, u.wp) for t in tasks for u in t.units)


def test_no_work_no_task() -> None:
    assert pack_units([], 10_000, 2) == []


def test_a_hundred_small_sinks_take_as_many_tasks_as_cores() -> None:
    units = [unit(f"s{k}", wp, 25) for k in range(100) for wp in range(2)]
    tasks = pack_units(units, 10_000, 2)
    assert len(tasks) == 2
    assert placed(tasks) == Counter((u.key, u.wp) for u in units)  # each unit exactly once
    assert abs(sum(u.weight for u in tasks[0].units) - sum(u.weight for u in tasks[1].units)) <= 26


def test_one_busy_sink_spreads_its_writer_partitions_over_the_cores() -> None:
    units = [unit("busy", wp, 20_000) for wp in range(4)]
    assert sorted(len(t.units) for t in pack_units(units, 10_000, 4)) == [1, 1, 1, 1]
    tasks = pack_units(units, 10_000, 2)
    assert sorted(len(t.units) for t in tasks) == [2, 2]
    assert placed(tasks) == Counter((u.key, u.wp) for u in units)


def test_descriptions_weigh_as_reads_and_spread_over_at_most_one_task_per_core() -> None:
    units = [unit(f"s{k}", 0, 0, descs=1) for k in range(6)]
    tasks = pack_units(units, DESCRIPTION_WEIGHT, 8)
    assert len(tasks) == 6  # each description is a task's worth of work here
    assert placed(tasks) == Counter((u.key, u.wp) for u in units)
    tasks = pack_units(units, DESCRIPTION_WEIGHT, 2)
    assert [len(t.units) for t in tasks] == [3, 3]  # a micro-batch is one round of tasks
    assert placed(tasks) == Counter((u.key, u.wp) for u in units)
    many = [unit(f"s{k}", wp, 0, descs=1) for k in range(100) for wp in range(2)]
    assert len(pack_units(many, DESCRIPTION_WEIGHT, 2)) == 2


def test_a_sinks_writer_partitions_share_a_task_unless_they_outweigh_its_share() -> None:
    """Small sinks keep their writer partitions in one task (one thread runs them one after
    the other: the second reads no shard head again); a sink heavier than a task's share
    spreads its partitions."""
    many = [unit(f"s{k}", wp, 10, descs=1) for k in range(100) for wp in range(2)]
    tasks = pack_units(many, DESCRIPTION_WEIGHT, 8)
    assert len(tasks) == 8
    for t in tasks:
        keys = Counter(u.key for u in t.units)
        assert set(keys.values()) == {2}  # both partitions of each of its sinks
    assert placed(tasks) == Counter((u.key, u.wp) for u in many)
    heavy = [unit("busy", wp, 20_000) for wp in range(2)] + [unit(f"s{k}", wp, 10) for k in range(4) for wp in range(2)]
    tasks = pack_units(heavy, 10_000, 2)
    assert sum(1 for t in tasks if any(u.key == "busy" for u in t.units)) == 2  # its partitions apart


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

        self.flushes = 0

    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))

    def flush(self, timeout_s: float = 30.0) -> None:
        self.flushes += 1


class _Fleet:
    def __init__(self, members: dict, members_file: str) -> None:
        self._m = members
        self.members_file = members_file

    def members(self) -> dict:
        return dict(self._m)


def _rows(key: str, wp: int, kind: str, body: str) -> "pa.Table":
    import pyarrow as pa

    from services.write.shared_source import SHARED_OUTPUT_SCHEMA

    return pa.Table.from_pylist([{"sink": key, "wp": wp, "kind": kind, "body": body}], schema=SHARED_OUTPUT_SCHEMA)


def test_a_failed_unit_is_replayed_until_it_succeeds_then_the_replay_file_forgets_it(tmp_path, monkeypatch) -> None:
    import json

    from services.runtime.settings import ServiceSettings
    from services.write import shared as shared_write
    from services.write.driver import SinkWriter
    from services.write.shared_source import read_replay
    from shared.catalog import SinkDef

    monkeypatch.setattr(shared_write, "count_sink_failure", lambda *a, **k: 1)
    settings = ServiceSettings.from_env_and_args(None, {"SHARDSINK_QUARANTINE_AFTER": "0"})
    sink = SinkDef("s1", "d1", "c1", epoch=3)
    key = "s1@3"
    fleet = _Fleet({key: sink}, str(tmp_path / "members.json"))
    producer = _Producer()
    registry = {"s1": SinkWriter(sink=sink, settings=settings, partitions=2, producer=producer)}  # type: ignore[arg-type]
    app = shared_write.SharedWrite(settings, fleet, registry, producer)  # type: ignore[arg-type]

    failure = {"error": "RuntimeError: boom", "trace": "", "from": 40, "end": 55, "descs": [[0, 7, "ZA=="]]}
    app.handle(_rows(key, 1, "fail", json.dumps(failure)))
    assert read_replay(app.replay_file) == {key: {"1": {"from": 40, "descs": [[0, 7, "ZA=="]]}}}
    assert app.failing == {key: {1: (1, "RuntimeError: boom")}}

    app.handle(_rows(key, 1, "fail", json.dumps({**failure, "end": 60})))  # fails again: still held
    assert read_replay(app.replay_file)[key]["1"]["from"] == 40 and app.failing[key][1][0] == 2

    app.handle(_rows(key, 0, "fail", json.dumps({**failure, "from": 12, "end": 30})))  # its other partition too
    assert sorted(read_replay(app.replay_file)[key]) == ["0", "1"]

    stats = {"desired_updates": 3, "decode_errors": 0, "contract_violations": 0, "buffer_updates": 0, "buffer_bytes": 0}
    app.handle(_rows(key, 1, "stats", json.dumps(stats)))  # one replayed unit succeeded: never replayed again
    assert read_replay(app.replay_file) == {key: {"0": {"from": 12, "descs": [[0, 7, "ZA=="]]}}}
    assert list(app.failing[key]) == [0]
    app.handle(_rows(key, 0, "stats", json.dumps(stats)))
    assert read_replay(app.replay_file) == {}
    assert app.failing == {}


def test_a_micro_batch_flushes_the_shared_producer_once_for_every_sink(tmp_path, monkeypatch) -> None:
    """The reports of every sink in a micro-batch go out on one flush (a flush waits for the
    broker's acknowledgements: one per sink cost about 150 ms a micro-batch at 100 sinks)."""
    import json

    import pyarrow as pa

    from services.runtime.settings import ServiceSettings
    from services.write import shared as shared_write
    from shared.catalog import SinkDef
    from shared.io import kafka_admin

    monkeypatch.setattr(kafka_admin, "topic_partition_count", lambda *a, **k: 2)
    monkeypatch.setattr(shared_write, "sink_quarantine", lambda *a, **k: [])
    settings = ServiceSettings.from_env_and_args(None, {})
    members = {f"s{i}@1": SinkDef(f"s{i}", f"d{i}", f"c{i}", epoch=1) for i in range(3)}
    producer = _Producer()
    app = shared_write.SharedWrite(settings, _Fleet(members, str(tmp_path / "members.json")), {}, producer)  # type: ignore[arg-type]
    stats = json.dumps({"desired_updates": 3, "decode_errors": 0, "contract_violations": 0, "buffer_updates": 0,
                        "buffer_bytes": 0})
    app.handle(pa.concat_tables([_rows(k, wp, "stats", stats) for k in members for wp in range(2)]))
    assert producer.flushes == 1
    assert sorted(app.registry) == ["s0", "s1", "s2"] and all(not w.flush_each for w in app.registry.values())
    assert all(w.stats[1]["desired_updates"] == 3 for w in app.registry.values())


def test_a_failed_unit_leaves_no_version_of_its_micro_batch_that_an_earlier_attempt_wrote(tmp_path, monkeypatch) -> None:
    """A micro-batch whose driver step failed (a flush) runs again with the same id; a unit that
    succeeded in the first attempt saved that version. If the unit fails in the second attempt,
    the version goes: the replay of its input at the next micro-batch starts from the version
    before the batch (with the first attempt's version it absorbed the input twice: updates
    below a progress statement it had already seen, as error rows; chaos --quick, 2026-11-26)."""
    import json
    from types import SimpleNamespace

    from services.write import shared_source as wss
    from shared.catalog import SinkDef
    from shared.spark.state_files import WriterStateFiles

    files = WriterStateFiles(str(tmp_path))
    files.save(0, 6, b"before the batch", {"v": 6})
    files.save(0, 7, b"first attempt of batch 7", {"v": 7})
    files.save(1, 7, b"the other partition's", {"v": 7})

    def fail(*a, **k):
        raise RuntimeError("injected timeout after the PUT landed")

    from services.write import executor

    monkeypatch.setattr(executor, "run_write_step", fail)  # the unit imports it when it runs
    schema = json.dumps({"type": "record", "name": "R", "fields": [{"name": "k", "type": "long"}]})
    job = SimpleNamespace(sink=SinkDef("s", "d", "c", epoch=1), schema_json=schema, partitions=2, descs_topic="descs",
                          checkpoint=str(tmp_path), settings=SimpleNamespace(s3=None))
    u = wss.WriteUnit("s@1", 0, job, None, [], [])  # type: ignore[arg-type]
    reader = object.__new__(wss.WriteFleetReader)
    [row] = [r for b in reader._run_unit(u, 7, []) for r in b.to_pylist()]
    assert row["kind"] == "fail" and "injected timeout" in json.loads(row["body"])["error"]
    assert files.versions(0) == [6] and files.versions(1) == [7]  # the other partition's stands
    assert files.load(0, 8, lambda data: data) == (6, b"before the batch")


def _report_rows(sink_id: str, partitions: int = 2) -> "pa.RecordBatch":
    """A unit's output: its report (nothing staged) and its statistics (OUTPUT_SCHEMA)."""
    import json

    import pyarrow as pa

    from services.write.job import OUTPUT_SCHEMA
    from shared.sink_messages import BatchReport

    report = BatchReport(sink_id, "tok-1", 1, 0, 5, 1, partitions, written_at_ms=1234)
    return pa.RecordBatch.from_pylist([
        {"wp": 1, "kind": "report", "body": json.dumps(report.to_dict())},
        {"wp": 1, "kind": "stats", "body": json.dumps({"desired_updates": 3, "decode_errors": 0, "contract_violations": 0,
                                                       "buffer_updates": 0, "buffer_bytes": 0})},
    ], schema=OUTPUT_SCHEMA)


def test_a_unit_s_report_is_produced_by_its_executor_as_the_unit_ends(stack) -> None:
    """The report goes out from the unit's thread (the sink's append does not wait for the
    micro-batch's other units); the row tells the driver it went, so the driver produces it
    no second time."""
    import uuid
    from types import SimpleNamespace

    from services.runtime.settings import ServiceSettings
    from services.write import shared_source as wss
    from shared.catalog import SinkDef
    from shared.codec import message_codec
    from shared.io.kafka_admin import ensure_topic
    from shared.sink_messages import BatchReport
    from shared.spark.kafka_source import read_range

    batches = f"batches-{uuid.uuid4().hex[:8]}"
    settings = ServiceSettings.from_env_and_args(None, {**stack.env(), "SHARDSINK_TOPIC_BATCHES": batches})
    ensure_topic(settings.kafka, batches, 1)
    job = SimpleNamespace(sink=SinkDef("s7", "d7", "c7", epoch=1), settings=settings)
    out = wss._produce_reports(job, _report_rows("s7"))  # type: ignore[arg-type]
    assert out.column(1).to_pylist() == [wss.REPORTED, "stats"]
    assert out.column(2).to_pylist() == _report_rows("s7").column(2).to_pylist()  # the driver's metrics read it
    got = [v for b in read_range(settings.kafka, batches, 0, 0, 1, values_only=True) for v in b.column("value").to_pylist()]
    assert len(got) == 1
    sent = BatchReport.from_dict(message_codec("written_batch").decode(got[0]))
    assert sent == BatchReport("s7", "tok-1", 1, 0, 5, 1, 2, written_at_ms=1234)


def test_a_report_the_executor_cannot_deliver_is_left_to_the_driver(monkeypatch) -> None:
    """No broker answers: within its delivery budget the row stays a ``report``, which the
    driver produces before the micro-batch commits (as every report was before)."""
    from types import SimpleNamespace

    from services.runtime.settings import ServiceSettings
    from services.write import shared_source as wss
    from shared.catalog import SinkDef

    monkeypatch.setattr(wss, "REPORT_DELIVERY_S", 1.0)
    settings = ServiceSettings.from_env_and_args(None, {"SHARDSINK_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    job = SimpleNamespace(sink=SinkDef("s8", "d8", "c8", epoch=1), settings=settings)
    rows = _report_rows("s8")
    assert wss._produce_reports(job, rows).column(1).to_pylist() == ["report", "stats"]  # type: ignore[arg-type]


def test_a_unit_s_thread_does_not_wait_for_its_report_the_task_settles_every_delivery_once(monkeypatch) -> None:
    """A unit's reports are produced as it ends and its thread goes on (to its next unit): the
    delivery is awaited once for the task's units, at the task's end. No broker answers here,
    so the delivery is still pending when the unit's output comes back, and the settled row
    stays a ``report`` for the driver, with the sink's key."""
    from types import SimpleNamespace

    from services.runtime.settings import ServiceSettings
    from services.write import shared_source as wss
    from shared.catalog import SinkDef

    monkeypatch.setattr(wss, "REPORT_DELIVERY_S", 1.0)
    settings = ServiceSettings.from_env_and_args(None, {"SHARDSINK_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    job = SimpleNamespace(sink=SinkDef("s9", "d9", "c9", epoch=1), settings=settings)
    out = wss._send_reports(job, _report_rows("s9"), "s9@1")  # type: ignore[arg-type]
    [pending] = [d for d in out.deliveries if d is not None]
    assert not pending.done.is_set()  # produced, not awaited
    settled = out.settled()
    assert settled.column("kind").to_pylist() == ["report", "stats"]
    assert settled.column("sink").to_pylist() == ["s9@1", "s9@1"]
    assert not pending.ok


def test_settling_serves_a_delivery_past_its_deadline_that_the_broker_acknowledged(stack) -> None:
    """A task's first reports may be past their deadline by the task's end: their callbacks are
    served before the deadline counts, so an acknowledged report is not left to the driver (a
    second copy)."""
    import time
    import uuid

    from services.sinkio import ControlProducer
    from shared.io.kafka import KafkaSettings, OffsetProbe
    from shared.io.kafka_admin import ensure_topic

    kafka = KafkaSettings(stack.bootstrap_servers)
    topic = f"settle-{uuid.uuid4().hex[:8]}"
    ensure_topic(kafka, topic, 1)
    producer = ControlProducer.create(kafka, "settle-test")
    d = producer.send_tracked(topic, b"report", b"k", timeout_s=0.0)
    assert d is not None
    probe = OffsetProbe(kafka)
    deadline = time.monotonic() + 60
    while probe.end_offsets(topic).get(0, 0) < 1:
        assert time.monotonic() < deadline, "the record never reached the broker"
        time.sleep(0.05)
    assert not d.done.is_set()  # nobody served the callback yet
    producer.settle([d])
    assert d.ok


def test_the_driver_counts_a_report_its_executor_produced_and_does_not_send_it_again() -> None:
    import pyarrow as pa

    from services.runtime.settings import ServiceSettings
    from services.write.driver import SinkWriter
    from services.write.shared_source import REPORTED
    from shared.catalog import SinkDef

    producer = _Producer()
    w = SinkWriter(sink=SinkDef("s9", "d9", "c9", epoch=1), settings=ServiceSettings.from_env_and_args(None, {}),
                   partitions=2, producer=producer)  # type: ignore[arg-type]
    rows = pa.Table.from_batches([_report_rows("s9")])
    reported = rows.set_column(1, "kind", pa.array([REPORTED, "stats"], pa.string()))
    w.handle(reported)
    assert producer.sent == [] and w.metrics.reports_sent == 1
    w.handle(rows)  # a report the executor could not deliver: the driver produces it
    assert [t for t, _ in producer.sent] == [w.settings.batches_topic] and w.metrics.reports_sent == 2
