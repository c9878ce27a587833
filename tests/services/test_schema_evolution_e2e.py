"""Schema evolution end to end (issue 16): the real embedded stack (Tansu broker, moto S3) and
real Spark.

1. Through the CLI and the controller: a compatible alter is accepted on both paths
   (``--via controller``, ``--via catalog``), an incompatible one is refused with
   ``IncompatibleSchemaError`` naming the field and the rule and leaves the collection as it
   was, and peek, tail (a subscribe), ``snapshot`` and the Spark reader at times before the
   alter return rows in the current schema.
2. A collection goes through three alters (a nullable field added, an int promoted to long,
   an enum symbol added with a default) while its sink runs (the harness of
   ``tests/services/test_sink_e2e.py``: mint, write and append in one Spark application). Updates
   arrive in every version, old producers keep producing after an alter, and a row inserted
   in v1 is retracted in v4. At every upper the shard equals the model in the current schema;
   an alter alone writes no batch (the shard's batch list says so); a message of a schema the
   collection never had, and one of a known version that does not decode, become error rows.
"""

from __future__ import annotations

import csv
import io
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shardsink.cli.catalog import alter_collection_schema
from shared.avro_arrow import parse_row_schema
from shared.catalog import Catalog
from shared.codec import RowCodec
from shared.io.desired_producer import DesiredProducer
from shared.shard import SCHEMA_META_KEY, Shard, schema_view
from tests.cli.test_cli import ctl, env, run  # noqa: F401 - fixtures
from tests.services.test_sink_e2e import DEADLINE_S, POLL_S, Harness, h, running, shard_contents  # noqa: F401 - fixtures


def rec(*fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Row", "fields": list(fields)}


COLOR = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}
COLOR_BLUE = {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN", "BLUE"], "default": "RED"}
NOTE = {"name": "note", "type": ["null", "string"], "default": None}

V1 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "int"}, {"name": "c", "type": COLOR})
V2 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "int"}, {"name": "c", "type": COLOR}, NOTE)
V3 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "long"}, {"name": "c", "type": COLOR}, NOTE)
V4 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "long"}, {"name": "c", "type": COLOR_BLUE}, NOTE)
VERSIONS = [V1, V2, V3, V4]
#: A version the collection never has: its messages are error rows.
STRANGER = rec({"name": "k", "type": "long"}, {"name": "z", "type": "string"})


def _file(tmp_path: Path, name: str, schema: dict[str, Any]) -> str:
    p = tmp_path / f"{name}.avsc"
    p.write_text(json.dumps(schema))
    return str(p)


# -- 1. CLI and controller -------------------------------------------------------------------


