"""The confluent-kafka adapter: settings mapping, partition discovery, and partition ends that
are right on the embedded Tansu broker (whose ListOffsets under-reports the end)."""

from __future__ import annotations


import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from shared.devstack.embedded import EmbeddedStack
from shared.errors import KafkaConfigError, UnknownTopicError
from shared.io.kafka import KafkaSettings, OffsetProbe, consumer_config, end_offsets, env_options, partitions_of


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(timeout=30)


def produce_batches(bootstrap: str, topic: str, partition: int, sizes: list[int]) -> None:
    """Each size is one flush (so one record batch on the broker)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})
    n = 0
    for size in sizes:
        for _ in range(size):
            p.produce(topic, value=b"v%d" % n, partition=partition)
            n += 1
        assert p.flush(30) == 0


def count_records(bootstrap: str, topic: str, partition: int) -> int:
    """Reads the partition from 0 to end-of-partition the plain way and counts."""
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "count", "enable.partition.eof": True,
         "enable.auto.commit": False}
    )
    c.assign([TopicPartition(topic, partition, 0)])
    n = 0
    try:
        while True:
            m = c.poll(10)
            assert m is not None, "expected records or end-of-partition, found nothing in 10 s"
            if m.error():
                return n
            n += 1
    finally:
        c.close()


def test_settings_from_env_map_sasl_ssl_and_option_variables() -> None:
    env = {
        "SHARDSINK_KAFKA_BOOTSTRAP": "b1:9092,b2:9092",
        "SHARDSINK_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SHARDSINK_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "SHARDSINK_KAFKA_SASL_USERNAME": "u",
        "SHARDSINK_KAFKA_SSL_CA_LOCATION": "/ca.pem",
        "SHARDSINK_KAFKA_OPTION_CLIENT_ID": "mint",
        "SHARDSINK_KAFKA_COMMANDS_TOPIC": "commands",  # not a librdkafka option
        "OTHER": "x",
    }
    s = KafkaSettings.from_env(env)
    assert s.bootstrap == "b1:9092,b2:9092"
    assert dict(s.options) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "ssl.ca.location": "/ca.pem",
        "client.id": "mint",
    }
    assert env_options(env) == dict(s.options)
    conf = s.config(**{"linger.ms": 5})
    assert conf["bootstrap.servers"] == "b1:9092,b2:9092"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512" and conf["linger.ms"] == 5


def test_settings_from_spark_options_round_trip() -> None:
    opts = {"bootstrap": "h:1", "kafka.sasl.mechanism": "PLAIN", "topics": "a"}
    s = KafkaSettings.from_options(opts)
    assert s == KafkaSettings("h:1", (("sasl.mechanism", "PLAIN"),))
    assert KafkaSettings.from_options(s.to_options()) == s
    with pytest.raises(KafkaConfigError, match="expected option 'bootstrap'"):
        KafkaSettings.from_options({"topics": "a"})
    with pytest.raises(KafkaConfigError, match="BOOTSTRAP"):
        KafkaSettings.from_env({})


def test_the_least_fetch_wait_raises_every_consumer_s_own_and_travels_with_the_settings() -> None:
    """``SHARDSINK_KAFKA_FETCH_WAIT_MS`` is no librdkafka option: it raises each consumer's
    ``fetch.wait.max.ms`` to at least its value (librdkafka's 500 where a reader sets none),
    keeps a longer one, yields to the options and to a reader that opts out, and survives the
    trip through Spark-style options."""
    env = {"SHARDSINK_KAFKA_BOOTSTRAP": "h:1", "SHARDSINK_KAFKA_FETCH_WAIT_MS": "50"}
    s = KafkaSettings.from_env(env)
    assert s.fetch_wait_ms == 50 and s.options == () and "fetch.wait.max.ms" not in s.config()
    assert consumer_config(s, {"fetch.wait.max.ms": "5"})["fetch.wait.max.ms"] == "50"
    assert consumer_config(s, {"fetch.wait.max.ms": "100"})["fetch.wait.max.ms"] == "100"
    assert consumer_config(s)["fetch.wait.max.ms"] == "500"
    assert consumer_config(s, {"fetch.wait.max.ms": "10"}, wait_floor=False)["fetch.wait.max.ms"] == "10"
    assert consumer_config(KafkaSettings("h:1"), {"fetch.wait.max.ms": "5"})["fetch.wait.max.ms"] == "5"
    mine = KafkaSettings.from_env({**env, "SHARDSINK_KAFKA_OPTION_FETCH_WAIT_MAX_MS": "7"})
    assert consumer_config(mine, {"fetch.wait.max.ms": "5"})["fetch.wait.max.ms"] == "7"
    assert KafkaSettings.from_options(s.to_options()) == s
    assert KafkaSettings.from_options({"bootstrap": "h:1", "fetchWaitMs": "20"}).fetch_wait_ms == 20
    assert KafkaSettings.from_env({"SHARDSINK_KAFKA_BOOTSTRAP": "h:1"}).fetch_wait_ms == 0
    for bad in ("-1", "fast", "2.5"):
        with pytest.raises(KafkaConfigError, match="SHARDSINK_KAFKA_FETCH_WAIT_MS"):
            KafkaSettings.from_env({**env, "SHARDSINK_KAFKA_FETCH_WAIT_MS": bad})
    with pytest.raises(KafkaConfigError, match="least fetch wait"):
        KafkaSettings("h:1", fetch_wait_ms=-5)


def test_partitions_of_lists_every_partition_and_unknown_topic_is_typed(
    stack: EmbeddedStack, unique_id: str
) -> None:
    topic = f"parts-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 3)
    s = KafkaSettings.of(stack.bootstrap_servers)
    assert partitions_of(s, topic) == [0, 1, 2]
    with pytest.raises(UnknownTopicError, match="expected topic"):
        partitions_of(s, f"missing-{unique_id}")


def test_partitions_of_many_lists_every_topic_in_one_request_and_leaves_unknown_ones_out(
    stack: EmbeddedStack, unique_id: str
) -> None:
    """The partitions of several topics from one metadata request for the cluster's topics:
    each existing topic's partitions, sorted, and a topic the broker does not know left out
    (not an error: a source looks it up again later)."""
    a, b, missing = f"many-a-{unique_id}", f"many-b-{unique_id}", f"many-missing-{unique_id}"
    create_topic(stack.bootstrap_servers, a, 3)
    create_topic(stack.bootstrap_servers, b, 1)
    with OffsetProbe(KafkaSettings.of(stack.bootstrap_servers)) as probe:
        assert probe.partitions_of_many([a, missing, b]) == {a: [0, 1, 2], b: [0]}
        assert probe.partitions_of_many([missing]) == {}


def test_end_offsets_count_every_record_of_the_last_batch(
    stack: EmbeddedStack, unique_id: str
) -> None:
    bs = stack.bootstrap_servers
    topic = f"ends-{unique_id}"
    create_topic(bs, topic, 3)
    produce_batches(bs, topic, 0, [5, 3])
    produce_batches(bs, topic, 1, [1])
    s = KafkaSettings.of(bs)
    with OffsetProbe(s) as probe:
        ends = probe.end_offsets(topic)
        assert ends == {0: 8, 1: 1, 2: 0}
        assert ends[0] == count_records(bs, topic, 0)
        # the quirk being worked around: ListOffsets answers at most the true end
        wm = probe.watermarks([(topic, 0)])[(topic, 0)]
        assert wm <= ends[0]
        # unchanged watermarks: answered from the cache, nothing fetched
        assert probe.end_offsets(topic) == ends and probe.last_probed == 0
        produce_batches(bs, topic, 1, [4, 6])
        assert probe.end_offsets(topic) == {0: 8, 1: 11, 2: 0}
        assert probe.last_probed == 1
        # a large last batch: its end comes from the fetch's high watermark, not a read of it
        produce_batches(bs, topic, 2, [2500])
        assert probe.end_offsets(topic) == {0: 8, 1: 11, 2: 2500}
        assert count_records(bs, topic, 2) == 2500
    assert end_offsets(s, topic) == {0: 8, 1: 11, 2: 2500}


def test_bad_librdkafka_option_is_a_config_error(stack: EmbeddedStack) -> None:
    s = KafkaSettings.of(stack.bootstrap_servers, {"no.such.option": "1"})
    with pytest.raises(KafkaConfigError, match="no.such.option"):
        partitions_of(s, "anything")




def test_unreachable_brokers_are_typed_as_unavailable_and_clients_reconnect_within_a_second() -> None:
    """ListOffsets with no broker reachable (a network partition) fails with librdkafka's
    _NOENT "No leaders found": a KafkaUnavailableError (transient), which the Kafka source
    waits out. Clients try an unreachable broker again at most 1 s apart (librdkafka's default
    of 10 s kept them away from a healed broker), unless the user sets it."""
    from confluent_kafka import KafkaError, KafkaException

    from shared.errors import KafkaAdapterError, KafkaUnavailableError
    from shared.io.kafka import translate

    noent = KafkaException(KafkaError(KafkaError._NOENT, "Failed to query partition leaders: No leaders found"))
    assert isinstance(translate(noent, "listing offsets"), KafkaUnavailableError)
    other = translate(KafkaException(KafkaError(KafkaError._NOENT, "no such entry")), "x")
    assert isinstance(other, KafkaAdapterError) and not isinstance(other, KafkaUnavailableError)
    assert KafkaSettings("b:9092").config()["reconnect.backoff.max.ms"] == "1000"
    assert KafkaSettings.of("b:9092", {"reconnect.backoff.max.ms": "5000"}).config()["reconnect.backoff.max.ms"] == "5000"


def test_offsets_asked_during_a_kafka_partition_are_transient_and_answer_after_the_heal() -> None:
    """ListOffsets while the broker is cut off (a partition: connections refused) is a
    transient error the sources and the controller wait out, never "the topic is gone" (an
    UnknownTopicError ends a subscribe); once healed, the same probe answers again. Some cuts
    find the leaders still cached: librdkafka then times out and answers offset -1001 with no
    error, which must raise too (it once passed for an end offset); rounds make that likely."""
    from shared.errors import KafkaTimeoutError, KafkaUnavailableError

    with EmbeddedStack(net_faults=True) as s:
        s.start()
        assert s.kafka_proxy is not None
        bs = s.bootstrap_servers
        create_topic(bs, "cut", 2)
        produce_batches(bs, "cut", 0, [3])
        tps = [("cut", 0), ("cut", 1)]
        with OffsetProbe(KafkaSettings.of(bs), timeout_s=5) as probe:
            assert probe.ends(tps) == {("cut", 0): 3, ("cut", 1): 0}
            for _round in range(4):
                s.kafka_proxy.partition()
                for _ in range(3):
                    with pytest.raises((KafkaUnavailableError, KafkaTimeoutError)):
                        probe.watermarks(tps)
                s.kafka_proxy.heal()
                deadline = time.monotonic() + 60
                while True:
                    try:
                        assert probe.ends(tps) == {("cut", 0): 3, ("cut", 1): 0}
                        break
                    except (KafkaUnavailableError, KafkaTimeoutError):
                        assert time.monotonic() < deadline, "expected ListOffsets to answer within 60 s of the heal"
                        time.sleep(0.2)


def test_an_offset_listing_answered_without_offsets_is_a_timeout_not_an_end() -> None:
    """librdkafka's ListOffsets that times out with its leaders cached (the broker cut off)
    answers OFFSET_INVALID (-1001) for each partition with no error; read as an end it made a
    topic look empty. The probe raises a transient timeout instead, naming the partitions."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from shared.errors import KafkaTimeoutError

    class Unanswered:
        def list_offsets(self, req: dict, request_timeout: float) -> dict:
            futs = {}
            for tp in req:
                f: Future = Future()
                f.set_result(SimpleNamespace(offset=-1001 if tp.partition == 1 else 7))
                futs[tp] = f
            return futs

    probe = OffsetProbe(KafkaSettings.of("unused:9092"), timeout_s=5)
    probe._admin = Unanswered()  # type: ignore[assignment]
    with pytest.raises(KafkaTimeoutError, match=r"\('t', 1\)"):
        probe.watermarks([("t", 0), ("t", 1)])
    with pytest.raises(KafkaTimeoutError):
        probe.ends([("t", 0), ("t", 1)])
    assert probe.watermarks([("t", 0)]) == {("t", 0): 7}
