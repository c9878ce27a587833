"""confluent-kafka helpers: client settings, partition discovery, and partition ends that are
right on both the embedded Tansu broker and a real Kafka cluster.

Settings
--------
:class:`KafkaSettings` is a bootstrap string plus librdkafka options passed through unchanged
(for SASL/TLS: ``security.protocol``, ``sasl.*``, ``ssl.*``). It is built from

* a mapping (``KafkaSettings.from_options({"bootstrap": ..., "kafka.sasl.mechanism": ...})``,
  the shape of Spark source/sink options: ``kafka.<librdkafka option>``), or
* the environment (``KafkaSettings.from_env()``):

  ====================================  ==========================================
  variable                              librdkafka option
  ====================================  ==========================================
  ``SHARDSINK_KAFKA_BOOTSTRAP``         ``bootstrap.servers``
  ``SHARDSINK_KAFKA_SECURITY_PROTOCOL`` ``security.protocol``
  ``SHARDSINK_KAFKA_SASL_<NAME>``       ``sasl.<name>`` (``_`` becomes ``.``)
  ``SHARDSINK_KAFKA_SSL_<NAME>``        ``ssl.<name>`` (``_`` becomes ``.``)
  ``SHARDSINK_KAFKA_OPTION_<NAME>``     ``<name>``: any other option (``_`` becomes ``.``)
  ====================================  ==========================================

  A variable ending in ``_FILE`` names a file holding the value (a mounted secret), e.g.
  ``SHARDSINK_KAFKA_SASL_PASSWORD_FILE=/secrets/kafka/password`` sets ``sasl.password`` to the
  file's contents (trailing newline stripped); the direct variable wins when both are set.

  e.g. ``SHARDSINK_KAFKA_SASL_MECHANISM=SCRAM-SHA-512``, ``SHARDSINK_KAFKA_SSL_CA_LOCATION=/ca.pem``,
  ``SHARDSINK_KAFKA_OPTION_CLIENT_ID=mint``. librdkafka option names contain no ``_``, so the
  mapping is unambiguous. Other ``SHARDSINK_KAFKA_*`` variables (topic names and the like used
  by the services) are not passed to librdkafka.

  ``SHARDSINK_KAFKA_FETCH_WAIT_MS`` (``fetchWaitMs`` among Spark-style options) is not a
  librdkafka option: it is the least ``fetch.wait.max.ms`` of every consumer
  (:attr:`KafkaSettings.fetch_wait_ms`; see "Fetch waits" below).

Fetch waits (the embedded broker's listing)
-------------------------------------------
Each reader picks its own ``fetch.wait.max.ms``, small (5-20 ms) where it re-assigns its
consumer often: librdkafka keeps one fetch in flight per broker, so a new assignment waits for
a fetch parked at a partition's end. Tansu 0.6 (memory storage) answers a fetch by listing
every record batch of the partition, **within the fetch's wait**, and stops listing when the
wait is over: a fetch whose offset lies past what it listed in time comes back empty, and
librdkafka fetches again at once, with the broker burning a core. Measured on these machines,
one-record batches, a 5 ms wait: the last record of a partition of 5,000 batches came in
0.22 s, of 8,000 in 2.3 s or not within 20 s; with a 200 ms wait, every offset of a partition
of 20,000 batches came in 0.2-0.4 s. The benchmark's desired partitions hold about 3,250
batches each after its six 200k bursts, which a loaded machine does not list in 5 ms.
:attr:`KafkaSettings.fetch_wait_ms` raises every consumer's wait to at least that much; the
embedded stack sets it (:data:`shared.devstack.embedded.EMBEDDED_FETCH_WAIT_MS`). The price, on
Tansu: a fetch parked at a partition's end looks again after half its remaining wait, so a
record that arrives there is seen up to half the wait late. On real Kafka a fetch returns as
soon as a record arrives, and ListOffsets and fetches find offsets by index: leave it unset.

Partition ends (the Tansu quirk)
--------------------------------
Tansu 0.6's ``ListOffsets(latest)`` (and therefore ``get_watermark_offsets`` and
``AdminClient.list_offsets``) under-reports: it answers the base offset of the last record
batch plus one. Measured on the embedded broker: after producing a batch of 5 records and then
a batch of 3, both calls answer 6 where the true end is 8; after four batches of 1000, 3001
where the end is 4000. The true end is found by fetching from ``watermark - 1`` with an
``assign()``ed consumer and ``enable.partition.eof``: the broker returns the whole last batch
and librdkafka then signals end-of-partition; the end is ``max(last offset + 1, eof offset)``.
On real Kafka the watermark is exact, the fetch returns the last record and the EOF signal
reports the watermark, so the same probe agrees with ``ListOffsets``.

The probe is kept cheap: one ``ListOffsets`` request covers all partitions; a partition whose
watermark has not moved since the last probe has not received a new batch (on Tansu a new batch
moves the answer to its own base offset + 1, which is beyond the old one), so its cached end is
reused; only partitions whose watermark moved are fetched, all in one ``assign()``.

ListOffsets goes through an ``AdminClient`` (one per probe, kept): a partition without a known
leader (the broker unreachable) is librdkafka's ``_NOENT`` "No leaders found", a transient
:class:`KafkaUnavailableError`. The consumer's ``offsets_for_times`` (-1/-2) gives the same
answers in the steady state, but answers a partition whose leader is unknown with
``_UNKNOWN_PARTITION``, also for a while after the broker is back, which reads as "the topic
is gone": tried, it ended subscribes and failed the fault campaign.

A fetch that outlives its topic (the embedded broker and librdkafka)
--------------------------------------------------------------------
A Fetch (v13+) that Tansu 0.6 answers for a topic id it no longer has (the topic deleted, or
deleted and re-created, while the fetch waited) carries a leader hint (KIP-951) for a topic id
of zeros; librdkafka (every version tried, 2.8 to 2.16) then looks the topic up by a null name
and the process dies (SIGSEGV in ``rd_kafka_metadata_update_op``). Measured: a consumer that
fetched from a topic, ``unassign()``, the topic deleted within the fetch's
``fetch.wait.max.ms``: three crashes in three runs; a consumer closed before the deletion, or
one that only asked ListOffsets: none. So a client that reads a topic is closed (or idle for
longer than its ``fetch.wait.max.ms``) before the topic is deleted: ``shardsink tail`` closes
its consumer before deleting its output topic, and the controller's count consumer waits at
most 10 ms per fetch, whatever :attr:`KafkaSettings.fetch_wait_ms` says (:func:`new_consumer_own_wait`).
Real Kafka answers such a fetch with the topic's own id.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

from shared.errors import (
    KafkaAdapterError,
    KafkaConfigError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    UnknownTopicError,
)

#: Env prefix of the Kafka settings.
ENV_PREFIX = "SHARDSINK_KAFKA_"
#: Env suffixes (after :data:`ENV_PREFIX`) that map to librdkafka options by lower-casing and
#: replacing ``_`` with ``.``, keeping the prefix itself.
_ENV_PASSTHROUGH_PREFIXES = ("SECURITY_PROTOCOL", "SASL_", "SSL_")
_ENV_OPTION_PREFIX = "OPTION_"

#: librdkafka options that keep shutdown quiet (Tansu closes idle connections).
_QUIET = {"log.connection.close": "false"}
#: Once a broker is unreachable, librdkafka tries it again at most this far apart (its own
#: default, 10 s, kept a client away from a broker that came back for up to 10 s after a
#: network partition healed; the Java client's default is 1 s).
_RECONNECT = {"reconnect.backoff.max.ms": "1000"}

#: The most verbose librdkafka log level (syslog numbering) for clients created from now on;
#: None: librdkafka's default. The CLI lowers it (see :func:`quiet_client_logs`).
_CLIENT_LOG_LEVEL: int | None = None


def quiet_client_logs(level: int | None) -> None:
    """librdkafka writes only log lines at ``level`` or more severe (syslog numbering: 2 is
    critical, 3 error, 6 info) for every Kafka client created from now on; None: its default.

    A level, not a Python ``logger``: confluent-kafka calls a Python logger from inside
    ``poll``/``flush`` without handling an exception it raises, so a Ctrl-C that lands in the
    callback corrupts the interpreter (confluent-kafka-python issue 1708; seen here as a
    segmentation fault of a CLI ``tail`` cancelled by Ctrl-C)."""
    global _CLIENT_LOG_LEVEL
    _CLIENT_LOG_LEVEL = level


@dataclass(frozen=True, slots=True)
class KafkaSettings:
    """Where the brokers are and how to talk to them.

    ``options`` are librdkafka options passed through unchanged (sorted pairs, so the value is
    hashable and picklable).
    """

    bootstrap: str
    options: tuple[tuple[str, str], ...] = ()
    #: The least ``fetch.wait.max.ms`` of every consumer made from these settings (0: each
    #: reader's own). For brokers that need time to find an offset: see "Fetch waits" above.
    fetch_wait_ms: int = 0

    def __repr__(self) -> str:  # never print secrets (sasl.password, ssl.key.password...)
        shown = tuple((k, "***" if any(w in k for w in ("password", "secret", "pem", "jaas")) else v)
                      for k, v in self.options)
        wait = f", fetch_wait_ms={self.fetch_wait_ms}" if self.fetch_wait_ms else ""
        return f"KafkaSettings(bootstrap={self.bootstrap!r}, options={shown!r}{wait})"

    def __post_init__(self) -> None:
        if not self.bootstrap or not isinstance(self.bootstrap, str):
            raise KafkaConfigError(
                f"expected a bootstrap string 'host:port[,host:port]', found {self.bootstrap!r}"
            )
        for k, v in self.options:
            if k == "bootstrap.servers":
                raise KafkaConfigError(
                    "expected the bootstrap servers in 'bootstrap', found them in the options"
                )
            if not isinstance(v, str):
                raise KafkaConfigError(f"expected a string value for option {k!r}, found {v!r}")
        if not isinstance(self.fetch_wait_ms, int) or isinstance(self.fetch_wait_ms, bool) or self.fetch_wait_ms < 0:
            raise KafkaConfigError(f"expected the least fetch wait as whole milliseconds >= 0, found {self.fetch_wait_ms!r}")

    @staticmethod
    def of(bootstrap: str, options: Mapping[str, Any] | None = None) -> KafkaSettings:
        opts = {k: str(v) for k, v in (options or {}).items()}
        if "bootstrap.servers" in opts:
            bootstrap = bootstrap or opts.pop("bootstrap.servers")
            opts.pop("bootstrap.servers", None)
        return KafkaSettings(bootstrap, tuple(sorted(opts.items())))

    @staticmethod
    def from_options(options: Mapping[str, str]) -> KafkaSettings:
        """From Spark-style options: ``bootstrap`` (or ``kafka.bootstrap.servers``) and
        ``kafka.<librdkafka option>``. Keys are matched case-insensitively for ``bootstrap``;
        librdkafka option names are lower case already."""
        bootstrap = ""
        opts: dict[str, str] = {}
        wait = 0
        for k, v in options.items():
            kl = k.lower()
            if kl == "bootstrap":
                bootstrap = str(v)
            elif kl == "fetchwaitms":
                wait = _fetch_wait(str(v), k)
            elif kl.startswith("kafka."):
                name = kl[len("kafka.") :]
                if name == "bootstrap.servers":
                    bootstrap = bootstrap or str(v)
                else:
                    opts[name] = str(v)
        if not bootstrap:
            raise KafkaConfigError(
                "expected option 'bootstrap' (or 'kafka.bootstrap.servers'), found none among "
                f"{sorted(options)}"
            )
        return KafkaSettings(bootstrap, tuple(sorted(opts.items())), wait)

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> KafkaSettings:
        """From ``SHARDSINK_KAFKA_*`` variables (see the module docstring for the mapping)."""
        env = os.environ if environ is None else environ
        bootstrap = env.get(ENV_PREFIX + "BOOTSTRAP", "")
        if not bootstrap:
            raise KafkaConfigError(
                f"expected {ENV_PREFIX}BOOTSTRAP to be set to 'host:port', found it unset"
            )
        wait = _fetch_wait(env.get(FETCH_WAIT_ENV, "") or "0", FETCH_WAIT_ENV)
        return KafkaSettings(bootstrap, tuple(sorted(env_options(env).items())), wait)

    def to_options(self) -> dict[str, str]:
        """The Spark-style options (inverse of :meth:`from_options`)."""
        wait = {"fetchWaitMs": str(self.fetch_wait_ms)} if self.fetch_wait_ms else {}
        return {"bootstrap": self.bootstrap, **wait, **{f"kafka.{k}": v for k, v in self.options}}

    def config(self, **extra: Any) -> dict[str, Any]:
        """A confluent-kafka client config: defaults, then ``extra``, then the pass-through
        options (so that a user's option wins over our defaults)."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, **_QUIET, **_RECONNECT}
        if _CLIENT_LOG_LEVEL is not None:
            conf["log_level"] = _CLIENT_LOG_LEVEL
        conf.update(extra)
        conf.update(dict(self.options))
        return conf


#: The variable of :attr:`KafkaSettings.fetch_wait_ms` (not a librdkafka option).
FETCH_WAIT_ENV = ENV_PREFIX + "FETCH_WAIT_MS"


def _fetch_wait(text: str, where: str) -> int:
    try:
        wait = int(text)
    except ValueError:
        wait = -1
    if wait < 0:
        raise KafkaConfigError(f"expected {where} as whole milliseconds >= 0, found {text!r}")
    return wait


def env_options(environ: Mapping[str, str]) -> dict[str, str]:
    """The librdkafka options named by ``SHARDSINK_KAFKA_*`` variables."""
    out: dict[str, str] = {}
    from_files: dict[str, str] = {}
    for k, v in environ.items():
        if not k.startswith(ENV_PREFIX):
            continue
        rest = k[len(ENV_PREFIX) :]
        is_file = rest.endswith("_FILE")
        if is_file:
            rest = rest[: -len("_FILE")]
        if rest.startswith(_ENV_OPTION_PREFIX):
            name = rest[len(_ENV_OPTION_PREFIX) :]
        elif rest.startswith(_ENV_PASSTHROUGH_PREFIXES):
            name = rest
        else:
            continue
        if not name:
            continue
        if is_file:  # a mounted secret: the value is the file's contents
            try:
                with open(v, encoding="utf-8") as f:
                    from_files[name.lower().replace("_", ".")] = f.read().rstrip("\r\n")
            except OSError as e:
                raise KafkaConfigError(f"expected a readable file in {k}, found {v!r}: {e.strerror}") from None
        else:
            out[name.lower().replace("_", ".")] = v
    return {**from_files, **out}


def translate(e: BaseException, what: str) -> KafkaAdapterError:
    """A confluent_kafka error as one of ours (raise it ``from e``)."""
    err = e.args[0] if isinstance(e, KafkaException) and e.args else None
    if isinstance(err, KafkaError):
        code = err.code()
        msg = f"{what}: expected success, found {err.name()} ({err.str()})"
        if code in (KafkaError._INVALID_ARG, KafkaError.INVALID_CONFIG):
            return KafkaConfigError(msg, code=code)
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
                    KafkaError._UNKNOWN_PARTITION):
            return UnknownTopicError(msg, code=code)
        if code in (KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT):
            return KafkaTimeoutError(msg, code=code)
        if code in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                    KafkaError._RESOLVE, KafkaError.BROKER_NOT_AVAILABLE,
                    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION):
            return KafkaUnavailableError(msg, code=code)
        if code == KafkaError._NOENT and "leader" in err.str().lower():
            # ListOffsets with no broker reachable: "Failed to query partition leaders"
            return KafkaUnavailableError(msg, code=code)
        return KafkaAdapterError(msg, code=code)
    if isinstance(e, (ValueError, TypeError)):  # confluent_kafka's errors for bad configs
        return KafkaConfigError(f"{what}: expected a valid client config, found: {e}")
    return KafkaAdapterError(f"{what}: expected success, found {type(e).__name__}: {e}")


