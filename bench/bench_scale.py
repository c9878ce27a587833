"""Scale curves of the sink on the embedded stack (in-process services, one SparkSession).

Prints progress on stderr and, as its last stdout line, one JSON object with three curves:

- ``partitions``: sink throughput (updates/s, desired topic to committed shard) as the number
  of desired-topic partitions (= parallel decode tasks of the writers) grows 1, 2, 4, 8. N
  updates are produced as fast as the producer goes, in progress steps; the figure is N over
  the time from the first produce until the shard's upper passes the last progress.
- ``rate``: offered update rate 1k, 10k, 100k updates/s (a progress step every 0.5 s) on one
  collection: achieved throughput and freshness (p50/p99 of the time from ``advance_to``
  returning until the shard's upper reaches that frontier).
- ``size``: collection size 10k, 100k, 1M rows (loaded first), then a steady 10k updates/s of
  inserts and retractions of live rows: load throughput, freshness and achieved throughput.

- ``cluster``: the same burst throughput with the services as their own application
  (``python -m services``) on ``local[2]`` and on a Spark standalone cluster (master and
  workers from the pyspark wheel's ``spark-class``, one core each) with 1 and 2 workers: the
  write side's per-row work runs on the executors, so workers add throughput where the
  machine has cores to give (this one has 2, shared with the broker, S3 and the driver).

``knee`` names, for the rate and size curves, the first step where the sink stops keeping up:
its delay grows during the run (freshness of the last third of the steps above twice that of
the first third plus 1 s), or freshness p50 more than 3x the previous step's. (``achieved``
is updates over the time until the last step is committed, so a short run's tail delay
lowers it even when the sink keeps up.)

The services run in this process (``services.runner.Services``: mint, write and append
queries in one Spark application, the embedded default), one sink per measurement; a
measured sink is dropped before the next starts. ``--quick`` shrinks every size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from upper_watch import AnnouncedUpperWatch  # noqa: E402

SCHEMA = {
    "type": "record",
    "name": "Item",
    "namespace": "scale",
    "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "string"}],
}
STEP_TIMES = 10


def log(msg: str) -> None:
    print(f"[bench-scale] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    return round(s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))], 3)


class Feed:
    """One collection fed by one desired topic: pre-encoded inserts and retractions."""

    def __init__(self, settings: Any, name: str, partitions: int) -> None:
        from shardsink.cli.catalog import create_collection
        from shared.catalog import SinkDef
        from shared.io.desired_producer import DesiredProducer
        from shared.io.kafka_admin import ensure_topic
        from shared.shard import Shard

        self.settings = settings
        self.name = name
        self.topic = f"desired-{name}"
        ensure_topic(settings.kafka, self.topic, partitions)
        create_collection(settings, name, SCHEMA)
        self.producer = DesiredProducer(settings.kafka, self.topic, SCHEMA, linger_ms=20)
        self.rng = random.Random(11)
        self.live: list[bytes] = []
        self.next_id = 0
        self.frontier = 0
        self.shard = Shard.open(settings.store(), name)
        settings.catalog().create_sink(SinkDef(name, self.topic, name))
        self.watch = AnnouncedUpperWatch(self.shard, settings.kafka, settings.frontiers_topic)

    def make(self, n: int, retract: float = 0.15) -> list[tuple[bytes, int]]:
        enc = self.producer.rows.encode
        out: list[tuple[bytes, int]] = []
        for _ in range(n):
            if self.live and self.rng.random() < retract:
                i = self.rng.randrange(len(self.live))
                self.live[i], self.live[-1] = self.live[-1], self.live[i]
                out.append((self.live.pop(), -1))
            else:
                b = enc({"id": self.next_id, "v": f"v{self.next_id % 9973}"})
                self.next_id += 1
                self.live.append(b)
                out.append((b, 1))
        return out

    def send_step(self, updates: list[tuple[bytes, int]]) -> int:
        lo = self.frontier
        rnd = self.rng.randrange
        send = self.producer.send_encoded
        for b, d in updates:
            send(b, lo + rnd(STEP_TIMES), d)
        self.frontier = lo + STEP_TIMES
        self.producer.advance_to(self.frontier)
        return self.frontier

    def warm(self, timeout_s: float) -> float:
        """One small step, waited for: the sink's queries are up and in step."""
        t0 = time.monotonic()
        f = self.send_step(self.make(100, retract=0.0))
        self.watch.wait(f, timeout_s, f"{self.name} warm-up")
        return time.monotonic() - t0

    def close(self) -> None:
        self.watch.stop()
        self.producer.close()
        self.settings.catalog().drop_sink(self.name)


