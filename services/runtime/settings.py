"""The services' settings, parsed once at the edge, and the clients built from them.

:data:`SETTINGS` below is the reference: one row per environment variable (and the flag that
overrides it, the :class:`ServiceSettings` field it sets, its default, how it is parsed and
what it means). Everything else is derived from it: the dataclass defaults,
:meth:`ServiceSettings.add_arguments`, :meth:`ServiceSettings.from_env_and_args`,
:data:`ENV_VARS`, :data:`REQUIRED_ENV` and the table in ``docs/operations.md`` (rendered by
:func:`markdown_table`; tests/services/test_settings.py checks that the two agree). A flag beats its
variable, which beats the default; an empty flag counts as not given.

``SHARDSINK_FAULTS`` is for fault campaigns (``bench/chaos.py``) only: a comma-separated list
of ``name=value`` (see :class:`shared.devstack.faults.Faults`), e.g.
``error_p=0.02,lost_ack_p=0.02,latency_ms=5``. With it, :meth:`ServiceSettings.store` wraps the
S3 store in :class:`shared.devstack.faults.FaultyObjectStore` and
:meth:`shared.devstack.faults.Faults.wrap_producer` makes the control producers report injected
delivery errors. Never set it in a deployment.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.catalog import Catalog
from shared.sink_shard import SinkShard
from shared.io.kafka import KafkaSettings
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.objectstore import RetryingObjectStore

if TYPE_CHECKING:
    from shared.devstack.faults import Faults


def _text_or_none(text: str) -> str | None:
    return text or None


#: The values of ``SHARDSINK_QUERIES``: how a service instance runs its sinks.
QUERY_MODES = ("per-sink", "shared")


def _query_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in QUERY_MODES:
        raise ValueError(f"expected SHARDSINK_QUERIES in {QUERY_MODES}, found {text!r}")
    return mode


def _faults(text: str) -> Faults | None:
    """The development stack's fault injection is imported only when faults are asked for: a
    deployment never imports it."""
    if not text.strip():
        return None
    from shared.devstack.faults import Faults

    return Faults.parse(text)


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of :data:`SETTINGS`.

    - ``field``: the :class:`ServiceSettings` field it sets; ``kafka.X`` and ``s3.X`` are
      handed on to :meth:`KafkaSettings.from_env` and :meth:`S3Settings.from_env` as the
      variable; None: a variable read elsewhere (the controller, the JVM options, AWS, Spark),
      listed so that deployments can be checked against :data:`ENV_VARS`;
    - ``env``: the environment variable (None: a flag only);
    - ``flag``: the command-line flag that overrides the variable, if any;
    - ``default``: the default, spelt as the variable would be;
    - ``parse``: text -> the field's value (an ``int`` flag is checked by argparse);
    - ``doc``: what it means, one line (the flag's help, :data:`ENV_VARS`, docs/operations.md);
    - ``repeated``: a flag given once per value, read as a tuple (no variable);
    - ``required``: a deployment must set it (:data:`REQUIRED_ENV`).
    """

    field: str | None
    env: str | None
    flag: str | None
    default: str
    parse: Callable[[str], Any]
    doc: str
    repeated: bool = False
    required: bool = False
    #: Whose setting it is: ``service`` (a :class:`ServiceSettings` field) or ``controller``
    #: (a field of the controller's settings, :func:`controller_values`).
    owner: str = "service"

    @property
    def dest(self) -> str | None:
        """The flag's name in an ``argparse.Namespace``."""
        return self.flag.lstrip("-").replace("-", "_") if self.flag else None

    @property
    def default_value(self) -> Any:
        return () if self.repeated else self.parse(self.default)

    @property
    def shown_default(self) -> str:
        return "none" if self.repeated else self.default or "empty"

    def text(self, args: Mapping[str, Any], env: Mapping[str, str]) -> str:
        """The flag's value if given and not empty, else the variable's if set, else the default."""
        given = args.get(self.dest) if self.dest else None
        if given not in (None, ""):
            return str(given)
        return env.get(self.env, self.default) if self.env else self.default

    def value(self, args: Mapping[str, Any], env: Mapping[str, str]) -> Any:
        if self.repeated:
            return tuple(args.get(self.dest or "") or ())
        return self.parse(self.text(args, env))


