"""Bad input campaign (issue 7): random and mutated Avro messages and row values against the
decoders and the controller's command handling.

- Decoders (pure, in-process; and coverage-guided with atheris, tests/fuzz/atheris_decoders.py): the desired-message decoder, every message codec (commands,
  responses, control messages, subscribe output), the row codec, and the executor-side
  micro-batch decode of the sink (``services.sinkio.decode_partition``). Valid messages are
  mutated (bit flips, byte replacements, truncations, insertions, splices) or replaced by
  random bytes. Every input either decodes to a well-formed value or raises the typed
  :class:`DecodeError`; nothing else escapes. The sink's decode never raises: a bad message
  becomes a ``bad`` record with an error text, and a good one keeps its offset.
- The controller (run in a thread of this process, as tests/services/test_controller.py does): mutated
  command bytes, in rounds. Every input is answered: a command that does not decode with an
  ``Error`` of kind ``DecodeError`` (command id ``unknown``), every other one with a response
  to its id; every Error has a kind and a message; a round whose commands were all rejected
  leaves the collection's upper and contents unchanged; the controller is still running and
  still applies and answers valid commands at the end.

The number of inputs tried is printed (``-s`` shows it) and asserted to reach a floor.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.controller.service import Controller, ControllerSettings
from services.sinkio import DECODED_SCHEMA, KIND_BAD, KIND_PROGRESS, KIND_UPDATE, decode_partition
from shared.codec import RowCodec, message_codec
from shared.desired import DesiredProgress, DesiredUpdate, decode_desired, encode_progress, encode_update
from shared.devstack.embedded import EmbeddedStack
from shared.errors import DecodeError, EncodeError
from shared.frontier import Frontier
from shared.io.controller_client import ControllerClient, body_kind
from shared.shard import Shard
from tests.controller_fixture import ROWS, SCHEMA, append_body, client_for, controller_settings, create_body, peek_rows

TRIED: Counter[str] = Counter()
EXAMPLES = 400
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)

# -- mutations -------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random, rounds: int = 3) -> bytes:
    """A few random edits of ``data``: bit flips, replaced bytes, truncation, insertion,
    duplication of a slice."""
    b = bytearray(data)
    for _ in range(rng.randint(1, rounds)):
        op = rng.randrange(6)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2 and b:
            del b[rng.randrange(len(b)) :]
        elif op == 3:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and b:
            i = rng.randrange(len(b))
            j = rng.randrange(i, len(b) + 1)
            b[j:j] = b[i:j]
        elif op == 5 and len(b) > 10:
            i = rng.randrange(10, len(b))  # an edit past the single-object header
            b[i] = rng.choice([0x00, 0x01, 0x7F, 0x80, 0xFF])
    return bytes(b)


rows = st.fixed_dictionaries({"k": st.integers(-(2**63), 2**63 - 1), "v": st.text(max_size=20)})
times = st.integers(0, 2**64 - 1)
diffs = st.integers(-(2**63), 2**63 - 1)


@st.composite
def desired_inputs(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["update", "progress", "random", "mutated_update", "mutated_progress"]))
    if kind == "random":
        return bytes(draw(st.binary(max_size=64)))
    if kind.endswith("progress"):
        data = encode_progress(draw(st.integers(0, 2**31 - 1)), Frontier(draw(st.one_of(st.none(), times))))
    else:
        data = encode_update(ROWS.encode(draw(rows)), draw(times), draw(diffs))
    if kind.startswith("mutated"):
        data = mutate(data, random.Random(draw(st.integers(0, 2**32))))
    return data


# -- decoders --------------------------------------------------------------------------------


@FUZZ
@given(desired_inputs())
def test_desired_decoder_returns_a_message_or_a_decode_error_for_any_bytes(data: bytes) -> None:
    TRIED["desired"] += 1
    try:
        msg = decode_desired(data)
    except DecodeError:
        return
    assert isinstance(msg, (DesiredUpdate, DesiredProgress))
    if isinstance(msg, DesiredUpdate):
        assert isinstance(msg.row, bytes) and 0 <= msg.time < 2**64 and -(2**63) <= msg.diff < 2**63
        assert decode_desired(encode_update(msg.row, msg.time, msg.diff)) == msg
    else:
        assert msg.partition >= 0


CODECS = ["command", "response", "batch_description", "written_batch", "frontier_update", "subscribe_output", "desired"]


def _sample_command(rng: random.Random) -> dict[str, Any]:
    from shared.codec import tagged

    kind = rng.choice(["CreateCollection", "Append", "Peek", "Subscribe", "DropCollection", "SetReadPolicy"])
    if kind == "CreateCollection":
        body = create_body(f"c{rng.randrange(100)}")
    elif kind == "Append":
        body = append_body("c1", [({"k": rng.randrange(50), "v": "x"}, 3, 1)], 4, expected=3)
    elif kind == "Peek":
        body = {"collection_id": "c1", "as_of": rng.randrange(10)}
    elif kind == "Subscribe":
        body = {"collection_id": "c1", "output_topic": "t", "as_of": 0, "up_to": None, "with_snapshot": True}
    elif kind == "DropCollection":
        body = {"collection_id": "c1"}
    else:
        body = {"collection_id": "c1", "policy": ("io.shardsink.v1.LagWritesBy", {"lag": 4, "granularity": None})}
    return {"command_id": uuid.UUID(int=rng.getrandbits(128)).hex, "issued_at_ms": 1, "body": tagged(kind, body)}


@FUZZ
@given(st.sampled_from(CODECS), st.integers(0, 2**32), st.booleans())
def test_message_codecs_decode_or_raise_decode_error_for_mutated_and_random_bytes(name: str, seed: int, random_bytes: bool) -> None:
    TRIED[f"codec:{name}"] += 1
    codec = message_codec(name)
    rng = random.Random(seed)
    if random_bytes:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
        if rng.random() < 0.5:
            data = codec._header + data  # a valid header, garbage body  # noqa: SLF001
    elif name == "command":
        data = mutate(codec.encode(_sample_command(rng)), rng)
    elif name == "desired":
        data = mutate(encode_update(ROWS.encode({"k": 1, "v": "a"}), 5, 1), rng)
    else:
        # Mutate the single-object header and body of an arbitrary other message.
        data = mutate(codec._header + bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))), rng)  # noqa: SLF001
    try:
        value = codec.decode(data)
    except DecodeError:
        return
    assert isinstance(value, dict)


@FUZZ
@given(st.integers(0, 2**32), rows)
def test_row_codec_decodes_or_raises_decode_error_and_upgrade_keeps_decodable_rows(seed: int, row: dict[str, Any]) -> None:
    TRIED["row"] += 1
    rng = random.Random(seed)
    codec = RowCodec(SCHEMA)
    data = mutate(codec.encode(row), rng)
    try:
        decoded = codec.decode(data)
    except DecodeError:
        return  # (upgrade() passes current-version bytes through unchecked: the sink's decode
        # checks the body itself, see the sink decode test below)
    assert set(decoded) == {"k", "v"}
    assert codec.decode(codec.upgrade(data)) == decoded


@FUZZ
@given(st.lists(desired_inputs(), min_size=1, max_size=30), st.booleans())
def test_sink_decode_turns_every_bad_message_into_a_bad_record_and_never_raises(values: list[bytes], with_schema: bool) -> None:
    import json

    TRIED["sink_decode"] += len(values)
    topic = "desired-fuzz"
    rb = pa.RecordBatch.from_pydict(
        {
            "topic": [topic] * len(values),
            "partition": [0] * len(values),
            "offset": list(range(len(values))),
            "value": values,
        }
    )
    fn = decode_partition(topic, json.dumps(SCHEMA) if with_schema else None)
    (out,) = list(fn(iter([rb])))
    assert out.schema == DECODED_SCHEMA
    assert out.column("offset").to_pylist() == list(range(len(values)))
    for kind, err, value in zip(out.column("kind").to_pylist(), out.column("error").to_pylist(), values, strict=True):
        assert kind in (KIND_UPDATE, KIND_PROGRESS, KIND_BAD)
        if kind == KIND_BAD:
            assert err, "expected a bad record to carry its error"
        else:
            assert err is None
            decode_desired(value)  # an accepted message decodes on its own
            if kind == KIND_UPDATE and with_schema:
                ROWS.decode(ROWS.upgrade(decode_desired(value).row))  # type: ignore[union-attr]


# -- the controller --------------------------------------------------------------------------


@pytest.fixture
def controller(stack: EmbeddedStack) -> Iterator[tuple[Controller, ControllerClient, ControllerSettings]]:
    cs = controller_settings(stack, peek_timeout_ms=500)
    ctl = Controller(cs).start()
    client = client_for(cs)
    yield ctl, client, cs
    ctl.stop()
    client.close()


ROUNDS = 12
PER_ROUND = 20


def _template(rng: random.Random, collection: str, upper: int) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(["Append", "Append", "Append", "Peek", "CreateCollection", "SetReadPolicy", "Subscribe", "AllowWrites", "DropSink"])
    if kind == "Append":
        ups = [({"k": rng.randrange(30), "v": rng.choice("xyz")}, upper, rng.choice([1, -1])) for _ in range(rng.randint(1, 4))]
        return kind, append_body(collection, ups, upper + 1, expected=upper)
    if kind == "Peek":
        return kind, {"collection_id": collection, "as_of": max(0, upper - 1), "limit": None, "max_inline_bytes": None}
    if kind == "CreateCollection":
        return kind, create_body(f"fz-new-{rng.randrange(10**6)}")
    if kind == "SetReadPolicy":  # on another collection: an accepted policy moves since
        return kind, {"collection_id": "fz-other", "policy": ("io.shardsink.v1.LagWritesBy", {"lag": 1000, "granularity": None})}
    if kind == "Subscribe":
        return kind, {"collection_id": collection, "output_topic": f"fz-out-{rng.randrange(5)}", "as_of": 0, "up_to": 1, "with_snapshot": False}
    if kind == "AllowWrites":
        return kind, {"sink_ids": [f"nope-{rng.randrange(5)}"]}
    return kind, {"sink_id": f"nope-{rng.randrange(5)}"}


def _template_value(rng: random.Random, client: Any, collection: str, upper: int) -> bytes:
    """An encoded template command; random bytes when an accepted mutation moved the upper
    to the top of u64, where an Append's new upper (upper + 1) no longer encodes."""
    kind, body = _template(rng, collection, upper)
    try:
        return bytes(client.encode(kind, body)[1])
    except EncodeError:
        assert upper >= 2**64 - 1, f"expected the template to encode below the top of u64, found upper {upper}"
        return bytes(rng.randrange(256) for _ in range(40))


