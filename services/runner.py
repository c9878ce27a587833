"""Run sink services: one of mint, write, append (the separate mode that compose and
Kubernetes use), or all three in one Spark application (the embedded default: one JVM).

    python -m services.mint | python -m services.write | python -m services.append
    python -m services          # all three in one application
    spark-submit services/mint/__main__.py --bootstrap ... --bucket ...

The same code runs in both modes: each service is a :class:`services.runtime.supervisor.Supervisor`
that follows the catalog and runs one streaming query per sink.
"""

from __future__ import annotations

import argparse
import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import Supervisor, wait_forever
from services.runtime.logs import configure_logging
from services.runtime.checkpoints import remove_checkpoints
from services.runtime.spark import spark_session
from shared.catalog import SinkDef

log = logging.getLogger("shardsink")

SERVICES = ("mint", "write", "append")


def ensure_control_topics(settings: ServiceSettings) -> None:
    from shared.io.kafka_admin import ensure_topic

    for t in (settings.descs_topic, settings.batches_topic, settings.frontiers_topic):
        ensure_topic(settings.kafka, t, 1)


def desired_topic_exists(settings: ServiceSettings, topic: str) -> bool:
    from shared.errors import KafkaAdapterError
    from shared.io.kafka_admin import topic_partition_count

    try:
        return topic_partition_count(settings.kafka, topic) > 0
    except KafkaAdapterError:
        return False


def nudge(settings: ServiceSettings, sink: SinkDef) -> None:
    """Publish the shard's current upper on ``frontiers``: wakes the sink's queries up (used
    when a sink leaves read-only mode, which no Kafka message would otherwise announce)."""
    from services.sinkio import ControlProducer
    from shared.codec import message_codec
    from shared.shard import Shard

    upper = Shard.open(settings.store(), sink.collection_id).refresh().upper
    p = ControlProducer.create(settings.kafka, "nudge")
    msg = {"shard_id": sink.collection_id, "sink_id": sink.sink_id, "upper": upper.to_json(), "desc_token": None, "updated_at_ms": int(time.time() * 1000)}
    p.send(settings.frontiers_topic, message_codec("frontier_update").encode(msg), key=sink.collection_id.encode())
    p.flush()


def describe_for_write(settings: ServiceSettings, sink: SinkDef) -> dict[str, Any]:
    """What the shared write query's source needs of a member besides its definition: the
    collection's row schema, and the sink's quarantined desired ranges."""
    import json

    from services.write.quarantine import load_quarantine
    from shared.shard import Shard

    schema = Shard.open(settings.store(), sink.collection_id, grace_ms=settings.grace_ms).refresh().schema
    return {"row_schema": json.dumps(schema), "quarantine": [list(q) for q in load_quarantine(settings, sink)]}


