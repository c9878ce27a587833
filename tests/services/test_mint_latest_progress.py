"""Mint reads only the tail of each desired range, back to its latest progress statement
(:func:`services.mint.progress.read_latest_progress`), against the real broker: the desired
frontier it learns equals the one of reading every record, for ranges whose latest statement
is near their end, far from it, absent, or closed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pyarrow as pa
import pytest

import services.mint.progress as progress
import services.sinkio as sinkio
from services.mint.progress import read_latest_progress
from services.sinkio import KIND_PROGRESS, decode_on_driver
from shared.codec import MARKER, RowCodec, message_codec
from shared.desired import encode_progress, encode_update
from shared.devstack.embedded import EmbeddedStack
from shared.frontier import Frontier
from shared.io.kafka import KafkaSettings
from shared.spark.kafka_source import close_pooled_consumers, read_range
from tests.spark.test_spark_kafka_source import create_topic, produce

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}
UPDATE_PREFIX = MARKER + message_codec("desired").fingerprint + b"\x00"


def frontier_of(table: object, topic: str) -> Frontier:
    """Partition 0's progress after absorbing the decoded statements (forward only)."""
    f = Frontier.minimum()
    for r in decode_on_driver(table, topic, progress_only=True).to_pylist():  # type: ignore[arg-type]
        if r["kind"] == KIND_PROGRESS and r["partition"] == 0:
            g = Frontier.empty() if r["frontier_closed"] else Frontier.at(r["frontier"] & (2**64 - 1))
            f = f.join(g)
    return f


@pytest.fixture(scope="module")
def history(stack: EmbeddedStack) -> Iterator[tuple[KafkaSettings, str, list[bytes]]]:
    """One partition: 5,000 updates with progress statements at irregular gaps, a long run of
    updates with none, then a closing statement followed by more updates."""
    rng = random.Random(11)
    codec = RowCodec(SCHEMA)
    values: list[bytes] = []
    t = 0
    for step in range(40):
        for _ in range(rng.choice([3, 50, 120, 700])):
            values.append(encode_update(codec.encode({"k": len(values)}), t + rng.randrange(5), 1))
        t += 5
        values.append(encode_progress(0, Frontier.at(t)))
    for _ in range(3000):  # a long stretch of updates with no statement
        values.append(encode_update(codec.encode({"k": len(values)}), t, 1))
    values.append(encode_progress(0, Frontier.empty()))
    values.extend(encode_update(codec.encode({"k": i}), t, -1) for i in range(10))
    topic = f"mint-tail-{rng.randrange(10**9)}"
    create_topic(stack.bootstrap_servers, topic, 1)
    produce(stack.bootstrap_servers, topic, [(0, v) for v in values], rounds=7)
    yield KafkaSettings.of(stack.bootstrap_servers), topic, values
    close_pooled_consumers()  # this process's pooled consumers go before the broker does


def test_the_tail_read_learns_the_same_frontier_as_reading_every_record(
    history: tuple[KafkaSettings, str, list[bytes]],
) -> None:
    kafka, topic, values = history
    n = len(values)
    rng = random.Random(3)
    ranges = [(0, n), (0, n - 10), (0, n - 11), (0, n - 3012), (n - 3011, n - 11), (n - 11, n)]
    ranges += sorted({(a, min(n, a + rng.choice([1, 40, 600, 5000]))) for a in (rng.randrange(n) for _ in range(25))})
    seen: set[object] = set()
    for lo, hi in ranges:
        whole = [b.select(["topic", "partition", "offset", "value"])
                 for b in read_range(kafka, topic, 0, lo, hi, skip_prefix=UPDATE_PREFIX)]
        expected = frontier_of(pa.Table.from_batches(whole) if whole else sinkio._empty_raw(), topic)
        tail = read_latest_progress(kafka, topic, 0, lo, hi, UPDATE_PREFIX)
        got = frontier_of(tail, topic)
        assert got == expected, (lo, hi)
        seen.add(got.time if not got.is_empty() else "closed")
        offsets = tail["offset"].to_pylist()
        assert offsets == sorted(offsets) and all(lo <= o < hi for o in offsets)
    # the ranges cover a closed frontier, the last one before the long stretch, ranges without
    # any statement (the minimum) and several in between
    assert {"closed", 200, 0} <= seen and len(seen) > 5, seen