WEIRD_IDS = ["", ".", "..", "../x", "a/b", "x" * 200, "fz ", "\u00e9", "fz\x00", "fz"]


def _bad_values(rng: random.Random, collection: str, upper: int) -> tuple[str, dict[str, Any]]:
    """Well-formed Avro with bad values: odd ids, wrong uppers, times outside the append's
    range, rows that are random or mutated bytes, schemas that are not schemas."""
    kind = rng.choice(["Append", "Append", "Append", "CreateCollection", "Peek", "Subscribe", "SetReadPolicy"])
    cid = rng.choice(WEIRD_IDS + [collection] * 4)
    if kind == "Append":
        good = ROWS.encode({"k": rng.randrange(30), "v": "y"})
        row = rng.choice([good, mutate(good, rng, 1), bytes(rng.randrange(256) for _ in range(rng.randint(0, 12))), good[:10]])
        t = rng.choice([upper, upper + 1, upper - 1 if upper else 0, 2**64 - 1, 0])
        exp = rng.choice([upper, upper + 1, max(0, upper - 1), None, 2**64 - 1])
        new = rng.choice([upper + 1, upper, exp, None, 2**64 - 1, 0])
        return kind, {"collection_id": cid, "updates": [{"row": row, "time": t, "diff": rng.choice([1, -1, 0, 2**63 - 1, -(2**63)])}],
                      "expected_upper": exp, "new_upper": new}
    if kind == "CreateCollection":
        schema = rng.choice(['{"type": "string"}', "{", '{"type": "record", "name": "R", "fields": [{"name": "k"}]}', "null", '[]'])
        return kind, {"collection_id": cid, "row_schema": schema, "initial_since": rng.choice([0, 2**64 - 1]), "read_policy": None}
    if kind == "Peek":
        return kind, {"collection_id": cid, "as_of": rng.choice([0, upper, upper + 5, 2**64 - 1]), "limit": rng.choice([None, 0, -1]),
                      "max_inline_bytes": rng.choice([None, 0, -5])}
    if kind == "Subscribe":
        return kind, {"collection_id": cid, "output_topic": rng.choice(["", "bad topic!", "x" * 300]), "as_of": rng.choice([0, 2**64 - 1]),
                      "up_to": rng.choice([None, 0]), "with_snapshot": True}
    cid = "fz-other" if cid == collection else cid  # an accepted policy would move since
    return kind, {"collection_id": cid, "policy": ("io.shardsink.v1.LagWritesBy", {"lag": rng.choice([0, -1, 2**63 - 1]), "granularity": rng.choice([None, 0, -3])})}


