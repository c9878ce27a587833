"""Kafka offsets as the Kafka source for Spark plans micro-batches with them: pure functions.

An :data:`Offsets` value is ``{topic: {partition: next_offset}}``: where a micro-batch starts
or ends on every topic-partition it reads (:mod:`shared.spark.kafka_source`). Its checkpoint
form (:func:`offsets_to_json`) has the partitions as strings; keys starting with
:data:`ANNOTATION_PREFIX` there are annotations of sources built on that one, not topics. A
partition missing from an offsets value starts at 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.errors import KafkaConfigError

#: ``{topic: {partition: next_offset}}``
Offsets = dict[str, dict[int, int]]

#: Keys of a source's offsets that start with it are annotations, not topics (a Kafka topic
#: name is made of letters, digits, ``.``, ``_`` and ``-`` only): a source built on this one
#: may carry what it learned while planning a micro-batch in the micro-batch's logged offsets
#: (``services.mint.source``: each desired partition's latest progress statement).
ANNOTATION_PREFIX = "@"


def offsets_to_json(o: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """The checkpoint form: partition keys as strings, sorted for stable JSON."""
    return {t: {str(p): int(o[t][p]) for p in sorted(o[t])} for t in sorted(o)}


def offsets_from_json(j: Mapping[str, Any]) -> Offsets:
    """The offsets of the checkpoint form (annotations, :data:`ANNOTATION_PREFIX`, left out)."""
    if not isinstance(j, Mapping):
        raise KafkaConfigError(f"expected offsets as {{topic: {{partition: offset}}}}, found {j!r}")
    out: Offsets = {}
    for t, parts in j.items():
        if str(t).startswith(ANNOTATION_PREFIX):
            continue
        if not isinstance(parts, Mapping):
            raise KafkaConfigError(
                f"expected {{partition: offset}} for topic {t!r}, found {parts!r}"
            )
        try:
            out[str(t)] = {int(p): int(v) for p, v in parts.items()}
        except (TypeError, ValueError) as e:
            raise KafkaConfigError(
                f"expected integer partitions and offsets for topic {t!r}, found {parts!r}"
            ) from e
    return out


def advance(start: Offsets, latest: Offsets) -> Offsets:
    """The end of a batch reading everything: every partition of ``latest`` (new ones from 0)
    and every partition of ``start``, never below ``start``."""
    end: Offsets = {t: dict(ps) for t, ps in start.items()}
    for t, ps in latest.items():
        tend = end.setdefault(t, {})
        for p, e in ps.items():
            tend[p] = max(e, tend.get(p, 0))
    return end


def pending(start: Offsets, end: Offsets) -> list[tuple[str, int, int, int]]:
    """The non-empty ranges ``(topic, partition, from, until)`` between two offsets, sorted;
    a partition missing from ``start`` starts at 0."""
    out = []
    for t in sorted(end):
        for p in sorted(end[t]):
            s = start.get(t, {}).get(p, 0)
            e = end[t][p]
            if e > s:
                out.append((t, p, s, e))
    return out


def news_beside(start: Offsets, end: Offsets, held: str) -> bool:
    """Whether ``end`` holds records past ``start`` on a topic other than ``held``."""
    return any(o > start.get(t, {}).get(p, 0) for t, ps in end.items() if t != held for p, o in ps.items())


def held_back(start: Offsets, end: Offsets, held: str) -> Offsets:
    """``end`` with topic ``held`` kept where ``start`` has it (admission control that delays
    a topic's records to a later micro-batch; a partition ``start`` does not know keeps
    ``end``'s offset)."""
    out = {t: dict(ps) for t, ps in end.items()}
    if held in out:
        before = start.get(held, {})
        out[held] = {p: (before[p] if p in before else o) for p, o in out[held].items()}
    return out


def cap(start: Offsets, end: Offsets, max_records: int) -> Offsets:
    """``end`` reduced so that at most ``max_records`` records lie between ``start`` and it,
    shared among partitions in proportion to their backlog (remainders go to the partitions
    with the largest backlog first, then in topic/partition order). Always makes progress when
    there is something to read and ``max_records >= 1``."""
    if max_records < 1:
        raise KafkaConfigError(f"expected maxRecordsPerTrigger >= 1, found {max_records}")
    ranges = pending(start, end)
    total = sum(e - s for _, _, s, e in ranges)
    if total <= max_records:
        return end
    share = {(t, p): (e - s) * max_records // total for t, p, s, e in ranges}
    left = max_records - sum(share.values())
    by_backlog = sorted(ranges, key=lambda r: (-(r[3] - r[2]), r[0], r[1]))
    i = 0
    while left > 0:
        t, p, s, e = by_backlog[i % len(by_backlog)]
        if share[(t, p)] < e - s:
            share[(t, p)] += 1
            left -= 1
        i += 1
    out: Offsets = {t: dict(ps) for t, ps in end.items()}
    for t, p, s, _ in ranges:
        out[t][p] = s + share[(t, p)]
    return out
