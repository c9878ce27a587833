"""The driver JVM options the services add (``services.runtime.jvm.driver_java_options``)."""

from __future__ import annotations

import pytest

from services.runtime.jvm import ARCHIVE, driver_java_options
from shared.errors import InvalidUsageError


def test_the_driver_compiles_with_the_first_jit_tier_unless_told_otherwise() -> None:
    assert "-XX:TieredStopAtLevel=1" in driver_java_options({}).split()
    assert "-XX:TieredStopAtLevel=1" in driver_java_options({"SHARDSINK_DRIVER_JIT": "C1"}).split()
    assert "TieredStopAtLevel" not in driver_java_options({"SHARDSINK_DRIVER_JIT": "tiered"})
    with pytest.raises(InvalidUsageError, match="SHARDSINK_DRIVER_JIT"):
        driver_java_options({"SHARDSINK_DRIVER_JIT": "c3"})


def test_the_class_data_archive_is_used_when_it_exists_and_not_when_turned_off() -> None:
    opts = driver_java_options({})
    assert (f"-XX:SharedArchiveFile={ARCHIVE}" in opts) == ARCHIVE.is_file()
    assert "SharedArchiveFile" not in driver_java_options({"SHARDSINK_SPARK_CDS": "off"})


def test_a_launched_jvm_writes_stderr_without_the_incubator_notice_and_nothing_else_is_lost() -> None:
    """A JVM started with the module Spark's launcher adds prints the JDK's notice; started
    inside ``jvm_stderr_filtered`` it does not, and every other line reaches stderr: the
    JVM's own, the parent's, and what a child prints after the parent left the block."""
    import shutil
    import subprocess
    import sys

    java = shutil.which("java")
    assert java is not None
    script = f"""
import subprocess, sys, time
from services.runtime.jvm import jvm_stderr_filtered
print("parent before", file=sys.stderr, flush=True)
with jvm_stderr_filtered():
    subprocess.run([{java!r}, "--add-modules=jdk.incubator.vector", "-version"], check=True)
    late = subprocess.Popen([sys.executable, "-c",
                             "import sys, time; time.sleep(0.5); print('child after', file=sys.stderr)"])
print("parent after", file=sys.stderr, flush=True)
late.wait()
"""
    bare = subprocess.run([java, "--add-modules=jdk.incubator.vector", "-version"], capture_output=True, text=True)
    assert "WARNING: Using incubator modules: jdk.incubator.vector" in bare.stderr.splitlines()  # the cause, unfiltered
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    # Every other line, once (the filter's lines may interleave with the parent's own).
    expected = ["parent before", *(ln for ln in bare.stderr.splitlines() if "incubator" not in ln), "parent after",
                "child after"]
    assert "incubator" not in p.stderr and sorted(p.stderr.splitlines()) == sorted(expected), p.stderr
    assert p.stderr.splitlines()[0] == "parent before" and any("openjdk" in ln.lower() for ln in expected)


def test_local_files_get_their_permissions_through_java_nio_in_the_services_session(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the services' Hadoop jar built (``make`` builds it when a JDK is there), ``file:``
    paths are served by ``NioLocalFileSystem``: a created file gets Hadoop's default
    permissions minus the umask, and ``setPermission`` sets exactly the nine bits it is given,
    with no ``chmod`` process (the class's only change to Hadoop's local file system)."""
    import os
    import stat

    from services.runtime.jvm import HADOOP_JAR, NIO_FILE_SYSTEM, _javac, hadoop_jar

    if _javac() is None:
        pytest.skip("no JDK here: the services run with Hadoop's own local file system")
    assert hadoop_jar() == HADOOP_JAR, "expected `make` to have built the services' Hadoop jar"
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    path = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/offsets/0")
    fs = path.getFileSystem(conf)
    assert fs.getClass().getName() == NIO_FILE_SYSTEM
    out = fs.create(path, True)
    out.write(bytearray(b"v1\n{}"))
    out.close()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "offsets" / "0").st_mode) == 0o666 & ~umask
    assert (tmp_path / "offsets" / "0").read_bytes() == b"v1\n{}"
    for mode in (0o751, 0o640, 0o007, 0o700):
        fs.setPermission(path, jvm.org.apache.hadoop.fs.permission.FsPermission(mode))
        assert stat.S_IMODE(os.stat(tmp_path / "offsets" / "0").st_mode) == mode
