"""``make demo``: the sink end to end on the embedded stack, verified against a model.

1. starts the embedded stack (Tansu broker + moto S3 server on free loopback ports);
2. creates a collection ``orders`` and its desired topic (3 partitions) and registers a sink;
3. runs mint, write and append as three streaming queries in one Spark application;
4. produces a generated workload (inserts, updates as retract+insert, deletes) with progress,
   showing the desired frontier, the shard upper, the row count and the lag as it goes;
5. verifies the shard against the model at every upper it reaches, and exits 0 with a
   summary (non-zero on any divergence).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

SCHEMA = {
    "type": "record",
    "name": "Order",
    "namespace": "demo",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount_cents", "type": "long"},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["open", "paid", "shipped"]}},
    ],
}


def _line(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="progress steps to produce")
    ap.add_argument("--updates-per-step", type=int, default=500)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="max wait for the shard per step")
    args = ap.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from shardsink.cli.catalog import create_collection
    from services.runtime.settings import ServiceSettings
    from services.runtime.logs import configure_logging
    from services.runtime.spark import spark_session
    from services.runner import Services
    from shared.catalog import SinkDef
    from shared.devstack.embedded import EmbeddedStack
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard

    configure_logging("demo")
    t_start = time.monotonic()
    _line("shardsink demo: starting the embedded stack (Tansu Kafka + moto S3)...")
    with EmbeddedStack() as stack, tempfile.TemporaryDirectory(prefix="shardsink-demo-") as ck:
        env = {**os.environ, **stack.env(), "SHARDSINK_CHECKPOINT_DIR": ck, "SHARDSINK_CATALOG_POLL_MS": "300"}
        settings = ServiceSettings.from_env_and_args(None, env)
        _line(f"  kafka {stack.bootstrap_servers}  s3 {stack.s3_endpoint}  bucket {stack.bucket}")
        create_collection(settings, "orders", SCHEMA)
        ensure_topic(settings.kafka, "orders-desired", args.partitions)
        settings.catalog().create_sink(SinkDef("orders-sink", "orders-desired", "orders"))
        _line("  created collection 'orders', topic 'orders-desired', sink 'orders-sink'")
        _line("starting Spark (local mode) with the mint, write and append queries...")
        spark = spark_session(settings, "shardsink-demo")
        services = Services(settings, spark, ("mint", "write", "append")).start()
        shard = Shard.open(settings.store(), "orders")
        producer = DesiredProducer(settings.kafka, "orders-desired", SCHEMA)
        rng = random.Random(args.seed)
        live: dict[Any, dict[str, Any]] = {}
        model: collections.Counter[str] = collections.Counter()
        next_id = 0
        checks = 0
        lags: list[float] = []
        failures: list[str] = []
        try:
            for step in range(1, args.steps + 1):
                t = step * 1000
                for i in range(args.updates_per_step):
                    roll = rng.random()
                    ts = t + i % 100  # several times per progress step
                    if live and roll < 0.25:  # update: retract + insert
                        oid = rng.choice(list(live))
                        old = live[oid]
                        new = {**old, "status": rng.choice(["open", "paid", "shipped"]), "amount_cents": old["amount_cents"] + 100}
                        producer.send(old, ts, -1)
                        producer.send(new, ts, 1)
                        model[json.dumps(old, sort_keys=True)] -= 1
                        model[json.dumps(new, sort_keys=True)] += 1
                        live[oid] = new
                    elif live and roll < 0.35:  # delete
                        oid = rng.choice(list(live))
                        old = live.pop(oid)
                        producer.send(old, ts, -1)
                        model[json.dumps(old, sort_keys=True)] -= 1
                    else:  # insert
                        row = {"order_id": next_id, "customer": f"c{rng.randrange(50)}", "amount_cents": rng.randrange(100, 100000), "status": "open"}
                        next_id += 1
                        producer.send(row, ts, 1)
                        model[json.dumps(row, sort_keys=True)] += 1
                        live[row["order_id"]] = row
                producer.advance_to(t + 1000)
                advanced = time.monotonic()
                target = t + 1000
                deadline = advanced + args.timeout_s
                while True:
                    state = shard.refresh()
                    if state.upper.time is not None and state.upper.time >= target:
                        break
                    if time.monotonic() > deadline:
                        failures.append(f"step {step}: shard upper {state.upper} did not reach {target} in {args.timeout_s}s")
                        break
                    time.sleep(0.05)
                lag = time.monotonic() - advanced
                lags.append(lag)
                upper = shard.refresh().upper
                snap = shard.snapshot(upper.time - 1) if upper.time is not None and upper.time > 0 else None
                rows = 0
                if snap is not None:
                    got = {}
                    for r in snap.to_pylist():
                        d = r.pop("_diff")
                        r.pop("_error")
                        got[json.dumps(r, sort_keys=True)] = d
                        rows += d
                    expected = {k: v for k, v in model.items() if v}
                    checks += 1
                    if got != expected:
                        failures.append(f"step {step}: shard at {upper} differs from the model ({len(got)} vs {len(expected)} rows)")
                _line(
                    f"  step {step:3d}/{args.steps}  desired frontier {target:>7}  shard upper {upper.time!s:>7}  "
                    f"rows {rows:>6}  lag {lag:5.2f}s  {'ok' if not failures else 'DIVERGED'}"
                )
                if failures:
                    break
        finally:
            services.stop()
            spark.stop()
            producer.close()
        state = shard.refresh()
    elapsed = time.monotonic() - t_start
    lags.sort()
    summary = {
        "verified_steps": checks,
        "updates_produced": args.steps * args.updates_per_step,
        "final_upper": state.upper.to_json(),
        "batches": len(state.batches),
        "rows": state.total_rows(),
        "lag_p50_s": round(lags[len(lags) // 2], 2) if lags else None,
        "lag_max_s": round(lags[-1], 2) if lags else None,
        "elapsed_s": round(elapsed, 1),
        "ok": not failures,
    }
    if failures:
        for f in failures:
            print(f"FAILED: {f}", file=sys.stderr)
    _line(("demo passed: " if not failures else "demo FAILED: ") + json.dumps(summary))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