def test_alter_through_the_cli_both_ways_refuses_incompatible_schemas_and_readers_see_one_schema(
    env: Any, ctl: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], spark: Any  # noqa: F811
) -> None:
    from shardsink import open_collection
    from shared.spark.shardsink_source import read_collection

    cid = f"evo-cli-{int(time.time() * 1000) % 10**8}"
    v1 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "int"})
    v2 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "int"}, NOTE)
    v3 = rec({"name": "k", "type": "long"}, {"name": "n", "type": "long"}, NOTE)
    assert run(capsys, "collection", "create", cid, "--schema", _file(tmp_path, "v1", v1), "--via", "controller")[0] == 0
    lines = [json.dumps({"row": {"k": k, "n": 10 * k}, "time": k % 3, "diff": 1}) for k in range(6)]
    (tmp_path / "v1.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "append", cid, "--input", str(tmp_path / "v1.jsonl"), "--advance-to", "3")
    assert code == 0, err

    # A compatible alter through the controller: the ack names the version and its first upper.
    code, out, err = run(capsys, "collection", "alter", cid, "--schema", _file(tmp_path, "v2", v2), "--via", "controller")
    assert (code, json.loads(out)) == (0, {"altered": cid, "schema_version": 1, "from_upper": 3}), err
    catalog = Catalog(env.service.store())
    assert catalog.state().collection(cid).schema == parse_row_schema(v2)

    # Incompatible alters, both ways: one line naming the field and the rule; nothing changes.
    before = Shard(env.service.store(), cid).refresh()
    bad = rec({"name": "k", "type": "int"}, {"name": "n", "type": "int"}, NOTE)
    for via in ("controller", "catalog"):
        code, out, err = run(capsys, "collection", "alter", cid, "--schema", _file(tmp_path, "bad", bad), "--via", via)
        assert code == 2 and out == "" and err.count("\n") == 1, (via, err)
        assert err.startswith("error: IncompatibleSchemaError: ") and "Row.k" in err and "type-changed" in err, (via, err)
    dropped = rec({"name": "k", "type": "long"}, NOTE)  # n removed, and it had no default
    code, out, err = run(capsys, "collection", "alter", cid, "--schema", _file(tmp_path, "dropped", dropped))
    assert code == 2 and "Row.n" in err and "field-removed-without-default" in err, err
    after = Shard(env.service.store(), cid).refresh()
    assert (after.seqno, after.schema, after.versions) == (before.seqno, before.schema, before.versions)
    assert catalog.state().collection(cid).schema == parse_row_schema(v2)

    # A compatible alter through the catalog directly (int promoted to long).
    code, out, err = run(capsys, "collection", "alter", cid, "--schema", _file(tmp_path, "v3", v3), "--via", "catalog")
    assert (code, json.loads(out)) == (0, {"altered": cid, "schema_version": 2, "from_upper": 3}), err
    assert catalog.state().collection(cid).schema == parse_row_schema(v3)
    lines = [json.dumps({"row": {"k": 100, "n": 2**40, "note": "v3"}, "time": 3, "diff": 1}),
             json.dumps({"row": {"k": 1, "n": 10, "note": None}, "time": 4, "diff": -1})]  # a v1 row retracted
    (tmp_path / "v3.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "append", cid, "--input", str(tmp_path / "v3.jsonl"), "--advance-to", "5")
    assert code == 0, err

    # Readers at a time before both alters: rows in the current schema.
    expected_at_1 = Counter({(0, 0, None): 1, (1, 10, None): 1, (3, 30, None): 1, (4, 40, None): 1})
    f = tmp_path / "peek.csv"
    code, out, err = run(capsys, "peek", cid, "--as-of", "1", "--output", "csv", "--file", str(f))
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(f.read_text())))
    assert list(rows[0]) == ["k", "n", "note", "count"], rows[0]
    assert Counter({(int(r["k"]), int(r["n"]), r["note"] or None): int(r["count"]) for r in rows}) == expected_at_1
    code, out, err = run(capsys, "tail", cid, "--as-of", "1", "--up-to", "5")
    assert code == 0, err
    changes = [(int(t), int(d), json.loads(row)) for t, d, row in (line.split("\t") for line in out.splitlines())]
    assert sorted((t, d, r["k"]) for t, d, r in changes) == [(1, 1, 0), (1, 1, 1), (1, 1, 3), (1, 1, 4), (2, 1, 2), (2, 1, 5), (3, 1, 100), (4, -1, 1)]
    assert all(set(r) == {"k", "n", "note"} for _, _, r in changes), changes
    snap = open_collection(cid, env.service.store()).snapshot(1)
    assert snap.schema.names == ["k", "n", "note", "_diff"] and str(snap.schema.field("n").type) == "int64"
    assert Counter({(r["k"], r["n"], r["note"]): r["_diff"] for r in snap.to_pylist()}) == expected_at_1
    df = read_collection(spark, cid, as_of=1, settings=env.service.s3)
    assert df.columns == ["k", "n", "note", "_diff"]
    assert Counter({(r["k"], r["n"], r["note"]): r["_diff"] for r in df.collect()}) == expected_at_1
    assert run(capsys, "collection", "drop", cid)[0] == 0


# -- 2. a running sink across three alters --------------------------------------------------


class Model:
    """Desired updates as full rows ``(k, n, c, note)``; read in any version's columns."""

    def __init__(self) -> None:
        self.updates: list[tuple[tuple[Any, ...], int, int]] = []
        self.present: Counter[tuple[Any, ...]] = Counter()

    def add(self, row: tuple[Any, ...], t: int, d: int) -> None:
        self.updates.append((row, t, d))
        self.present[row] += d
        if not self.present[row]:
            del self.present[row]

    def at(self, upper: int, columns: list[str]) -> dict[tuple[Any, ...], int]:
        idx = [["k", "n", "c", "note"].index(c) for c in columns]
        acc: Counter[tuple[Any, ...]] = Counter()
        for row, t, d in self.updates:
            if t < upper:
                acc[tuple(row[i] for i in idx)] += d
        return {r: n for r, n in acc.items() if n}


