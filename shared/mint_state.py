"""The minter's state machine: descriptions of the batches to write.

The minter reads the desired topic's progress, the shard's upper and the read-only flag, and
mints :class:`~shared.sink_messages.BatchDescription` values for ``descs`` (the messages and
the protocol they carry are in :mod:`shared.sink_messages`).

:class:`MintState` does no I/O. Each method absorbs one input or returns the decision the
service's adapter must carry out (publish a description).

Invariant (from the seeds, kept by the class below and tested in
``tests/shared/test_sink_state.py``; numbered as the sink's, see :mod:`shared.sink_messages`):

1. lowers minted by one :class:`MintState` are unique and strictly increasing; uppers are
   monotone; nothing is minted while read-only.
"""

from __future__ import annotations

from typing import Any

from shared.desired import DesiredFrontierTracker
from shared.errors import InvalidUsageError
from shared.frontier import Frontier
from shared.sink_messages import BatchDescription, FrontierLike, as_frontier


class MintState:
    """The minter of one sink (one active instance per sink and replica).

    Inputs: the desired topic's progress (per partition), the shard's upper (read from the
    shard itself, or from ``frontiers``), and the read-only flag. Output: descriptions.

    Invariants: lowers are unique and strictly increasing (a description is minted only when
    the persist frontier moved beyond the last lower); uppers never regress (the desired
    frontier never does); nothing is minted while read-only. The persist frontier starts at
    ``as_of``, so the first lower is at least ``as_of``: no work is spent on earlier times.
    """

    def __init__(
        self,
        sink_id: str,
        epoch: int,
        partition_count: int,
        *,
        as_of: int = 0,
        read_only: bool = False,
        append_workers: int = 1,
        nonce: str = "",
    ) -> None:
        if append_workers < 1:
            raise InvalidUsageError(f"expected append_workers >= 1, found {append_workers}")
        if epoch < 0:
            raise InvalidUsageError(f"expected an epoch >= 0, found {epoch}")
        self.sink_id = sink_id
        self.epoch = epoch
        self.append_workers = append_workers
        self.nonce = nonce
        self.desired = DesiredFrontierTracker(partition_count)
        self.persist_frontier = Frontier.at(as_of)
        self.last_lower: Frontier | None = None
        self.read_only = read_only
        self.next_append_worker = 0
        self.minted = 0

    @property
    def desired_frontier(self) -> Frontier:
        return self.desired.frontier()

    def absorb_desired_progress(self, partition: int, frontier: FrontierLike) -> None:
        """A progress statement of one desired partition (regressions are ignored)."""
        self.desired.observe_progress(partition, as_frontier(frontier))

    def absorb_partition_count(self, partitions: int) -> None:
        """The desired topic has (at least) this many partitions now."""
        self.desired.grow(partitions)

    def absorb_shard_upper(self, upper: FrontierLike) -> None:
        """The shard's upper, as read from the shard (only its advances matter)."""
        self.persist_frontier = self.persist_frontier.join(as_frontier(upper))

    def allow_writes(self) -> None:
        """Leave read-only mode (one way)."""
        self.read_only = False

    def checkpoint(self) -> dict[str, Any]:
        """What a restarted minter must not re-read from the desired topic: every partition's
        latest progress. The epoch, the last lower and the read-only flag are not kept: a
        restart takes a new epoch (its first description supersedes any in flight) and reads
        the flag from the catalog."""
        return {"v": 1, "progress": self.desired.to_json()}

    def restore(self, data: dict[str, Any]) -> None:
        """Take the progress of :meth:`checkpoint` (a partition count that grew since is kept)."""
        if not isinstance(data, dict) or data.get("v") != 1:
            raise InvalidUsageError(f"expected a mint checkpoint of version 1, found {data!r}")
        restored = DesiredFrontierTracker.from_json(data["progress"])
        restored.grow(self.desired.partitions)
        self.desired = restored

    def persist_advanced(self) -> bool:
        """Whether the persist frontier moved since the last description (or none was minted):
        until it does, no description can be minted, whatever the desired frontier."""
        return self.last_lower is None or self.last_lower.less_than(self.persist_frontier)

    def maybe_mint(self, now_ms: int = 0) -> BatchDescription | None:
        """Mint ``[persist frontier, desired frontier)`` when writes are allowed, the desired
        frontier is ahead of the persist frontier, and the persist frontier advanced since
        the last description."""
        desired = self.desired.frontier()
        persist = self.persist_frontier
        desired_ahead = persist.less_than(desired)
        if self.read_only or not desired_ahead or not self.persist_advanced():
            return None
        assert persist.time is not None
        token = f"{self.sink_id}:{self.epoch}:{persist.time}"
        if self.nonce:
            token += f":{self.nonce}"
        desc = BatchDescription(
            sink_id=self.sink_id,
            lower=persist,
            upper=desired,
            epoch=self.epoch,
            token=token,
            append_worker=self.next_append_worker,
            partition_count=self.desired.partitions,
            minted_at_ms=now_ms,
        )
        self.next_append_worker = (self.next_append_worker + 1) % self.append_workers
        self.last_lower = persist
        self.minted += 1
        return desc