def _controller(field: str, env: str, flag: str, default: str, parse: Callable[[str], Any], doc: str) -> Setting:
    """A setting of the controller's own (:func:`controller_values`)."""
    return Setting(field, env, flag, default, parse, doc, owner="controller")


def _elsewhere(env: str, doc: str) -> Setting:
    """A variable no :class:`ServiceSettings` field reads, documented here."""
    return Setting(None, env, None, "", str, doc)


# fmt: off
#: Every setting of the services, and every other variable they read: the reference.
SETTINGS: tuple[Setting, ...] = (
    #       field                            env                                  flag                         default  parse
    # -- Kafka (client options: ENV_PREFIXES, see shared/io/kafka.py) ---------------------------------------
    Setting("kafka.bootstrap",               "SHARDSINK_KAFKA_BOOTSTRAP",         "--bootstrap",               "127.0.0.1:9092", str,
            "Kafka bootstrap servers", required=True),
    _elsewhere("SHARDSINK_KAFKA_SECURITY_PROTOCOL", "librdkafka security.protocol"),
    Setting("kafka.fetch_wait_ms",           "SHARDSINK_KAFKA_FETCH_WAIT_MS",     None,                        "0", int,
            "least fetch.wait.max.ms (ms) of every consumer; 0: each reader's own (5-100). "
            "The embedded Tansu broker needs 50: it lists a partition's batches within a fetch's wait"),
    # -- S3 -------------------------------------------------------------------------------------------------
    Setting("s3.endpoint",                   "SHARDSINK_S3_ENDPOINT",             "--s3-endpoint",             "", str,
            "S3 endpoint URL (empty: AWS)"),
    Setting("s3.bucket",                     "SHARDSINK_S3_BUCKET",               "--bucket",                  "shardsink", str,
            "S3 bucket", required=True),
    Setting("s3.prefix",                     "SHARDSINK_S3_PREFIX",               "--s3-prefix",               "", str,
            "S3 key prefix"),
    Setting("s3.client",                     "SHARDSINK_S3_CLIENT",               "--s3-client",               "obstore", str,
            "what sends the steps' S3 requests (GET, PUT, HEAD of one object): obstore, or boto3 like the rest"),
    _elsewhere("AWS_ACCESS_KEY_ID", "S3 access key (unset: the AWS credential chain)"),
    _elsewhere("AWS_SECRET_ACCESS_KEY", "S3 secret key (unset: the AWS credential chain)"),
    _elsewhere("AWS_ACCESS_KEY_ID_FILE", "file holding the S3 access key"),
    _elsewhere("AWS_SECRET_ACCESS_KEY_FILE", "file holding the S3 secret key"),
    _elsewhere("AWS_DEFAULT_REGION", "S3 region"),
    _elsewhere("AWS_REGION", "S3 region (alternative name)"),
    _elsewhere("AWS_CA_BUNDLE", "file of CA certificates to trust for S3 over TLS, besides the system's"),
    # -- topics ---------------------------------------------------------------------------------------------
    Setting("descs_topic",                   "SHARDSINK_TOPIC_DESCS",             "--descs-topic",             "descs", str,
            "batch descriptions topic"),
    Setting("batches_topic",                 "SHARDSINK_TOPIC_BATCHES",           "--batches-topic",           "batches", str,
            "written-batch reports topic"),
    Setting("frontiers_topic",               "SHARDSINK_TOPIC_FRONTIERS",         "--frontiers-topic",         "frontiers", str,
            "shard upper advances topic"),
    # -- the sink services ----------------------------------------------------------------------------------
    Setting("checkpoint_dir",                "SHARDSINK_CHECKPOINT_DIR",          "--checkpoint-dir",          "/tmp/shardsink-checkpoints", str,
            "Spark checkpoint root"),
    Setting("spark_master",                  "SHARDSINK_SPARK_MASTER",            "--master",                  "local[2]", str,
            "Spark master when not under spark-submit (ignored under it)"),
    Setting("trigger_ms",                    "SHARDSINK_TRIGGER_MS",              "--trigger-ms",              "100", int,
            "micro-batch trigger interval (ms)"),
    Setting("source_wait_ms",                "SHARDSINK_SOURCE_WAIT_MS",          "--source-wait-ms",          "2000", int,
            "a trigger that finds no record waits up to this long (ms) for one (the Kafka source's waitForRecordsMs), "
            "so a micro-batch starts just after the record that calls for it; 0: each trigger looks once"),
    Setting("catalog_poll_ms",               "SHARDSINK_CATALOG_POLL_MS",         "--catalog-poll-ms",         "1000", int,
            "how often (ms) services re-read the catalog"),
    Setting("grace_ms",                      "SHARDSINK_STAGED_GRACE_MS",         "--grace-ms",                "600000", int,
            "GC grace period (ms) of unreferenced objects"),
    Setting("max_records_per_trigger",       "SHARDSINK_MAX_RECORDS_PER_TRIGGER", "--max-records-per-trigger", "100000", int,
            "admission control of the write query: most records one micro-batch reads"),
    Setting("quarantine_after",              "SHARDSINK_QUARANTINE_AFTER",        "--quarantine-after",        "3", int,
            "failures of one write micro-batch before its input is quarantined (its updates become error rows); "
            "0: never (retried forever, with backoff)"),
    Setting("s3_retry_ms",                   "SHARDSINK_S3_RETRY_MS",             "--s3-retry-ms",             "60000", int,
            "an S3 call that failed transiently (refused, reset, timed out) is retried for this long (ms), at most 1 s "
            "apart, before its micro-batch or command fails: an S3 outage shorter than this holds the work, which "
            "goes on once S3 answers; 0: 4 attempts"),
    Setting("only_sinks",                    None,                                "--sink",                    "", str,
            "serve only this sink (repeatable; none: every sink of the catalog)", repeated=True),
    Setting("sink_shard",                    "SHARDSINK_SINK_SHARD",              "--sink-shard",              "0/1", SinkShard.parse,
            "i/n: this instance serves the sinks whose stable hash of the id is i modulo n (n instances split "
            "the sinks with no overlap and no gap, see docs/scaling.md); 0/1: every sink"),
    Setting("queries",                       "SHARDSINK_QUERIES",                 "--queries",                 "shared", _query_mode,
            "shared: one streaming query per service serves every sink of the instance, and sinks join and leave "
            "it without a restart (docs/scaling.md); per-sink: each service runs one streaming query per sink"),
    _elsewhere("SHARDSINK_SPARK_KAFKA_CONNECTOR", "shardsink (default) or builtin (spark-sql-kafka jar)"),
    # -- test only ------------------------------------------------------------------------------------------
    Setting("faults",                        "SHARDSINK_FAULTS",                  None,                        "", _faults,
            "test only: S3 and Kafka producer faults to inject (bench/chaos.py); never in a deployment"),
    Setting("simulated_low_watermarks_file", "SHARDSINK_TEST_LOW_WATERMARKS_FILE", None,                       "", _text_or_none,
            "test only: a JSON file of simulated low watermarks (retention, see shared/spark/kafka_source.py)"),
    Setting("test_fail_on_row",              "SHARDSINK_TEST_FAIL_ON_ROW",        None,                        "", _text_or_none,
            "test only: the write step fails on desired rows whose bytes hold this text"),
    # -- the controller (services/controller/__main__.py: controller_values) ------------------------------
    *(_controller(*row) for row in (
        ("commands_topic",       "SHARDSINK_TOPIC_COMMANDS",                  "--commands-topic",       "commands", str,
         "controller commands topic"),
        ("responses_topic",      "SHARDSINK_TOPIC_RESPONSES",                 "--responses-topic",      "responses", str,
         "controller responses topic"),
        ("tick_ms",              "SHARDSINK_CONTROLLER_TICK_MS",              "--tick-ms",              "50", int,
         "the controller's tick interval (ms)"),
        ("head_refresh_ms",      "SHARDSINK_CONTROLLER_HEAD_REFRESH_MS",      "--head-refresh-ms",      "1000", int,
         "a collection nobody waits on has its shard head read at least this often (ms; announced uppers and "
         "waiting readers are read at the next tick)"),
        ("peek_timeout_ms",      "SHARDSINK_PEEK_TIMEOUT_MS",                 "--peek-timeout-ms",      "30000", int,
         "how long a peek waits for its as-of to become readable (ms)"),
        ("max_inline_bytes",     "SHARDSINK_PEEK_MAX_INLINE_BYTES",           "--max-inline-bytes",     "65536", int,
         "peek results larger than this are answered as S3 objects"),
        ("reclaim_grace_ms",     "SHARDSINK_RECLAIM_GRACE_MS",                "--reclaim-grace-ms",     "0", int,
         "how long a dropped collection's storage is kept (ms)"),
        ("gc_interval_ms",       "SHARDSINK_GC_INTERVAL_MS",                  "--gc-interval-ms",       "30000", int,
         "how often the controller collects garbage (ms)"),
        ("spark.master",         "SHARDSINK_CONTROLLER_SPARK_MASTER",         "--spark-master",         "", _text_or_none,
         "Spark master of the controller's data-heavy jobs (empty: in-process; not SHARDSINK_SPARK_MASTER)"),
        ("spark.min_bytes",      "SHARDSINK_CONTROLLER_SPARK_MIN_BYTES",      "--spark-min-bytes",      "67108864", int,
         "parts read by a merge, peek or snapshot before it runs on Spark"),
        ("spark.gc_min_objects", "SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS", "--spark-gc-min-objects", "10000", int,
         "data objects of a shard before its gc sweep runs on Spark"),
        ("spark.timeout_ms",     "SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS",     "--spark-timeout-ms",     "600000", int,
         "a controller Spark job running longer is cancelled and done in-process (ms)"),
    )),
    # -- the drivers' JVM (services/runtime/jvm.py) ---------------------------------------------------------
    _elsewhere("SHARDSINK_SPARK_CDS", "on (default) or off: the drivers' JVM class-data archive"),
    _elsewhere("SHARDSINK_DRIVER_JIT", "c1 (default) or tiered: the drivers' JIT"),
    _elsewhere("SHARDSINK_HADOOP_NIO", "on (default) or off: local checkpoint files through java.nio"),
    # -- schemas, logs, metrics -----------------------------------------------------------------------------
    _elsewhere("SHARDSINK_SCHEMAS_DIR", "where the .avsc files are"),
    _elsewhere("SHARDSINK_SCHEMA_REGISTRY_URL", "Confluent-compatible schema registry (optional)"),
    _elsewhere("SHARDSINK_SCHEMA_REGISTRY_USER", "schema registry basic-auth user (optional)"),
    _elsewhere("SHARDSINK_SCHEMA_REGISTRY_PASSWORD", "schema registry basic-auth password (optional)"),
    _elsewhere("SHARDSINK_WIRE_FORMAT", "single-object (default) or confluent"),
    _elsewhere("SHARDSINK_LOG_LEVEL", "log level"),
    _elsewhere("SHARDSINK_METRICS_PORT", "Prometheus metrics port (unset or 0: no server)"),
    # -- Spark and Kubernetes -------------------------------------------------------------------------------
    _elsewhere("PYSPARK_PYTHON", "Python interpreter of the Spark executors"),
    _elsewhere("PYSPARK_DRIVER_PYTHON", "Python interpreter of a driver that spark-submit starts"),
    _elsewhere("PYSPARK_SUBMIT_ARGS", "spark-submit options of a service's driver (--conf ... pyspark-shell)"),
    _elsewhere("POD_NAME", "Kubernetes: the pod's name, expanded into PYSPARK_SUBMIT_ARGS (deploy/k8s/overlays/cluster)"),
    _elsewhere("POD_NAMESPACE", "Kubernetes: the pod's namespace, expanded into PYSPARK_SUBMIT_ARGS"),
)
# fmt: on

