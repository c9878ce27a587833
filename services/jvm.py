"""The driver JVM's start-up: a class-data-sharing archive of the classes a service loads.

A service's SparkSession takes 7-10 s to start on this project's 2-core machines, most of it
loading and verifying some 20,000 classes from Spark's jars; a restarted write service waits
for it before it can recover. The JDK's application class-data sharing (AppCDS, JDK 13+)
maps classes from an archive instead: measured 5.0-5.7 s instead of 7.5-10 s per session.

The archive is built once per installation (``make`` does it after installing the
project, the Dockerfile at image build) by running a representative workload in a JVM started
with ``-XX:ArchiveClassesAtExit`` (``python -m services.jvm build``). It is tied to the JDK
and the jars it was built with; the driver uses it when it exists (``-Xshare:auto``: a JVM
that finds it unusable starts without it, as before). ``SHARDSINK_SPARK_CDS=off`` turns it
off.

The driver also compiles with the JIT's first tier only (``-XX:TieredStopAtLevel=1``, C1).
A service's driver JVM mostly orchestrates: micro-batch planning, checkpoint logs, task
scheduling and, in local mode, the executors' Arrow conversions. With tiered compilation the
C2 compiler threads kept compiling through the first minutes of a run and were the largest
CPU consumer in a flight recording of the sink's throughput run; measured with 200k-update
bursts after a 100k warm-up, the services used 7.4-7.9 CPU-seconds with C1 only against
10.8-11.4 with both tiers, and took the burst at 27-30k updates/s against 21-23k.
``SHARDSINK_DRIVER_JIT=tiered`` restores the JDK's default.

The options go in ``spark.driver.defaultJavaOptions`` so that a user's
``spark.driver.extraJavaOptions`` (``PYSPARK_SUBMIT_ARGS``) is added to them, not replaced.

The JVM's stderr (:func:`jvm_stderr_filtered`). Spark's launcher adds
``--add-modules=jdk.incubator.vector`` to every JVM it starts
(``org.apache.spark.launcher.JavaModuleOptions``, unconditionally: the Vector API speeds up
MLlib's BLAS, which the services do not use), and the JDK's module system answers every
start with ``WARNING: Using incubator modules: jdk.incubator.vector`` on stderr. Neither has
a switch: the launcher has no setting that leaves the module out, and the JDK prints the
notice whenever an incubating module is resolved. So a service launches its JVM with its
stderr through a small filter process that drops that one line and passes every other byte
on, unchanged and at once: Spark's log lines, Java stack traces and the Python workers'
output still reach the terminal. The filter lives as long as anything holds the pipe (the
JVM and the workers it starts), so nothing printed at shutdown is lost.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

#: Where the archive lives: beside the installation's Python (the venv or the image).
ARCHIVE = Path(sys.prefix) / "share" / "shardsink" / "spark-classes.jsa"


def driver_java_options(env: Mapping[str, str] | None = None) -> str:
    """The driver JVM options the services add: the class-data archive when it is usable,
    and the first JIT tier only unless ``SHARDSINK_DRIVER_JIT=tiered``."""
    e = os.environ if env is None else env
    options = []
    cds = e.get("SHARDSINK_SPARK_CDS", "on").strip().lower() not in ("off", "0", "false", "no")
    if cds and ARCHIVE.is_file():
        options.append(f"-XX:SharedArchiveFile={ARCHIVE} -Xshare:auto")
    jit = e.get("SHARDSINK_DRIVER_JIT", "c1").strip().lower()
    if jit not in ("c1", "tiered"):
        from shared.errors import InvalidUsageError

        raise InvalidUsageError(f"expected SHARDSINK_DRIVER_JIT c1 or tiered, found {jit!r}")
    if jit == "c1":
        options.append("-XX:TieredStopAtLevel=1")
    return " ".join(options)


#: The JDK's notice at every start of a JVM that Spark's launcher started (module docstring).
INCUBATOR_NOTICE = "WARNING: Using incubator modules: jdk.incubator.vector"

#: The filter: every line but the notice, unbuffered; Ctrl-C is the services' to handle (the
#: JVM ignores it too), so the filter outlives it and passes on what the JVM prints after.
_FILTER = r"""
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
notice, out = sys.argv[1].encode(), sys.stdout.buffer
try:
    for line in sys.stdin.buffer:
        if line.rstrip(b"\r\n") != notice:
            out.write(line)
            out.flush()
except OSError:
    pass
"""


@contextlib.contextmanager
def jvm_stderr_filtered(notice: str = INCUBATOR_NOTICE) -> Iterator[None]:
    """Processes started inside (the driver JVM, launched by pyspark) write their stderr
    through a filter process that drops the line ``notice`` and passes everything else on to
    this process's stderr. This process's own stderr is restored on exit. A stderr without a
    file descriptor (a test's capture) is left alone."""
    try:
        target = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-S", "-c", _FILTER, notice], stdin=read_end, stdout=target, close_fds=True
        )
    finally:
        os.close(read_end)
    saved = os.dup(target)
    os.dup2(write_end, target)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, target)
        os.close(saved)


_WORKLOAD = r"""
import time
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").appName("shardsink-cds")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
import pandas as pd

def ident(it):
    yield from it

def count(key, pdfs, state):
    n = sum(len(p) for p in pdfs) + (state.get[0] if state.exists else 0)
    state.update((n,))
    yield pd.DataFrame({"k": [int(key[0])], "n": [n]})

spark.range(1000).selectExpr("id % 3 as k").mapInArrow(ident, "k long").groupBy("k").count().collect()
stream = spark.readStream.format("rate").option("rowsPerSecond", 50).load().selectExpr("value % 3 as k")
seen = []
q = (stream.groupBy("k").applyInPandasWithState(count, "k long, n long", "n long", "append", "NoTimeout")
     .writeStream.foreachBatch(lambda df, i: seen.append(df.toArrow().num_rows))
     .option("checkpointLocation", CHECKPOINT).trigger(processingTime="200 milliseconds").start())
deadline = time.time() + 60
while len(seen) < 4 and time.time() < deadline:
    time.sleep(0.2)
q.stop()
spark.stop()
"""


def build_archive(path: Path = ARCHIVE, timeout_s: float = 300.0) -> Path:
    """Run the workload in a JVM that writes its loaded classes to ``path`` at exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardsink-cds-") as ck:
        env = {
            **os.environ,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PYSPARK_SUBMIT_ARGS": f"--conf spark.driver.extraJavaOptions=-XX:ArchiveClassesAtExit={tmp} pyspark-shell",
        }
        code = f"CHECKPOINT = {ck + '/q'!r}\n" + _WORKLOAD
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=timeout_s,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The JVM writes the archive as it exits, after the Python process has returned: wait
    # for every process started with it to be gone.
    deadline = time.monotonic() + 120
    while _running_with(str(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not tmp.is_file() or _running_with(str(tmp)):
        raise RuntimeError(f"expected the JVM to write a class-data archive at {tmp}, found none")
    os.replace(tmp, path)
    return path


def _running_with(text: str) -> bool:
    """Whether a live process has ``text`` in its command line."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if text.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m services.jvm", description="the driver JVM's class-data archive")
    ap.add_argument("command", choices=["build", "path"], help="build: (re)build the archive; path: print where it is")
    args = ap.parse_args(argv)
    if args.command == "path":
        print(ARCHIVE)
        return 0
    t0 = time.monotonic()
    built = build_archive()
    print(f"built {built} ({built.stat().st_size >> 20} MiB) in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