def _contents(shard: Shard, upper: int) -> Counter[tuple[Any, ...]]:
    if upper == 0:
        return Counter()
    snap = shard.snapshot(upper - 1)
    c: Counter[tuple[Any, ...]] = Counter()
    for k, v, d in zip(snap["k"].to_pylist(), snap["v"].to_pylist(), snap["_diff"].to_pylist(), strict=True):
        c[(k, v)] += d
    return c


def test_controller_answers_every_mutated_command_and_rejected_ones_leave_the_shard_unchanged(controller: Any) -> None:
    ctl, client, cs = controller
    rng = random.Random(int.from_bytes(uuid.uuid4().bytes[:4], "big"))
    collection = "fz"
    assert body_kind(client.call("CreateCollection", create_body(collection))) == "Ack"
    assert body_kind(client.call("CreateCollection", create_body("fz-other"))) == "Ack"
    shard = Shard(cs.service.store(), collection)
    ups = [({"k": i, "v": "x"}, 0, 1) for i in range(5)]
    assert body_kind(client.call("Append", append_body(collection, ups, 1, expected=0))) == "Ack"
    cmd_codec = client.cmd_codec
    sent_ids: list[str] = []
    undecodable = 0
    kinds: Counter[str] = Counter()
    unchanged_checks = 0
    target: dict[str, tuple[str, Any]] = {}  # command id -> (kind, collection id)
    unknown_before = sum(1 for r in client.seen if r.get("command_id") == "unknown")
    for _round in range(ROUNDS):
        before_upper = int(shard.refresh().upper.time or 0)
        before = _contents(shard, before_upper)
        round_ids: list[str] = []
        for _ in range(PER_ROUND):
            r = rng.random()
            if r < 0.5:
                kind, body = _bad_values(rng, collection, before_upper)
                try:
                    _, data = client.encode(kind, body)
                except Exception:  # noqa: BLE001 - a value Avro itself refuses: mutate a template
                    data = mutate(_template_value(rng, client, collection, before_upper), rng, 1)
            else:
                value = _template_value(rng, client, collection, before_upper)
                if r < 0.55:
                    data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 60)))
                elif r < 0.6:
                    data = value[: rng.randrange(len(value))]
                else:
                    data = mutate(value, rng, 1)
            try:
                cmd = cmd_codec.decode(data)
                cid = str(cmd["command_id"])
                target[cid] = (body_kind(cmd), cmd["body"][1].get("collection_id"))
            except (DecodeError, KeyError, TypeError, AttributeError):
                cid = None
            client.send_raw(data)
            TRIED["controller"] += 1
            if cid is None:
                undecodable += 1
            elif cid not in sent_ids and cid != "unknown":
                round_ids.append(cid)
                sent_ids.append(cid)
        # Every decodable command answered (to its id); the undecodable ones as "unknown".
        accepted_changes = False
        for cid in round_ids:
            resp = client.wait(cid, timeout_s=120)
            k = body_kind(resp)
            kinds[k] += 1
            if k == "Error":
                assert resp["body"][1]["kind"] and resp["body"][1]["message"], resp
            elif k == "Ack":
                # e.g. a mutation that is still a valid Append: only changes of this
                # collection spoil the round's unchanged check.
                accepted_changes |= target[cid][1] == collection and target[cid][0] != "Subscribe"
            else:
                assert k in ("PeekResult", "PeekCanceled"), resp
        after_upper = int(shard.refresh().upper.time or 0)
        if not accepted_changes:
            unchanged_checks += 1
            assert after_upper == before_upper, f"expected rejected commands to leave the upper at {before_upper}, found {after_upper}"
            assert _contents(shard, after_upper) == before, "expected rejected commands to leave the contents unchanged"
        assert ctl.alive(), f"expected the controller running, found it stopped: {ctl.error!r}"
    # The undecodable inputs were each answered with a typed DecodeError (id "unknown").
    deadline_polls = 0
    while sum(1 for r in client.seen if r.get("command_id") == "unknown") - unknown_before < undecodable and deadline_polls < 600:
        client.poll(0.1)
        deadline_polls += 1
    unknown = [r for r in client.seen if r.get("command_id") == "unknown"][unknown_before:]
    assert len(unknown) == undecodable, f"expected {undecodable} DecodeError answers, found {len(unknown)}"
    assert all(body_kind(r) == "Error" and r["body"][1]["kind"] == "DecodeError" for r in unknown)
    # Still serving: a valid create, append and peek on a collection no mutated command can
    # name (a mutation that is still a valid command may have dropped or advanced the fuzzed
    # collections).
    fresh = f"{collection}-after"
    assert body_kind(client.call("CreateCollection", create_body(fresh))) == "Ack"
    add = [({"k": 10_000, "v": "after"}, 0, 1)]
    assert body_kind(client.call("Append", append_body(fresh, add, 1, expected=0))) == "Ack"
    assert peek_rows(client.call("Peek", {"collection_id": fresh, "as_of": 0})) == Counter({(10_000, "after"): 1})
    assert ctl.alive() and ctl.error is None
    print(f"controller fuzz: {TRIED['controller']} commands ({undecodable} undecodable), responses {dict(kinds)}, "
          f"{unchanged_checks} all-rejected rounds checked unchanged")
    assert TRIED["controller"] >= ROUNDS * PER_ROUND
    assert kinds["Error"] > 0 and undecodable > 0


