"""The services' settings, parsed once at the edge, and the clients built from them.

Settings (environment variable, flag, default):

=============================  ======================  ==================================
variable                       flag                    default
=============================  ======================  ==================================
SHARDSINK_KAFKA_BOOTSTRAP      --bootstrap             127.0.0.1:9092
SHARDSINK_KAFKA_* (options)    (see shared.io.kafka)   SASL/TLS passed to librdkafka
SHARDSINK_S3_ENDPOINT          --s3-endpoint           (AWS default endpoint)
SHARDSINK_S3_BUCKET            --bucket                shardsink
SHARDSINK_S3_PREFIX            --s3-prefix             ''
AWS_ACCESS_KEY_ID[_FILE]       -                       AWS credential chain
AWS_SECRET_ACCESS_KEY[_FILE]   -                       AWS credential chain
SHARDSINK_CHECKPOINT_DIR       --checkpoint-dir        /tmp/shardsink-checkpoints
SHARDSINK_TOPIC_DESCS          --descs-topic           descs
SHARDSINK_TOPIC_BATCHES        --batches-topic         batches
SHARDSINK_TOPIC_FRONTIERS      --frontiers-topic       frontiers
SHARDSINK_TRIGGER_MS           --trigger-ms            100
SHARDSINK_SOURCE_WAIT_MS       --source-wait-ms        500 (a trigger that finds nothing waits up to this for a record)
SHARDSINK_CATALOG_POLL_MS      --catalog-poll-ms       1000
SHARDSINK_SPARK_MASTER         --master                local[2] (ignored under spark-submit)
SHARDSINK_STAGED_GRACE_MS      --grace-ms              600000
SHARDSINK_MAX_RECORDS_PER_TRIGGER --max-records-per-trigger 100000 (write: admission control)
SHARDSINK_QUARANTINE_AFTER     --quarantine-after      3 (write: failures of one micro-batch before its input is quarantined; 0: never)
SHARDSINK_FAULTS               -                       '' (test only: injected faults)
SHARDSINK_TEST_LOW_WATERMARKS_FILE -                   '' (test only: simulated retention)
SHARDSINK_TEST_FAIL_ON_ROW     -                       '' (test only: write fails on rows holding it)
=============================  ======================  ==================================

``SHARDSINK_FAULTS`` is for fault campaigns (``bench/chaos.py``) only: a comma-separated list
of ``name=value`` (see :class:`shared.devstack.faults.Faults`), e.g. ``error_p=0.02,lost_ack_p=0.02,latency_ms=5``.
With it, :meth:`ServiceSettings.store` wraps the S3 store in
:class:`shared.devstack.faults.FaultyObjectStore` and :meth:`shared.devstack.faults.Faults.wrap_producer` makes the
control producers report injected delivery errors. Never set it in a deployment.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.catalog import Catalog
from shared.io.kafka import KafkaSettings
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.objectstore import RetryingObjectStore

if TYPE_CHECKING:
    from shared.devstack.faults import Faults

#: Every environment variable the services read (name -> meaning). Deployment files are
#: checked against this list by tests/test_deploy.py.
#: Every environment variable the services read (name -> meaning). Deployment files are
#: checked against this list by tests/test_deploy.py.
ENV_VARS: dict[str, str] = {
    "SHARDSINK_KAFKA_BOOTSTRAP": "Kafka bootstrap servers",
    "SHARDSINK_KAFKA_SECURITY_PROTOCOL": "librdkafka security.protocol",
    "SHARDSINK_S3_ENDPOINT": "S3 endpoint URL (empty: AWS)",
    "SHARDSINK_S3_BUCKET": "S3 bucket",
    "SHARDSINK_S3_PREFIX": "S3 key prefix",
    "AWS_ACCESS_KEY_ID": "S3 access key",
    "AWS_SECRET_ACCESS_KEY": "S3 secret key",
    "AWS_ACCESS_KEY_ID_FILE": "file holding the S3 access key",
    "AWS_SECRET_ACCESS_KEY_FILE": "file holding the S3 secret key",
    "AWS_DEFAULT_REGION": "S3 region",
    "AWS_REGION": "S3 region (alternative name)",
    "SHARDSINK_CHECKPOINT_DIR": "Spark checkpoint root",
    "SHARDSINK_TOPIC_DESCS": "batch descriptions topic",
    "SHARDSINK_TOPIC_BATCHES": "written-batch reports topic",
    "SHARDSINK_TOPIC_FRONTIERS": "shard upper advances topic",
    "SHARDSINK_TOPIC_COMMANDS": "controller commands topic",
    "SHARDSINK_TOPIC_RESPONSES": "controller responses topic",
    "SHARDSINK_TRIGGER_MS": "micro-batch trigger interval",
    "SHARDSINK_SOURCE_WAIT_MS": "how long a trigger that finds nothing new waits for a record",
    "SHARDSINK_CATALOG_POLL_MS": "how often services re-read the catalog",
    "SHARDSINK_SPARK_MASTER": "Spark master when not under spark-submit",
    "SHARDSINK_CONTROLLER_SPARK_MASTER": "Spark master of the controller's data-heavy jobs ('': in-process)",
    "SHARDSINK_CONTROLLER_SPARK_MIN_BYTES": "parts read by a merge, peek or snapshot before it runs on Spark",
    "SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS": "data objects of a shard before its gc sweep runs on Spark",
    "SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS": "a controller Spark job running longer is cancelled and done in-process",
    "SHARDSINK_CONTROLLER_TICK_MS": "the controller's tick interval",
    "SHARDSINK_CONTROLLER_HEAD_REFRESH_MS": "a collection nobody waits on has its shard head read at least this often "
                                            "(announced uppers and waiting readers are read at the next tick)",
    "SHARDSINK_PEEK_TIMEOUT_MS": "how long a peek waits for its as-of to become readable",
    "SHARDSINK_PEEK_MAX_INLINE_BYTES": "peek results larger than this are answered as S3 objects",
    "SHARDSINK_RECLAIM_GRACE_MS": "how long a dropped collection's storage is kept",
    "SHARDSINK_GC_INTERVAL_MS": "how often the controller collects garbage",
    "SHARDSINK_SPARK_CDS": "on (default) or off: the drivers' JVM class-data archive (services/runtime/jvm.py)",
    "SHARDSINK_DRIVER_JIT": "c1 (default) or tiered: the drivers' JIT (services/runtime/jvm.py)",
    "SHARDSINK_HADOOP_NIO": "on (default) or off: local checkpoint files through java.nio (services/runtime/jvm.py)",
    "SHARDSINK_STAGED_GRACE_MS": "GC grace period for unreferenced objects",
    "SHARDSINK_LOG_LEVEL": "log level",
    "SHARDSINK_SCHEMAS_DIR": "where the .avsc files are",
    "SHARDSINK_SPARK_KAFKA_CONNECTOR": "shardsink (default) or builtin (spark-sql-kafka jar)",
    "SHARDSINK_SCHEMA_REGISTRY_URL": "Confluent-compatible schema registry (optional)",
    "SHARDSINK_SCHEMA_REGISTRY_USER": "schema registry basic-auth user (optional)",
    "SHARDSINK_SCHEMA_REGISTRY_PASSWORD": "schema registry basic-auth password (optional)",
    "SHARDSINK_WIRE_FORMAT": "single-object (default) or confluent",
    "SHARDSINK_METRICS_PORT": "Prometheus metrics port",
    "PYSPARK_PYTHON": "Python interpreter of the Spark executors",
    "PYSPARK_DRIVER_PYTHON": "Python interpreter of a driver that spark-submit starts",
    "PYSPARK_SUBMIT_ARGS": "spark-submit options of a service's driver (--conf ... pyspark-shell)",
    "POD_NAME": "Kubernetes: the pod's name, expanded into PYSPARK_SUBMIT_ARGS (deploy/k8s/overlays/cluster)",
    "POD_NAMESPACE": "Kubernetes: the pod's namespace, expanded into PYSPARK_SUBMIT_ARGS",
    "SHARDSINK_FAULTS": "test only: injected S3 and Kafka producer faults (bench/chaos.py)",
    "SHARDSINK_MAX_RECORDS_PER_TRIGGER": "most records the write query reads per micro-batch",
    "SHARDSINK_TEST_LOW_WATERMARKS_FILE": "test only: JSON of simulated low watermarks (retention)",
    "SHARDSINK_QUARANTINE_AFTER": "failures of one write micro-batch before its input is quarantined",
    "SHARDSINK_TEST_FAIL_ON_ROW": "test only: the write step fails on desired rows holding this text",
}
#: Prefixes of Kafka client options passed through to librdkafka (see shared/io/kafka.py).
ENV_PREFIXES: tuple[str, ...] = ("SHARDSINK_KAFKA_SASL_", "SHARDSINK_KAFKA_SSL_", "SHARDSINK_KAFKA_OPTION_")
#: Variables a deployment must set.
REQUIRED_ENV: tuple[str, ...] = ("SHARDSINK_KAFKA_BOOTSTRAP", "SHARDSINK_S3_BUCKET")


def is_known_env(name: str) -> bool:
    return name in ENV_VARS or name.startswith(ENV_PREFIXES)


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    kafka: KafkaSettings
    s3: S3Settings
    checkpoint_dir: str = "/tmp/shardsink-checkpoints"
    descs_topic: str = "descs"
    batches_topic: str = "batches"
    frontiers_topic: str = "frontiers"
    trigger_ms: int = 100
    #: A sink query's trigger that finds no record to read waits up to this long for one (the
    #: Kafka source's ``waitForRecordsMs``): a micro-batch starts milliseconds after the record
    #: that calls for it, instead of at the next trigger. 0: each trigger looks once.
    source_wait_ms: int = 500
    catalog_poll_ms: int = 1000
    spark_master: str = "local[2]"
    grace_ms: int = 600_000
    #: Restrict a service instance to these sinks (empty: all sinks in the catalog).
    only_sinks: tuple[str, ...] = ()
    #: Test only (``SHARDSINK_FAULTS``): faults injected into the S3 store and control producers.
    faults: Faults | None = None
    #: Admission control of the write query: no micro-batch reads more records than this.
    max_records_per_trigger: int = 100_000
    #: Test only: a JSON file of simulated low watermarks (see shared.spark.kafka).
    simulated_low_watermarks_file: str | None = None
    #: The write query's input is quarantined (its updates become error rows) after this many
    #: failures of the same micro-batch; 0: never (retried forever, with backoff).
    quarantine_after: int = 3
    #: Test only: the write step raises on a desired row whose bytes hold this text.
    test_fail_on_row: str | None = None

    def __post_init__(self) -> None:
        if self.trigger_ms < 0 or self.catalog_poll_ms <= 0 or self.source_wait_ms < 0:
            raise ValueError(
                f"expected trigger_ms >= 0, source_wait_ms >= 0 and catalog_poll_ms > 0, found "
                f"{self.trigger_ms}, {self.source_wait_ms}, {self.catalog_poll_ms}"
            )

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--bootstrap", help="Kafka bootstrap servers (SHARDSINK_KAFKA_BOOTSTRAP)")
        p.add_argument("--s3-endpoint", help="S3 endpoint URL (SHARDSINK_S3_ENDPOINT)")
        p.add_argument("--bucket", help="S3 bucket (SHARDSINK_S3_BUCKET)")
        p.add_argument("--s3-prefix", help="S3 key prefix (SHARDSINK_S3_PREFIX)")
        p.add_argument("--checkpoint-dir", help="Spark checkpoint root (SHARDSINK_CHECKPOINT_DIR)")
        p.add_argument("--descs-topic")
        p.add_argument("--batches-topic")
        p.add_argument("--frontiers-topic")
        p.add_argument("--trigger-ms", type=int)
        p.add_argument("--source-wait-ms", type=int)
        p.add_argument("--catalog-poll-ms", type=int)
        p.add_argument("--master", help="Spark master for local runs (SHARDSINK_SPARK_MASTER)")
        p.add_argument("--grace-ms", type=int)
        p.add_argument("--max-records-per-trigger", type=int)
        p.add_argument("--quarantine-after", type=int)
        p.add_argument("--sink", action="append", default=[], help="serve only this sink (repeatable)")

    @staticmethod
    def from_env_and_args(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> ServiceSettings:
        e = dict(os.environ if env is None else env)
        a = vars(args) if args is not None else {}

        def pick(flag: str, var: str, default: str) -> str:
            v = a.get(flag)
            return str(v) if v not in (None, "") else e.get(var, default)

        kafka_env = {**e, "SHARDSINK_KAFKA_BOOTSTRAP": pick("bootstrap", "SHARDSINK_KAFKA_BOOTSTRAP", "127.0.0.1:9092")}
        s3 = S3Settings.from_env(
            {
                **e,
                "SHARDSINK_S3_ENDPOINT": pick("s3_endpoint", "SHARDSINK_S3_ENDPOINT", ""),
                "SHARDSINK_S3_BUCKET": pick("bucket", "SHARDSINK_S3_BUCKET", "shardsink"),
                "SHARDSINK_S3_PREFIX": pick("s3_prefix", "SHARDSINK_S3_PREFIX", ""),
            }
        )
        return ServiceSettings(
            kafka=KafkaSettings.from_env(kafka_env),
            s3=s3,
            checkpoint_dir=pick("checkpoint_dir", "SHARDSINK_CHECKPOINT_DIR", "/tmp/shardsink-checkpoints"),
            descs_topic=pick("descs_topic", "SHARDSINK_TOPIC_DESCS", "descs"),
            batches_topic=pick("batches_topic", "SHARDSINK_TOPIC_BATCHES", "batches"),
            frontiers_topic=pick("frontiers_topic", "SHARDSINK_TOPIC_FRONTIERS", "frontiers"),
            trigger_ms=int(pick("trigger_ms", "SHARDSINK_TRIGGER_MS", "100")),
            source_wait_ms=int(pick("source_wait_ms", "SHARDSINK_SOURCE_WAIT_MS", "500")),
            catalog_poll_ms=int(pick("catalog_poll_ms", "SHARDSINK_CATALOG_POLL_MS", "1000")),
            spark_master=pick("master", "SHARDSINK_SPARK_MASTER", "local[2]"),
            grace_ms=int(pick("grace_ms", "SHARDSINK_STAGED_GRACE_MS", "600000")),
            only_sinks=tuple(a.get("sink") or ()),
            faults=faults_from_env(e),
            max_records_per_trigger=int(pick("max_records_per_trigger", "SHARDSINK_MAX_RECORDS_PER_TRIGGER", "100000")),
            simulated_low_watermarks_file=e.get("SHARDSINK_TEST_LOW_WATERMARKS_FILE") or None,
            quarantine_after=int(pick("quarantine_after", "SHARDSINK_QUARANTINE_AFTER", "3")),
            test_fail_on_row=e.get("SHARDSINK_TEST_FAIL_ON_ROW") or None,
        )

    # -- clients ---------------------------------------------------------------------------
    def store(self) -> S3ObjectStore:
        """One S3 client per settings and process (boto3 clients are thread-safe and costly
        to build: building one per call dominated the services' CPU profile), behind a
        :class:`shared.objectstore.RetryingObjectStore` (a transient error of an idempotent
        call is retried instead of failing the micro-batch or command)."""
        store: Any = _s3_store(self.s3)
        if self.faults is not None:
            store = self.faults.wrap_store(store)
        return RetryingObjectStore(store)  # type: ignore[return-value]

    def catalog(self) -> Catalog:
        return Catalog(self.store())


@functools.lru_cache(maxsize=16)
def _s3_store(s3: S3Settings) -> S3ObjectStore:
    return S3ObjectStore(s3)


def faults_from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    """The faults ``SHARDSINK_FAULTS`` asks for (test only); None when it is unset. The
    development stack's fault injection is loaded only then: a deployment never imports it."""
    text = (os.environ if env is None else env).get("SHARDSINK_FAULTS", "")
    if not text.strip():
        return None
    from shared.devstack.faults import Faults

    return Faults.parse(text)