def _as_dict(row: tuple[Any, ...], version: int) -> dict[str, Any]:
    k, n, c, note = row
    return {"k": k, "n": n, "c": c} if version == 0 else {"k": k, "n": n, "c": c, "note": note}


def _fits(row: tuple[Any, ...], version: int) -> bool:
    _, n, c, note = row
    return (version >= 3 or c != "BLUE") and (version >= 1 or note is None) and (version >= 2 or -(2**31) <= n < 2**31)


class Sender:
    """Produces updates of the current version, and of older ones through producers of those
    versions (old producers keep running after an alter: their rows hash by the old body)."""

    def __init__(self, harness: Harness, topic: str, model: Model, seed: int) -> None:
        self.h, self.topic, self.model = harness, topic, model
        self.rng = random.Random(seed)
        self.current = 0
        self.main = DesiredProducer(harness.settings.kafka, topic, V1)
        self.keep: set[tuple[Any, ...]] = set()

    def upgrade(self, version: int) -> None:
        self.current = version
        self.main.rows = RowCodec(VERSIONS[version], previous=VERSIONS[:version])

    @property
    def frontier(self) -> int:
        t = self.main.frontier.time
        assert t is not None
        return t

    def row(self) -> tuple[Any, ...]:
        v = self.current
        n = self.rng.choice([self.rng.randrange(100), 2**31 - 1]) if v < 2 else self.rng.choice([self.rng.randrange(100), 2**40 + 3])
        c = self.rng.choice(COLOR_BLUE["symbols"] if v >= 3 else COLOR["symbols"])
        note = self.rng.choice([None, "x", "y"]) if v >= 1 else None
        return (self.rng.randrange(25), n, c, note)

    def step(self, n: int = 16, *, old_share: float = 0.3, extra: list[tuple[tuple[Any, ...], int]] = ()) -> int:  # type: ignore[assignment]
        lo = self.frontier
        olds: dict[int, DesiredProducer] = {}
        sends: list[tuple[tuple[Any, ...], int, int]] = [(r, lo, d) for r, d in extra]
        for t in sorted(self.rng.randrange(lo, lo + 3) for _ in range(n)):
            removable = sorted((r for r in self.model.present if r not in self.keep), key=repr)
            if removable and self.rng.random() < 0.4:
                r = self.rng.choice(removable)
                sends.append((r, t, -1))
            else:
                sends.append((self.row(), t, self.rng.choice((1, 1, 2))))
        for i, (r, t, d) in enumerate(sends):
            # some updates through a producer of an older version the row fits (not the extras:
            # they go in the current version)
            older = [v for v in range(self.current) if _fits(r, v)]
            if i >= len(extra) and older and self.rng.random() < old_share:
                v = self.rng.choice(older)
                if v not in olds:
                    olds[v] = DesiredProducer(self.h.settings.kafka, self.topic, VERSIONS[v], frontier=self.main.frontier)
                olds[v].send(_as_dict(r, v), t, d)
            else:
                self.main.send(_as_dict(r, self.current), t, d)
            self.model.add(r, t, d)
        for p in olds.values():
            p.close()  # flushes: every old-version update is durable before the progress below
        self.main.advance_to(lo + 3)
        return lo + 3


def _written_in(shard: Shard, key: str) -> str:
    """The schema fingerprint a part names in its Parquet metadata (plain pyarrow)."""
    import pyarrow.parquet as pq

    return str(pq.read_schema(io.BytesIO(shard.store.get(key))).metadata[SCHEMA_META_KEY].decode())


def _converge(harness: Harness, shard: Shard, model: Model, target: int, sid: str, errors: int = 0) -> None:
    """Poll until the upper reaches ``target``; at every upper seen the shard equals the model
    in the shard's current schema, and holds ``errors`` error rows at the end."""
    deadline, seen = time.monotonic() + DEADLINE_S, None
    while True:
        upper = shard.refresh().upper.time
        assert upper is not None and upper <= target, (upper, target)
        if upper != seen and upper > 0:
            seen = upper
            got = shard_contents(shard, upper - 1)
            expected = model.at(upper, shard.row_columns)
            assert got.rows == expected, (
                f"expected the shard at {upper - 1} to equal the model in {shard.row_columns}: "
                f"{sorted(set(got.rows.items()) ^ set(expected.items()), key=repr)[:6]}"
            )
            if upper >= target:
                assert sum(got.errors.values()) == errors, got.errors
                return
        if time.monotonic() > deadline:
            pytest.fail(f"expected the upper to reach {target} within {DEADLINE_S}s, found {upper}; {harness.diagnostics([sid])}")
        time.sleep(POLL_S)