ATHERIS_RUNS = 20_000


def test_atheris_coverage_guided_fuzzing_of_the_decoders_finds_no_crash(tmp_path: Any) -> None:
    """tests/fuzz/atheris_decoders.py for a fixed number of runs from a corpus of valid
    messages: any exception other than DecodeError (or an accepted row that does not decode)
    is a crash, reported by a non-zero exit and a crash-* file."""
    import subprocess
    import sys
    from pathlib import Path

    harness = Path(__file__).resolve().parents[1] / "fuzz" / "atheris_decoders.py"
    proc = subprocess.run(
        [sys.executable, str(harness), f"-runs={ATHERIS_RUNS}", "-seed=7", f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus")],
        capture_output=True, text=True, check=False, timeout=600,
    )
    crashes = list(Path(tmp_path).glob("crash-*"))
    assert proc.returncode == 0 and not crashes, f"expected no crash, found exit {proc.returncode}, {crashes}:\n{proc.stderr[-3000:]}"
    assert f"Done {ATHERIS_RUNS} runs" in proc.stderr
    TRIED["atheris"] += ATHERIS_RUNS


@pytest.mark.stack  # counts the controller round too, which runs against the embedded stack
def test_zz_fuzz_campaign_reached_its_input_floor() -> None:
    """Runs last in this module: the number of inputs tried over the campaign."""
    total = sum(TRIED.values())
    print(f"bad input campaign: {total} inputs tried: {dict(sorted(TRIED.items()))}")
    assert TRIED["desired"] >= EXAMPLES and TRIED["row"] >= EXAMPLES and TRIED["sink_decode"] >= EXAMPLES
    assert sum(v for k, v in TRIED.items() if k.startswith("codec:")) >= EXAMPLES
    assert TRIED["controller"] >= ROUNDS * PER_ROUND
    assert TRIED["atheris"] >= ATHERIS_RUNS
    assert total >= 20_000
