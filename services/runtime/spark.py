"""The Spark session every service (and the tests' and benchmarks' sessions) runs with."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from services.runtime.jvm import NIO_FILE_SYSTEM, driver_java_options, hadoop_jar, jvm_stderr_filtered
from services.runtime.settings import ServiceSettings


#: The driver's log4j2 configuration (see the file).
LOG4J2_CONF = Path(__file__).resolve().parent / "log4j2.properties"


def with_service_defaults(builder: Any) -> Any:
    """The settings every shardsink Spark application runs with (the services, the tests'
    session, the benchmarks' baselines); a user's ``PYSPARK_SUBMIT_ARGS`` overrides them."""
    # The class-data archive (services/runtime/jvm.py) and the services' log configuration (warnings
    # and errors on stderr, without the default profile's start-up notices).
    java_options = " ".join(o for o in (driver_java_options(), f"-Dlog4j2.configurationFile=file:{LOG4J2_CONF}") if o)
    builder = builder.config("spark.driver.defaultJavaOptions", java_options)
    jar = hadoop_jar()
    if jar is not None and not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Local paths without a chmod process per file (services/runtime/jvm.py). Only when this
        # process launches the JVM: under spark-submit the class path is already set.
        builder = (
            builder.config("spark.driver.extraClassPath", str(jar))
            .config("spark.executor.extraClassPath", str(jar))
            .config("spark.hadoop.fs.file.impl", NIO_FILE_SYSTEM)
        )
    return (
        builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stopTimeout", "30s")
        # Python workers forked with the sink's modules already loaded (services/runtime/worker_daemon.py)
        .config("spark.python.daemon.module", "services.runtime.worker_daemon")
        # Checkpoint files (offset and commit logs, state store deltas) through Hadoop's
        # FileSystem API instead of FileContext: on a local or mounted path, FileContext's
        # rename asks for the link status of both paths, which Hadoop's local file system
        # (without its native library, as in the pyspark wheel) answers by running
        # `readlink` as a child process, and it sets permissions by running `chmod`: measured
        # 20 child processes a second and 80-100 ms per log write with the three queries
        # running; 25-40 ms with this manager. Both managers write a temporary file and
        # rename it; the offset log of a query is written by that query alone.
        .config(
            "spark.sql.streaming.checkpointFileManagerClass",
            "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
        )
    )


def spark_session(settings: ServiceSettings, app_name: str) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Started with plain python: we pick the master. Under spark-submit the JVM started
        # us (it sets PYSPARK_GATEWAY_PORT) and spark-submit's --master applies.
        builder = builder.master(settings.spark_master)
        if settings.spark_master.startswith("local"):
            # In local mode everything is on this machine: bind to loopback, without Spark's
            # warning that the hostname resolves to it.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # The JVM we launch writes its stderr without the JDK's incubator-module notice (jvm.py).
    launching = not os.environ.get("PYSPARK_GATEWAY_PORT")
    with jvm_stderr_filtered() if launching else contextlib.nullcontext():
        spark = with_service_defaults(builder).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from shared.spark.kafka_connector import register_kafka_source

    register_kafka_source(spark)
    return spark