@dataclass
class Services:
    """Running services of one application (and their per-sink state, for metrics/tests)."""

    settings: ServiceSettings
    spark: Any
    names: tuple[str, ...]
    supervisors: list[Supervisor] = field(default_factory=list)
    #: Shared mode (``SHARDSINK_QUERIES=shared``): one fleet per service, and their group.
    fleets: dict[str, Any] = field(default_factory=dict)
    group: Any = None
    #: Shared mode: each service's driver step (``SharedMint``, ``SharedWrite``, ``SharedAppend``).
    shared: dict[str, list[Any]] = field(default_factory=dict)
    minters: dict[str, Any] = field(default_factory=dict)
    writers: dict[str, Any] = field(default_factory=dict)
    appenders: dict[str, Any] = field(default_factory=dict)

    def start(self) -> Services:
        if self.settings.queries == "shared":
            return self._start_shared()
        from services.append.service import start_append_query
        from services.mint.service import start_mint_query
        from services.write.service import on_write_failure, start_write_query

        ensure_control_topics(self.settings)
        s = self.settings

        def guarded(fn: Any, registry: dict[str, Any]) -> Any:
            def start(sink: SinkDef) -> Any:
                if not desired_topic_exists(s, sink.desired_topic):
                    return None
                return fn(self.spark, s, sink, registry)

            return start

        for name in self.names:
            if name == "mint":
                sup = Supervisor("mint", s, guarded(start_mint_query, self.minters), on_change=lambda sink: nudge(s, sink))
            elif name == "write":
                sup = Supervisor(
                    "write", s, guarded(start_write_query, self.writers),
                    on_failure=functools.partial(on_write_failure, self.spark, s),
                )
            elif name == "append":
                sup = Supervisor("append", s, guarded(start_append_query, self.appenders))
            else:
                raise ValueError(f"expected a service in {SERVICES}, found {name!r}")
            sup.reap = functools.partial(remove_checkpoints, self.spark, s, name)
            self.supervisors.append(sup.start())
        return self

    def _start_shared(self) -> Services:
        """One query per service for every sink (services/runtime/fleet.py)."""
        from services.append.shared import start_shared_append_query
        from services.mint.shared import start_shared_mint_query
        from services.runtime.fleet import Fleet, FleetGroup
        from services.write.shared import start_shared_write_query

        ensure_control_topics(self.settings)
        s = self.settings
        starts = {
            "mint": (start_shared_mint_query, self.minters),
            "write": (start_shared_write_query, self.writers),
            "append": (start_shared_append_query, self.appenders),
        }
        for name in self.names:
            if name not in starts:
                raise ValueError(f"expected a service in {SERVICES}, found {name!r}")
        # Write and append take a new sink before mint can mint for it (FleetGroup).
        for name in sorted(self.names, key=("write", "append", "mint").index):
            fn, registry = starts[name]
            box = self.shared.setdefault(name, [])

            def start(fleet: Any, fn: Any = fn, registry: Any = registry, box: Any = box) -> Any:
                return fn(self.spark, s, fleet, registry, box)

            fleet = Fleet(
                name, s, start,
                ready=lambda sink: desired_topic_exists(s, sink.desired_topic),
                on_change=(lambda sink: nudge(s, sink)) if name == "mint" else None,
                describe=functools.partial(describe_for_write, s) if name == "write" else None,
                reap=functools.partial(remove_checkpoints, self.spark, s, f"{name}-shared"),
            )
            self.fleets[name] = fleet
        self.group = FleetGroup(s, list(self.fleets.values())).start()
        return self

    def failing(self) -> dict[str, dict[str, str]]:
        """Shared mode: per service, the sinks held by a failure now, with the error."""
        out: dict[str, dict[str, str]] = {}
        for name, box in self.shared.items():
            for app in box:
                got = {}
                for key, v in getattr(app, "failing", {}).items():
                    if isinstance(v, dict):
                        got[key] = "; ".join(f"partition {wp}: {err}" for wp, (_, err) in sorted(v.items()))
                    elif isinstance(v, tuple):
                        got[key] = str(v[-1])
                    else:
                        got[key] = str(v)
                if got:
                    out[name] = got
        return out

    def stop(self) -> None:
        """Stop every query, then flush and release the control producers (so no client
        keeps reconnecting to a broker that is going away)."""
        import gc

        if self.group is not None:
            self.group.stop()
            self.group = None
        for box in self.shared.values():
            for app in box:
                try:
                    app.producer.flush(timeout_s=5)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
        for sup in self.supervisors:
            sup.stop()
        self.supervisors.clear()
        for registry in (self.minters, self.writers, self.appenders):
            for part in registry.values():
                try:
                    part.producer.flush(timeout_s=5)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
            registry.clear()
        from shared.spark.kafka_source import close_pooled_consumers

        close_pooled_consumers()  # mint's and append's reads on the driver
        gc.collect()


def main(names: Sequence[str], argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"shardsink-{'-'.join(names)}", description=f"run the {', '.join(names)} service(s)")
    ServiceSettings.add_arguments(parser)
    args = parser.parse_args(argv)
    settings = ServiceSettings.from_env_and_args(args)
    configure_logging("+".join(names))
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    log.info("settings: kafka %s, %r, checkpoints %s", settings.kafka.bootstrap, settings.s3, settings.checkpoint_dir)
    spark = spark_session(settings, f"shardsink-{'-'.join(names)}")
    from services.runtime.warmup import warm_up

    warm_up(spark)  # the queries' Python workers start while the services set up
    services = Services(settings, spark, tuple(names)).start()
    from services.runtime.metrics import start_metrics

    start_metrics(services)
    log.info("running %s", ", ".join(names))
    stop = threading.Event()
    try:
        wait_forever(stop)
    finally:
        services.stop()
        try:
            spark.stop()
        except Exception as e:  # noqa: BLE001 - a SIGTERM to the whole process group ends the JVM first
            log.warning("Spark did not stop cleanly (had its JVM already exited?): %s", e)
    return 0
