"""What the Kafka source and the Kafka sink for Spark share: the ``headers`` column's type
(the source's output column, the sink's input column) and the parsing of their options.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql.types import ArrayType, BinaryType, StringType, StructField, StructType

from shared.errors import KafkaConfigError

#: ``headers array<struct<key string, value binary>>``
HEADER_TYPE = ArrayType(
    StructType([StructField("key", StringType()), StructField("value", BinaryType())])
)


def bool_option(options: Mapping[str, str], key: str, default: bool) -> bool:
    """Option ``key`` as ``true``/``1``/``yes`` or ``false``/``0``/``no``; ``default`` when
    absent."""
    v = options.get(key)
    if v is None:
        return default
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise KafkaConfigError(f"expected option {key!r} to be true or false, found {v!r}")


def int_option(
    options: Mapping[str, str], key: str, default: int | None, least: int = 1
) -> int | None:
    """Option ``key`` as an integer of at least ``least``; ``default`` when absent."""
    v = options.get(key)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError as e:
        raise KafkaConfigError(f"expected option {key!r} to be an integer, found {v!r}") from e
    if n < least:
        raise KafkaConfigError(f"expected option {key!r} >= {least}, found {n}")
    return n
