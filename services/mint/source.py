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
micro-batch) or at least every :data:`shared.spark.kafka_source.ADMIT_EVERY_S` (mint then reads the shard's state in
case an announcement was lost). Admission control only ever delays records: the next
admitted micro-batch covers every held one, and mint reads each desired partition's range
back to its latest progress statement (:func:`services.mint.progress.read_latest_progress`).

It also finds, while planning, what mint needs of the admitted desired records: each
partition's latest progress statement (read back from the range's end,
:func:`services.mint.progress.latest_progress_record`), carried in the micro-batch's offsets under
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
description during a burst). So the desired topic is always held
(:class:`shared.spark.holding_source.HoldingStreamReader`), and the hold file decides only whether a
statement admits it: when no description is held, the desired ranges past the start are
admitted once they hold a statement (their tails read to their starts, each record read once:
a range read without a statement is remembered, and the next look reads only what came after
it; the statements found go into :data:`PROGRESS_KEY` without a second read). Until then, with
no news on ``frontiers``, ``latestOffset`` answers the start: no micro-batch, and a wait for
records (``waitForRecordsMs``) watches the desired partitions too, so that a statement that
arrives is admitted at once. News and at least every
:data:`shared.spark.kafka_source.ADMIT_EVERY_S` admit them too; a tail it cannot read, a start or
restart and an ``availableNow`` trigger admit at once.

