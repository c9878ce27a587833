"""``services.runtime.warmup``: the services' start-up read that starts Spark's Python workers before
the queries need them, on the real Spark session."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from services.runtime.warmup import WARMUP_SOURCE, warm_up


def test_the_warm_up_read_runs_its_tasks_and_leaves_the_session_as_it_was(spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardsink.warmup")
    th = warm_up(spark, tasks=2)
    th.join(timeout=300)
    assert not th.is_alive()
    assert any("warmed up" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # Its tasks ran the write task's imports in the workers and returned one row each.
    rows = spark.read.format(WARMUP_SOURCE).option("tasks", "3").load().collect()
    assert sorted(r.task for r in rows) == [0, 1, 2]
    assert spark.range(3).count() == 3  # the session goes on as before
