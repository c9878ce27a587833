"""Shared fixtures: one embedded stack (Tansu + moto) and one SparkSession per test session,
and a Spark standalone cluster per module that asks for one.

The stack and the session are expensive to start (the SparkSession takes about 5 s), so they
are session-scoped; tests isolate themselves by using fresh shard ids, topic names and
checkpoint dirs. A standalone cluster holds the machine's cores while it runs, so it lives
as long as the module that uses it.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shared.devstack.embedded import EmbeddedStack, SparkStandalone

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


#: Fixtures that start the embedded stack or Spark: a test that uses one (directly or through
#: another fixture) is marked ``stack`` and left out of ``make test-fast``.
STACK_FIXTURES = frozenset({"stack", "s3_client", "spark", "standalone_cluster"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="session")
def stack() -> Iterator[EmbeddedStack]:
    with EmbeddedStack() as s:
        yield s


@pytest.fixture(scope="session")
def s3_client(stack: EmbeddedStack) -> Any:
    import boto3

    env = stack.env()
    return boto3.client(
        "s3",
        endpoint_url=stack.s3_endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from services.runtime.spark import with_service_defaults

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (
        with_service_defaults(SparkSession.builder.master("local[2]").appName("shardsink-tests"))
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    """A Spark standalone master and two workers of one core each on 127.0.0.1, started from
    the pyspark wheel's ``spark-class`` (applications attach with ``master_url``)."""
    with SparkStandalone(workers=2, cores=1, log_dir=tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


@pytest.fixture
def unique_id() -> str:
    """A fresh id for shards, topics and checkpoints of one test."""
    return uuid.uuid4().hex[:12]
