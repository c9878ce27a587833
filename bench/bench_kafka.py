"""Kafka source/sink benchmark (``make bench-kafka``). Last line: one JSON object.

Starts an EmbeddedStack, produces N small records to a topic of 4 partitions and measures, on
the same topic in the same run:

* ``raw_produce_records_per_s``: plain confluent-kafka produce + flush;
* ``raw_consume_records_per_s``: plain confluent-kafka consume of every record with
  ``assign()`` (one consumer, all partitions, touching key and value);
* ``source_records_per_s``: the ``shardsink-kafka`` Spark source into the ``noop`` sink with an
  ``availableNow`` trigger, timed from ``start()`` to termination (so query start-up and
  shutdown are included) once the session and its Python workers are warm (small warm-up
  queries run first); the median of ``--runs`` runs, each from a fresh checkpoint;
  ``source_batch_records_per_s`` is the same rate over the micro-batches' ``triggerExecution``
  time only (query start and stop excluded);
* ``sink_records_per_s``: our source -> our sink (idempotent producer, id headers) of the same
  N records to a fresh topic, so this is the pipeline rate (the sink is the slower half);
  median of ``--runs`` runs;
* ``decode_updates_per_s``: ``decode_updates_benchmark`` from ``bench/bench_decode.py``.

Target: ``source_records_per_s >= 0.5 * raw_consume_records_per_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from shared.devstack.embedded import EmbeddedStack  # noqa: E402
from shared.io.kafka import KafkaSettings, end_offsets  # noqa: E402
from shared.spark.kafka_connector import kafka_read_stream, kafka_write_stream

PARTITIONS = 4


def create_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        f.result(timeout=30)


def raw_produce(bootstrap: str, topic: str, n: int) -> float:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True,
                  "log.connection.close": False})
    t0 = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=b"value-%08d" % i, key=b"k%08d" % i,
                          partition=i % PARTITIONS)
                break
            except BufferError:
                p.poll(0.01)
    remaining = p.flush(120)
    dt = time.perf_counter() - t0
    assert remaining == 0, f"expected every record delivered, found {remaining} outstanding"
    return dt


def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    ends = end_offsets(KafkaSettings.of(bootstrap), topic)
    assert sum(ends.values()) == n, f"expected {n} records, found ends {ends}"
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False,
                  "log.connection.close": False})
    t0 = time.perf_counter()
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    got = 0
    nbytes = 0
    while got < n:
        for m in c.consume(10_000, timeout=0.05):
            if m.error() is None:
                got += 1
                nbytes += len(m.value()) + len(m.key())
    dt = time.perf_counter() - t0
    c.close()
    return dt


def run_query(writer: Any, ckpt: Path) -> tuple[float, int, float]:
    """(wall seconds from start() to termination, rows, seconds inside micro-batches)."""
    t0 = time.perf_counter()
    q = writer.option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start()
    q.awaitTermination()
    dt = time.perf_counter() - t0
    if q.exception() is not None:
        raise RuntimeError(str(q.exception()))
    rows = sum(int(p["numInputRows"]) for p in q.recentProgress)
    in_batches = sum(int(p["durationMs"].get("triggerExecution", 0)) for p in q.recentProgress)
    return dt, rows, in_batches / 1000.0


def decode_rate() -> tuple[float, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from bench_decode import decode_updates_benchmark
    except ImportError:
        return _fallback_decode(), "fastavro single-object fallback"
    return float(decode_updates_benchmark()), "bench_decode.decode_updates_benchmark"


def _fallback_decode(n: int = 200_000) -> float:
    import io

    import fastavro

    schema = fastavro.parse_schema({
        "type": "record", "name": "Update", "fields": [
            {"name": "row", "type": "bytes"}, {"name": "time", "type": "long"},
            {"name": "diff", "type": "long"}]})
    msgs = []
    for i in range(n):
        b = io.BytesIO()
        fastavro.schemaless_writer(b, schema, {"row": b"r%d" % i, "time": i, "diff": 1})
        msgs.append(b"\xc3\x01" + b"\x00" * 8 + b.getvalue())
    t0 = time.perf_counter()
    for m in msgs:
        fastavro.schemaless_reader(io.BytesIO(m[10:]), schema)
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.records
    runs = max(1, args.runs)

    from pyspark.sql import SparkSession

    tmp = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    with EmbeddedStack() as stack:
        bs = stack.bootstrap_servers
        settings = KafkaSettings.of(bs)
        topic, out, warm = "bench-in", "bench-out", "bench-warm"
        outs = [f"{out}-{i}" for i in range(runs + 1)]
        for t in (topic, warm, *outs):
            create_topic(bs, t)

        produce_s = raw_produce(bs, topic, n)
        consume_s = raw_consume(bs, topic, n)
        raw_produce(bs, warm, 1000)

        spark = (
            SparkSession.builder.master("local[2]").appName("bench-kafka")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        source_runs: list[tuple[float, float]] = []
        sink_runs: list[float] = []
        try:
            # warm-up: starts the Python workers of the read and write paths
            run_query(kafka_read_stream(spark, settings, [warm]).writeStream.format("noop"),
                      tmp / "warm-source")
            run_query(kafka_write_stream(kafka_read_stream(spark, settings, [warm])
                                         .select("key", "value"), settings, topic=outs[-1]),
                      tmp / "warm-sink")
            for r in range(runs):
                wall, rows, in_batches = run_query(
                    kafka_read_stream(spark, settings, [topic]).writeStream.format("noop"),
                    tmp / f"source-{r}",
                )
                assert rows == n, f"expected the source to read {n} rows, found {rows}"
                source_runs.append((wall, in_batches))
            for r in range(runs):
                sink_df = kafka_read_stream(spark, settings, [topic]).select("key", "value")
                wall, rows, _ = run_query(kafka_write_stream(sink_df, settings, topic=outs[r]),
                                          tmp / f"sink-{r}")
                assert rows == n, f"expected the sink to write {n} rows, found {rows}"
                written = sum(end_offsets(settings, outs[r]).values())
                assert written == n, f"expected {n} records in {outs[r]}, found {written}"
                sink_runs.append(wall)
        finally:
            spark.stop()

    decode, decode_how = decode_rate()
    raw_consume_rate = n / consume_s
    source_rate = n / statistics.median(w for w, _ in source_runs)
    source_batch_rate = n / statistics.median(b for _, b in source_runs)
    result = {
        "records": n,
        "partitions": PARTITIONS,
        "raw_produce_records_per_s": round(n / produce_s),
        "raw_consume_records_per_s": round(raw_consume_rate),
        "source_records_per_s": round(source_rate),
        "source_vs_raw_consume": round(source_rate / raw_consume_rate, 3),
        "source_batch_records_per_s": round(source_batch_rate),
        "sink_records_per_s": round(n / statistics.median(sink_runs)),
        "runs": runs,
        "decode_updates_per_s": round(decode),
        "decode_updates_from": decode_how,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
