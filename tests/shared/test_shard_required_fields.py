"""A collection whose rows hold records with required fields keeps its error rows: an error
row has no row (its row columns are null), and Arrow refuses to cast a null in a required
field even under a null record, so such a shard could not stage, append or compact a batch
with an error row (the write service would have failed on every bad message of such a
collection). Pure core: the in-memory object store."""

from __future__ import annotations

import pyarrow as pa
import pytest

from shared.errors import SchemaMismatchError
from shared.objectstore import MemoryObjectStore
from shared.shard import Shard

INNER = {"type": "record", "name": "Inner", "fields": [
    {"name": "a", "type": "double"},
    {"name": "s", "type": "string"},
    {"name": "tags", "type": {"type": "array", "items": "string"}},
    {"name": "m", "type": {"type": "map", "values": "long"}},
    {"name": "deep", "type": {"type": "record", "name": "Deep", "fields": [
        {"name": "f", "type": {"type": "fixed", "name": "F4", "size": 4}},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["X", "Y"]}},
    ]}},
]}
SCHEMA = {"type": "record", "name": "Row", "fields": [
    {"name": "k", "type": "long"},
    {"name": "r", "type": INNER},
    {"name": "maybe", "type": ["null", {"type": "record", "name": "Opt", "fields": [{"name": "x", "type": "int"}]}],
     "default": None},
]}


def row(k: int) -> dict:
    return {"k": k, "r": {"a": 1.5, "s": "s", "tags": ["t"], "m": {"z": 1},
                          "deep": {"f": b"abcd", "e": "Y"}}, "maybe": {"x": k} if k % 2 else None}


def _rows(table: pa.Table) -> list[tuple]:
    out = []
    for d in table.to_pylist():
        err = d.pop("_error")
        diff = d.pop("_diff")
        d.pop("_time", None)
        if isinstance(d["r"], dict) and isinstance(d["r"]["m"], list):
            d["r"]["m"] = dict(d["r"]["m"])
        out.append((None if err is not None else d, err, diff))
    return sorted(out, key=repr)


def test_error_rows_of_a_collection_with_required_record_fields_are_staged_appended_read_and_compacted() -> None:
    sh = Shard.create(MemoryObjectStore(), "req", SCHEMA)
    sh.compare_and_append([(row(1), 0, 1), (None, 0, 1, "bad message at d/0@7"), (row(2), 1, 1)], 0, 2, token="t1")
    sh.compare_and_append([(None, 2, 1, "bad message at d/0@9"), (None, 2, 1, "bad message at d/0@9")], 2, 3, token="t2")
    # Only error rows, staged as the write service stages them: null row columns.
    view = sh.view()
    etab = pa.table({**{f.name: pa.nulls(2, f.type) for f in view.row_schema},
                     "_time": pa.array([3, 3], pa.uint64()), "_diff": pa.array([1, -1], pa.int64()),
                     "_error": pa.array(["gone", "kept"], pa.string())})
    etab = etab.set_column(etab.schema.get_field_index("_diff"), "_diff", pa.array([1, 2], pa.int64()))
    staged = sh.stage(sh.to_table(etab))
    sh.compare_and_append_staged([staged], 3, 4, token="t3")

    want = sorted([(row(1), None, 1), (row(2), None, 1), (None, "bad message at d/0@7", 1),
                   (None, "bad message at d/0@9", 2), (None, "gone", 1), (None, "kept", 2)], key=repr)
    assert _rows(sh.snapshot(3)) == want
    sh.compact()
    assert _rows(sh.snapshot(3)) == want


def test_a_null_in_a_required_field_of_a_record_that_is_there_is_still_refused() -> None:
    sh = Shard.create(MemoryObjectStore(), "req2", SCHEMA)
    view = sh.view()
    good = sh.to_table([(row(1), 0, 1)])
    r = good["r"].combine_chunks()
    broken = pa.StructArray.from_arrays([pa.array([None], pa.float64()), *[r.field(i) for i in range(1, r.type.num_fields)]],
                                        names=[f.name for f in r.type])
    table = good.set_column(good.schema.get_field_index("r"), pa.field("r", broken.type), broken)
    assert view.part_schema.field("r").type.field("a").nullable is False
    with pytest.raises(SchemaMismatchError):
        sh.to_table(table)