def burst(feed: Feed, n: int, step: int, timeout_s: float, retract: float = 0.15) -> dict[str, Any]:
    """n updates as fast as the producer goes; throughput to the committed shard."""
    batches = [feed.make(step, retract) for _ in range(max(1, n // step))]
    total = sum(len(b) for b in batches)
    t0 = time.monotonic()
    for b in batches:
        f = feed.send_step(b)
    produce_s = time.monotonic() - t0
    done = feed.watch.wait(f, timeout_s, f"{feed.name} burst")
    return {"updates": total, "updates_per_s": round(total / (done - t0)), "produce_s": round(produce_s, 2)}


def steady(feed: Feed, rate: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    """A progress step every 0.5 s carrying rate/2 updates, for ``seconds``."""
    per = max(1, rate // 2)
    steps = max(2, int(seconds / 0.5))
    batches = [feed.make(per) for _ in range(steps)]
    adv: dict[int, float] = {}
    t_start = time.monotonic()
    for i, b in enumerate(batches):
        f = feed.send_step(b)
        adv[f] = time.monotonic()
        sleep = t_start + (i + 1) * 0.5 - time.monotonic()
        if sleep > 0:
            time.sleep(sleep)
    offered_s = time.monotonic() - t_start
    done = feed.watch.wait(max(adv), timeout_s, f"{feed.name} steady {rate}/s")
    fresh = [(feed.watch.when(f) or done) - t for f, t in sorted(adv.items())]
    total = per * steps
    third = max(1, len(fresh) // 3)
    first, last = sorted(fresh[:third])[third // 2], sorted(fresh[-third:])[third // 2]
    return {
        "offered_updates_per_s": rate,
        "produced_updates_per_s": round(total / offered_s),
        "achieved_updates_per_s": round(total / (done - t_start)),
        "freshness_p50_s": pct(fresh, 0.5),
        "freshness_p99_s": pct(fresh, 0.99),
        "steps": steps,
        # Keeping up: the delay does not grow over the run (last third vs first third).
        "freshness_first_third_s": round(first, 3),
        "freshness_last_third_s": round(last, 3),
        "keeps_up": last <= 2 * first + 1.0,
    }


def knee(points: list[dict[str, Any]], key: str) -> Any:
    """The first point where the sink stops keeping up (see the module docstring)."""
    prev: float | None = None
    for p in points:
        f = p.get("freshness_p50_s")
        if not p.get("keeps_up", True):
            return p[key]
        if prev and f is not None and f > 3 * prev:
            return p[key]
        prev = f
    return None


def cluster_curve(settings: Any, env: dict[str, str], work: Path, run: str, n: int, timeout_s: float) -> list[dict[str, Any]]:
    """Burst throughput of ``python -m services`` on local[2] and on 1 and 2 standalone workers."""
    import signal
    import subprocess

    from shared.devstack.embedded import SparkStandalone

    points = []
    for workers in (0, 1, 2):
        cluster = SparkStandalone(workers=workers, cores=1).start() if workers else None
        master = cluster.master_url if cluster else "local[2]"
        feed = Feed(settings, f"cluster{workers}-{run}", 4)
        log_path = work / f"cluster{workers}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services", "--sink", feed.name], cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**env, "PYSPARK_PYTHON": sys.executable, "SHARDSINK_SPARK_MASTER": master},
            )
        try:
            warm_s = feed.warm(timeout_s)
            r = burst(feed, n, 5_000, timeout_s)
            r.update({"master": "local[2]" if not workers else f"standalone, {workers} worker(s) x 1 core",
                      "workers": workers, "warm_s": round(warm_s, 1)})
            points.append(r)
            log(f"cluster {r['master']}: {r['updates_per_s']} updates/s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
            feed.close()
            if cluster is not None:
                cluster.stop()
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run, a few minutes)")
    ap.add_argument("--partitions", default=None, help="comma-separated partition counts (default 1,2,4,8)")
    ap.add_argument("--rates", default=None, help="comma-separated rates (default 1000,10000,100000; quick 1000,10000)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the standalone-cluster curve")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes (default 10000,100000,1000000; quick 10000,100000)")
    args = ap.parse_args(argv)

    from services.runtime.settings import ServiceSettings
    from services.runtime.spark import spark_session
    from services.runner import Services
    from shared.devstack.embedded import EmbeddedStack

    def ints(text: str | None, full: str, quick: str) -> list[int]:
        return [int(x) for x in (text or (quick if args.quick else full)).split(",") if x]

    parts = ints(args.partitions, "1,2,4,8", "1,2,4,8")
    rates = ints(args.rates, "1000,10000,100000", "1000,10000")
    sizes = ints(args.sizes, "10000,100000,1000000", "10000,100000")
    burst_n = 10_000 if args.quick else 60_000
    steady_s = 5.0 if args.quick else 12.0
    timeout_s = 600.0
    work = Path(f"/tmp/shardsink-bench-scale-{uuid.uuid4().hex[:8]}")
    out: dict[str, Any] = {"quick": args.quick, "cores": os.cpu_count(), "load_start": round(os.getloadavg()[0], 1)}
    t_bench = time.monotonic()
    with EmbeddedStack() as stack:
        env = {
            **os.environ,
            **stack.env(),
            "SHARDSINK_CHECKPOINT_DIR": str(work / "checkpoints"),
            "SHARDSINK_CATALOG_POLL_MS": "300",
        }
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        settings = ServiceSettings.from_env_and_args(None, env)
        spark = spark_session(settings, "bench-scale")
        services = Services(settings, spark, ("mint", "write", "append")).start()
        run = uuid.uuid4().hex[:6]

        def measured(name: str, partitions: int, body: Callable[[Feed], dict[str, Any]]) -> dict[str, Any]:
            feed = Feed(settings, f"{name}-{run}", partitions)
            try:
                warm_s = feed.warm(timeout_s)
                r = body(feed)
                r["warm_s"] = round(warm_s, 1)
                return r
            finally:
                feed.close()

        try:
            curve = []
            for p in parts:
                r = measured(f"p{p}", p, lambda f: burst(f, burst_n, 5_000, timeout_s))
                r["partitions"] = p
                curve.append(r)
                log(f"partitions {p}: {r['updates_per_s']} updates/s")
            out["partitions"] = curve

            def rate_curve(f: Feed) -> dict[str, Any]:
                pts = []
                for rate in rates:
                    pt = steady(f, rate, steady_s, timeout_s)
                    log(f"rate {rate}/s: achieved {pt['achieved_updates_per_s']}/s, freshness p50 {pt['freshness_p50_s']}s p99 {pt['freshness_p99_s']}s")
                    pts.append(pt)
                return {"points": pts}

            out["rate"] = measured("rate", 2, rate_curve)["points"]
            out["rate_knee"] = knee(out["rate"], "offered_updates_per_s")

            size_pts = []
            for size in sizes:
                def size_run(f: Feed, size: int = size) -> dict[str, Any]:
                    load = burst(f, size, min(size, 50_000), timeout_s, retract=0.0)
                    pt = steady(f, 10_000, steady_s, timeout_s)
                    pt["size"] = size
                    pt["load_updates_per_s"] = load["updates_per_s"]
                    return pt

                pt = measured(f"size{size}", 2, size_run)
                log(f"size {size}: load {pt['load_updates_per_s']}/s; at 10k/s freshness p50 {pt['freshness_p50_s']}s, achieved {pt['achieved_updates_per_s']}/s")
                size_pts.append(pt)
            out["size"] = size_pts
            out["size_knee"] = knee(size_pts, "size")
        finally:
            services.stop()
            spark.stop()
        if not args.no_cluster:
            out["cluster"] = cluster_curve(settings, env, work, run, burst_n, timeout_s)
    out["load_end"] = round(os.getloadavg()[0], 1)
    out["total_s"] = round(time.monotonic() - t_bench, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
