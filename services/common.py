"""What every service shares: settings parsed once at the edge, the clients built from them,
the SparkSession, and the supervisor that follows the catalog and runs one streaming query per
sink (so sinks are added and dropped at runtime without restarting the services).

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
of ``name=value`` (see :class:`Faults`), e.g. ``error_p=0.02,lost_ack_p=0.02,latency_ms=5``.
With it, :meth:`ServiceSettings.store` wraps the S3 store in
:class:`shared.objectstore.FaultyObjectStore` and :meth:`Faults.wrap_producer` makes the
control producers report injected delivery errors. Never set it in a deployment.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from pathlib import Path
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.catalog import Catalog, SinkDef
from shared.io.kafka import KafkaSettings
from shared.io.s3 import S3ObjectStore, S3Settings

log = logging.getLogger("shardsink")

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
    "SHARDSINK_SPARK_CDS": "on (default) or off: the drivers' JVM class-data archive (services/jvm.py)",
    "SHARDSINK_DRIVER_JIT": "c1 (default) or tiered: the drivers' JIT (services/jvm.py)",
    "SHARDSINK_HADOOP_NIO": "on (default) or off: local checkpoint files through java.nio (services/jvm.py)",
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
class Faults:
    """Injected faults (test only, env ``SHARDSINK_FAULTS``). Probabilities are per call.

    - ``error_p``: an S3 call fails before it is sent (determinate);
    - ``lost_ack_p``: an S3 PUT lands, then reports a timeout (indeterminate);
    - ``timeout_p``: an S3 call reports a timeout without being performed (indeterminate);
    - ``latency_ms``: up to this much extra latency on every S3 call (uniform);
    - ``kafka_error_p``: a control message is not produced and its delivery reports an error,
      and so does every later one until the producer is flushed (no gaps, as with an
      idempotent producer);
    - ``kafka_lost_ack_p``: a control message is produced, then its delivery reports an error.
    """

    error_p: float = 0.0
    lost_ack_p: float = 0.0
    timeout_p: float = 0.0
    latency_ms: float = 0.0
    kafka_error_p: float = 0.0
    kafka_lost_ack_p: float = 0.0

    @staticmethod
    def parse(text: str) -> Faults | None:
        """``"error_p=0.02,latency_ms=5"`` -> Faults; ``""`` -> None."""
        if not text.strip():
            return None
        names = set(Faults.__dataclass_fields__)
        values: dict[str, float] = {}
        for item in text.split(","):
            name, sep, value = item.strip().partition("=")
            if not sep or name not in names:
                raise ValueError(f"expected SHARDSINK_FAULTS items name=value with a name in {sorted(names)}, found {item!r}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"expected a number for {name} in SHARDSINK_FAULTS, found {value!r}") from None
        return Faults(**values)

    def wrap_store(self, store: Any) -> Any:
        from shared.objectstore import FaultPlan, FaultyObjectStore

        plan = FaultPlan(
            error_p=self.error_p,
            lost_ack_p=self.lost_ack_p,
            timeout_p=self.timeout_p,
            latency_s=(0.0, self.latency_ms / 1000.0),
        )
        return FaultyObjectStore(store, plan)

    def wrap_producer(self, producer: Any) -> Any:
        if self.kafka_error_p <= 0 and self.kafka_lost_ack_p <= 0:
            return producer
        return _FaultyProducer(producer, self.kafka_error_p, self.kafka_lost_ack_p)


class _FaultyProducer:
    """A confluent_kafka Producer whose deliveries sometimes report an injected error.

    Like an idempotent producer, it never leaves a gap: after an injected error every later
    message also fails until the next ``flush`` (the tail of the batch is lost, not a message
    in its middle)."""

    def __init__(self, inner: Any, error_p: float, lost_ack_p: float) -> None:
        import random

        self._inner = inner
        self._error_p = error_p
        self._lost_ack_p = lost_ack_p
        self._rng = random.Random()
        self._failing = False

    def flush(self, *args: Any, **kw: Any) -> Any:
        self._failing = False
        return self._inner.flush(*args, **kw)

    def produce(self, topic: str, value: Any = None, key: Any = None, on_delivery: Any = None, **kw: Any) -> None:
        r = self._rng.random()
        if (self._failing or r < self._error_p + self._lost_ack_p) and on_delivery is not None:
            from confluent_kafka import KafkaError

            err = KafkaError(KafkaError._MSG_TIMED_OUT, "injected delivery error (SHARDSINK_FAULTS)")
            if self._failing or r < self._error_p:
                self._failing = True
                on_delivery(err, None)  # never produced, nor is anything after it until flush
                return
            self._inner.produce(topic, value=value, key=key, **kw)  # produced, reported failed
            on_delivery(err, None)
            return
        self._inner.produce(topic, value=value, key=key, on_delivery=on_delivery, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def faults_from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    return Faults.parse((os.environ if env is None else env).get("SHARDSINK_FAULTS", ""))


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
    #: Test only: a JSON file of simulated low watermarks (see shared.io.spark_kafka).
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
        from shared.objectstore import RetryingObjectStore

        store: Any = _s3_store(self.s3)
        if self.faults is not None:
            store = self.faults.wrap_store(store)
        return RetryingObjectStore(store)  # type: ignore[return-value]

    def catalog(self) -> Catalog:
        return Catalog(self.store())


@functools.lru_cache(maxsize=16)
def _s3_store(s3: S3Settings) -> S3ObjectStore:
    return S3ObjectStore(s3)


def configure_logging(service: str) -> None:
    """Structured (JSON) logs on stderr; secrets are never logged (settings repr masks them)."""
    import json

    class _Json(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            out: dict[str, Any] = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "service": service,
                "msg": record.getMessage(),
            }
            for k in ("sink_id", "collection_id", "shard_id"):
                v = getattr(record, k, None)
                if v is not None:
                    out[k] = v
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Json())
    root = logging.getLogger("shardsink")
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("SHARDSINK_LOG_LEVEL", "INFO").upper())
    root.propagate = False


#: The driver's log4j2 configuration (see the file).
LOG4J2_CONF = Path(__file__).resolve().parent / "log4j2.properties"


def with_service_defaults(builder: Any) -> Any:
    """The settings every shardsink Spark application runs with (the services, the tests'
    session, the benchmarks' baselines); a user's ``PYSPARK_SUBMIT_ARGS`` overrides them."""
    from services.jvm import NIO_FILE_SYSTEM, driver_java_options, hadoop_jar

    # The class-data archive (services/jvm.py) and the services' log configuration (warnings
    # and errors on stderr, without the default profile's start-up notices).
    java_options = " ".join(o for o in (driver_java_options(), f"-Dlog4j2.configurationFile=file:{LOG4J2_CONF}") if o)
    builder = builder.config("spark.driver.defaultJavaOptions", java_options)
    jar = hadoop_jar()
    if jar is not None and not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Local paths without a chmod process per file (services/jvm.py). Only when this
        # process launches the JVM: under spark-submit the class path is already set.
        builder = (
            builder.config("spark.driver.extraClassPath", str(jar))
            .config("spark.executor.extraClassPath", str(jar))
            .config("spark.hadoop.fs.file.impl", NIO_FILE_SYSTEM)
        )
    return (
        builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stopTimeout", "30s")
        # Python workers forked with the sink's modules already loaded (services/worker_daemon.py)
        .config("spark.python.daemon.module", "services.worker_daemon")
        # Checkpoint files (offset and commit logs, state store deltas) through Hadoop's
        # FileSystem API instead of FileContext: on a local or mounted path, FileContext's
        # rename asks for the link status of both paths, which Hadoop's local file system
        # (without its native library, as in the pyspark wheel) answers by running
        # `readlink` as a child process, and it sets permissions by running `chmod`: measured
        # 20 child processes a second and 80-100 ms per log write with the three queries
        # running; 25-40 ms with this manager. Both managers write a temporary file and
        # rename it; the offset log of a query is written by that query alone.
        .config(
            "spark.sql.streaming.checkpointFileManagerClass",
            "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
        )
    )


def spark_session(settings: ServiceSettings, app_name: str) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Started with plain python: we pick the master. Under spark-submit the JVM started
        # us (it sets PYSPARK_GATEWAY_PORT) and spark-submit's --master applies.
        builder = builder.master(settings.spark_master)
        if settings.spark_master.startswith("local"):
            # In local mode everything is on this machine: bind to loopback, without Spark's
            # warning that the hostname resolves to it.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import contextlib

    from services.jvm import jvm_stderr_filtered

    # The JVM we launch writes its stderr without the JDK's incubator-module notice (jvm.py).
    launching = not os.environ.get("PYSPARK_GATEWAY_PORT")
    with jvm_stderr_filtered() if launching else contextlib.nullcontext():
        spark = with_service_defaults(builder).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from shared.io.spark_kafka import register_kafka_source

    register_kafka_source(spark)
    return spark


@dataclass
class SinkRunner:
    """One running streaming query for one sink."""

    sink: SinkDef
    query: Any
    stop_fn: Callable[[], None] | None = None


@dataclass
class Supervisor:
    """Follows the catalog and keeps one streaming query per live sink.

    ``start_query(sink)`` builds and starts the sink's query and returns it; a query whose
    sink is dropped (or re-created with another epoch) is stopped. A query that failed is
    restarted on the next poll (its state is rebuilt from the topics and the shard).
    """

    name: str
    settings: ServiceSettings
    start_query: Callable[[SinkDef], Any]
    #: Called when a running sink's definition changes in place (read-only -> writable).
    on_change: Callable[[SinkDef], None] | None = None
    running: dict[str, SinkRunner] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    restarts: int = 0
    #: Backoff doubles from ``backoff_s`` up to ``max_backoff_s``; a query that stays up for
    #: ``max_backoff_s`` resets it. Without it, a loaded machine feeds a restart storm.
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    #: Per sink: consecutive failures and the monotonic time before which no restart is tried.
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)

    _catalog: Catalog | None = None
    #: Deletes this service's checkpoints whose folder name the given predicate rejects
    #: (see :func:`remove_checkpoints`); None: checkpoints are left alone.
    reap: Callable[[Callable[[str], bool]], Any] | None = None
    _reaped: bool = False
    #: Called with the sink and the exception of a query that failed (before its restart).
    on_failure: Callable[[SinkDef, Any], object] | None = None

    def _keep_checkpoint(self, name: str, live: dict[str, SinkDef]) -> bool:
        owner = checkpoint_owner(name)
        if owner is None:
            return True  # not a sink's checkpoint
        sink_id, epoch = owner
        if epoch < 0:
            return False  # a fresh-per-start checkpoint of an older version
        if self.settings.only_sinks and sink_id not in self.settings.only_sinks:
            return True  # another instance's sink
        sink = live.get(sink_id)
        return sink is not None and sink.epoch == epoch  # else dropped, or an older epoch

    def poll_once(self) -> None:
        if self._catalog is None:
            self._catalog = self.settings.catalog()
        catalog = self._catalog
        live = {s.sink_id: s for s in catalog.state().live_sinks()}
        wanted = {
            sid: s
            for sid, s in live.items()
            if not self.settings.only_sinks or sid in self.settings.only_sinks
        }
        stopped = self._poll(wanted)
        if self.reap is not None and (stopped or not self._reaped):
            self._reaped = True
            try:
                gone = self.reap(lambda name: self._keep_checkpoint(name, live))
                if gone:
                    log.info("removed %s checkpoints %s", self.name, gone)
            except Exception as e:  # noqa: BLE001 - a failed clean-up must not stop the service
                log.warning("removing old %s checkpoints failed: %s", self.name, e)
        self._start_wanted(wanted)

    def _poll(self, wanted: dict[str, SinkDef]) -> bool:
        """Stop the queries of dropped, re-created or failed sinks; True if any stopped."""
        stopped = False
        for sink_id, runner in list(self.running.items()):
            want = wanted.get(sink_id)
            if want is not None and want.epoch == runner.sink.epoch and want != runner.sink:
                runner.sink = want
                if self.on_change is not None:
                    self.on_change(want)
            failed = runner.query is not None and not runner.query.isActive
            if want is None or want.epoch != runner.sink.epoch or failed:
                if not failed and self._initializing(runner):
                    continue  # stopped at a later poll, once its sources are up
                if failed:
                    exc = runner.query.exception()
                    n = self._failures.get(sink_id, (0, 0.0))[0]
                    if self.clock() - self._started_at.get(sink_id, 0.0) > self.max_backoff_s:
                        n = 0  # it ran long enough: a fresh failure, not a crash loop
                    delay = min(self.max_backoff_s, self.backoff_s * 2**n)
                    self._failures[sink_id] = (n + 1, self.clock() + delay)
                    log.error("query failed, restarting in %.1fs: %s", delay, exc, extra={"sink_id": sink_id})
                    self.restarts += 1
                    if self.on_failure is not None:
                        try:
                            self.on_failure(runner.sink, exc)
                        except Exception as e:  # noqa: BLE001 - the supervisor must outlive it
                            log.warning("handling the failure failed: %s", e, extra={"sink_id": sink_id})
                self._stop_runner(runner)
                del self.running[sink_id]
                stopped = True
        return stopped

    def _start_wanted(self, wanted: dict[str, SinkDef]) -> None:
        for sink_id, sink in wanted.items():
            if sink_id not in self.running:
                if self.clock() < self._failures.get(sink_id, (0, 0.0))[1]:
                    continue  # backing off after a failure
                query = self.start_query(sink)
                if query is None:
                    continue  # not startable yet (e.g. its desired topic does not exist): retry
                log.info("started %s for sink", self.name, extra={"sink_id": sink_id})
                self.running[sink_id] = SinkRunner(sink, query)
                self._started_at[sink_id] = self.clock()

    def _initializing(self, runner: SinkRunner) -> bool:
        """Whether a query is still starting its sources (at most a minute after its start).
        A query stopped then leaves the Python processes Spark is starting for its sources
        unable to connect back, each printing a traceback on the service's stderr; a dropped
        sink's query is stopped once they are up, a poll or a few later."""
        query = runner.query
        if query is None or self.clock() - self._started_at.get(runner.sink.sink_id, 0.0) > 60.0:
            return False
        try:
            return bool(query.isActive and query.status.get("message") == "Initializing sources")
        except Exception:  # noqa: BLE001 - a query that cannot say is not waited for
            return False

    def _stop_runner(self, runner: SinkRunner) -> None:
        name = None
        try:
            if runner.query is not None:
                name = runner.query.name
                with _STOPPING_LOCK:  # whatever its micro-batch fails with now is this stop
                    _STOPPING.add(name)
                runner.query.stop()
        except Exception as e:  # noqa: BLE001 - stopping a failed query may raise again
            log.warning("stopping query: %s", e, extra={"sink_id": runner.sink.sink_id})
        finally:
            if name is not None:
                with _STOPPING_LOCK:
                    _STOPPING.discard(name)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - the supervisor must outlive bad polls
                log.error("catalog poll failed: %s", e, exc_info=True)
            self._stop.wait(self.settings.catalog_poll_ms / 1000.0)

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self.run_forever, name=f"{self.name}-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for runner in list(self.running.values()):
            self._stop_runner(runner)
        self.running.clear()


#: Java exceptions that mean "interrupted" (a query being stopped interrupts its thread).
_INTERRUPTIONS = (
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
)


#: Names of the queries being stopped by their supervisor (see :func:`interruptible`).
_STOPPING: set[str] = set()
_STOPPING_LOCK = threading.Lock()


class QueryInterruptedError(Exception):
    """A ``foreachBatch`` function interrupted by its query's stop (see :func:`interruptible`)."""


def interruptible(fn: Callable[[Any, int], None], name: str | None = None) -> Callable[[Any, int], None]:
    """Wrap a ``foreachBatch`` function so that an interruption by ``query.stop()`` reaches Spark
    as a short error.

    When a query stops during a micro-batch, the function's call into the JVM (``toArrow()``...)
    fails with a ``Py4JJavaError`` whose text holds the whole Java stack trace, and the error
    Spark gets back holds that and the Python traceback. Spark decides whether the failure was
    its own stop by matching that text with ``Py4JJavaError: An error occurred while
    calling((.|\r\n|\r|\n)*)(<interruption>)`` (StreamExecution.isInterruptionException), a
    pattern that recurses once per character: on a text of some thousands of characters the
    stream execution thread dies of a ``StackOverflowError`` (1,024 ``java.util.regex`` frames
    in the service log at shutdown). Raising instead a short error in the shape that pattern
    expects, without the chained traceback, lets Spark recognise the stop and end the query
    cleanly.

    The pattern's recursion runs on whatever a micro-batch fails with while its query stops,
    not only on interruptions: measured with java.util.regex on a default thread, 2,000
    characters after ``calling`` already overflow. A stop can fail a JVM call in other ways (a
    closed file system, a cancelled job) whose text holds a Java stack trace too. So while the
    query ``name`` is being stopped by its :class:`Supervisor`, any error of the function is
    that stop and is raised in the short form. Every other error passes through unchanged: a
    failure outside a stop is not matched by that pattern, and its whole text reaches the
    query's exception (the write service's quarantine reads it)."""

    def each(batch_df: Any, batch_id: int) -> None:
        try:
            fn(batch_df, batch_id)
        except Exception as e:
            try:
                text = str(e)
            except Exception:  # noqa: BLE001 - the JVM may already be going away
                text = type(e).__name__
            hit = next((n for n in _INTERRUPTIONS if n in text), None)
            if hit is None and name is not None:
                with _STOPPING_LOCK:
                    if name in _STOPPING:
                        hit = _INTERRUPTIONS[0]
            if hit is None:
                raise
            raise QueryInterruptedError(
                f"py4j.protocol.Py4JJavaError: An error occurred while calling foreachBatch (batch {batch_id}).\n: {hit}"
            ) from None

    return each


def checkpoint_path(settings: ServiceSettings, service: str, sink: SinkDef) -> str:
    """The checkpoint of one service's query for one sink: ``<root>/<service>/<sink>-e<epoch>``.

    Durable across restarts for every service: the write query's holds the correction
    buffers (Spark state) with the offsets they reflect; mint's and append's hold their small
    driver state (:mod:`services.driver_state`) with theirs, so no restart re-reads a topic
    from its start. It must be on a path every executor of the write query reaches (a shared
    volume, or ``s3a://`` with hadoop-aws). A new epoch (re-created or adopted sink) starts
    new checkpoints; :func:`remove_checkpoints` deletes the old ones. One query per
    checkpoint: run one instance of each service per sink.
    """
    return f"{settings.checkpoint_dir.rstrip('/')}/{service}/{sink.sink_id}-e{sink.epoch}"


def hadoop_path(spark: Any, path: str) -> tuple[Any, Any]:
    """``(FileSystem, Path)`` of a checkpoint path through Hadoop (local paths and ``s3a://``)."""
    p = spark.sparkContext._jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), p


