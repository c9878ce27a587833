"""The state value behind the golden fixture ``tests/fixtures/state/v1.json``."""

from __future__ import annotations

from shared.frontier import Frontier
from shared.state import AppendRecord, BatchMeta, Part, ReaderHold, RetiredPart, ShardState

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}],
}


def golden_state() -> ShardState:
    return ShardState(
        shard_id="golden",
        seqno=7,
        schema=SCHEMA,
        upper=Frontier.at(30),
        since=Frontier.at(10),
        batches=(
            BatchMeta(
                id="b1",
                lower=Frontier.at(0),
                upper=Frontier.at(20),
                since=Frontier.at(10),
                parts=(Part("shards/golden/data/a.parquet", 5, 1234),),
                rows=5,
            ),
            BatchMeta(
                id="b2",
                lower=Frontier.at(20),
                upper=Frontier.at(30),
                since=Frontier.at(20),
                parts=(Part("shards/golden/data/b.parquet", 2, 900), Part("shards/golden/data/c.parquet", 1, 800)),
                rows=3,
            ),
        ),
        readers=(
            ReaderHold("controller", "critical", Frontier.at(10), 0, None),
            ReaderHold("peek-1", "leased", Frontier.at(12), 60000, 1700000060000),
        ),
        recent=(AppendRecord("tok-1", Frontier.at(20), Frontier.at(30), 6),),
        retired=(RetiredPart("shards/golden/data/old.parquet", 1700000000000),),
        dropped=False,
        appends=3,
        written_ms=1700000000500,
        change_token="tok-1",
    )