def new_consumer(settings: KafkaSettings, **extra: Any) -> Consumer:
    """A consumer for ``assign()`` use only (never ``subscribe()``: group joins take about 20 s
    on Tansu, and Spark or the service owns the offsets). librdkafka insists on a group id; a
    random one that never joins or commits costs nothing."""
    return _consumer(consumer_config(settings, extra))


def new_consumer_own_wait(settings: KafkaSettings, **extra: Any) -> Consumer:
    """:func:`new_consumer` whose ``fetch.wait.max.ms`` is its own even below
    :attr:`KafkaSettings.fetch_wait_ms`: for a reader whose fetch must not outlive a topic that
    may be deleted (see above)."""
    return _consumer(consumer_config(settings, extra, wait_floor=False))


def _consumer(conf: dict[str, Any]) -> Consumer:
    try:
        return Consumer(conf)
    except (KafkaException, ValueError, TypeError) as e:
        raise translate(e, "creating a Kafka consumer") from e


def consumer_config(settings: KafkaSettings, extra: Mapping[str, Any] | None = None, *,
                    wait_floor: bool = True) -> dict[str, Any]:
    """The config of :func:`new_consumer`: its ``fetch.wait.max.ms`` (the reader's own, else
    librdkafka's 500) raised to :attr:`KafkaSettings.fetch_wait_ms` with ``wait_floor``, unless
    the options set it."""
    conf = settings.config(
        **{
            "group.id": f"shardsink-assign-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": "false",
            "enable.auto.offset.store": "false",
            **(extra or {}),
        }
    )
    if wait_floor and settings.fetch_wait_ms and "fetch.wait.max.ms" not in dict(settings.options):
        own = int(conf.get("fetch.wait.max.ms", 500))
        conf["fetch.wait.max.ms"] = str(max(own, settings.fetch_wait_ms))
    return conf


