"""Keep a reused PySpark worker's garbage collection proportional to one task's garbage.

PySpark's worker daemon runs ``gc.collect()`` after every task of a reused worker
(``pyspark/daemon.py``). A full collection walks every object the cyclic collector tracks,
and a worker that has imported pyarrow, pandas, pyspark and botocore (whose S3 service model
alone is tens of thousands of dicts) tracks about 130k of them: measured 90-110 ms of CPU per
collection on this machine, paid after every source read, decode and stateful task, a dozen
times per sink cycle. ``gc.freeze()`` moves the objects alive now (modules, clients, codecs,
cached contexts) to the permanent generation, which collections skip: the collection after
the task then walks only what the task itself left behind (measured 0.01 ms after a freeze).

Call :func:`settle` at the start of every executor-side entry point (a source's ``read``, a
``mapInArrow`` or stateful function). It is O(1) (a list splice). What it freezes is never
collected as a cycle; objects a task creates and drops are still freed by reference counting,
so only cyclic garbage that already existed when the task started is kept.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Freeze the objects alive now so that the daemon's collection after this task is cheap."""
    gc.freeze()
