"""How the shared write query packs its units of work into tasks (services/write/shared_source.py):
every unit once, few tasks for many small units, a task per heavy unit so one busy sink's
writer partitions run side by side, and none for no work."""

from __future__ import annotations

from collections import Counter

from services.write.shared_source import DESCRIPTION_WEIGHT, WriteUnit, pack_units
from shared.spark.kafka_source import KafkaInputPartition


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


def test_one_busy_sink_gets_a_task_per_writer_partition() -> None:
    units = [unit("busy", wp, 20_000) for wp in range(4)]
    tasks = pack_units(units, 10_000, 2)
    assert sorted(len(t.units) for t in tasks) == [1, 1, 1, 1]


def test_descriptions_weigh_as_reads_and_spread_over_at_most_four_tasks_per_core() -> None:
    units = [unit(f"s{k}", 0, 0, descs=1) for k in range(6)]
    tasks = pack_units(units, DESCRIPTION_WEIGHT, 2)
    assert len(tasks) == 6  # each description is a task's worth of work here
    assert placed(tasks) == Counter((u.key, u.wp) for u in units)
    many = [unit(f"s{k}", wp, 0, descs=1) for k in range(100) for wp in range(2)]
    assert len(pack_units(many, DESCRIPTION_WEIGHT, 2)) == 8
