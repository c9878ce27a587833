"""The executor-side decode of desired micro-batches (pure: no Spark needed to test it)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from services.sinkio import KIND_BAD, KIND_CONTROL, KIND_PROGRESS, KIND_UPDATE, decode_partition, u64
from shared.codec import RowCodec
from shared.desired import encode_progress, encode_update
from shared.frontier import Frontier
from tests.campaigns.test_fuzz_inputs import mutate

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}
OTHER = {"type": "record", "name": "Other", "fields": [{"name": "s", "type": "string"}]}


def _batch(values: list[bytes], topic: str = "d") -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict(
        {"topic": [topic] * n, "partition": [0] * n, "offset": list(range(n)), "value": values}
    )


def test_updates_progress_and_bad_messages_are_told_apart_in_order() -> None:
    good = RowCodec(SCHEMA).encode({"k": 1})
    alien = RowCodec(OTHER).encode({"s": "x"})
    values = [
        encode_update(good, 2**63 + 5, -2),
        encode_progress(0, Frontier.at(7)),
        encode_progress(0, Frontier.empty()),
        encode_update(alien, 3, 1),
        b"\x00garbage",
    ]
    import json

    (out,) = list(decode_partition("d", json.dumps(SCHEMA))([_batch(values)]))
    rows = out.to_pylist()
    assert [r["kind"] for r in rows] == [KIND_UPDATE, KIND_PROGRESS, KIND_PROGRESS, KIND_BAD, KIND_BAD]
    assert rows[0]["row"] == good and u64(rows[0]["time"]) == 2**63 + 5 and rows[0]["diff"] == -2
    assert rows[1]["frontier"] == 7 and not rows[1]["frontier_closed"]
    assert rows[2]["frontier_closed"]
    # A row of another schema keeps its time and diff: it lands in the error collection then.
    assert rows[3]["time"] == 3 and rows[3]["diff"] == 1 and "schema" in rows[3]["error"]
    assert rows[4]["time"] is None and "undecodable" in rows[4]["error"]


def test_progress_only_drops_updates_undecoded_and_keeps_the_rest() -> None:
    values = [encode_update(RowCodec(SCHEMA).encode({"k": 1}), 5, 1), encode_progress(0, Frontier.at(9)), b"junk"]
    (out,) = list(decode_partition("d", progress_only=True)([_batch(values)]))
    assert out.column("kind").to_pylist() == [KIND_PROGRESS, KIND_BAD]
    assert out.column("offset").to_pylist() == [1, 2]


def test_control_topics_pass_through_raw() -> None:
    (out,) = list(decode_partition("d")([_batch([b"\x01\x02"], topic="descs")]))
    assert out.column("kind").to_pylist() == [KIND_CONTROL]
    assert out.column("value").to_pylist() == [b"\x01\x02"]


RANGED = {
    "type": "record",
    "name": "Ranged",
    "fields": [
        {"name": "i", "type": "int"},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
        {"name": "m", "type": {"type": "map", "values": "long"}},
    ],
}


def test_values_out_of_their_fields_range_become_bad_rows_at_their_time_naming_offset_and_field() -> None:
    """An int field carrying 2**31 (zig-zag varint encodes it, only the range forbids it) and an
    enum index beyond the symbols decode as bad rows in the executors, never as updates that
    would fail the writer later; the good rows around them are updates in canonical bytes."""
    import json

    codec = RowCodec(RANGED)
    header = b"\xc3\x01" + codec.fingerprint
    good = codec.encode({"i": 7, "e": "B", "m": {"a": 1}})
    wide_int = header + b"\x80\x80\x80\x80\x10" + b"\x02" + b"\x00"  # i = 2**31
    bad_enum = header + b"\x0e" + b"\x04" + b"\x00"  # i = 7, e = index 2 of 2 symbols
    # the same value as `good`, written otherwise: an over-long varint for i = 7 and the map in
    # a block with a negative count and a byte size; it decodes and is made canonical
    other_bytes = header + b"\x8e\x00" + b"\x02" + b"\x01\x06\x02a\x02" + b"\x00"
    assert other_bytes != good and codec.decode(other_bytes) == codec.decode(good)
    values = [
        encode_update(good, 10, 1),
        encode_update(wide_int, 11, 1),
        encode_update(bad_enum, 12, -1),
        encode_update(other_bytes, 13, 1),
    ]
    (out,) = list(decode_partition("d", json.dumps(RANGED))([_batch(values)]))
    rows = out.to_pylist()
    assert [r["kind"] for r in rows] == [KIND_UPDATE, KIND_BAD, KIND_BAD, KIND_UPDATE]
    assert rows[0]["row"] == good and rows[3]["row"] == good
    assert (rows[1]["time"], rows[1]["diff"], rows[1]["row"]) == (11, 1, None)
    assert "d/0@1" in rows[1]["error"] and "at Ranged.i, found 2147483648" in rows[1]["error"]
    assert (rows[2]["time"], rows[2]["diff"]) == (12, -1)
    assert "d/0@2" in rows[2]["error"] and "IndexError" in rows[2]["error"]


def _reference(value: bytes | None, row_codec: RowCodec | None) -> tuple[object, ...]:
    """What the per-record decoder makes of one desired message (the vectorised decoder
    must agree): kind, row, time, diff, frontier, closed, has an error."""
    from shared.desired import DesiredProgress, decode_desired
    from shared.errors import DecodeError

    def signed(t: int) -> int:
        return t - 2**64 if t >= 2**63 else t

    try:
        msg = decode_desired(value if value is not None else b"")
    except DecodeError:
        return (KIND_BAD, None, None, None, None, False, True)
    if isinstance(msg, DesiredProgress):
        closed = msg.frontier.is_empty()
        return (KIND_PROGRESS, None, None, None, None if closed else signed(msg.frontier.time or 0), closed, False)
    if row_codec is None:
        return (KIND_UPDATE, msg.row, signed(msg.time), msg.diff, None, False, False)
    try:
        return (KIND_UPDATE, row_codec.canonical(msg.row), signed(msg.time), msg.diff, None, False, False)
    except DecodeError:
        return (KIND_BAD, None, signed(msg.time), msg.diff, None, False, True)


def _messages(draw: Any, codec: RowCodec) -> list[bytes | None]:
    import random

    out: list[bytes | None] = []
    header = b"\xc3\x01" + codec.fingerprint
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["update", "update", "progress", "mutated", "mutated_row", "random", "none", "old"]))
        time = draw(st.integers(0, 2**64 - 1))
        row = codec.encode({"i": draw(st.integers(-(2**31), 2**31 - 1)), "e": draw(st.sampled_from(["A", "B"])),
                            "m": draw(st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=3))})
        if kind == "update":
            out.append(encode_update(row, time, draw(st.integers(-3, 3))))
        elif kind == "progress":
            out.append(encode_progress(draw(st.integers(0, 5)), Frontier(draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))))))
        elif kind == "mutated":
            out.append(mutate(encode_update(row, time, 1), random.Random(draw(st.integers(0, 2**32)))))
        elif kind == "mutated_row":
            body = mutate(row[10:], random.Random(draw(st.integers(0, 2**32))))
            out.append(encode_update(header + body, time, 1))
        elif kind == "old":  # a row written with another schema: the per-record path decides
            out.append(encode_update(RowCodec(OTHER).encode({"s": "x"}), time, 1))
        elif kind == "random":
            out.append(bytes(draw(st.binary(max_size=30))))
        else:
            out.append(None)
    return out


@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans())
def test_the_vectorised_decode_agrees_with_the_per_record_decoder_on_any_input(data: Any, with_schema: bool) -> None:
    import json

    codec = RowCodec(RANGED)
    values = _messages(data.draw, codec)
    (out,) = list(decode_partition("d", json.dumps(RANGED) if with_schema else None)([_batch(values)]))  # type: ignore[arg-type]
    got = [(r["kind"], r["row"], r["time"], r["diff"], r["frontier"], r["frontier_closed"], r["error"] is not None)
           for r in out.to_pylist()]
    want = [_reference(v, codec if with_schema else None) for v in values]
    assert got == want
