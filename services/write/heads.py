"""Shard heads the write tasks of one executor tell each other: the newest state seqno a task
read, per shard, in a small file the executor's Python workers share.

A description's read-back needs the first shard state that reached its lower. A process that
read the sink's shard moments ago serves it from its cache (a sink's two writer partitions in
one task); but a sink's consecutive steps land on any of the executor's Python workers (one
per task slot), and a worker that last ran the sink a few steps ago walks the states it missed
one GET at a time. With the seqno another worker read, the worker GETs that state first
(:meth:`shared.shard.Shard.refresh`'s ``start_at``). Measured at 100 sinks on two task slots
(BENCHMARKS.md, sixteenth session): the shard-state GETs found per commit went from 1.98 to
1.77 over all processes, and the write workers' read-backs take 1.28 GETs a commit.

A seqno is only ever a hint: the state it names is read from the shard's own store, and a state
object never changes once written, so a wrong or stale seqno (another deployment's, a shard
dropped and created again) costs one GET that finds nothing and is then overwritten; it can
never make a read-back absorb another shard's contents.

The files live in ``<tmp>/shardsink-heads/``, one of a few bytes per shard a write task on
this host has read: every process on the host shares them, which the hint's check makes
harmless (another application's seqno of the same shard on the same store is as good).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

_DIR = Path(tempfile.gettempdir()) / "shardsink-heads"


def _file(shard: str) -> Path:
    return _DIR / hashlib.sha1(shard.encode()).hexdigest()[:24]


def heard(shard: str) -> int | None:
    """The newest seqno of ``shard`` (any string naming it: store and prefix) a process on this
    host told, None when none did (or the file is unreadable)."""
    try:
        text = _file(shard).read_text()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def tell(shard: str, seqno: int) -> None:
    """Tell the executor's other workers that ``shard`` has state ``seqno`` (written whole or
    not at all; a failure only costs them the hint)."""
    tmp = None
    try:
        path = _file(shard)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(str(seqno))
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