Same options as ``shardsink-kafka``, plus ``shardsinkMintHold`` (JSON: the hold file and the
desired topic). A checkpoint that is not a local path (``s3a://``) has no hold file: the
source then never holds for the minter (a statement admits the desired records at once).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from pyspark.sql.streaming.datasource import ReadLimit

from shared.errors import ShardsinkError
from shared.kafka_offsets import ANNOTATION_PREFIX, Offsets, offsets_from_json
from shared.spark.fleet_source import HoldFileReader
from shared.spark.holding_source import HoldingStreamReader
from shared.spark.kafka_source import SourceOptions
from shared.spark.kafka_connector import KafkaDataSource

log = logging.getLogger("shardsink.mint")

MINT_SOURCE = "shardsink-mint"
HOLD_OPTION = "shardsinkMintHold"
HOLD_FILE = "mint-hold"
#: The annotation of a mint micro-batch's offsets that carries the desired partitions' latest
#: progress statements.
PROGRESS_KEY = ANNOTATION_PREFIX + "progress"
#: What a desired range's tail holds: its latest progress statement ``(offset, value)``, None
#: for none, or the error that kept it from being read.
Tail = tuple[int, bytes] | None | ShardsinkError


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
    """Holds the desired topic back (:class:`HoldingStreamReader`: news on ``frontiers``, the
    other topic it reads, ends the hold); while the minter's hold file says it is not holding,
    a progress statement past the start admits it too (module docstring)."""

    def __init__(self, options: SourceOptions, hold: dict[str, Any]) -> None:
        super().__init__(options, held=hold["desired_topic"])
        self.hold = hold
        #: per desired partition, ``(start, end)``: a range read back to ``start`` without a
        #: progress statement (the next look at a range from ``start`` reads from ``end`` on)
        self._quiet: dict[int, tuple[int, int]] = {}
        #: the last tails read: the ranges ``(partition, start, end)`` and what each held
        self._tails: tuple[list[tuple[int, int, int]], list[Tail]] = ([], [])

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "hold": self.hold, "_quiet": {}, "_tails": ([], [])}

    def minter_holds(self) -> bool:
        """Whether the minter's hold file says it holds the desired topic back."""
        return _holding(self.hold.get("file"))

    def admits(self, start: Offsets, end: Offsets, limit: ReadLimit) -> bool:
        """While the minter is not holding: whether a desired range ``[start, end)`` may hold a
        progress statement (one found, or a tail that could not be read)."""
        if self.minter_holds():
            return False
        return any(found is not None for found in self.read_tails(start, end)[1])

    def held_may_admit(self) -> bool:
        """While the minter is not holding, the desired partitions' next record may be the
        statement that admits them: a wait watches them too."""
        return not self.minter_holds()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        end = super().latestOffset(start, limit)
        progress = self.latest_progress(offsets_from_json(start), offsets_from_json(end), start.get(PROGRESS_KEY))
        return {**end, PROGRESS_KEY: progress} if progress else end

    def read_tails(self, start: Mapping[str, Mapping[int, int]], end: Mapping[str, Mapping[int, int]],
                   ) -> tuple[list[tuple[int, int, int]], list[Tail]]:
        """The desired ranges ``(partition, start, end)`` of ``[start, end)`` that are not empty,
        and the latest progress statement of each (None: none; an error: its tail could not be
        read). The ranges last read are answered again without a read."""
        from services.mint.progress import latest_progress_records

        topic = self.hold["desired_topic"]
        ranges = [(p, start.get(topic, {}).get(p, 0), b) for p, b in sorted(end.get(topic, {}).items())]
        ranges = [(p, a, b) for p, a, b in ranges if b > a]
        if not ranges:
            return [], []
        if ranges == self._tails[0]:
            return self._tails
        prefix = dict(self.options.skip_value_prefixes).get(topic)
        quiet = {p: q for p, q in self._quiet.items() if any(p == r[0] and q[0] == r[1] for r in ranges)}

        # [a, quiet end) was read without a statement: only what came after it can hold one.
        reads = [(p, max(a, min(b, quiet[p][1])) if p in quiet else a, b) for p, a, b in ranges]
        todo = [i for i, (_, a, b) in enumerate(reads) if a < b]
        results: list[Tail] = [None] * len(ranges)
        # The partitions' tails are read together (one consumer, one assignment): the
        # micro-batch waits for the slowest, not for their sum.
        try:
            got: list[Any] = latest_progress_records(self.options.settings, [(topic, *reads[i]) for i in todo], prefix)
        except ShardsinkError as e:
            got = [e] * len(todo)
        for i, f in zip(todo, got, strict=True):
            results[i] = f
        self._quiet = {}
        for (p, a, b), found in zip(ranges, results, strict=True):
            if isinstance(found, ShardsinkError):
                # The minter reads the range itself (and meets the error there, typed).
                log.warning("could not read the latest progress of %s/%d in [%d, %d): %s", topic, p, a, b, found)
            elif found is None:
                self._quiet[p] = (a, b)
        self._tails = (ranges, results)
        return self._tails

    def latest_progress(self, start: Mapping[str, Mapping[int, int]], end: Mapping[str, Mapping[int, int]],
                        carried: Any) -> dict[str, list[Any]]:
        """The :data:`PROGRESS_KEY` annotation of ``end``: ``carried`` (``start``'s), updated
        with the latest statement of each desired range ``[start, end)`` that is not empty."""
        out: dict[str, list[Any]] = dict(carried) if isinstance(carried, Mapping) else {}
        for (p, _, _), found in zip(*self.read_tails(start, end), strict=True):
            if isinstance(found, ShardsinkError):
                out.pop(str(p), None)
            elif found is not None:
                out[str(p)] = [found[0], base64.b64encode(found[1]).decode()]
            elif str(p) not in out:
                out[str(p)] = [-1, None]
        return out


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
    """The ``source`` argument of :func:`shared.spark.kafka_connector.kafka_read_stream`."""
    hold = {"file": hold_file, "desired_topic": desired_topic}
    return MINT_SOURCE, MintDataSource, {HOLD_OPTION: json.dumps(hold)}


#: With sinks held (a description in flight) and nothing else new, the shared mint source
#: makes a micro-batch this often (its offsets' :data:`TICK_KEY` counts them).
HELD_TICK_S = 1.0
TICK_KEY = ANNOTATION_PREFIX + "tick"
#: A shared mint micro-batch that admits the ranges of at least this many members is a busy
#: fleet's: the next one starts no sooner than :data:`BUSY_SPACING_S` after it was planned.
BUSY_MEMBERS = 4
#: At 100 sinks mint ran two to three times as many micro-batches as write and append, a
#: fixed cost each (planning, logs, the driver's step); 300 ms between them while busy lowered
#: the services' CPU in every pair of runs measured (BENCHMARKS.md, "twenty-fifth session"),
#: and a sink alone (one member a micro-batch) never waits for it.
BUSY_SPACING_S = 0.3