def remove_checkpoints(spark: Any, settings: ServiceSettings, service: str, keep: Callable[[str], bool]) -> list[str]:
    """Delete the checkpoints under ``<root>/<service>/`` whose name ``keep`` rejects
    (through Hadoop's FileSystem, so local paths and ``s3a://`` alike). Returns them."""
    fs, root = hadoop_path(spark, f"{settings.checkpoint_dir.rstrip('/')}/{service}")
    if not fs.exists(root):
        return []
    gone = []
    for st in fs.listStatus(root):
        name = st.getPath().getName()
        if not keep(name):
            fs.delete(st.getPath(), True)
            gone.append(name)
    return gone


def checkpoint_owner(name: str) -> tuple[str, int] | None:
    """``(sink id, epoch)`` of a checkpoint folder's name, None for another. (Folders named
    ``<sink>-e<epoch>-r<8 hex>`` are the fresh-per-start checkpoints mint and append had
    before theirs became durable: they belong to no one now.)"""
    import re

    m = re.fullmatch(r"(.+)-e(\d+)(-r[0-9a-f]{8})?", name)
    if not m:
        return None
    return (m.group(1), int(m.group(2))) if m.group(3) is None else ("", -1)


def wait_forever(stop: threading.Event) -> None:
    import signal

    def _handler(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    while not stop.is_set():
        time.sleep(0.5)