#: Every environment variable the services read (name -> meaning). Deployment files are
#: checked against this list by tests/services/test_deploy.py.
ENV_VARS: dict[str, str] = {s.env: s.doc for s in SETTINGS if s.env is not None}
#: Prefixes of Kafka client options passed through to librdkafka (see shared/io/kafka.py).
ENV_PREFIXES: tuple[str, ...] = (
    "SHARDSINK_KAFKA_SASL_",
    "SHARDSINK_KAFKA_SSL_",
    "SHARDSINK_KAFKA_OPTION_",
)
#: Variables a deployment must set.
REQUIRED_ENV: tuple[str, ...] = tuple(s.env for s in SETTINGS if s.required and s.env is not None)

_BY_FIELD: dict[str, Setting] = {s.field: s for s in SETTINGS if s.field is not None and s.owner == "service"}
_CONTROLLER: dict[str, Setting] = {s.field: s for s in SETTINGS if s.field is not None and s.owner == "controller"}


def is_known_env(name: str) -> bool:
    return name in ENV_VARS or name.startswith(ENV_PREFIXES)


def _default(field: str) -> Any:
    """A :class:`ServiceSettings` field's default, from its row of :data:`SETTINGS`."""
    return _BY_FIELD[field].default_value


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """What every service runs with. Each field's variable, flag, default and meaning are its
    row of :data:`SETTINGS`."""

    kafka: KafkaSettings
    s3: S3Settings
    checkpoint_dir: str = _default("checkpoint_dir")
    descs_topic: str = _default("descs_topic")
    batches_topic: str = _default("batches_topic")
    frontiers_topic: str = _default("frontiers_topic")
    trigger_ms: int = _default("trigger_ms")
    source_wait_ms: int = _default("source_wait_ms")
    catalog_poll_ms: int = _default("catalog_poll_ms")
    spark_master: str = _default("spark_master")
    grace_ms: int = _default("grace_ms")
    only_sinks: tuple[str, ...] = _default("only_sinks")
    sink_shard: SinkShard = _default("sink_shard")
    queries: str = _default("queries")
    faults: Faults | None = _default("faults")
    max_records_per_trigger: int = _default("max_records_per_trigger")
    simulated_low_watermarks_file: str | None = _default("simulated_low_watermarks_file")
    quarantine_after: int = _default("quarantine_after")
    test_fail_on_row: str | None = _default("test_fail_on_row")
    s3_retry_ms: int = _default("s3_retry_ms")

    def __post_init__(self) -> None:
        if self.trigger_ms < 0 or self.catalog_poll_ms <= 0 or self.source_wait_ms < 0:
            raise ValueError(
                f"expected trigger_ms >= 0, source_wait_ms >= 0 and catalog_poll_ms > 0, found "
                f"{self.trigger_ms}, {self.source_wait_ms}, {self.catalog_poll_ms}"
            )
        if self.s3_retry_ms < 0:
            raise ValueError(f"expected s3_retry_ms >= 0, found {self.s3_retry_ms}")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        """One flag per row of :data:`SETTINGS` that has one, its help naming the variable."""
        for s in SETTINGS:
            if s.flag is None or s.owner != "service":
                continue
            if s.repeated:
                p.add_argument(s.flag, action="append", default=[], help=_help(s))
            else:
                p.add_argument(s.flag, type=int if s.parse is int else str, help=_help(s))

    @staticmethod
    def from_env_and_args(
        args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
    ) -> ServiceSettings:
        e = dict(os.environ if env is None else env)
        a = vars(args) if args is not None else {}
        own: dict[str, Any] = {}
        nested: dict[str, str] = {}  # kafka.* and s3.*: handed on as their variables
        for field, s in _BY_FIELD.items():
            if "." not in field:
                own[field] = s.value(a, e)
            elif s.env is not None:
                nested[s.env] = s.text(a, e)
        s3 = S3Settings.from_env({**e, **nested})
        kafka = KafkaSettings.from_env({**e, **nested})
        return ServiceSettings(kafka, s3, **own)

    def serves(self, sink_id: str) -> bool:
        """Whether this instance serves ``sink_id``: its share of the sinks
        (:attr:`sink_shard`), narrowed to :attr:`only_sinks` when that names any."""
        return self.sink_shard.owns(sink_id) and (not self.only_sinks or sink_id in self.only_sinks)

    # -- clients ---------------------------------------------------------------------------
    def store(self) -> S3ObjectStore:
        """One S3 client per settings and process (boto3 clients are thread-safe and costly
        to build: building one per call dominated the services' CPU profile), behind a
        :class:`shared.objectstore.RetryingObjectStore` (a transient error of an idempotent
        call is retried instead of failing the micro-batch or command, for up to
        ``s3_retry_ms``)."""
        store: Any = _s3_store(self.s3)
        if self.faults is not None:
            store = self.faults.wrap_store(store)
        return RetryingObjectStore(store, budget_s=self.s3_retry_ms / 1000.0)  # type: ignore[return-value]

    def catalog(self) -> Catalog:
        return Catalog(self.store())