def consumer_pool_key(settings: KafkaSettings, extra: Mapping[str, Any]) -> str:
    """What tells pooled consumers apart: the config :func:`new_consumer` gives them (the least
    fetch wait applied), its random group id aside."""
    return repr(sorted((k, v) for k, v in consumer_config(settings, extra).items() if k != "group.id"))


def consume_available(consumer: Consumer, max_messages: int, timeout_s: float) -> list[Any]:
    """Up to ``max_messages`` messages: waits at most ``timeout_s`` for the first, then takes
    those already fetched without waiting. (``Consumer.consume(n, timeout)`` returns only
    once it has ``n`` messages or the timeout has passed: a lone command or response waited
    the whole timeout, 50 ms on the controller's loop and on the client's.)"""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *(consumer.consume(num_messages=max_messages - 1, timeout=0) if max_messages > 1 else [])]


#: How long the broker holds a fetch of :meth:`OffsetProbe.await_records` that finds no record.
WATCH_FETCH_WAIT_MS = 100
#: The probe's consumer: fetches the partitions' last batches and answers at their end.
_PROBE_CONSUMER = {"enable.partition.eof": "true", "auto.offset.reset": "error", "fetch.wait.max.ms": "10"}
#: The watcher's consumer (:meth:`OffsetProbe.await_records`): fetches wait at the broker.
_WATCH_CONSUMER = {"enable.partition.eof": "false", "auto.offset.reset": "latest",
                   "fetch.wait.max.ms": str(WATCH_FETCH_WAIT_MS)}


