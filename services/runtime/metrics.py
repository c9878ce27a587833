"""Prometheus metrics over HTTP (``SHARDSINK_METRICS_PORT``), collected at scrape time from
the running services' own counters, so the hot path does no metric bookkeeping of its own.

Exported (labels ``sink`` or ``collection``):

- ``shardsink_descriptions_minted_total``, ``shardsink_mint_desired_frontier``
- ``shardsink_write_desired_updates_total``, ``shardsink_write_decode_errors_total``,
  ``shardsink_write_contract_violations_total``, ``shardsink_write_batches_staged_total``,
  ``shardsink_write_correction_updates``, ``shardsink_write_correction_bytes``,
  ``shardsink_write_history_unproven_partitions`` (writer partitions refusing to write
  because desired history they cannot prove they saw was lost to retention),
  ``shardsink_write_quarantined_ranges`` (desired ranges of micro-batches that kept failing,
  decoded as error rows)
- ``shardsink_append_batches_total``, ``shardsink_append_upper_mismatches_total``,
  ``shardsink_append_staged_deleted_total``
- ``shardsink_shard_upper``, ``shardsink_shard_since``, ``shardsink_shard_upper_lag``
  (desired frontier minus shard upper, in time units), ``shardsink_shard_batches``
- ``shardsink_microbatch_duration_ms`` (last trigger duration of each streaming query, from
  Spark's progress reports)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("shardsink.metrics")


class ServicesCollector(Collector):
    def __init__(self, services: Any) -> None:
        self.services = services

    def collect(self) -> Iterator[Any]:
        s = self.services
        minted = CounterMetricFamily("shardsink_descriptions_minted", "batch descriptions minted", labels=["sink"])
        desired = GaugeMetricFamily("shardsink_mint_desired_frontier", "desired frontier seen by mint", labels=["sink"])
        upper = GaugeMetricFamily("shardsink_shard_upper", "shard upper", labels=["sink"])
        lag = GaugeMetricFamily("shardsink_shard_upper_lag", "desired frontier minus shard upper", labels=["sink"])
        for sink_id, m in list(s.minters.items()):
            minted.add_metric([sink_id], m.minted)
            f = m.state.desired_frontier.time
            p = m.state.persist_frontier.time
            if f is not None:
                desired.add_metric([sink_id], f)
            if p is not None:
                upper.add_metric([sink_id], p)
            if f is not None and p is not None:
                lag.add_metric([sink_id], max(0, f - p))
        yield from (minted, desired, upper, lag)
        w_fields = {
            "desired_updates": "desired updates absorbed",
            "decode_errors": "desired messages or rows that failed to decode",
            "contract_violations": "updates below their partition's progress",
            "batches_staged": "batches staged",
            "rows_staged": "rows staged",
            "error_rows_staged": "error rows staged (updates that could not be written as rows)",
        }
        for field, doc in w_fields.items():
            c = CounterMetricFamily(f"shardsink_write_{field}", doc, labels=["sink"])
            for sink_id, w in list(s.writers.items()):
                c.add_metric([sink_id], getattr(w.metrics, field))
            yield c
        for field, doc in (("buffer_updates", "correction buffer updates"), ("buffer_bytes", "correction buffer bytes")):
            g = GaugeMetricFamily(f"shardsink_write_correction_{field.split('_')[1]}", doc, labels=["sink"])
            for sink_id, w in list(s.writers.items()):
                g.add_metric([sink_id], getattr(w.metrics, field))
            yield g
        for field, doc in (
            ("history_unproven_partitions", "writer partitions refusing to write: desired history lost to retention"),
            ("quarantined_ranges", "desired ranges quarantined to the error collection after repeated write failures"),
        ):
            g = GaugeMetricFamily(f"shardsink_write_{field}", doc, labels=["sink"])
            for sink_id, w in list(s.writers.items()):
                g.add_metric([sink_id], getattr(w.metrics, field))
            yield g
        for field, name, doc in (
            ("appends", "batches", "batches appended"),
            ("upper_mismatches", "upper_mismatches", "compare_and_append upper mismatches"),
            ("staged_deleted", "staged_deleted", "staged data objects deleted"),
        ):
            c = CounterMetricFamily(f"shardsink_append_{name}", doc, labels=["sink"])
            for sink_id, a in list(s.appenders.items()):
                c.add_metric([sink_id], getattr(a.metrics, field))
            yield c
        failing = GaugeMetricFamily("shardsink_sink_failing", "1 while a sink is held by a failure of its own "
                                    "(shared queries: the other sinks go on)", labels=["service", "sink"])
        for service, keys in (s.failing() if hasattr(s, "failing") else {}).items():
            for key in keys:
                failing.add_metric([service, key.rsplit("@", 1)[0]], 1)
        yield failing
        dur = GaugeMetricFamily("shardsink_microbatch_duration_ms", "last micro-batch duration", labels=["query"])
        for sup in list(getattr(s, "supervisors", [])):
            for runner in list(sup.running.values()):
                q = runner.query
                try:
                    prog = q.lastProgress if q is not None else None
                except Exception:  # noqa: BLE001 - a stopped query has no progress
                    prog = None
                if prog and "durationMs" in prog:
                    dur.add_metric([str(prog.get("name") or q.name)], float(prog["durationMs"].get("triggerExecution", 0)))
        for fleet in list(getattr(s, "fleets", {}).values()):
            q = fleet.query
            try:
                prog = q.lastProgress if q is not None else None
            except Exception:  # noqa: BLE001 - a stopped query has no progress
                prog = None
            if prog and "durationMs" in prog:
                dur.add_metric([str(prog.get("name") or q.name)], float(prog["durationMs"].get("triggerExecution", 0)))
        yield dur


def start_metrics(services: Any, port: int | None = None) -> int | None:
    """Serve /metrics on ``port`` (default ``SHARDSINK_METRICS_PORT``; none: no server)."""
    p = port if port is not None else int(os.environ.get("SHARDSINK_METRICS_PORT", "0") or 0)
    if not p:
        return None
    REGISTRY.register(ServicesCollector(services))
    start_http_server(p)
    log.info("metrics on :%d/metrics", p)
    return p


class ControllerCollector(Collector):
    """Per collection: upper, since, upper - since, batches, rows, bytes (from the shard heads
    the controller last saw); pending peeks and running subscribes."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Any]:
        c = self.controller
        fams = {
            name: GaugeMetricFamily(f"shardsink_collection_{name}", doc, labels=["collection"])
            for name, doc in (
                ("upper", "shard upper"),
                ("since", "shard since"),
                ("since_lag", "upper minus since (history kept, in time units)"),
                ("batches", "batches in the shard"),
                ("rows", "rows stored (before consolidation across batches)"),
                ("bytes", "bytes of data objects"),
            )
        }
        for cid, col in list(c.collections.items()):
            head = col.shard._log.cached()
            if head is None:
                continue
            if head.upper.time is not None:
                fams["upper"].add_metric([cid], head.upper.time)
            if head.since.time is not None:
                fams["since"].add_metric([cid], head.since.time)
            if head.upper.time is not None and head.since.time is not None:
                fams["since_lag"].add_metric([cid], head.upper.time - head.since.time)
            fams["batches"].add_metric([cid], len(head.batches))
            fams["rows"].add_metric([cid], head.total_rows())
            fams["bytes"].add_metric([cid], head.total_bytes())
        yield from fams.values()
        peeks = GaugeMetricFamily("shardsink_controller_pending_peeks", "peeks waiting for their time")
        peeks.add_metric([], len(c.peeks))
        yield peeks
        subs = GaugeMetricFamily("shardsink_controller_subscribes", "running subscribes")
        subs.add_metric([], len(getattr(c.section, "subscribes", {}) or {}))
        yield subs
        jobs = CounterMetricFamily(
            "shardsink_controller_spark_jobs",
            "controller work sent to Spark, by kind (merge, sweep, peek, snapshot) and outcome "
            "(spark: done there; fallback: failed or timed out there, done in-process)",
            labels=["kind", "outcome"],
        )
        spark_jobs = getattr(c, "spark_jobs", None)
        for (kind, outcome), n in sorted((spark_jobs.counts() if spark_jobs is not None else {}).items()):
            jobs.add_metric([kind, outcome], n)
        yield jobs


def start_controller_metrics(controller: Any, port: int | None = None) -> int | None:
    p = port if port is not None else int(os.environ.get("SHARDSINK_METRICS_PORT", "0") or 0)
    if not p:
        return None
    REGISTRY.register(ControllerCollector(controller))
    start_http_server(p)
    log.info("metrics on :%d/metrics", p)
    return p
