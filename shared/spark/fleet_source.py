"""The Kafka source of a shared query (one query serves every sink of a service instance):
fixed control topics, plus each member sink's desired topic under the sink's key.

The members are read from a JSON file (``{"sinks": {"<sink>@<epoch>": {"desired_topic": ...,
...}}}``) that the query's driver rewrites when a sink joins or leaves
(:class:`services.runtime.fleet.Fleet`); the source looks at it at every ``latestOffset``. The
offsets are the Kafka source's, with one entry per member keyed by the sink's key instead of
its topic (``{"descs": {"0": 12}, "s1@17": {"0": 40, "1": 38}}``): a sink re-created with a new
epoch is a new key and starts from its topic's first offset, and a sink that left drops out of
the next micro-batch's offsets. A member's desired topic is a history-gap topic (offsets lost
to retention are marked, never silently skipped: :func:`shared.spark.kafka_source._with_gap_marker`).

Admission control (``hold``): a member's records are admitted with news on a control topic
that names it (:meth:`FleetStreamReader.admitted_on_news`), every member's when more of them
wait than one micro-batch admits, and each member's at least every ``admit_every_s`` after its
last admission (a clock per member); otherwise they keep ``start``'s offsets. Holding only ever
delays records.

Annotations a subclass adds to a micro-batch's offsets (keys starting with ``@``) are logged
with them, so a re-run of the micro-batch plans the same work.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows

from shared.kafka_offsets import Offsets, advance, cap, offsets_from_json, offsets_to_json, pending
from shared.spark.kafka_connector import KafkaDataSource
from shared.spark.kafka_source import ADMIT_EVERY_S, KafkaInputPartition, KafkaStreamReader, SourceOptions

#: The option naming the members file.
MEMBERS_OPTION = "shardsinkMembers"


class SinkRange(KafkaInputPartition):
    """A member's desired range: a topic-partition range that knows its sink's key."""

    def __init__(self, key: str, topic: str, partition: int, start: int, end: int, lost_from: int | None = None) -> None:
        super().__init__(topic, partition, start, end, lost_from)
        self.key = key


class FleetStreamReader(KafkaStreamReader):
    """Control topics (``options.topics``) plus every member's desired topic (module docstring)."""

    #: Hold the members' records back between news on the control topics.
    hold: bool = False
    admit_every_s: float = ADMIT_EVERY_S
    #: Between these slices of a wait, a member that joined ends it (:meth:`wait_ended`).
    wait_slice_s: float | None = 0.5

    def __init__(self, options: SourceOptions, members_file: str) -> None:
        super().__init__(options)
        self.members_file = members_file
        self._members: dict[str, dict[str, Any]] = {}
        self._members_stamp: tuple[int, int] | None = None
        #: when each held member's records were last admitted (monotonic), by key
        self._admitted_at: dict[str, float] = {}
        self._lows: dict[str, dict[int, int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "members_file": self.members_file, "_members": {},
                "_members_stamp": None, "_admitted_at": {}, "_lows": {}}

    # -- members ----------------------------------------------------------------------------
    def members(self) -> dict[str, dict[str, Any]]:
        """The member sinks by key, as the members file says now (read again when it changed)."""
        try:
            st = os.stat(self.members_file)
        except FileNotFoundError:
            return self._members
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._members_stamp:
            try:
                with open(self.members_file) as f:
                    self._members = dict(json.load(f).get("sinks", {}))
                self._members_stamp = stamp
            except (OSError, ValueError):
                pass  # being replaced: the old membership until the next look
        return self._members

    def topic_of(self, key: str) -> str | None:
        m = self.members().get(key)
        return None if m is None else str(m["desired_topic"])

    # -- offsets ----------------------------------------------------------------------------
    def latest_ends(self) -> Offsets:
        """The control topics' ends, then the members' (:meth:`OffsetProbe.ends_in_turn`): a control
        record within a micro-batch's ends (a description, an announcement) comes with every
        desired record produced before it. In one look, a description minted between the
        broker's ``ListOffsets`` answer and the fetch of the moved ``descs`` partition came
        without its sink's last records, and the writer held it until the sink's next
        admission (``ADMIT_ALL_EVERY_S``, 20 s, for a sink's last step: one step of 2,000 in
        some runs at 100 sinks)."""
        members = {k: str(m["desired_topic"]) for k, m in self.members().items()}
        control, desired = self._p().ends_in_turn(self._tps(self.options.topics), self._tps(sorted(set(members.values()))))
        out: Offsets = {t: {p: e for (tt, p), e in control.items() if tt == t} for t in self.options.topics}
        for key, topic in members.items():
            out[key] = {p: e for (tt, p), e in desired.items() if tt == topic}
        return out

    def initialOffset(self) -> dict[str, Any]:
        out: Offsets = {}
        for t in self.options.topics:
            parts = self._parts(t)
            if self.options.starting == "latest":
                ends = self._p().ends([(t, p) for p in parts])
                out[t] = {p: ends[(t, p)] for p in parts}
            else:
                wm = self._p().watermarks([(t, p) for p in parts], earliest=True)
                out[t] = {p: wm[(t, p)] for p in parts}
        return offsets_to_json(out)  # members start at 0 (lost history shows as a gap)

    def _end(self, s: Offsets, limit: ReadLimit) -> Offsets:
        latest = self.latest_ends()
        self._latest = latest
        keep = set(latest)
        end = {t: ps for t, ps in advance({t: ps for t, ps in s.items() if t in keep}, latest).items()}
        if isinstance(limit, ReadMaxRows):
            end = cap(s, end, int(limit.max_rows))
        return end

    def held_keys(self) -> set[str]:
        """The members whose records are held back now (``hold``: every member)."""
        return set(self.members()) if self.hold else set()

    def next_end(self, s: Offsets, limit: ReadLimit) -> Offsets:
        end = self._end(s, limit)
        held = self.held_keys()
        if not held or self._target is not None:
            return end
        now = time.monotonic()
        control = set(self.options.topics)
        news = any(o > s.get(t, {}).get(p, 0) for t in control for p, o in end.get(t, {}).items())
        waiting = {k: sum(max(0, o - s.get(k, {}).get(p, 0)) for p, o in ps.items()) for k, ps in end.items() if k in held}
        full = isinstance(limit, ReadMaxRows) and sum(waiting.values()) >= int(limit.max_rows)
        admit: set[str] = set()
        if full or not self._admitted_at:  # more wait than a micro-batch admits, or the first look
            admit = set(held)
        elif news:
            chosen = self.admitted_on_news(s, end)
            admit = set(held) if chosen is None else set(chosen)
        # Each member's held records are admitted at least every ``admit_every_s`` (its clock
        # starts when it is first seen, and again at each admission): one member's clock never
        # admits the others', so a fleet whose sinks are described in turn is not made to run
        # every member's units in one micro-batch.
        for k in held:
            since = self._admitted_at.setdefault(k, now)
            if k in admit or not waiting.get(k) or now - since >= self.admit_every_s:
                admit.add(k)
                self._admitted_at[k] = now
        for k in [k for k in self._admitted_at if k not in held]:
            del self._admitted_at[k]
        return {k: (ps if k not in held or k in admit else {p: s[k][p] if p in s.get(k, {}) else o for p, o in ps.items()})
                for k, ps in end.items()}

    def admitted_on_news(self, start: Offsets, end: Offsets) -> set[str] | None:
        """The held members that news on a control topic in ``[start, end)`` admits (None:
        every member)."""
        return None

    def wait_budget(self) -> float:
        budget = super().wait_budget()
        if not self.held_keys():
            return budget
        if not self._admitted_at:
            return 0.0
        due = min(self._admitted_at.values()) + self.admit_every_s
        return max(0.0, min(budget, due - time.monotonic()))

    def wait_ended(self) -> bool:
        """A member joined or left (the members file changed) since the ends were taken: a
        new member's records make a micro-batch without waiting out the budget."""
        before = self._members_stamp
        self.members()
        return self._members_stamp != before

    def watched(self) -> dict[tuple[str, int], int]:
        """The partitions whose next record makes a micro-batch (by topic, as a wait reads them)."""
        members = {k: str(m["desired_topic"]) for k, m in self.members().items()}
        held = self.held_keys()
        out: dict[tuple[str, int], int] = {}
        for k, ps in (self._latest or {}).items():
            if k in held:
                continue
            for p, e in ps.items():
                out[(members.get(k, k), p)] = e
        return out

    def member_lows(self, keys: Sequence[str]) -> dict[str, dict[int, int]]:
        """The first offset still on each member's topic partitions (retention)."""
        members = {k: str(m["desired_topic"]) for k, m in self.members().items() if k in keys}
        tps = self._tps(sorted(set(members.values())))
        wm = self._p().watermarks(tps, earliest=True) if tps else {}
        out: dict[str, dict[int, int]] = {}
        for k, t in members.items():
            out[k] = {p: o for (tt, p), o in wm.items() if tt == t}
        path = self.options.simulated_low_watermarks_file
        if path and os.path.exists(path):
            with open(path) as f:
                sim = json.load(f)
            for k, t in members.items():
                for p, o in sim.get(t, {}).items():
                    out[k][int(p)] = max(int(o), out[k].get(int(p), 0))
        return out

    def input_ranges(self, start: Mapping[str, Any], end: Mapping[str, Any]) -> list[KafkaInputPartition]:
        """Control ranges as the Kafka source's; each member's ranges as :class:`SinkRange` (of
        its topic), offsets below the low watermark marked lost."""
        ranges = pending(offsets_from_json(start), offsets_from_json(end))
        control = set(self.options.topics)
        keys = sorted({t for t, _, _, _ in ranges if t not in control})
        lows = self.member_lows(keys) if keys else {}
        out: list[KafkaInputPartition] = []
        for k, p, s, e in ranges:
            if k in control:
                out.append(KafkaInputPartition(k, p, s, e))
                continue
            topic = self.topic_of(k)
            if topic is None:
                continue  # left since: nothing of it is read
            low = lows.get(k, {}).get(p, 0)
            if s < low:
                out.append(SinkRange(k, topic, p, min(low, e), e, lost_from=s))
            else:
                out.append(SinkRange(k, topic, p, s, e))
        return out


#: Beside the members file: the keys whose records the query's driver holds back now (JSON list).
HOLDS_FILE = "holds.json"


class HoldFileReader(FleetStreamReader):
    """Holds back the members the driver lists in :data:`HOLDS_FILE` (mint: a sink whose
    description is in flight cannot use its desired records until its upper moves, which news
    on ``frontiers`` announces)."""

    def held_keys(self) -> set[str]:
        path = os.path.join(os.path.dirname(self.members_file), HOLDS_FILE)
        try:
            with open(path) as f:
                return set(json.load(f)) & set(self.members())
        except (OSError, ValueError, TypeError):
            return set()


def write_holds(members_file: str, keys: set[str]) -> None:
    """Say which members the driver holds back (a temporary file renamed into place)."""
    path = os.path.join(os.path.dirname(members_file), HOLDS_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(sorted(keys), f)
    os.replace(tmp, path)


class FleetDataSource(KafkaDataSource):
    """``shardsink-fleet``: a streaming reader only (:class:`HoldFileReader`)."""

    @classmethod
    def name(cls) -> str:
        return "shardsink-fleet"

    def streamReader(self, schema: Any) -> FleetStreamReader:
        return HoldFileReader(SourceOptions.parse(self.options), members_option(self.options))


def members_option(options: Mapping[str, str]) -> str:
    low = {k.lower(): v for k, v in options.items()}
    return str(low[MEMBERS_OPTION.lower()])
