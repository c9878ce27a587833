"""Which sinks a service instance serves: ``SHARDSINK_SINK_SHARD=i/n``.

n instances of a service, each with its own ``i`` in ``0..n-1``, split the catalog's sinks
between them with no overlap and no gap: instance ``i`` serves the sinks whose stable hash is
``i`` modulo ``n``. The hash is the first 8 bytes of the sink id's BLAKE2b digest, the same
in every process, Python version and machine (Python's own ``hash`` of a string is salted
per process), so instances agree on who serves what without talking to each other, and a
restart keeps each sink where it was. Changing ``n`` moves sinks between instances: stop the
old instances before the new ones start, as with any change of which instance serves a sink
(one active minter, writer and appender per sink).

``0/1``, the default, serves every sink. ``--sink`` (:attr:`ServiceSettings.only_sinks`)
narrows an instance further to the sinks it names.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_FORM = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


def sink_hash(sink_id: str) -> int:
    """A hash of ``sink_id`` that every process computes alike (unsigned, 64 bits)."""
    return int.from_bytes(hashlib.blake2b(sink_id.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class SinkShard:
    """Instance ``index`` of ``count``: it serves the sinks whose :func:`sink_hash` is
    ``index`` modulo ``count``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"expected a sink shard i/n with 0 <= i < n, found {self.index}/{self.count}")

    @staticmethod
    def parse(text: str) -> SinkShard:
        """``"2/4"`` -> instance 2 of 4; ``""`` -> every sink (``0/1``)."""
        if not text.strip():
            return SinkShard()
        m = _FORM.fullmatch(text)
        if m is None:
            raise ValueError(f"expected SHARDSINK_SINK_SHARD as i/n (e.g. 0/2), found {text!r}")
        return SinkShard(int(m.group(1)), int(m.group(2)))

    def owns(self, sink_id: str) -> bool:
        """Whether this instance serves ``sink_id``."""
        return self.count == 1 or sink_hash(sink_id) % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
