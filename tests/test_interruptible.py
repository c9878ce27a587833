"""``services.common.interruptible``: a foreachBatch function interrupted by its query's stop
reaches Spark as a short error that Spark's own check recognises, instead of a text long
enough to overflow the stack of that check's regex."""

from __future__ import annotations

import re
import traceback
from typing import Any

import pytest

from services.common import QueryInterruptedError, interruptible

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
