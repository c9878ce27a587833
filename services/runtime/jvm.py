"""The driver JVM's start-up: a class-data-sharing archive of the classes a service loads.

A service's SparkSession takes 7-10 s to start on this project's 2-core machines, most of it
loading and verifying some 20,000 classes from Spark's jars; a restarted write service waits
for it before it can recover. The JDK's application class-data sharing (AppCDS, JDK 13+)
maps classes from an archive instead: measured 5.0-5.7 s instead of 7.5-10 s per session.

The archive is built once per installation (``make`` does it after installing the
project, the Dockerfile at image build) by running a representative workload in a JVM started
with ``-XX:ArchiveClassesAtExit`` (``python -m services.runtime.jvm build``). It is tied to the JDK
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

The local file system without child processes (:data:`HADOOP_JAR`). Without Hadoop's native
library, which the pyspark wheel does not ship, Hadoop's local file system sets the
permissions of every file it creates by running ``chmod``: a streaming query's offset and
commit logs are two files (and two checksum files) per micro-batch, so each micro-batch of each
query forked four processes from the driver JVM (measured: 7.8 ms a file, against 0.4 ms with
the permissions set through java.nio). ``services/java`` holds a subclass of Hadoop's local
file system that sets them through java.nio (``io.shardsink.hadoop.NioLocalFileSystem``); the
build compiles it into a jar with the JDK's ``javac`` against pyspark's Hadoop jars, and the
services use it for ``file:`` paths when the jar exists (``spark.hadoop.fs.file.impl``, the jar
on the driver's and executors' class path). It is built before the class-data archive, whose
class path must match the driver's. ``SHARDSINK_HADOOP_NIO=off`` turns it off.

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
#: The compiled ``services/java`` classes (see the module docstring), beside the archive.
HADOOP_JAR = ARCHIVE.with_name("shardsink-hadoop.jar")
#: The class that serves ``file:`` paths when :data:`HADOOP_JAR` is used.
NIO_FILE_SYSTEM = "io.shardsink.hadoop.NioLocalFileSystem"
JAVA_SOURCES = Path(__file__).resolve().parent / "java"


def hadoop_jar(env: Mapping[str, str] | None = None) -> Path | None:
    """The jar of the services' Hadoop classes when it is built and not turned off."""
    e = os.environ if env is None else env
    if e.get("SHARDSINK_HADOOP_NIO", "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    return HADOOP_JAR if HADOOP_JAR.is_file() else None


def _javac() -> str | None:
    import shutil

    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "javac").is_file():
        return str(Path(home, "bin", "javac"))
    found = shutil.which("javac")
    if found:
        return found
    java = shutil.which("java")  # a JDK's javac sits beside its java
    if java:
        candidate = Path(java).resolve().parent / "javac"
        if candidate.is_file():
            return str(candidate)
    return None


def build_jar(path: Path = HADOOP_JAR, timeout_s: float = 300.0) -> Path:
    """Compile ``services/java`` against pyspark's jars into the jar at ``path``."""
    import zipfile

    import pyspark

    javac = _javac()
    if javac is None:
        raise RuntimeError("expected a JDK's javac (JAVA_HOME, PATH, or beside java), found none")
    jars = sorted(str(p) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    sources = sorted(str(p) for p in JAVA_SOURCES.rglob("*.java"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardsink-javac-") as out:
        subprocess.run([javac, "-nowarn", "--release", "17", "-cp", os.pathsep.join(jars), "-d", out, *sources],
                       check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
        tmp = path.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\nCreated-By: shardsink\r\n\r\n")
            for f in sorted(Path(out).rglob("*.class")):
                z.write(f, f.relative_to(out).as_posix())
    os.replace(tmp, path)
    return path


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
        # The driver's class path as the services start it: the Hadoop jar first, when used.
        jar = hadoop_jar()
        extra = f"--conf spark.driver.extraClassPath={jar} " if jar is not None else ""
        env = {
            **os.environ,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PYSPARK_SUBMIT_ARGS": f"{extra}--conf spark.driver.extraJavaOptions=-XX:ArchiveClassesAtExit={tmp} pyspark-shell",
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

    ap = argparse.ArgumentParser(prog="python -m services.runtime.jvm", description="the driver JVM's Hadoop jar and class-data archive")
    ap.add_argument("command", choices=["build", "path"],
                    help="build: (re)build the jar, then the archive; path: print where the archive is")
    args = ap.parse_args(argv)
    if args.command == "path":
        print(ARCHIVE)
        return 0
    t0 = time.monotonic()
    try:
        jar = build_jar()
        print(f"built {jar} in {time.monotonic() - t0:.1f}s")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        HADOOP_JAR.unlink(missing_ok=True)  # never an archive built with a jar that is gone
        print(f"no Hadoop jar: Hadoop's local file system forks chmod per file ({e})", file=sys.stderr)
    t0 = time.monotonic()
    built = build_archive()
    print(f"built {built} ({built.stat().st_size >> 20} MiB) in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
