"""``services.runtime.supervisor.interruptible``: a foreachBatch function interrupted by its query's stop
reaches Spark as a short error that Spark's own check recognises, instead of a text long
enough to overflow the stack of that check's regex."""

from __future__ import annotations

import re
import traceback
from typing import Any

import pytest

from services.runtime.supervisor import QueryInterruptedError, interruptible

#: Spark 4.3's StreamExecution.isInterruptionException pattern (from spark-sql's class file),
#: with Python's re standing in for java.util.regex.
SPARK_STOP_PATTERN = re.compile(
    r"py4j.protocol.Py4JJavaError: An error occurred while calling((.|\r\n|\r|\n)*)"
    r"(java.lang.InterruptedException|java.io.InterruptedIOException|java.nio.channels.ClosedByInterruptException)"
)


class FakePy4JJavaError(Exception):
    """What a JVM call fails with when the stop interrupts it: the message holds the whole Java
    stack trace."""

    def __str__(self) -> str:
        frames = "".join(f"\n\tat org.apache.spark.sql.Dataset.collectAsArrowToPython(Dataset.scala:{i})" for i in range(400))
        return f"An error occurred while calling o123.collectAsArrowToPython.\n: java.lang.InterruptedException{frames}"


def spark_sees(fn: Any) -> str:
    """The text Spark gets back from a failed Python foreachBatch call: the formatted traceback."""
    try:
        fn(None, 7)
    except Exception:  # noqa: BLE001
        return traceback.format_exc()
    raise AssertionError("expected the function to raise")


def test_an_interrupted_batch_becomes_a_short_error_that_spark_recognises_as_its_stop() -> None:
    def each(_df: Any, _batch_id: int) -> None:
        raise FakePy4JJavaError()

    raw = spark_sees(each)
    assert len(raw) > 20_000  # what overflowed the regex's recursion before
    text = spark_sees(interruptible(each))
    m = SPARK_STOP_PATTERN.search(text)
    assert m is not None and m.group(3) == "java.lang.InterruptedException", text
    assert len(text) < 2_000 and "Dataset.scala" not in text
    with pytest.raises(QueryInterruptedError):
        interruptible(each)(None, 7)


def test_other_errors_pass_through_unchanged() -> None:
    err = ValueError("a real failure: java.lang.IllegalStateException")

    def each(_df: Any, _batch_id: int) -> None:
        raise err

    with pytest.raises(ValueError) as caught:
        interruptible(each)(None, 1)
    assert caught.value is err
    calls = []
    interruptible(lambda df, b: calls.append((df, b)))("df", 3)
    assert calls == [("df", 3)]


class FakeClosedFileSystemError(Exception):
    """A JVM call failed by a stop in another way than an interrupt (a closed file system): a
    long text with a Java stack trace and none of the interruption names."""

    def __str__(self) -> str:
        frames = "".join(f"\n\tat org.apache.hadoop.fs.FileSystem.create(FileSystem.java:{i})" for i in range(400))
        return f"An error occurred while calling o77.create.\n: java.io.IOException: Filesystem closed{frames}"


def test_any_error_while_the_supervisor_stops_the_query_is_that_stop() -> None:
    from services.runtime import supervisor as common

    def each(_df: Any, _batch_id: int) -> None:
        raise FakeClosedFileSystemError()

    # Not stopping: the failure is the query's own, passed through whole.
    with pytest.raises(FakeClosedFileSystemError):
        interruptible(each, "mint-s-1")(None, 3)
    with common._STOPPING_LOCK:
        common._STOPPING.add("mint-s-1")
    try:
        text = spark_sees(interruptible(each, "mint-s-1"))
        other = spark_sees(interruptible(each, "mint-other-1"))  # another query is not stopping
    finally:
        with common._STOPPING_LOCK:
            common._STOPPING.discard("mint-s-1")
    m = SPARK_STOP_PATTERN.search(text)
    assert m is not None and len(text) < 2_000 and "FileSystem.java" not in text, text
    assert "QueryInterruptedError" in text
    assert "FileSystem.java" in other and "QueryInterruptedError" not in other


def test_the_supervisor_marks_a_query_as_stopping_only_while_it_stops_it() -> None:
    from services.runtime import supervisor as common
    from services.runtime.supervisor import SinkRunner, Supervisor

    seen: list[bool] = []

    class Query:
        name = "write-s-2"

        def stop(self) -> None:
            with common._STOPPING_LOCK:
                seen.append(self.name in common._STOPPING)

    sup = Supervisor.__new__(Supervisor)
    sup._stop_runner(SinkRunner(sink=None, query=Query()))  # type: ignore[arg-type]
    assert seen == [True]
    assert "write-s-2" not in common._STOPPING
