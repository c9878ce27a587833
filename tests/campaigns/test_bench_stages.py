"""How ``bench/bench_sinks.py`` splits a step's freshness: the description that first reached the
step's progress statement (its ``minted_at_ms``), and the last of its writer partitions' reports
(``written_at_ms``, and when it was produced), read from the ``descs`` and ``batches`` topics of
the real broker."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_sinks  # noqa: E402

from services.runtime.settings import ServiceSettings  # noqa: E402
from services.sinkio import ControlProducer  # noqa: E402
from shared.codec import message_codec  # noqa: E402
from shared.frontier import Frontier  # noqa: E402
from shared.io.kafka_admin import ensure_topic  # noqa: E402
from shared.sink_messages import BatchDescription, BatchReport  # noqa: E402


def _until(pred: Any, budget_s: float = 60.0) -> bool:
    deadline = time.monotonic() + budget_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_steps_split_is_its_first_description_and_its_last_report(stack: Any, unique_id: str) -> None:
    settings = ServiceSettings.from_env_and_args(None, stack.env())
    descs_topic, batches_topic = f"descs-{unique_id}", f"batches-{unique_id}"
    for t in (descs_topic, batches_topic):
        ensure_topic(settings.kafka, t, 1)
    watch = bench_sinks.StageWatch(settings.kafka, descs_topic, batches_topic)
    producer = ControlProducer.create(settings.kafka, "bench-stages-test")
    dcodec, rcodec = message_codec("batch_description"), message_codec("written_batch")
    try:
        t0 = time.time()
        # Two descriptions of sink s: [0, 3) and [3, 9); another sink's in between.
        first = BatchDescription("s", Frontier.at(0), Frontier.at(3), 1, "tok-a", partition_count=2,
                                 minted_at_ms=int(t0 * 1000) + 100)
        other = BatchDescription("o", Frontier.at(0), Frontier.at(9), 1, "tok-o", minted_at_ms=int(t0 * 1000) + 150)
        second = BatchDescription("s", Frontier.at(3), Frontier.at(9), 1, "tok-b", partition_count=2,
                                  minted_at_ms=int(t0 * 1000) + 200)
        for d in (first, other, second):
            producer.send(descs_topic, dcodec.encode(d.to_dict()))
        # tok-b's writer partition 1 reports, then 0: its step is written when the later came.
        for d, wp, at in ((first, 0, 300), (first, 1, 400), (second, 1, 700), (other, 0, 800)):
            producer.send(batches_topic, rcodec.encode(BatchReport.for_description(d, wp, now_ms=int(t0 * 1000) + at).to_dict()))
        producer.flush()
        assert _until(lambda: watch.split("s", 2) is not None and watch.split("o", 9) is not None)
        skew = time.monotonic() - time.time()
        minted, written, produced = watch.split("s", 3) or (0.0, 0.0, 0.0)
        assert abs(minted - (t0 + 0.1 + skew)) < 0.05 and abs(written - (t0 + 0.4 + skew)) < 0.05
        assert t0 + skew - 0.05 <= produced <= time.monotonic() + 0.05  # produced in this test, after t0
        assert watch.split("s", 3) == watch.split("s", 1)  # the first description that reached it
        assert watch.split("s", 5) is None  # tok-b: one writer partition of two has reported
        assert watch.split("s", 10) is None  # no description reached it
        before = time.monotonic()
        producer.send(batches_topic, rcodec.encode(BatchReport.for_description(second, 0, now_ms=int(t0 * 1000) + 900).to_dict()))
        producer.flush()
        assert _until(lambda: watch.split("s", 9) is not None)
        minted, written, produced_last = watch.split("s", 9) or (0.0, 0.0, 0.0)
        assert abs(minted - (t0 + 0.2 + skew)) < 0.05 and abs(written - (t0 + 0.9 + skew)) < 0.05
        assert produced_last >= before - 0.05  # when the later report was produced
    finally:
        watch.stop()
