"""The mint service's source: the Kafka source (``shardsink-kafka``) over the desired topic
and ``frontiers``, whose admission control holds the desired topic back while mint cannot use
it.

Mint mints only when the shard's upper moved since its last description. While that
description is in flight, the desired records that arrive (most of all during a burst) cannot
change what mint does, yet each trigger that finds some would run a micro-batch for them: the
micro-batch's planning, logs and driver call cost some 45 ms of CPU (measured on this
project's 2-core machines), ten times a second. So the mint query's driver says whether it is
holding (:func:`write_hold`: a small file in the query's checkpoint, rewritten when it
changes), and while it is, ``latestOffset`` admits the desired topic's records only together
with an upper announcement on ``frontiers`` (the news that ends the hold, in the same
micro-batch) or at least every :data:`shared.io.spark_kafka.ADMIT_EVERY_S` (mint then reads the shard's state in
case an announcement was lost). Admission control only ever delays records: the next
admitted micro-batch covers every held one, and mint reads each desired partition's range
back to its latest progress statement (:func:`services.sinkio.read_latest_progress`).

Same options as ``shardsink-kafka``, plus ``shardsinkMintHold`` (JSON: the hold file and the
desired topic). A checkpoint that is not a local path (``s3a://``) has no
hold file: the source then admits everything, as the plain Kafka source does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shared.io.spark_kafka import HoldingStreamReader, KafkaDataSource, SourceOptions

MINT_SOURCE = "shardsink-mint"
HOLD_OPTION = "shardsinkMintHold"
HOLD_FILE = "mint-hold"


def hold_path(checkpoint: str) -> str | None:
    """The hold file of a mint query's checkpoint; None when the checkpoint is not local."""
    from urllib.parse import urlparse

    u = urlparse(checkpoint)
    if u.scheme not in ("", "file"):
        return None
    return os.path.join(u.path if u.scheme == "file" else checkpoint, HOLD_FILE)


def write_hold(path: str | None, holding: bool) -> None:
    """Say whether the minter holds the desired topic back (a temporary file renamed into
    place: the source never reads half of it)."""
    if path is None:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("1" if holding else "0")
    os.replace(tmp, path)


def _holding(path: str | None) -> bool:
    if path is None:
        return False
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


class MintStreamReader(HoldingStreamReader):
    """Holds the desired topic back while the minter's hold file says so; news on
    ``frontiers`` (the other topic it reads) ends the hold."""

    def __init__(self, options: SourceOptions, hold: dict[str, Any]) -> None:
        super().__init__(options, held=hold["desired_topic"])
        self.hold = hold

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "hold": self.hold}

    def holding(self) -> bool:
        return _holding(self.hold.get("file"))


class MintDataSource(KafkaDataSource):
    """``shardsink-mint``: a streaming reader only."""

    @classmethod
    def name(cls) -> str:
        return MINT_SOURCE

    def streamReader(self, schema: Any) -> MintStreamReader:
        low = {k.lower(): v for k, v in self.options.items()}
        return MintStreamReader(SourceOptions.parse(self.options), json.loads(low[HOLD_OPTION.lower()]))


def mint_source(desired_topic: str, hold_file: str | None) -> tuple[str, type[MintDataSource], dict[str, str]]:
    """The ``source`` argument of :func:`shared.io.spark_kafka.kafka_read_stream`."""
    hold = {"file": hold_file, "desired_topic": desired_topic}
    return MINT_SOURCE, MintDataSource, {HOLD_OPTION: json.dumps(hold)}
