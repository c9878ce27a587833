"""The Kafka source's wait for records (``waitForRecordsMs``, :mod:`shared.spark.kafka_source`),
against the real broker: a ``latestOffset`` that finds nothing to read waits for a record on
the partitions whose records make a micro-batch and answers with it as soon as it comes; a
holding reader (the append service's source) is not woken by a record of its held topic, and
waits no longer than the time the held topic is admitted anyway; an ``availableNow`` trigger
does not wait."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import Producer

import services.append.source as aps
from shared.devstack.embedded import EmbeddedStack
from shared.errors import KafkaConfigError
from shared.io.kafka import KafkaSettings, OffsetProbe
from shared.spark.kafka_source import ADMIT_EVERY_S, SourceOptions
from shared.spark.kafka_connector import KafkaDataSource
from tests.spark.test_spark_kafka_source import create_topic, frozen_monotonic, produce, stream_reader


class Later:
    """A producer kept open (a new one takes about half a second to connect): ``send`` produces
    records after a delay, from a thread, and flushes them: one record batch, which the tests
    rely on (a fetch that ends a wait brings the whole send). The long linger keeps the
    records of one send together until ``flush`` sends them at once; with ``linger.ms`` 0
    librdkafka could send the first record alone (measured: about 1 send of 3 records in 300)."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5000})

    def send(self, topic: str, values: list[bytes], after_s: float) -> threading.Thread:
        def run() -> None:
            time.sleep(after_s)
            for v in values:
                self.producer.produce(topic, value=v, partition=0)
            assert self.producer.flush(30) == 0

        t = threading.Thread(target=run)
        t.start()
        return t


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()  # not time.monotonic, which a test may freeze
    out = fn(*args)
    return out, time.perf_counter() - t0


def test_latest_offset_answers_with_a_record_that_arrives_while_it_waits(stack: EmbeddedStack, unique_id: str) -> None:
    topic = f"wait-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 2)
    source: tuple[str, Any, dict[str, str]] = ("shardsink-kafka", KafkaDataSource, {})
    r = stream_reader(stack.bootstrap_servers, source, [topic], waitForRecordsMs="20000")
    limit = r.getDefaultReadLimit()
    start = r.initialOffset()
    produce(stack.bootstrap_servers, topic, [(0, b"a"), (1, b"b")])
    end, _ = timed(r.latestOffset, start, limit)  # records there: no wait
    assert end[topic] == {"0": 1, "1": 1}
    # Nothing new: it waits, and a record produced meanwhile ends the wait with its offset in
    # the answer (a wait of 20 s that timed out would answer the start instead).
    th = Later(stack.bootstrap_servers).send(topic, [b"c", b"d"], 0.3)
    later, took = timed(r.latestOffset, end, limit)
    th.join()
    assert later[topic] == {"0": 3, "1": 1}  # one flush, both records
    assert took < 20.0
    r.stop()

    # With nothing produced, the wait ends at its budget with the start itself, in one wait
    # at the brokers (a plain reader has nothing to look at between slices).
    quiet = stream_reader(stack.bootstrap_servers, source, [topic], waitForRecordsMs="1200")
    probe, waits = quiet._p(), []
    await_records = probe.await_records
    probe.await_records = lambda watched, timeout_s: waits.append(timeout_s) or await_records(watched, timeout_s)
    same, took = timed(quiet.latestOffset, later, quiet.getDefaultReadLimit())
    assert same == later
    assert took >= 1.1
    assert len(waits) == 1 and waits[0] > 1.0, f"expected one wait for the whole budget, found {waits}"
    # availableNow: the query stops at its target, never waits for more.
    quiet.prepareForTriggerAvailableNow()
    assert quiet.latestOffset(later, quiet.getDefaultReadLimit()) == later
    quiet.stop()


