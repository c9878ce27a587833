"""The plain Spark peer of ``bench/bench_sinks.py --peer spark``: one Structured Streaming query
over every desired topic, on the real broker, S3 server and Spark of the embedded stack. Each
record produced since the start lands once in the topic's Parquet objects, and a topic's
progress line names the least progress statement its objects hold over the topic's partitions,
which is what the benchmark times freshness by."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_sinks  # noqa: E402

from services.runtime.settings import ServiceSettings  # noqa: E402


def _until(pred: Any, child: Any, budget_s: float) -> bool:
    deadline = time.monotonic() + budget_s
    while not pred():
        if time.monotonic() > deadline or not child.alive():
            return pred()
        time.sleep(0.1)
    return True


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.timeout(600)
def test_the_spark_peer_lands_every_record_once_and_times_a_topic_by_its_least_progress(
    stack: Any, s3_client: Any, unique_id: str, tmp_path: Path
) -> None:
    env = {**os.environ, **stack.env(), "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    settings = ServiceSettings.from_env_and_args(None, env)
    names = [f"sp{unique_id}a", f"sp{unique_id}b"]
    feeds = [bench_sinks.new_feed(settings, None, name, seed=i) for i, name in enumerate(names)]
    starts = bench_sinks.topic_ends(settings.kafka, [f.topic for f in feeds])
    progress = tmp_path / "progress.jsonl"
    prefix = f"bench-sinks-spark/{unique_id}"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"prefix": prefix, "progress": str(progress),
                                "checkpoint": str(tmp_path / "checkpoint"), "start": starts}))
    uppers = bench_sinks.PeerUppers(progress, {f.topic: f.name for f in feeds})
    child = bench_sinks.Child([sys.executable, str(REPO / "bench" / "bench_sinks.py"), "--spark-peer", str(spec)],
                              env, tmp_path / "peer.log")
    try:
        # Two steps of each topic (50 updates and a progress statement on each partition);
        # the second is produced once the first is visible.
        for _ in range(2):
            sent = {f.name: f.step(uppers) for f in feeds}
            assert all(sent.values())
            assert _until(lambda: all(uppers.upper(n) >= (sent[n] or 0) for n in names), child, 300), (
                f"expected every topic's progress line to reach its step, found {[uppers.upper(n) for n in names]} "
                f"against {sent}; the peer's log:\n{(tmp_path / 'peer.log').read_text()[-3000:]}")
        # One topic steps again: only its frontier moves.
        a, b = feeds
        held_b = uppers.upper(b.name)
        f3 = a.step(uppers) or 0
        assert _until(lambda: uppers.upper(a.name) >= f3, child, 300)
        assert uppers.upper(b.name) == held_b == b.frontier
    finally:
        child.stop()
        uppers.stop()
        for f in feeds:
            f.producer.close()

    lines = [json.loads(x) for x in progress.read_text().splitlines()]
    assert lines[0] == {"started": True, "topics": 2}
    for f in feeds:
        mine = [x for x in lines[1:] if x["topic"] == f.topic]
        reached = [x["frontier"] for x in mine if x["frontier"] is not None]
        # A topic's frontier only grows, and never passes what was produced to it.
        assert reached == sorted(reached) and reached[-1] == f.frontier
    # Every record produced since the start, in the objects once.
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=settings.s3.bucket, Prefix=prefix + "/")["Contents"]]
    got = pa.concat_tables(
        [pq.read_table(io.BytesIO(s3_client.get_object(Bucket=settings.s3.bucket, Key=k)["Body"].read())) for k in keys])
    ends = bench_sinks.topic_ends(settings.kafka, [f.topic for f in feeds])
    seen = sorted(zip(got.column("topic").to_pylist(), got.column("partition").to_pylist(),
                      got.column("offset").to_pylist(), strict=True))
    produced = sorted((t, p, o) for t, parts in ends.items() for p, end in parts.items()
                      for o in range(starts[t][p], end))
    assert seen == produced
    counted = bench_sinks.peer_records(progress, feeds, starts, settings.kafka)
    assert counted == {"spark_records": len(produced), "spark_records_expected": len(produced)}
    # Each object is one topic's records of one micro-batch.
    assert all(k.split("/")[-2] in {f.topic for f in feeds} for k in keys)