@dataclass(frozen=True, slots=True)
class PartitionEnd:
    """A cached end: ``watermark`` as ListOffsets answered it, ``end`` as probed."""

    watermark: int
    end: int


@dataclass
class OffsetProbe:
    """Long-lived partition discovery and end-offset probe (see the module docstring).

    Holds one consumer and one admin client; ``close()`` (or a ``with`` block) releases them.
    Not thread-safe. The cache is per instance: a Spark source keeps one on its driver side.
    """

    settings: KafkaSettings
    timeout_s: float = 30.0
    _consumer: Consumer | None = field(default=None, init=False, repr=False)
    _admin: AdminClient | None = field(default=None, init=False, repr=False)
    _watcher: Consumer | None = field(default=None, init=False, repr=False)
    _ends: dict[tuple[str, int], PartitionEnd] = field(default_factory=dict, init=False, repr=False)
    #: Ends that fetches of :meth:`await_records` saw (true ends when fetched; an end only grows).
    _fetched: dict[tuple[str, int], int] = field(default_factory=dict, init=False, repr=False)
    #: Number of partitions fetched by the last probe (for tests and benchmarks).
    last_probed: int = field(default=0, init=False)

    # -- clients -------------------------------------------------------------------------------
    def _c(self) -> Consumer:
        if self._consumer is None:
            self._consumer = new_consumer(self.settings, **_PROBE_CONSUMER)
        return self._consumer

    def _a(self) -> AdminClient:
        if self._admin is None:
            try:
                self._admin = AdminClient(self.settings.config())
            except (KafkaException, ValueError) as e:
                raise translate(e, "creating a Kafka admin client") from e
        return self._admin

    def _w(self) -> Consumer:
        if self._watcher is None:
            self._watcher = new_consumer(self.settings, **_WATCH_CONSUMER)
        return self._watcher

    def close(self) -> None:
        for c in (self._consumer, self._watcher):
            if c is not None:
                c.close()
        self._consumer = self._watcher = None
        self._admin = None

    def __enter__(self) -> OffsetProbe:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- queries -------------------------------------------------------------------------------
    def partitions_of(self, topic: str) -> list[int]:
        """The partition ids of ``topic``, sorted. Raises :class:`UnknownTopicError`."""
        try:
            md = self._c().list_topics(topic=topic, timeout=self.timeout_s)
        except KafkaException as e:
            raise translate(e, f"listing partitions of topic {topic!r}") from e
        parts = _partitions_in(md, topic)
        if parts is None:
            raise UnknownTopicError(
                f"expected topic {topic!r} to exist, found it unknown to the broker", topic=topic
            )
        return parts

    def partitions_of_many(self, topics: Iterable[str]) -> dict[str, list[int]]:
        """The partition ids of each of ``topics`` that exists, sorted, from one metadata
        request for every topic of the cluster (one request instead of one per topic); a topic
        the broker does not know is left out. Raises for any other error of a topic asked for."""
        try:
            md = self._c().list_topics(timeout=self.timeout_s)
        except KafkaException as e:
            raise translate(e, "listing the cluster's topics") from e
        found = {topic: _partitions_in(md, topic) for topic in topics}
        return {topic: parts for topic, parts in found.items() if parts is not None}

    def watermarks(self, tps: Iterable[tuple[str, int]], earliest: bool = False) -> dict[tuple[str, int], int]:
        """ListOffsets (latest, or earliest) for many partitions in one request. Latest
        under-reports on Tansu: use :meth:`end_offsets` for the end."""
        spec = OffsetSpec.earliest() if earliest else OffsetSpec.latest()  # type: ignore[no-untyped-call]
        req = {TopicPartition(t, p): spec for t, p in tps}
        if not req:
            return {}
        try:
            futs = self._a().list_offsets(req, request_timeout=self.timeout_s)
            out = {(tp.topic, tp.partition): int(f.result().offset) for tp, f in futs.items()}
        except KafkaException as e:
            raise translate(e, "listing offsets") from e
        # A request that times out with the broker cut off (its leaders known from before)
        # answers OFFSET_INVALID (-1001) with no error: no answer, never an offset.
        missing = sorted(tp for tp, off in out.items() if off < 0)
        if missing:
            raise KafkaTimeoutError(
                f"listing offsets: expected an offset for every partition within {self.timeout_s} s, "
                f"found none for {missing[:5]}"
            )
        return out

    def start_offsets(self, topic: str) -> dict[int, int]:
        """The first available offset of every partition of ``topic`` (0 unless retention
        deleted records)."""
        parts = self.partitions_of(topic)
        wm = self.watermarks([(topic, p) for p in parts], earliest=True)
        return {p: wm[(topic, p)] for p in parts}

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The true end (next offset to be written) of every partition of ``topic``."""
        parts = self.partitions_of(topic)
        ends = self.ends([(topic, p) for p in parts])
        return {p: ends[(topic, p)] for p in parts}

    def ends(self, tps: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The true ends of the given partitions, probing only those whose watermark moved
        past what a fetch of :meth:`await_records` already saw (a watermark at or below an end
        a fetch saw means no batch began after that fetch: that end is still the true one)."""
        tps = list(tps)
        wms = self.watermarks(tps)
        out: dict[tuple[str, int], int] = {}
        to_probe: dict[tuple[str, int], int] = {}
        for tp in tps:
            wm, seen = wms[tp], self._fetched.get(tp, 0)
            cached = self._ends.get(tp)
            if cached is not None and cached.watermark == wm:
                out[tp] = max(cached.end, seen)
            elif wm <= 0:
                out[tp] = seen
            elif seen >= wm:
                self._ends[tp] = PartitionEnd(wm, seen)
                out[tp] = seen
            else:
                to_probe[tp] = wm
        self.last_probed = len(to_probe)
        if to_probe:
            probed = self._probe(to_probe)
            for tp, wm in to_probe.items():
                end = max(probed[tp], wm)
                prev = self._ends.get(tp)
                end = max(end, prev.end if prev else 0)  # the end only grows
                self._ends[tp] = PartitionEnd(wm, end)
                out[tp] = end
        return out

    def ends_in_turn(self, *groups: Sequence[tuple[str, int]]) -> list[dict[tuple[str, int], int]]:
        """:meth:`ends` of each group of partitions, one look per group, in order: a record
        within an earlier group's ends was produced before a later group's ends were taken. In
        one look a partition's end is its ``ListOffsets`` answer or, where that moved, what a
        fetch after it saw: one partition's end could be newer than another's."""
        return [self.ends(tps) if tps else {} for tps in groups]

    def await_records(self, positions: Mapping[tuple[str, int], int], timeout_s: float) -> dict[tuple[str, int], int]:
        """Wait up to ``timeout_s`` for a record at or past ``positions`` (next offsets) on any
        of those partitions. Returns what the fetch taught about their ends (past each record
        fetched, or the fetch response's high watermark), empty when no record came in time;
        :meth:`ends` remembers them (it answers no less, and probes no partition whose
        watermark they cover).

        The watcher's fetches wait at the broker (``fetch.wait.max.ms``,
        :data:`WATCH_FETCH_WAIT_MS`) until a record arrives: measured on the embedded broker,
        a record reaches the caller 1-6 ms after its produce, and an idle wait of 3 s costs
        about 6 ms of CPU. Errors of the fetch (a partition gone, a broker restarting) do not
        end the wait early; the next probe of the ends meets them, typed."""
        if not positions or timeout_s <= 0:
            return {}
        c = self._w()
        deadline = time.monotonic() + timeout_s
        try:
            c.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])
            got: list[Any] = []
            while not got:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {}
                first = c.poll(left)
                if first is None:
                    return {}
                got = [m for m in [first, *c.consume(num_messages=1000, timeout=0)] if m.error() is None]
            out: dict[tuple[str, int], int] = {}
            for m in got:
                tp = (str(m.topic()), int(m.partition() or 0))
                out[tp] = max(out.get(tp, 0), int(m.offset() or 0) + 1)
            for tp in out:
                _, hw = c.get_watermark_offsets(TopicPartition(*tp), cached=True)
                out[tp] = max(out[tp], int(hw))
                self._fetched[tp] = max(out[tp], self._fetched.get(tp, 0))
            return out
        except KafkaException as e:
            raise translate(e, f"waiting for records on {sorted(positions)}") from e
        finally:
            try:
                c.unassign()
            except KafkaException:
                pass

    def _probe(self, wms: Mapping[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Fetch the last batch of every partition (from ``watermark - 1``): the first record
        fetched brings the fetch response's high watermark (the true end, also on Tansu,
        whose ListOffsets alone under-reports), else read on until EOF. Asking for no more
        records than partitions are pending keeps librdkafka from handing the rest of each
        batch to Python, a message object per record (on Tansu the last batch is read whole:
        hundreds of records per partition during a burst, at every trigger of every query)."""
        c = self._c()
        found: dict[tuple[str, int], int] = {tp: wm for tp, wm in wms.items()}
        pending = set(wms)
        try:
            c.assign([TopicPartition(t, p, wm - 1) for (t, p), wm in wms.items()])
            deadline = time.monotonic() + self.timeout_s
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KafkaTimeoutError(
                        f"expected end-of-partition within {self.timeout_s}s while probing the "
                        f"ends of {sorted(pending)}, found none",
                        partitions=sorted(pending),
                    )
                for m in c.consume(num_messages=max(1, len(pending)), timeout=min(left, 0.02)):
                    tp = (str(m.topic()), int(m.partition() or 0))
                    off = int(m.offset() or 0)
                    err = m.error()
                    if err is None:
                        found[tp] = max(found[tp], off + 1)
                        if tp in pending:
                            _, hw = c.get_watermark_offsets(TopicPartition(*tp), cached=True)
                            if hw > off:  # the fetch response's high watermark: the end
                                found[tp] = max(found[tp], int(hw))
                                pending.discard(tp)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        found[tp] = max(found[tp], off)
                        pending.discard(tp)
                    elif err.code() == KafkaError._AUTO_OFFSET_RESET:
                        # watermark - 1 below the log start: the partition is empty of
                        # records (real Kafka after retention); the watermark is the end.
                        pending.discard(tp)
                    else:
                        raise translate(KafkaException(err), f"probing the end of {tp}")
        finally:
            try:
                c.unassign()
            except KafkaException:
                pass
        return found


def _partitions_in(md: Any, topic: str) -> list[int] | None:
    """The sorted partition ids of ``topic`` in the cluster metadata ``md``; None when the
    broker does not know it. Raises for any other error of the topic."""
    tmd = md.topics.get(topic)
    if tmd is None or tmd.error is not None and tmd.error.code() in (
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
    ):
        return None
    if tmd.error is not None:
        raise translate(KafkaException(tmd.error), f"listing partitions of topic {topic!r}")
    return sorted(tmd.partitions)


def partitions_of(settings: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[int]:
    """The partition ids of ``topic`` (one-shot; keep an :class:`OffsetProbe` for repeated use)."""
    with OffsetProbe(settings, timeout_s) as p:
        return p.partitions_of(topic)


def end_offsets(settings: KafkaSettings, topic: str, timeout_s: float = 30.0) -> dict[int, int]:
    """The true end of every partition of ``topic`` (one-shot; see :class:`OffsetProbe`)."""
    with OffsetProbe(settings, timeout_s) as p:
        return p.end_offsets(topic)
