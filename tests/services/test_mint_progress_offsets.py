"""Mint decides its progress windows together (:func:`services.mint.progress.progress_offsets`): the
offsets it finds are those :func:`services.sinkio.decode_on_driver` finds window by window,
for windows of statements and updates in the current framing (one columnar decode of all
windows) and for windows holding anything else (a body that does not decode, a negative
partition, a null value, another framing: the per-window decode, as before). The shared
mint's step decodes every sink's statements and announcements as one batch
(:func:`services.mint.progress.decode_statements_on_driver`): each sink gets what its own decode
gives."""

from __future__ import annotations

import pyarrow as pa
import pytest

import services.mint.progress as progress
from services.mint.progress import decode_statements_on_driver, progress_offsets
from services.sinkio import KIND_PROGRESS, decode_on_driver
from shared.codec import MARKER, RowCodec, message_codec
from shared.desired import encode_progress, encode_update
from shared.frontier import Frontier

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}
PROGRESS_PREFIX = MARKER + message_codec("desired").fingerprint + b"\x02"


def window(topic: str, partition: int, first: int, values: list[bytes | None]) -> pa.Table:
    return pa.table({
        "topic": pa.array([topic] * len(values), pa.string()),
        "partition": pa.array([partition] * len(values), pa.int32()),
        "offset": pa.array(range(first, first + len(values)), pa.int64()),
        "value": pa.array(values, pa.binary()),
    })


def one_by_one(topic: str, w: pa.Table) -> list[int]:
    d = decode_on_driver(w, topic, progress_only=True)
    return [o for k, o in zip(d["kind"].to_pylist(), d["offset"].to_pylist(), strict=True) if k == KIND_PROGRESS]


def row(k: int) -> bytes:
    return RowCodec(SCHEMA).encode({"k": k})


CLEAN = {
    "statements": ("desired-a", window("desired-a", 0, 10, [encode_progress(0, Frontier.at(5)), encode_progress(0, Frontier.at(7))])),
    "updates and statements": ("desired-b", window("desired-b", 1, 0, [
        encode_update(row(1), 3, 1), encode_progress(1, Frontier.at(4)), encode_update(row(2), 4, -1),
        encode_progress(1, Frontier.empty()), encode_update(row(3), 9, 2)])),
    "updates only": ("desired-c", window("desired-c", 0, 40, [encode_update(row(i), 1, 1) for i in range(5)])),
    "a time past 2**63": ("desired-d", window("desired-d", 0, 3, [encode_progress(0, Frontier.at(2**64 - 2))])),
}
OTHER = {
    "a body that does not decode": ("desired-e", window("desired-e", 0, 0, [encode_progress(0, Frontier.at(1)),
                                                                          PROGRESS_PREFIX + b"\x81"])),
    "a negative partition": ("desired-f", window("desired-f", 0, 0, [encode_progress(-1, Frontier.at(2)),
                                                                     encode_progress(0, Frontier.at(3))])),
    "a null value": ("desired-g", window("desired-g", 1, 7, [None, encode_progress(1, Frontier.at(9))])),
    "another framing": ("desired-h", window("desired-h", 0, 0, [b"not a desired message", encode_progress(0, Frontier.at(1))])),
}


@pytest.fixture
def slow_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The topics of the windows decided one by one."""
    calls: list[str] = []
    real = progress.decode_on_driver

    def counting(raw: pa.Table, topic: str | None, **kw: object) -> pa.Table:
        calls.append(str(topic))
        return real(raw, topic, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(progress, "decode_on_driver", counting)
    return calls


def test_windows_in_the_current_framing_are_decided_together_as_one_by_one(slow_calls: list[str]) -> None:
    windows = list(CLEAN.values())
    expected = [one_by_one(t, w) for t, w in windows]
    slow_calls.clear()
    assert progress_offsets(windows) == expected
    assert expected == [[10, 11], [1, 3], [], [3]]
    assert slow_calls == []


@pytest.mark.parametrize("name", sorted(OTHER))
def test_a_window_holding_anything_else_is_decided_alone_as_before(name: str, slow_calls: list[str]) -> None:
    odd = OTHER[name]
    windows = [CLEAN["statements"], odd, CLEAN["updates and statements"]]
    expected = [one_by_one(t, w) for t, w in windows]
    slow_calls.clear()
    assert progress_offsets(windows) == expected
    assert slow_calls == [odd[0]]


def test_every_mix_of_windows_finds_what_each_window_alone_finds() -> None:
    windows = [*CLEAN.values(), *OTHER.values()]
    for i in range(len(windows)):
        mix = windows[i:] + windows[:i]
        assert progress_offsets(mix) == [one_by_one(t, w) for t, w in mix]
    assert progress_offsets([]) == []


def with_announcements(topic: str, w: pa.Table, values: list[bytes]) -> tuple[str, pa.Table]:
    """A sink's statements and the frontiers topic's records, as the shared mint's step reads them."""
    return topic, pa.concat_tables([w, window("frontiers", 0, 100, list(values)).cast(w.schema)])


def test_the_sinks_statements_decoded_together_are_what_each_sinks_decode_gives() -> None:
    items = [with_announcements(t, w, [b"an announcement", b"another"]) for t, w in [*CLEAN.values(), *OTHER.values()]]
    items.append(("desired-empty", window("desired-empty", 0, 0, [])))
    items.append(with_announcements("desired-z", window("desired-z", 0, 0, []), [b"only an announcement"]))
    for i in range(0, len(items), 3):
        mix = items[i:] + items[:i]
        got = decode_statements_on_driver(mix)
        expected = [decode_on_driver(w, t, progress_only=True) for t, w in mix]
        assert [g.to_pylist() for g in got] == [e.to_pylist() for e in expected]
    assert sum(e.num_rows for e in expected) > 0
    assert decode_statements_on_driver([]) == []
    assert decode_statements_on_driver(items[-2:-1])[0].num_rows == 0
