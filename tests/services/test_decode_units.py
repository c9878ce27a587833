"""A write task decodes its units' records as one batch (:func:`services.sinkio.decode_units`):
each unit gets the rows its own decoder gives it (``decode_partition`` with its topic and
writer partition), whatever its records: updates, statements, bad and mutated messages, rows
of another schema, nulls, history-gap markers and descriptions, several units of one topic."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from services.sinkio import decode_partition, decode_units
from shared.codec import RowCodec
from shared.spark.kafka_source import HISTORY_GAP_HEADER, _arrow_schema
from tests.services.test_sinkio import RANGED, _messages

SCHEMA_JSON = json.dumps(RANGED)
DESCS = "descs"


def source_batch(topic: str, partition: int, first: int, values: list[bytes | None],
                 headers: list[Any] | None = None) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict({
        "key": [None] * n, "value": values, "topic": [topic] * n, "partition": [partition] * n,
        "offset": list(range(first, first + n)), "timestamp": [None] * n, "headers": headers or [None] * n,
    }, schema=_arrow_schema())


def one_unit(topic: str, batches: list[pa.RecordBatch], wp: int) -> list[dict[str, Any]]:
    fn = decode_partition(topic, SCHEMA_JSON, route_to=2, executor=False, only_wp=wp)
    return [r for b in fn(iter(batches)) for r in b.to_pylist()]


@st.composite
def units(draw: Any) -> list[tuple[str, list[pa.RecordBatch], int]]:
    codec = RowCodec(RANGED)
    out = []
    for _ in range(draw(st.integers(1, 5))):
        topic, wp = draw(st.sampled_from(["d0", "d1", "d2"])), draw(st.integers(0, 1))
        batches = []
        first = draw(st.integers(0, 1000))
        if draw(st.booleans()):  # a history gap before the range
            batches.append(source_batch(topic, wp, first, [None], [[{"key": HISTORY_GAP_HEADER, "value": b"0-5"}]]))
            first += 5
        for _ in range(draw(st.integers(0, 2))):
            values = _messages(draw, codec)
            batches.append(source_batch(topic, wp, first, values))
            first += len(values)
        if draw(st.booleans()):  # the sink's descriptions
            descs = draw(st.lists(st.binary(max_size=20), min_size=1, max_size=3))
            batches.append(source_batch(DESCS, 0, draw(st.integers(0, 50)), list(descs)))
        out.append((topic, batches, wp))
    return out


@settings(max_examples=120, deadline=None)
@given(units())
def test_units_decoded_together_get_what_each_units_decoder_gives(us: list[tuple[str, list[pa.RecordBatch], int]]) -> None:
    got = decode_units(us, SCHEMA_JSON, 2)
    assert len(got) == len(us)
    for (topic, batches, wp), batch in zip(us, got, strict=True):
        assert batch.to_pylist() == one_unit(topic, batches, wp)


def test_a_bad_row_is_named_at_its_own_topic_and_control_records_go_to_their_units_partition() -> None:
    codec = RowCodec(RANGED)
    good = codec.encode({"i": 1, "e": "A", "m": {}})
    from shared.desired import encode_update

    bad = encode_update(good[:10] + b"\xff\xff\xff", 3, 1)
    us = [("d0", [source_batch("d0", 0, 0, [encode_update(good, 1, 1)]), source_batch(DESCS, 0, 7, [b"desc"])], 0),
          ("d1", [source_batch("d1", 1, 4, [bad]), source_batch(DESCS, 0, 7, [b"desc"])], 1)]
    a, b = (x.to_pylist() for x in decode_units(us, SCHEMA_JSON, 2))
    assert [(r["wp"], r["kind"]) for r in a] == [(0, "update"), (0, "control")]
    assert [(r["wp"], r["kind"]) for r in b] == [(1, "bad"), (1, "control")]
    assert "at d1/1@4" in b[0]["error"]
    assert decode_units([("d0", [], 0), ("d1", [], 1)], SCHEMA_JSON, 2)[1].num_rows == 0
