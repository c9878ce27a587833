"""The driver JVM options the services add (``services.jvm.driver_java_options``)."""

from __future__ import annotations

import pytest

from services.jvm import ARCHIVE, driver_java_options
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