def _help(s: Setting) -> str:
    text = f"{s.doc} ({s.env}, default {s.shown_default})" if s.env else s.doc
    return text.replace("%", "%%")


@functools.lru_cache(maxsize=16)
def _s3_store(s3: S3Settings) -> S3ObjectStore:
    return S3ObjectStore(s3)


def faults_from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    """The faults ``SHARDSINK_FAULTS`` asks for (test only); None when it is unset."""
    faults: Faults | None = _BY_FIELD["faults"].value({}, os.environ if env is None else env)
    return faults


def markdown_table() -> str:
    """:data:`SETTINGS` as the Markdown table of docs/operations.md's Configuration section."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| Variable | Flag | Default | Meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        var = f"`{s.env}`" if s.env else ""
        flag = f"`{s.flag}`" if s.flag else ""
        if s.field is None:
            default = ""  # read elsewhere: see its meaning
        elif s.default and not s.repeated:
            default = f"`{s.default}`"
        else:
            default = s.shown_default
        doc = s.doc + ("; a deployment must set it" if s.required else "")
        lines.append(f"| {var} | {flag} | {default} | {cell(doc)} |")
    return "\n".join(lines) + "\n"


def controller_default(field: str) -> Any:
    """A controller setting's default (``spark.X``: of its Spark jobs), from :data:`SETTINGS`."""
    return _CONTROLLER[field].default_value


def add_controller_arguments(p: argparse.ArgumentParser) -> None:
    """The controller's own flags (beside :meth:`ServiceSettings.add_arguments`)."""
    for s in _CONTROLLER.values():
        assert s.flag is not None
        p.add_argument(s.flag, type=int if s.parse is int else str, help=_help(s))


def controller_values(args: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Field -> value of every controller setting (flag, else variable, else default);
    ``spark.X`` are the fields of the controller's Spark job settings."""
    e = os.environ if env is None else env
    return {field: s.value(args, e) for field, s in _CONTROLLER.items()}
