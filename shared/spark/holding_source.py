"""Admission control for a Kafka source whose query holds one topic back
(:class:`HoldingStreamReader`): the write source per sink holds the desired topic between
descriptions, mint's and append's their own. It extends the reader of
:mod:`shared.spark.kafka_source`."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pyspark.sql.streaming.datasource import ReadLimit

from shared.kafka_offsets import Offsets, held_back, news_beside
from shared.spark.kafka_source import ADMIT_EVERY_S, KafkaStreamReader, SourceOptions


class HoldingStreamReader(KafkaStreamReader):
    """Admission control that holds the records of one topic it reads (``held``) back while
    they cannot change what its query does, because a micro-batch costs its planning, offset
    and commit logs and driver call (tens of ms of CPU) whatever it holds. ``latestOffset``
    admits them together with news on any other topic it reads (read in the same
    micro-batch), while :meth:`holding` says no, when :meth:`admits` says so, at an
    availableNow trigger, and at least every :data:`ADMIT_EVERY_S`; otherwise the held topic
    keeps the offsets of ``start``. Holding only ever delays records: the next admitted
    micro-batch covers every held one. The first call (a start or a restart) admits. With
    ``waitForRecordsMs``, a holding reader waits for a record of the other topics only, and
    never past the time the held topic is admitted anyway."""

    admit_every_s: ClassVar[float] = ADMIT_EVERY_S

    def __init__(self, options: SourceOptions, held: str) -> None:
        super().__init__(options)
        self.held = held
        self._admitted = float("-inf")

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "held": self.held, "_admitted": float("-inf")}

    def latest_ends(self) -> Offsets:
        """The other topics' ends, then the held topic's (:meth:`OffsetProbe.ends_in_turn`): a
        description within the ends comes with the held records produced before it."""
        out: Offsets = {t: {} for t in self.options.topics}
        others = [t for t in self.options.topics if t != self.held]
        held = [t for t in self.options.topics if t == self.held]
        for ends in self._p().ends_in_turn(self._tps(others), self._tps(held)):
            for (t, p), e in ends.items():
                out[t][p] = e
        return out

    def holding(self) -> bool:
        """Whether the query cannot use the held topic now (default: always)."""
        return True

    def admits(self, start: Offsets, end: Offsets, limit: ReadLimit) -> bool:
        """Another reason to admit the held topic at once, up to the candidate ``end`` (default:
        none)."""
        return False

    def held_may_admit(self) -> bool:
        """Whether a held record may itself be a reason to admit (:meth:`admits` reads the held
        records): then a wait for records watches the held topic too (default: no)."""
        return False

    def waiting(self, start: Offsets) -> int:
        """Records of the held topic past ``start``, up to the latest ends last looked up."""
        s = start.get(self.held, {})
        return sum(max(0, e - s.get(p, 0)) for p, e in (self._latest or {}).get(self.held, {}).items())

    def next_end(self, s: Offsets, limit: ReadLimit) -> Offsets:
        end = self._end(s, limit)
        now = time.monotonic()
        if (self._target is not None or not self.holding() or now - self._admitted >= self.admit_every_s
                or news_beside(s, end, self.held) or self.admits(s, end, limit)):
            self._admitted = now
            return end
        return held_back(s, end, self.held)

    def wait_budget(self) -> float:
        """Never past the time the held topic is admitted anyway."""
        left = self.admit_every_s - (time.monotonic() - self._admitted)
        return max(0.0, min(super().wait_budget(), left))

    def watched(self) -> dict[tuple[str, int], int]:
        """While holding, only the other topics: a held record alone makes no micro-batch
        (unless :meth:`held_may_admit`)."""
        w = super().watched()
        if not self.holding() or self.held_may_admit():
            return w
        return {tp: e for tp, e in w.items() if tp[0] != self.held}