class MintFleetReader(HoldFileReader):
    """The shared mint query's reader (:class:`shared.spark.fleet_source.HoldFileReader`: every
    member's desired topic, held while the driver lists the member in the holds file) that
    also finds, while planning, each admitted member range's latest progress statement, as
    :class:`MintStreamReader` does for one sink: ``{"<sink>@<epoch>": {"<partition>": [offset,
    base64 value]}}`` under :data:`PROGRESS_KEY` (``[-1, null]``: none; no entry: its tail could
    not be read, and the driver reads it). The tails are read here, in the source runner, together
    (:func:`services.mint.progress.latest_progress_records`), so the driver coordinates and reads no
    desired record. While the driver holds
    sinks back and nothing else comes, it makes a micro-batch every :data:`HELD_TICK_S` (the
    driver reads a waiting sink's shard in case its upper's announcement was lost). After a
    micro-batch that admitted :data:`BUSY_MEMBERS` members or more, the next plan waits until
    :data:`BUSY_SPACING_S` after it: a busy fleet's news gathers into fewer micro-batches."""

    _ticked: float = 0.0
    #: When the last busy micro-batch was planned (None: the last was not busy).
    _busy_at: float | None = None

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        from services.mint.progress import latest_progress_records
        from services.sinkio import desired_prefixes

        if self._busy_at is not None:
            wait = self._busy_at + BUSY_SPACING_S - time.monotonic()
            self._busy_at = None
            if wait > 0:
                time.sleep(wait)
        end = super().latestOffset(start, limit)
        s, e = offsets_from_json(start), offsets_from_json(end)
        members = self.members()
        ranges = [(k, p, s.get(k, {}).get(p, 0), b) for k in sorted(members) for p, b in sorted(e.get(k, {}).items())
                  if b > s.get(k, {}).get(p, 0)]
        if not ranges:
            if s != e:
                return end
            held = self.held_keys()
            now = time.monotonic()
            if held and now - self._ticked >= HELD_TICK_S:
                # Sinks wait for their uppers and nothing comes: a micro-batch anyway, in which
                # the driver reads the shards of those whose read is due (an announcement may
                # have been lost), so a wait never outlives a lost announcement.
                self._ticked = now
                base = {k: v for k, v in start.items() if k != PROGRESS_KEY}
                return {**base, TICK_KEY: int(start.get(TICK_KEY, 0)) + 1}
            # Nothing new: the start as it is (its annotation too), so no micro-batch is made.
            return dict(start)
        self._ticked = time.monotonic()
        if len({k for k, _, _, _ in ranges}) >= BUSY_MEMBERS:
            self._busy_at = self._ticked
        tails = latest_progress_records(self.options.settings, [(str(members[k]["desired_topic"]), p, a, b) for k, p, a, b in ranges],
                                        desired_prefixes()[0])
        progress: dict[str, dict[str, Any]] = {}
        for (k, p, _, _), found in zip(ranges, tails, strict=True):
            if isinstance(found, Exception):  # that range's error alone (ShardsinkError)
                continue
            progress.setdefault(k, {})[str(p)] = [-1, None] if found is None else [found[0], base64.b64encode(found[1]).decode()]
        return {**end, PROGRESS_KEY: progress}


def fleet_planned_progress(offsets: Mapping[str, Any] | None) -> dict[str, dict[int, tuple[int, bytes] | None]]:
    """The :data:`PROGRESS_KEY` annotation of a shared mint micro-batch's logged end
    ``offsets``, per member key as :func:`planned_progress` reads one sink's."""
    raw = (offsets or {}).get(PROGRESS_KEY)
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): planned_progress({PROGRESS_KEY: v}) for k, v in raw.items() if isinstance(v, Mapping)}


class MintFleetDataSource(KafkaDataSource):
    """``shardsink-mint-fleet``: the shared mint query's source (:class:`MintFleetReader`)."""

    @classmethod
    def name(cls) -> str:
        return "shardsink-mint-fleet"

    def streamReader(self, schema: Any) -> MintFleetReader:
        from shared.spark.fleet_source import members_option

        return MintFleetReader(SourceOptions.parse(self.options), members_option(self.options))
