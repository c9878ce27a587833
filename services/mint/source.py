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

It also finds, while planning, what mint needs of the admitted desired records: each
partition's latest progress statement (read back from the range's end,
:func:`services.sinkio.latest_progress_record`), carried in the micro-batch's offsets under
:data:`PROGRESS_KEY` (an annotation, which the Kafka source's offsets leave out:
``{"<partition>": [offset, base64 value]}``, the latest statement below the partition's end
offset that the source has seen, ``[-1, null]`` for none). Spark logs the offsets with the
micro-batch, so the minter's driver reads the statements there (:func:`planned_progress`)
instead of reading the desired topic itself: the driver coordinates, the source runner reads.
A partition whose tail could not be read has no entry, and the minter reads that range itself.

Desired records without a progress statement are held back too. A producer writes a step's
updates and then its statement; the first records of a step would otherwise wake the query
for a micro-batch that finds no statement and mints nothing, and the statement would wait for
that micro-batch to end and for the next trigger (measured: about 1.5 mint micro-batches per
description during a burst). So when no description is held and the admitted desired ranges
hold no statement (their tails read to their starts, each record read once: a range read
without a statement is remembered, and the next look reads only what came after it), with no
news on ``frontiers``, ``latestOffset`` answers the start: no micro-batch. It admits them as
soon as a statement arrives, with news, and at least every
:data:`shared.io.spark_kafka.ADMIT_EVERY_S`; a tail it cannot read, a start or restart and an
``availableNow`` trigger admit at once.

Same options as ``shardsink-kafka``, plus ``shardsinkMintHold`` (JSON: the hold file and the
desired topic). A checkpoint that is not a local path (``s3a://``) has no
hold file: the source then admits everything, as the plain Kafka source does.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pyspark.sql.streaming.datasource import ReadLimit

from shared.errors import ShardsinkError
from shared.io.spark_kafka import (
    ANNOTATION_PREFIX,
    HoldingStreamReader,
    KafkaDataSource,
    SourceOptions,
    offsets_from_json,
)

log = logging.getLogger("shardsink.mint")

MINT_SOURCE = "shardsink-mint"
HOLD_OPTION = "shardsinkMintHold"
HOLD_FILE = "mint-hold"
#: The annotation of a mint micro-batch's offsets that carries the desired partitions' latest
#: progress statements.
PROGRESS_KEY = ANNOTATION_PREFIX + "progress"


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
        #: when ``latestOffset`` last answered more than its start (None: never, it admits)
        self._delivered: float | None = None
        #: per desired partition, ``(start, end)``: a range read back to ``start`` without a
        #: progress statement (the next look at a range from ``start`` reads from ``end`` on)
        self._quiet: dict[int, tuple[int, int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "hold": self.hold, "_delivered": None, "_quiet": {}}

    def holding(self) -> bool:
        return _holding(self.hold.get("file"))

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        s = offsets_from_json(start)
        deadline = time.monotonic() + self.wait_budget()
        while True:
            end = super().latestOffset(start, limit)
            e = offsets_from_json(end)
            progress, found = self.latest_progress(s, e, start.get(PROGRESS_KEY))
            if found or not self._nothing_to_mint(s, e):
                self._delivered = time.monotonic()
                return {**end, PROGRESS_KEY: progress} if progress else end
            # Only updates so far: wait, as for the first record, for the ones after them.
            left = deadline - time.monotonic()
            if left <= 0 or not self._p().await_records(self.watched(), left):
                return start

    def _nothing_to_mint(self, s: Mapping[str, Mapping[int, int]], e: Mapping[str, Mapping[int, int]]) -> bool:
        """Whether ``e`` is ``s`` but for desired records without a statement, which mint has no
        use for yet (module docstring)."""
        if self._target is not None or self._delivered is None:
            return False  # availableNow reaches its target; a start or restart admits
        if time.monotonic() - self._delivered >= self.admit_every_s:
            return False
        topic = self.hold["desired_topic"]
        return all(p in s.get(t, {}) and (t == topic or o <= s[t][p]) for t, ps in e.items() for p, o in ps.items())

    def latest_progress(self, start: Mapping[str, Mapping[int, int]], end: Mapping[str, Mapping[int, int]],
                        carried: Any) -> tuple[dict[str, list[Any]], bool]:
        """The :data:`PROGRESS_KEY` annotation of ``end``: ``carried`` (``start``'s), updated
        with the latest statement of each desired range ``[start, end)`` that is not empty; and
        whether a range may hold a statement (one found, or a tail that could not be read)."""
        from services.sinkio import latest_progress_record

        topic = self.hold["desired_topic"]
        prefix = dict(self.options.skip_value_prefixes).get(topic)
        out: dict[str, list[Any]] = dict(carried) if isinstance(carried, Mapping) else {}
        ranges = [(p, start.get(topic, {}).get(p, 0), b) for p, b in sorted(end.get(topic, {}).items())]
        ranges = [(p, a, b) for p, a, b in ranges if b > a]
        quiet = {p: q for p, q in self._quiet.items() if any(p == r[0] and q[0] == r[1] for r in ranges)}

        def one(r: tuple[int, int, int]) -> tuple[int, bytes] | None | ShardsinkError:
            p, a, b = r
            # [a, quiet end) was read without a statement: only what came after it can hold one.
            a = max(a, min(b, quiet[p][1])) if p in quiet else a
            if a >= b:
                return None
            try:
                return latest_progress_record(self.options.settings, topic, p, a, b, prefix)
            except ShardsinkError as e:
                return e

        # The partitions' tails are read concurrently (a consumer each; librdkafka waits and
        # parses without the GIL): the micro-batch waits for the slowest, not for their sum.
        if len(ranges) > 1:
            with ThreadPoolExecutor(max_workers=min(8, len(ranges))) as ex:
                results = list(ex.map(one, ranges))
        else:
            results = [one(r) for r in ranges]
        any_found = False
        self._quiet = {}
        for (p, a, b), found in zip(ranges, results, strict=True):
            if isinstance(found, ShardsinkError):
                # The minter reads the range itself (and meets the error there, typed).
                log.warning("could not read the latest progress of %s/%d in [%d, %d): %s", topic, p, a, b, found)
                out.pop(str(p), None)
                any_found = True
                continue
            if found is not None:
                out[str(p)] = [found[0], base64.b64encode(found[1]).decode()]
                any_found = True
            else:
                self._quiet[p] = (a, b)
                if str(p) not in out:
                    out[str(p)] = [-1, None]
        return out, any_found


def planned_progress(offsets: Mapping[str, Any] | None) -> dict[int, tuple[int, bytes] | None]:
    """The :data:`PROGRESS_KEY` annotation of a mint micro-batch's logged end ``offsets`` by
    partition: ``(offset, value)`` of the latest statement below the end, None when there is
    none; a partition without an entry is missing (the minter reads its range itself)."""
    raw = (offsets or {}).get(PROGRESS_KEY)
    out: dict[int, tuple[int, bytes] | None] = {}
    if not isinstance(raw, Mapping):
        return out
    for p, entry in raw.items():
        try:
            off, value = entry
            out[int(p)] = None if value is None or int(off) < 0 else (int(off), base64.b64decode(value))
        except (TypeError, ValueError):
            continue  # not an entry this source writes: the minter reads the range itself
    return out


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