def test_a_holding_reader_waits_for_news_on_its_other_topics_only(
    stack: EmbeddedStack, unique_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = frozen_monotonic(monkeypatch)  # admission's clock; the waits themselves take real time
    descs, batches = f"wait-descs-{unique_id}", f"wait-batches-{unique_id}"
    create_topic(stack.bootstrap_servers, descs, 1)
    create_topic(stack.bootstrap_servers, batches, 1)
    later = Later(stack.bootstrap_servers)
    r = stream_reader(stack.bootstrap_servers, aps.append_source(descs), [descs, batches], waitForRecordsMs="20000")
    limit = r.getDefaultReadLimit()
    start = r.latestOffset(r.initialOffset(), limit)  # the first call admits
    # The held topic's records do not end the wait, and the wait ends when the held topic is
    # admitted anyway (ADMIT_EVERY_S after the last admission: 0.5 s from now), not after 20 s.
    clock[0] += ADMIT_EVERY_S - 0.5
    later.send(descs, [b"description"], 0.0).join()
    th = later.send(descs, [b"description 2"], 0.1)
    same, took = timed(r.latestOffset, start, limit)
    th.join()
    assert same == start
    assert 0.45 <= took < 20.0
    clock[0] += 0.5
    end = r.latestOffset(start, limit)  # the held topic's time has come: admitted
    assert end[descs] == {"0": 2} and end[batches] == {"0": 0}
    # A report (news on the other topic) ends the wait, and the held description comes with it.
    later.send(descs, [b"description 3"], 0.0).join()
    th = later.send(batches, [b"report"], 0.3)
    after, took = timed(r.latestOffset, end, limit)
    th.join()
    assert after[descs] == {"0": 3} and after[batches] == {"0": 1}
    assert took < ADMIT_EVERY_S
    r.stop()


def test_await_records_reports_the_ends_it_fetched(stack: EmbeddedStack, unique_id: str) -> None:
    topic = f"wait-probe-{unique_id}"
    create_topic(stack.bootstrap_servers, topic, 1)
    produce(stack.bootstrap_servers, topic, [(0, b"a"), (0, b"b")])
    with OffsetProbe(KafkaSettings.of(stack.bootstrap_servers)) as probe:
        assert probe.await_records({(topic, 0): 2}, 0.3) == {}  # nothing past the end
        assert probe.await_records({(topic, 0): 2}, 0.0) == {}
        th = Later(stack.bootstrap_servers).send(topic, [b"c", b"d", b"e"], 0.2)
        learned = probe.await_records({(topic, 0): 2}, 20.0)
        th.join()
        assert learned == {(topic, 0): 5}  # one flush: one batch, its end from the fetch
        # The probe's ends take what the fetch saw: no fetch of the last batch again.
        assert probe.ends([(topic, 0)]) == {(topic, 0): 5}
        assert probe.last_probed == 0
        assert probe.await_records({(topic, 0): 1}, 20.0) == {(topic, 0): 5}  # records already there


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_a_bad_wait_option_is_a_typed_error(value: str) -> None:
    with pytest.raises(KafkaConfigError, match="waitforrecordsms"):
        SourceOptions.parse({"topics": "t", "bootstrap": "127.0.0.1:1", "waitForRecordsMs": value})
    assert SourceOptions.parse({"topics": "t", "bootstrap": "127.0.0.1:1", "waitForRecordsMs": "0"}).wait_for_records_ms == 0


def test_a_shared_query_s_wait_ends_when_a_member_joins(stack: EmbeddedStack, unique_id: str, tmp_path: Any) -> None:
    """A shared query's source waits for records on its members' topics; a sink that joins
    meanwhile (the members file changes) ends the wait, and its records, produced before it
    joined, are in the answer: a new sink does not wait out the budget (20 s here)."""
    from services.runtime.fleet import write_members
    from shared.catalog import SinkDef
    from shared.spark.fleet_source import MEMBERS_OPTION, FleetDataSource

    control = f"wait-ctl-{unique_id}"
    create_topic(stack.bootstrap_servers, control, 1)
    old, new = (SinkDef(f"{n}-{unique_id}", f"wait-{n}-{unique_id}", f"c{n}-{unique_id}", epoch=1) for n in ("old", "new"))
    for s in (old, new):
        create_topic(stack.bootstrap_servers, s.desired_topic, 1)
    members = str(tmp_path / "fleet" / "members.json")
    write_members(members, {f"{old.sink_id}@1": old})
    source: tuple[str, Any, dict[str, str]] = (FleetDataSource.name(), FleetDataSource, {MEMBERS_OPTION: members})
    r = stream_reader(stack.bootstrap_servers, source, [control], waitForRecordsMs="20000")
    limit = r.getDefaultReadLimit()
    produce(stack.bootstrap_servers, old.desired_topic, [(0, b"x")])  # a micro-batch at once, no wait
    start = r.latestOffset(r.initialOffset(), limit)
    assert start == {control: {"0": 0}, f"{old.sink_id}@1": {"0": 1}}
    produce(stack.bootstrap_servers, new.desired_topic, [(0, b"a"), (0, b"b")])

    def join() -> None:
        time.sleep(0.3)
        write_members(members, {f"{old.sink_id}@1": old, f"{new.sink_id}@1": new})

    th = threading.Thread(target=join)
    th.start()
    end, took = timed(r.latestOffset, start, limit)
    th.join()
    assert end[f"{new.sink_id}@1"] == {"0": 2}, f"expected the new member's records in the answer, found {end}"
    assert took < 10.0, f"expected the wait to end when the member joined, found {took:.1f} s"
    r.stop()
