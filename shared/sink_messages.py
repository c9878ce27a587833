"""The sink's messages: what the mint, write and append services tell each other.

The sink runs as three services joined by Kafka topics (``descs``, ``batches``,
``frontiers``). Timely gave the seeds two things for free that Kafka does not: ordering
between operators (a batch's data before the trigger that lets it be appended) and
completeness (the ``batches`` frontier says every worker has written). Here both are explicit
in the messages:

* a **description** (:class:`BatchDescription`) carries an identity: the minter's ``epoch``
  (a restarted minter takes a larger one) and a unique ``token``. Supersession is ordered by
  ``(lower, epoch)``: a greater lower always wins; at the same lower, the greater epoch wins;
* a **report** (:class:`BatchReport`) is sent by EVERY writer partition for every
  description it writes, including "nothing to write", and names the description by token;
* the appender appends a description only once it holds a report from each of the
  description's ``partition_count`` partitions, all carrying its token: batches written for
  another description (an old epoch's, with the same lower) are never appended under it.

Each message has one state machine that produces it and one that consumes it, each in its
own module with its invariants written beside it (numbered as the sink's, tested in
``tests/shared/test_sink_state.py``):

* :mod:`shared.mint_state` mints descriptions (invariant 1);
* :mod:`shared.write_state` writes them and reports (invariant 2);
* :mod:`shared.append_state` collects reports and appends (invariants 3 and 4).

The machines depend on this module, never on each other. These values do no I/O; the
storage layer (``shared.shard``) is never imported: staged-batch handles are opaque here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from shared.errors import InvalidUsageError
from shared.frontier import Frontier


FrontierLike = Union[Frontier, int, None]


def as_frontier(v: FrontierLike) -> Frontier:
    """An int is ``{t}``, None is the empty frontier."""
    if isinstance(v, Frontier):
        return v
    if v is None:
        return Frontier.empty()
    return Frontier.at(v)


@dataclass(frozen=True, slots=True)
class AppendedBatch:
    """What one append added to a shard: the data objects of every batch its committed state
    holds above ``lower`` (the upper it started from), and how many row schema versions that
    state has. Announced with the new upper on ``frontiers``, and carried by the description
    minted from that upper: a writer whose contents reach ``lower`` takes the shard to the new
    upper from it, as it would from the state itself, without reading the state. Field names
    follow the ``AppendedBatch`` record of ``schemas/frontier_update.avsc``."""

    lower: Frontier
    parts: tuple[str, ...] = ()
    schema_versions: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower.time, "parts": list(self.parts), "schema_versions": self.schema_versions}

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> AppendedBatch | None:
        """None for None (a message without one) or for a malformed one (it is only ever a
        shortcut: its reader then reads the shard's state)."""
        if not isinstance(d, dict):
            return None
        try:
            lower, parts, versions = d["lower"], d["parts"], int(d["schema_versions"])
            if not isinstance(lower, int) or not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
                return None
            return AppendedBatch(Frontier.at(lower), tuple(parts), versions)
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class BatchDescription:
    """Write the updates in ``[lower, upper)`` and append them as one batch.

    Identity: ``token`` (unique), ordered by ``(lower, epoch)``. Field names follow
    ``schemas/batch_description.avsc``.
    """

    sink_id: str
    lower: Frontier
    upper: Frontier
    epoch: int
    token: str
    append_worker: int = 0
    partition_count: int = 1
    minted_at_ms: int = 0
    #: the append that brought the shard to ``lower`` (:class:`AppendedBatch`), when mint
    #: learned ``lower`` from its announcement; None otherwise
    appended: AppendedBatch | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", as_frontier(self.lower))
        object.__setattr__(self, "upper", as_frontier(self.upper))
        if not self.sink_id:
            raise InvalidUsageError("expected a non-empty sink_id, found ''")
        if self.lower.is_empty():
            raise InvalidUsageError(f"expected a non-empty lower, found {self.lower}")
        if not self.lower.less_than(self.upper):
            raise InvalidUsageError(
                f"expected lower < upper in a batch description, found {self.lower} and "
                f"{self.upper}"
            )
        if self.epoch < 0 or self.append_worker < 0 or self.partition_count < 1:
            raise InvalidUsageError(
                "expected epoch >= 0, append_worker >= 0 and partition_count >= 1, found "
                f"{self.epoch}, {self.append_worker}, {self.partition_count}"
            )
        if not self.token:
            raise InvalidUsageError("expected a non-empty token, found ''")

    @property
    def lower_time(self) -> int:
        assert self.lower.time is not None
        return self.lower.time

    def order_key(self) -> tuple[int, int]:
        """Supersession order: a greater lower wins, then a greater epoch."""
        return (self.lower_time, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "epoch": self.epoch,
            "token": self.token,
            "append_worker": self.append_worker,
            "partition_count": self.partition_count,
            "minted_at_ms": self.minted_at_ms,
            "appended": None if self.appended is None else self.appended.to_dict(),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BatchDescription:
        try:
            return BatchDescription(
                sink_id=str(d["sink_id"]),
                lower=Frontier.from_json(d["lower"]),
                upper=Frontier.from_json(d["upper"]),
                epoch=int(d["epoch"]),
                token=str(d["token"]),
                append_worker=int(d.get("append_worker", 0)),
                partition_count=int(d.get("partition_count", 1)),
                minted_at_ms=int(d.get("minted_at_ms", 0)),
                appended=AppendedBatch.from_dict(d.get("appended")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsageError(f"expected a batch description, found {d!r}: {e}") from e


@dataclass(frozen=True, slots=True)
class BatchReport:
    """Writer ``partition`` has written (staged, not appended) its part of a description.

    ``staged`` is the storage layer's handle of the staged data objects, or None when the
    partition had nothing to write. Field names follow ``schemas/written_batch.avsc``; the
    handle must compare equal to itself after a round trip (a re-delivered report is
    recognised by it).
    """

    sink_id: str
    desc_token: str
    epoch: int
    lower: Frontier
    upper: Frontier
    partition: int
    partition_count: int
    staged: Any = None
    rows: int = 0
    written_at_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", as_frontier(self.lower))
        object.__setattr__(self, "upper", as_frontier(self.upper))
        if not 0 <= self.partition < self.partition_count:
            raise InvalidUsageError(
                f"expected 0 <= partition < {self.partition_count}, found {self.partition}"
            )
        if self.lower.is_empty():
            raise InvalidUsageError(f"expected a non-empty lower, found {self.lower}")

    @staticmethod
    def for_description(
        desc: BatchDescription, partition: int, staged: Any = None, rows: int = 0, now_ms: int = 0
    ) -> BatchReport:
        return BatchReport(
            sink_id=desc.sink_id,
            desc_token=desc.token,
            epoch=desc.epoch,
            lower=desc.lower,
            upper=desc.upper,
            partition=partition,
            partition_count=desc.partition_count,
            staged=staged,
            rows=rows,
            written_at_ms=now_ms,
        )

    @property
    def empty(self) -> bool:
        return self.staged is None

    @property
    def lower_time(self) -> int:
        assert self.lower.time is not None
        return self.lower.time

    def order_key(self) -> tuple[int, int]:
        return (self.lower_time, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        """As ``schemas/written_batch.avsc`` names it (``staged`` is passed through as is)."""
        return {
            "sink_id": self.sink_id,
            "desc_token": self.desc_token,
            "epoch": self.epoch,
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "writer_partition": self.partition,
            "partition_count": self.partition_count,
            "staged_batch": self.staged,
            "rows": self.rows,
            "empty": self.staged is None,
            "written_at_ms": self.written_at_ms,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BatchReport:
        try:
            return BatchReport(
                sink_id=str(d["sink_id"]),
                desc_token=str(d["desc_token"]),
                epoch=int(d["epoch"]),
                lower=Frontier.from_json(d["lower"]),
                upper=Frontier.from_json(d["upper"]),
                partition=int(d["writer_partition"]),
                partition_count=int(d["partition_count"]),
                staged=d.get("staged_batch"),
                rows=int(d.get("rows", 0)),
                written_at_ms=int(d.get("written_at_ms", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsageError(f"expected a written-batch report, found {d!r}: {e}") from e