def test_the_tail_read_reads_a_few_windows_not_the_range(
    history: tuple[KafkaSettings, str, list[bytes]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records the broker hands out, counted at the ranges reader: a range that ends with its
    statement (a producer's step) is read as its last record alone; the closing statement sits
    10 records before the end, so the last record and then one window of the default size find
    it."""
    kafka, topic, values = history
    n = len(values)
    windows: list[tuple[int, int]] = []
    import shared.spark.kafka_ranges as kr

    orig = kr.read_ranges

    def counting(k, ranges, **kw):  # type: ignore[no-untyped-def]
        windows.extend((r.start, r.end) for r in ranges)
        return orig(k, ranges, **kw)

    monkeypatch.setattr(kr, "read_ranges", counting)
    tail = read_latest_progress(kafka, topic, 0, 0, n - 10, UPDATE_PREFIX)  # ends with the closing statement
    assert windows == [(n - 11, n - 10)]
    assert frontier_of(tail, topic) == Frontier.empty()
    windows.clear()
    tail = read_latest_progress(kafka, topic, 0, 0, n, UPDATE_PREFIX)
    assert windows == [(n - 1, n), (n - 1 - progress.LATEST_PROGRESS_WINDOW, n - 1)]
    assert frontier_of(tail, topic) == Frontier.empty()
    # The stretch of 3,000 updates without a statement: windows grow until one holds it.
    windows.clear()
    read_latest_progress(kafka, topic, 0, 0, n - 11, UPDATE_PREFIX)
    sizes = [hi - lo for lo, hi in windows]
    assert sizes[:2] == [1, progress.LATEST_PROGRESS_WINDOW] and all(b == 4 * a for a, b in zip(sizes[1:], sizes[2:-1]))
    assert windows[0][1] == n - 11 and all(w[1] == v[0] for v, w in zip(windows, windows[1:]))
    assert sum(sizes) < n - 11


def test_the_tails_of_many_ranges_read_together_find_what_each_read_alone_finds(
    history: tuple[KafkaSettings, str, list[bytes]],
) -> None:
    """latest_progress_records (the shared mint source's: every range's windows read together,
    round after round) gives each range the statement latest_progress_record gives it alone:
    ranges whose statement is in the first window, after several growing windows, in none, the
    same partition named twice, and an empty range."""
    kafka, topic, values = history
    n = len(values)
    rng = random.Random(5)
    ranges = [(topic, 0, 0, n), (topic, 0, 0, n - 11), (topic, 0, n - 3011, n - 11), (topic, 0, 7, 7), (topic, 0, n - 11, n)]
    ranges += [(topic, 0, a, min(n, a + rng.choice([1, 40, 600, 5000]))) for a in (rng.randrange(n) for _ in range(12))]
    got = progress.latest_progress_records(kafka, ranges, UPDATE_PREFIX)
    want = [progress.latest_progress_record(kafka, t, p, a, b, UPDATE_PREFIX) for t, p, a, b in ranges]
    assert got == want
    assert want[1] is not None and want[2] is None and want[3] is None  # found after growing windows; none; empty



def test_a_range_that_cannot_be_read_gets_its_own_error_and_the_others_their_statements(
    history: tuple[KafkaSettings, str, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range whose read fails (the reader answers it with an error, here made to in its
    second round of windows, after a first window was read) gets that error from
    latest_progress_records, and every other range what it finds alone; read_latest_progress_of
    raises the error of the first failing range in partition order."""
    import shared.spark.kafka_ranges as kafka_ranges
    from shared.errors import KafkaTimeoutError, ShardsinkError

    kafka, topic, values = history
    n = len(values)
    real = kafka_ranges.read_ranges
    rounds: list[int] = []
    fail_from = [2]  # the first round (1-based) whose read of the ranges ending by n - 3011 fails

    def failing_second_round(settings, specs, **kw):  # type: ignore[no-untyped-def]
        rounds.append(len(specs))
        got = real(settings, specs, **kw)
        return [KafkaTimeoutError("cut off") if len(rounds) >= fail_from[0] and r.end <= n - 3011 else g
                for r, g in zip(specs, got, strict=True)]

    ranges = [(topic, 0, 0, n - 11), (topic, 0, 0, n - 3011), (topic, 0, n - 3011, n - 11)]
    want = [progress.latest_progress_record(kafka, t, p, a, b, UPDATE_PREFIX) for t, p, a, b in ranges]
    assert want[0] is not None and want[1] is not None and want[2] is None
    monkeypatch.setattr(kafka_ranges, "read_ranges", failing_second_round)
    got = progress.latest_progress_records(kafka, ranges, UPDATE_PREFIX)
    assert len(rounds) > 1
    assert isinstance(got[1], ShardsinkError) and "cut off" in str(got[1])
    assert [got[0], got[2]] == [want[0], want[2]]
    rounds.clear()
    fail_from[0] = 1
    with pytest.raises(KafkaTimeoutError, match="cut off"):
        progress.read_latest_progress_of(kafka, topic, {0: (0, n - 3011)}, UPDATE_PREFIX)
