"""The controller's settings and the in-memory records its rooms share.

- :class:`ControllerSettings`: parsed once at the edge (``__main__``), validated here.
- :class:`PendingPeek`: a peek waiting for its time to become readable (its command is
  logged as ``pending`` in the catalog, so it survives a restart).
- :class:`OpenCollection`: the controller's view of a live collection (its shard handle, read
  capabilities and row codec), rebuilt from the catalog on every start.
- :class:`Tick`: what one tick read (the catalog, the live collections, their heads), handed
  to each tick step of the rooms in turn.

Nothing here does I/O; the durable state is :class:`shared.controller_state.ControllerSection`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any

from services.runtime.settings import ServiceSettings, controller_default
from services.controller.spark_jobs import SparkJobSettings
from shared.catalog import CatalogState, CollectionDef
from shared.codec import RowCodec
from shared.controller_state import Capabilities
from shared.shard import Shard
from shared.state import ShardState

#: The controller's critical reader hold on every collection's shard.
READER_ID = "controller"

@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """Controller settings (env / flags parsed once in ``__main__``)."""

    service: ServiceSettings
    commands_topic: str = controller_default("commands_topic")
    responses_topic: str = controller_default("responses_topic")
    tick_ms: int = controller_default("tick_ms")
    #: How long a peek at a time not yet readable waits before NotReadableYet.
    peek_timeout_ms: int = controller_default("peek_timeout_ms")
    #: Peek results up to this many encoded bytes are answered inline.
    max_inline_bytes: int = controller_default("max_inline_bytes")
    #: Bound of the command log (idempotent replay of command ids).
    log_max_entries: int = 1000
    #: Routine gc of live shards and of old catalog states.
    gc_interval_ms: int = controller_default("gc_interval_ms")
    #: A dropped collection's objects are deleted after this long (0: at once).
    reclaim_grace_ms: int = controller_default("reclaim_grace_ms")
    #: Commit the command offset when idle for this long.
    idle_commit_ms: int = 500
    #: A collection nobody waits on is refreshed (its shard head read: an S3 request) at least
    #: this often; one with a waiting peek or a running subscribe at every tick, and one whose
    #: appender announced a new upper on ``frontiers`` at the next tick.
    head_refresh_ms: int = controller_default("head_refresh_ms")
    #: Data-heavy work as Spark jobs (services/controller/spark_jobs.py); no master: none.
    spark: SparkJobSettings = SparkJobSettings()

    def __post_init__(self) -> None:
        if (self.tick_ms <= 0 or self.peek_timeout_ms < 0 or self.max_inline_bytes < 0 or self.log_max_entries < 1
                or self.head_refresh_ms < 0):
            raise ValueError(
                "expected tick_ms > 0, peek_timeout_ms >= 0, max_inline_bytes >= 0, log_max_entries >= 1, "
                f"head_refresh_ms >= 0, found {self.tick_ms}, {self.peek_timeout_ms}, {self.max_inline_bytes}, "
                f"{self.log_max_entries}, {self.head_refresh_ms}"
            )


@dataclass
class PendingPeek:
    command_id: str
    collection_id: str
    as_of: int
    limit: int | None
    max_inline: int
    deadline: float


@dataclass
class OpenCollection:
    """In-memory view of a live collection (rebuilt on start)."""

    shard: Shard
    caps: Capabilities
    batches_seen: int = -1
    #: When the loop last read the shard's head (monotonic seconds; never: -inf).
    refreshed_at: float = float("-inf")
    #: An upper was announced on ``frontiers`` since that read.
    announced: bool = False
    _codec: RowCodec | None = None

    @property
    def row_codec(self) -> RowCodec:
        """The codec of the collection's current row schema (as of the shard's last read head),
        which decodes rows of every earlier version too. Follows an alter of the schema."""
        st = self.shard.head(max_age_s=1e9)
        if self._codec is None or self._codec.schema != st.schema:
            self._codec = RowCodec(st.schema, previous=[v.schema for v in st.versions[:-1]])
        return self._codec


@dataclass(frozen=True, slots=True)
class Tick:
    """What one tick read, handed to each tick step in turn: the catalog (fenced: its
    controller epoch is this controller's), the live collections, and each one's shard head
    (read again when due, else the last one read)."""

    catalog: CatalogState
    live: dict[str, CollectionDef]
    heads: dict[str, ShardState]


def heads_due(last_read: Mapping[str, float], urgent: Set[str], now: float, every_s: float, tick_s: float) -> list[str]:
    """The collections whose shard heads a tick reads (the others keep the last head read):
    every ``urgent`` one (a peek or a subscribe waits on it, its upper was announced), then
    the quiet ones last read ``every_s`` ago or more, oldest first, at most as many a tick as
    spreads them over ``every_s`` (collections created together would otherwise all be read
    in the same tick, every ``every_s``). ``last_read``: every live collection's last read."""
    stale = sorted((t, cid) for cid, t in last_read.items() if cid not in urgent and now - t >= every_s)
    if every_s > 0:
        stale = stale[: math.ceil(len(last_read) * tick_s / every_s) + 1]
    return [*sorted(urgent & last_read.keys()), *(cid for _, cid in stale)]


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


def jdump(v: Any) -> str:
    return json.dumps(v)


def digest(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:32]
