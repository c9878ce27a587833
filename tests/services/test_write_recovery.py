"""Bounded recovery of the write service (issue 11, test 2), on the real broker, S3 server and
Spark, with mint, write and append as separate processes (the compose/Kubernetes mode).

The write service is SIGKILLed (its whole process group) after a history of N updates and
again after 10N, with the same live collection size (every step inserts as many rows as it
retracts once the collection is filled). The restarted writer resumes from its checkpoint:
the source's own offsets, as Spark logged them in the checkpoint (``offsets/<batch id>``),
show that no micro-batch after the restart starts below the offsets of the last batch
committed before the kill (a replay would start a new offsets log at 0), and the shard
equals the model. How long recovery takes is measured by ``make bench-sink``
(``recovery_history_ratio``), not asserted here.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shared.io.desired_producer import DesiredProducer
from shared.shard import Shard
from tests.services.test_sink_crash import (  # noqa: F401 - crash_setup is a fixture
    SCHEMA,
    START_TIMEOUT_S,
    UpperWatch,
    as_counter,
    crash_setup,
    diff_summary,
    nonzero,
)

LIVE = 300
PER_STEP = 200  # inserts and as many retractions once the collection is full
N = 2_000
WAIT_S = 300.0

Row = tuple[int, str]


class SteadyWork:
    """Inserts and retractions that keep the live collection at ``LIVE`` rows."""

    def __init__(self, producer: DesiredProducer, seed: int) -> None:
        self.producer = producer
        self.rng = random.Random(seed)
        self.sent: list[tuple[Row, int, int]] = []
        self.live: list[Row] = []
        self.next_key = 0
        self.frontier = 0

    def send(self, row: Row, t: int, d: int) -> None:
        self.producer.send({"k": row[0], "v": row[1]}, t, d)
        self.sent.append((row, t, d))

    def step(self) -> int:
        t = self.frontier
        for _ in range(PER_STEP if len(self.live) >= LIVE else LIVE):
            row = (self.next_key, f"v{self.rng.randrange(1000)}")
            self.next_key += 1
            self.send(row, t, 1)
            self.live.append(row)
        while len(self.live) > LIVE:
            self.send(self.live.pop(0), t, -1)
        self.frontier = t + 1
        self.producer.advance_to(self.frontier)
        return self.frontier

    def until(self, updates: int) -> int:
        while len(self.sent) < updates:
            self.step()
        self.producer.flush()
        return self.frontier

    def model(self, upper: int) -> Counter[Row]:
        out: Counter[Row] = Counter()
        for row, t, d in self.sent:
            if t < upper:
                out[row] += d
        return nonzero(out)


def offsets_log(checkpoint: Path) -> dict[int, dict[str, dict[str, int]]]:
    """The source's end offsets of every micro-batch Spark planned: ``{batch id: offsets}``."""
    out = {}
    for f in (checkpoint / "offsets").iterdir():
        if f.name.isdigit():
            lines = f.read_text().splitlines()
            out[int(f.name)] = json.loads(lines[2])  # v1, metadata, then our source's offsets
    return out


def write_query(settings: Any, sink_id: str, epoch: int, topic: str) -> tuple[Path, str]:
    """The write query's checkpoint and the key its offsets give the sink's desired topic: the
    sink's own query, or the shared query (``SHARDSINK_QUERIES=shared``: ``<sink>@<epoch>``)."""
    if settings.queries == "shared":
        return Path(settings.checkpoint_dir) / "write-shared" / "query-0of1", f"{sink_id}@{epoch}"
    return Path(settings.checkpoint_dir) / "write" / f"{sink_id}-e{epoch}", topic


def committed(checkpoint: Path) -> int:
    return max(int(f.name) for f in (checkpoint / "commits").iterdir() if f.name.isdigit())


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_killed_writer_resumes_from_its_checkpoint_after_short_and_long_histories(
    crash_setup: dict[str, Any],
) -> None:
    s = crash_setup["settings"]
    procs = crash_setup["procs"]
    sink_id, topic = crash_setup["sink_id"], crash_setup["topic"]
    shard = Shard.open(s.store(), crash_setup["collection"])
    epoch = s.catalog().state().sink(sink_id).epoch
    ckpt, key = write_query(s, sink_id, epoch, topic)
    work = SteadyWork(DesiredProducer(s.kafka, topic, SCHEMA), seed=5)
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.wait_started(START_TIMEOUT_S)
    watch = UpperWatch(shard).start()
    try:
        for history in (N, 10 * N):
            frontier = work.until(history)
            watch.wait_upper(frontier, WAIT_S, f"in step after {history} updates", list(procs.values()))
            write = procs["write"]
            write.kill()
            last = committed(ckpt)
            before = offsets_log(ckpt)
            resume_from = before[last][key]
            assert sum(resume_from.values()) >= history, (
                f"expected the checkpoint to reflect the {history} updates read, found {resume_from}"
            )
            write.start()
            write.wait_started(START_TIMEOUT_S)
            frontier = work.until(len(work.sent) + 2 * PER_STEP)
            watch.wait_upper(frontier, WAIT_S, f"in step after the kill at {history}", list(procs.values()))
            after = offsets_log(ckpt)
            assert set(before) <= set(after), "expected the offsets log to go on, not start over"
            for b in sorted(after):
                if b <= last:
                    assert after[b] == before[b], f"expected batch {b} unchanged by the restart"
                    continue
                start = after[b - 1][key]
                low = {p: o for p, o in start.items() if o < resume_from.get(p, 0)}
                assert not low, (
                    f"expected batch {b} after the restart to start at or above the checkpoint "
                    f"{resume_from}, found {start}"
                )
            upper = watch.upper()
            actual = as_counter(shard.snapshot(upper - 1))
            assert actual == work.model(upper), diff_summary(actual, work.model(upper))
            assert len(actual) == LIVE
    finally:
        watch.stop()