def test_a_collection_evolves_through_three_versions_while_its_sink_runs(h: Harness, unique_id: str, spark: Any) -> None:  # noqa: F811
    from shared.spark.shardsink_source import read_collection

    cid, sid, topic = f"c-evo-{unique_id}", f"s-evo-{unique_id}", f"desired-evo-{unique_id}"
    shard = h.collection(cid, V1, topic, partitions=2)
    h.sink(sid, topic, cid)
    model = Model()
    send = Sender(h, topic, model, seed=16)
    kept = (999, 7, "GREEN", None)  # inserted in v1, retracted in v4
    send.keep.add(kept)

    send.step(extra=[(kept, 1)])
    _converge(h, shard, model, send.step(), sid)

    for version in (1, 2, 3):
        # Updates in flight when the schema changes: produced, not waited for.
        send.step()
        alter_collection_schema(h.settings, cid, VERSIONS[version])  # what `collection alter --via catalog` does
        send.upgrade(version)
        _converge(h, shard, model, send.frontier, sid)
        # The alter alone writes nothing: progress without updates adds no batch.
        before = [b.id for b in shard.refresh().batches]
        send.main.advance_to(send.frontier + 2)
        _converge(h, shard, model, send.frontier, sid)
        assert [b.id for b in shard.refresh().batches] == before, "expected no batch written because of the alter"
        # Updates in the new version and the older ones; the writers stage in the new version.
        _converge(h, shard, model, send.step(n=24), sid)
        last = shard.refresh().batches[-1]
        assert {_written_in(shard, p.key) for p in last.parts} == {schema_view(parse_row_schema(VERSIONS[version])).fingerprint}

    state = shard.refresh()
    assert [v.schema for v in state.versions] == [parse_row_schema(v) for v in VERSIONS]
    first_alter = state.versions[1].from_upper.time
    assert first_alter is not None and model.at(first_alter, ["k", "n", "c", "note"]).get(kept) == 1

    # The row inserted in v1 retracted in v4 (hashed by its v4 body: maybe another partition
    # than its insert's), and a message of a schema the collection never had: an error row.
    # A row framed with v2 (which the write query's decoder, started under v1, does not know)
    # whose body does not decode: resolved by the write step, an error row too.
    stranger = RowCodec(STRANGER).encode({"k": 1, "z": "?"})
    send.main.send_encoded(stranger, send.frontier, 1)
    broken = RowCodec(V2).encode({"k": 1, "n": 1, "c": "RED", "note": None})[:10] + b"\xff"
    send.main.send_encoded(broken, send.frontier, 1)
    target = send.step(extra=[(kept, -1)])
    _converge(h, shard, model, target, sid, errors=2)
    assert kept not in model.present
    got = shard_contents(shard, target - 1)
    assert not [r for r in got.rows if r[0] == 999], got.rows
    texts = sorted(got.errors)
    assert sorted(got.errors.values()) == [1, 1] and all(f"{topic}/" in e for e in texts), texts
    assert any("fingerprint" in e for e in texts) and any("do not decode" in e for e in texts), texts

    # Every time below the upper, not only the uppers a poll saw; times before the first
    # alter read in the current schema, from the Python API and from Spark.
    for t in range(target):
        assert shard_contents(shard, t).rows == model.at(t + 1, shard.row_columns), t
    early = shard.snapshot(first_alter - 1)
    assert early.schema.names == ["k", "n", "c", "note", "_error", "_diff"]
    assert str(early.schema.field("n").type) == "int64"
    df = read_collection(spark, cid, as_of=first_alter - 1, settings=h.settings.s3)
    assert df.columns == ["k", "n", "c", "note", "_diff"]
    assert {(r["k"], r["n"], r["c"], r["note"]): r["_diff"] for r in df.collect()} == model.at(first_alter, ["k", "n", "c", "note"])
