"""End-to-end: every type family flows through the sink, and no value stalls it (issue 17).

The real embedded stack (Tansu broker, moto S3) and real Spark, with the harness of
``tests/services/test_sink_e2e.py`` (one Services for the module; a test registers its collection,
desired topic and sink at runtime). Rows are compared by their canonical encoding
(``RowCodec.encode``): the model is the multiset of the produced rows' canonical bytes, the
shard's contents the canonical bytes of its rows read back with ``arrow_to_rows``. So a value
that changed anywhere on the way (a nanosecond, a map entry, a decimal digit) fails the test.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from shared.avro_arrow import arrow_to_rows
from shared.codec import RowCodec
from shared.desired import encode_update
from shared.io.desired_producer import DesiredProducer
from shared.shard import DIFF, ERROR, Shard
from tests.services.test_sink_e2e import DEADLINE_S, POLL_S, Harness, h, running  # noqa: F401 - fixtures

UTC = dt.UTC

TIMES: dict[str, Any] = {
    "type": "record",
    "name": "Times",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "ts_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "ts_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "ts_nanos", "type": {"type": "long", "logicalType": "timestamp-nanos"}},
        {"name": "lts_ms", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
        {"name": "lts_us", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
        {"name": "lts_nanos", "type": {"type": "long", "logicalType": "local-timestamp-nanos"}},
        {"name": "d", "type": {"type": "int", "logicalType": "date"}},
        {"name": "t_ms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "t_us", "type": {"type": "long", "logicalType": "time-micros"}},
    ],
}

NESTED: dict[str, Any] = {
    "type": "record",
    "name": "Nested",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "counts", "type": {"type": "map", "values": "long"}},
        {
            "name": "inner",
            "type": {
                "type": "record",
                "name": "Inner",
                "fields": [
                    {"name": "tags", "type": {"type": "map", "values": ["null", "string"]}},
                    {"name": "xs", "type": {"type": "array", "items": "double"}},
                ],
            },
        },
        {"name": "maybe", "type": ["null", "Inner"], "default": None},
        {"name": "list_of_maps", "type": {"type": "array", "items": {"type": "map", "values": "int"}}},
    ],
}

EXACT: dict[str, Any] = {
    "type": "record",
    "name": "Exact",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 3}},
        {
            "name": "big",
            "type": {
                "type": "fixed",
                "name": "Big",
                "size": 20,
                "logicalType": "decimal",
                "precision": 45,
                "scale": 5,
            },
        },
        {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "dur", "type": {"type": "fixed", "name": "Dur", "size": 12, "logicalType": "duration"}},
        {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN", "BLUE"]}},
        {"name": "raw", "type": {"type": "fixed", "name": "Four", "size": 4}},
        {"name": "f", "type": "float"},
        {"name": "opt_dec", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 0}]},
    ],
}


def times_row(rng: random.Random, i: int) -> dict[str, Any]:
    micros = rng.randrange(-(10**15), 10**15)
    return {
        "id": i,
        "ts_ms": dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(milliseconds=micros // 1000),
        "ts_us": dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=micros),
        "ts_nanos": rng.choice([-(2**63), 2**63 - 1, rng.randrange(-(2**63), 2**63)]),
        "lts_ms": dt.datetime(2000, 1, 1) + dt.timedelta(milliseconds=rng.randrange(10**12)),
        "lts_us": dt.datetime(2000, 1, 1) + dt.timedelta(microseconds=rng.randrange(10**15)),
        "lts_nanos": rng.randrange(-(10**18), 10**18),
        "d": dt.date(1, 1, 1) + dt.timedelta(days=rng.randrange(3_652_058)),
        "t_ms": dt.time(rng.randrange(24), rng.randrange(60), rng.randrange(60), rng.randrange(1000) * 1000),
        "t_us": dt.time(23, 59, 59, 999_999) if rng.random() < 0.2 else dt.time(rng.randrange(24), 0, 0, rng.randrange(10**6)),
    }


def nested_row(rng: random.Random, i: int) -> dict[str, Any]:
    def inner() -> dict[str, Any]:
        keys = rng.sample(["zeta", "alpha", "é", "", "B"], rng.randrange(4))
        return {
            "tags": {k: rng.choice([None, "x", "ÿ"]) for k in keys},
            "xs": [rng.choice([0.0, -0.0, 1.5, float("inf"), 1e-300]) for _ in range(rng.randrange(3))],
        }

    counts = {f"k{rng.randrange(50)}": rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(4))}
    return {
        "id": i,
        "counts": dict(reversed(list(counts.items()))),  # any key order: canonical is sorted
        "inner": inner(),
        "maybe": rng.choice([None, inner()]),
        "list_of_maps": [{"b": 1, "a": rng.randrange(2**31)} for _ in range(rng.randrange(3))],
    }


def _dec(unscaled: int, scale: int) -> Decimal:
    """An exact decimal (``Decimal.scaleb`` would round to the context's 28 digits)."""
    return Decimal(f"{unscaled}E-{scale}")


def exact_row(rng: random.Random, i: int) -> dict[str, Any]:
    return {
        "id": i,
        "amount": _dec(rng.randrange(-(10**12) + 1, 10**12), 3),
        "big": _dec(rng.choice([10**45 - 1, -(10**45) + 1, rng.randrange(10**40)]), 5),
        "u": uuid.UUID(int=rng.getrandbits(128)),
        "dur": rng.randbytes(12),
        "color": rng.choice(["RED", "GREEN", "BLUE"]),
        "raw": rng.randbytes(4),
        "f": rng.choice([0.5, -0.0, float("inf"), 3.4028234663852886e38]),
        "opt_dec": rng.choice([None, Decimal(rng.randrange(-9999, 10000))]),
    }


class TypedWorkload:
    """Inserts and retractions of rows of any type; the model counts canonical row bytes."""

    def __init__(self, producer: DesiredProducer, make_row: Callable[[random.Random, int], dict[str, Any]], seed: int) -> None:
        self.producer = producer
        self.codec = producer.rows
        self.make_row = make_row
        self.rng = random.Random(seed)
        self.updates: list[tuple[bytes, int, int]] = []
        self.present: Counter[bytes] = Counter()
        self.rows: dict[bytes, dict[str, Any]] = {}
        self.next_id = 0

    @property
    def frontier(self) -> int:
        t = self.producer.frontier.time
        assert t is not None
        return t

    def step(self, *, n: int = 20, length: int = 3) -> int:
        lo = self.frontier
        for t in sorted(self.rng.randrange(lo, lo + length) for _ in range(n)):
            if self.present and self.rng.random() < 0.4:
                key = self.rng.choice(sorted(self.present))
                d = -self.rng.randint(1, self.present[key])
                row = self.rows[key]
            else:
                row, d = self.make_row(self.rng, self.next_id % 12), self.rng.choice((1, 1, 2))
                self.next_id += 1
            key = self.codec.encode(row)
            self.rows[key] = row
            self.producer.send(row, t, d)
            self.updates.append((key, t, d))
            self.present[key] += d
            if self.present[key] == 0:
                del self.present[key]
        self.producer.advance_to(lo + length)
        return lo + length

    def model(self, upper: int) -> dict[bytes, int]:
        acc: Counter[bytes] = Counter()
        for key, t, d in self.updates:
            if t < upper:
                acc[key] += d
        return {k: v for k, v in acc.items() if v}


def contents(shard: Shard, codec: RowCodec, as_of: int) -> tuple[dict[bytes, int], dict[str, int]]:
    """The shard at ``as_of``: ``{canonical row bytes: diff}`` and ``{error: diff}``."""
    snap = shard.snapshot(as_of)
    ok = snap.filter(snap[ERROR].is_null())
    rows: Counter[bytes] = Counter()
    for row, d in zip(arrow_to_rows(ok.select(shard.row_columns), codec.schema), ok[DIFF].to_pylist(), strict=True):
        rows[codec.encode(row)] += d
    errors: Counter[str] = Counter()
    bad = snap.filter(snap[ERROR].is_valid())
    for e, d in zip(bad[ERROR].to_pylist(), bad[DIFF].to_pylist(), strict=True):
        errors[e] += d
    return {k: v for k, v in rows.items() if v}, {k: v for k, v in errors.items() if v}


def converge(h: Harness, shard: Shard, work: TypedWorkload, sid: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """Poll until the upper reaches the desired frontier; at every upper seen the good rows
    equal the model. Returns the final contents."""
    import time

    target, deadline, seen = work.frontier, time.monotonic() + DEADLINE_S, None
    got: tuple[dict[bytes, int], dict[str, int]] = ({}, {})
    while True:
        upper = shard.refresh().upper.time
        assert upper is not None and upper <= target
        if upper != seen and upper > 0:
            seen = upper
            got = contents(shard, work.codec, upper - 1)
            expected = work.model(upper)
            assert got[0] == expected, (
                f"expected the shard at {upper - 1} to equal the desired collection: "
                f"{len(set(got[0].items()) ^ set(expected.items()))} rows differ"
            )
        if upper >= target:
            return got
        if time.monotonic() > deadline:
            pytest.fail(
                f"expected the shard upper to reach {target} within {DEADLINE_S}s, found {upper}; "
                f"{h.diagnostics([sid])}"
            )
        time.sleep(POLL_S)


def _varint(n: int) -> bytes:
    """Avro's zig-zag varint of ``n`` (an int's or a long's body: only the range tells them apart)."""
    import io

    import fastavro

    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, "long", n)
    return buf.getvalue()




@pytest.mark.parametrize(
    ("family", "schema", "make_row"),
    [
        pytest.param("times", TIMES, times_row),
        pytest.param("nested", NESTED, nested_row),
        pytest.param("exact", EXACT, exact_row),
    ],
)
def test_each_type_family_reaches_every_step_with_contents_equal_to_the_model(
    h: Harness, unique_id: str, family: str, schema: dict[str, Any], make_row: Callable[[random.Random, int], dict[str, Any]]
) -> None:
    cid, sid, topic = f"c-{family}-{unique_id}", f"s-{family}-{unique_id}", f"desired-{family}-{unique_id}"
    shard = h.collection(cid, schema, topic, partitions=2)
    h.sink(sid, topic, cid)
    work = TypedWorkload(DesiredProducer(h.settings.kafka, topic, schema), make_row, seed=sum(map(ord, family)))
    for _ in range(4):
        work.step(n=20, length=3)
        rows, errors = converge(h, shard, work, sid)
        assert errors == {}, f"expected no error rows, found {errors}"
    assert shard.refresh().upper.time == work.frontier
    retracted = sum(1 for _, _, d in work.updates if d < 0)
    assert retracted > 0, "expected the workload to retract rows"


def test_out_of_range_and_mistyped_values_land_in_the_error_collection_and_the_sink_goes_on(
    h: Harness, unique_id: str
) -> None:
    """An int carrying 2**31, an enum index beyond its symbols, a time of day past midnight, a
    decimal beyond its precision (through the desired producer's ``send_encoded``), and raw
    bytes that are no row of the schema (through a plain Kafka producer) each become one error
    row at its time naming its offset; the good rows around them land, and the upper reaches
    every step."""
    from confluent_kafka import Producer

    schema = {
        "type": "record",
        "name": "Ranged",
        "fields": [
            {"name": "id", "type": "int"},
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
            {"name": "t", "type": {"type": "int", "logicalType": "time-millis"}},
            {"name": "dec", "type": {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 2}},
        ],
    }
    cid, sid, topic = f"c-bad-{unique_id}", f"s-bad-{unique_id}", f"desired-bad-{unique_id}"
    shard = h.collection(cid, schema, topic, partitions=2)
    h.sink(sid, topic, cid)
    producer = DesiredProducer(h.settings.kafka, topic, schema)
    work = TypedWorkload(
        producer,
        lambda rng, i: {"id": i, "e": rng.choice("AB"), "t": dt.time(rng.randrange(24)), "dec": _dec(rng.randrange(-9999, 10000), 2)},
        seed=17,
    )
    work.step(n=15)
    converge(h, shard, work, sid)

    codec = producer.rows
    header = b"\xc3\x01" + codec.fingerprint
    # id = 1 (02), e = A (00), t = 0 (00), dec = 0.00 (bytes of length 1: 02 00)
    tail = b"\x00\x00\x02\x00"
    f = work.frontier
    bad = {
        "int": header + _varint(2**31) + tail,  # id = 2**31
        "enum": header + b"\x02" + _varint(2) + b"\x00\x02\x00",  # e = index 2 of 2 symbols
        "time": header + b"\x02\x00" + _varint(86_400_000) + b"\x02\x00",  # t = 24:00
        "decimal": header + b"\x02\x00\x00\x04\x27\x10",  # dec unscaled 10000: 5 digits > 4
    }
    assert codec.decode(header + b"\x02" + tail) == {"id": 1, "e": "A", "t": dt.time(0), "dec": Decimal("0.00")}
    for i, value in enumerate(bad.values()):
        producer.send_encoded(value, f + i % 3, 1)
    raw = Producer(h.settings.kafka.config())
    raw.produce(topic, value=encode_update(b"\xc3\x01" + b"\x00" * 8 + b"\x02", f + 1, 1), partition=0)
    raw.produce(topic, value=encode_update(header + b"\x02\x00", f + 2, 1), partition=1)  # truncated
    assert raw.flush(30) == 0

    work.step(n=15, length=3)
    _, errors = converge(h, shard, work, sid)
    assert sum(errors.values()) == 6 and len(errors) == 6, f"expected 6 error rows, found {errors}"
    text = "\n".join(sorted(errors))
    for reason in (
        "at Ranged.id, found 2147483648",
        "IndexError",
        "time-millis in [0, 86400000), found 86400000",
        "decimal of at most 4 digits",
        "fingerprint",
        "do not decode",
    ):
        assert reason in text, f"expected an error naming {reason!r}, found:\n{text}"
    assert all(f"{topic}/" in e and "@" in e for e in errors), f"expected source offsets, found {errors}"
    # Each keeps the bytes it carried (the row's, or the whole message's) ...
    for value in bad.values():
        assert sum(e.endswith(f"row bytes {value.hex()}") for e in errors) == 1, (value.hex(), errors)
    unknown = b"\xc3\x01" + b"\x00" * 8 + b"\x02"  # a row framed with no schema's fingerprint
    assert sum(e.endswith(f"row bytes {unknown.hex()}") for e in errors) == 1, errors
    # ... and is an error row at its own time: in the snapshot at that time, not before.
    at = {**{v: f + i % 3 for i, v in enumerate(bad.values())}, unknown: f + 1, header + b"\x02\x00": f + 2}
    for value, t in at.items():
        (err,) = [e for e in errors if e.endswith(f"row bytes {value.hex()}")]
        assert err in contents(shard, codec, t)[1] and err not in contents(shard, codec, t - 1)[1], (t, err)

    # The sink goes on: later steps land, the errors stay exactly once.
    work.step(n=15)
    _, again = converge(h, shard, work, sid)
    assert again == errors


def test_a_shard_row_the_schema_cannot_hold_becomes_an_error_row_and_the_sink_goes_on(
    h: Harness, unique_id: str
) -> None:
    """A row in the shard that no row of the schema can hold (written there by hand: a null in
    a non-nullable field) has no key for the correction buffer to correct it by. The write
    step meets it in its read-back and, instead of skipping it in silence, puts one error row
    in the error collection naming it (its time, diff, reason and contents) at the first time
    it can write; the good rows reach the shard at every step and the error stays once."""
    import pyarrow as pa

    schema = {"type": "record", "name": "Kv", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}
    cid, sid, topic = f"c-unwritable-{unique_id}", f"s-unwritable-{unique_id}", f"desired-unwritable-{unique_id}"
    shard = h.collection(cid, schema, topic, partitions=2)
    # 40 rows, two of them without a key (k null), in one object no writer partition tagged
    ks = [None if i in (9, 30) else i for i in range(40)]
    by_hand = pa.table({"k": pa.array(ks, pa.int64()), "v": ["no key" if k is None else "kept" for k in ks],
                        "_time": pa.array([0] * 40, pa.uint64()), "_diff": pa.array([1] * 40, pa.int64())})
    shard.compare_and_append(by_hand, 0, 1)
    producer = DesiredProducer(h.settings.kafka, topic, schema)
    work = TypedWorkload(producer, lambda rng, i: {"k": 100 + i, "v": rng.choice("xyz")}, seed=3)
    for k in ks:  # the desired collection holds the good rows
        if k is not None:
            producer.send({"k": k, "v": "kept"}, 0, 1)
            work.updates.append((work.codec.encode({"k": k, "v": "kept"}), 0, 1))
    producer.advance_to(1)
    h.sink(sid, topic, cid, replace_contents=True)  # the shard holds rows; the topic is the whole truth

    def good_and_errors(as_of: int) -> tuple[dict[bytes, int], dict[str, int]]:
        snap = shard.snapshot(as_of)
        ok = snap.filter(pa.compute.and_(snap[ERROR].is_null(), snap["k"].is_valid()))
        rows: Counter[bytes] = Counter()
        for row, d in zip(arrow_to_rows(ok.select(["k", "v"]), schema), ok[DIFF].to_pylist(), strict=True):
            rows[work.codec.encode(row)] += d
        unkeyed = snap.filter(pa.compute.and_(snap[ERROR].is_null(), snap["k"].is_null()))
        assert unkeyed["v"].to_pylist() == ["no key"] and unkeyed[DIFF].to_pylist() == [2]  # never retracted
        bad = snap.filter(snap[ERROR].is_valid())
        return {k: v for k, v in rows.items() if v}, dict(zip(bad[ERROR].to_pylist(), bad[DIFF].to_pylist(), strict=True))

    import time

    for _ in range(3):
        target = work.step(n=12, length=2)
        deadline = time.monotonic() + DEADLINE_S
        while (shard.refresh().upper.time or 0) < target:
            assert time.monotonic() < deadline, h.diagnostics([sid])
            time.sleep(POLL_S)
        rows, errors = good_and_errors(target - 1)
        assert rows == work.model(target)
        # the two identical rows (consolidated when appended: one row, diff 2) give one error
        assert len(errors) == 1 and list(errors.values()) == [2], errors
        (error,) = errors
        assert "a row of the shard at time 0 (diff 2) holds a value the collection's schema cannot hold" in error, error
        assert "expected a value in non-nullable field 'k', found null" in error, error
        assert 'row {"k": null, "v": "no key"}' in error, error
    assert error not in good_and_errors(0)[1]  # at the first time the sink could write (1), not 0
    assert good_and_errors(1)[1] == {error: 2}
    producer.close()
