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

The files live in ``<tmp>/shardsink-heads-<parent pid>/``: Spark forks an executor's Python
workers from one daemon, so they share the directory, and the first worker to use it removes
the directories of daemons that are gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

_PREFIX = "shardsink-heads-"
_dir: Path | None = None


def _heads_dir() -> Path:
    global _dir
    if _dir is None or _dir.name != f"{_PREFIX}{os.getppid()}":
        root = Path(tempfile.gettempdir())
        for d in root.glob(f"{_PREFIX}*"):
            pid = d.name[len(_PREFIX):]
            if pid.isdigit() and int(pid) != os.getppid() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        _dir = root / f"{_PREFIX}{os.getppid()}"
        _dir.mkdir(exist_ok=True)
    return _dir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _file(shard: str) -> Path:
    return _heads_dir() / hashlib.sha1(shard.encode()).hexdigest()[:24]


def heard(shard: str) -> int | None:
    """The newest seqno of ``shard`` (any string naming it: store and prefix) a worker of this
    executor told, None when none did (or the file is unreadable)."""
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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(str(seqno))
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
