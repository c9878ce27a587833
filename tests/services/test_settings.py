"""The services' settings: one table (``services.runtime.settings.SETTINGS``) gives each
setting's variable, flag, default and meaning, and everything derived from it behaves as the
settings always did: the defaults with an empty environment, each variable and each flag
setting its field (a flag beating its variable), every variable documented, and
docs/operations.md's configuration table listing every setting with the table's default.

The expected values here are written out, not read from the table: they pin the behaviour.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from services.runtime.settings import (
    ENV_VARS,
    add_controller_arguments,
    REQUIRED_ENV,
    SETTINGS,
    ServiceSettings,
    faults_from_env,
    is_known_env,
    markdown_table,
)
from shared.devstack.faults import Faults
from shared.sink_shard import SinkShard

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"

#: What the settings are with no variable set and no flag given.
DEFAULTS: dict[str, Any] = {
    "kafka.bootstrap": "127.0.0.1:9092",
    "kafka.fetch_wait_ms": 0,
    "s3.endpoint": None,
    "s3.bucket": "shardsink",
    "s3.prefix": "",
    "s3.client": "obstore",
    "checkpoint_dir": "/tmp/shardsink-checkpoints",
    "descs_topic": "descs",
    "batches_topic": "batches",
    "frontiers_topic": "frontiers",
    "trigger_ms": 100,
    "source_wait_ms": 2000,
    "catalog_poll_ms": 1000,
    "spark_master": "local[2]",
    "grace_ms": 600_000,
    "only_sinks": (),
    "faults": None,
    "max_records_per_trigger": 100_000,
    "simulated_low_watermarks_file": None,
    "quarantine_after": 3,
    "test_fail_on_row": None,
    "s3_retry_ms": 60_000,
    "sink_shard": SinkShard(0, 1),
    "queries": "shared",
}

#: field -> (variable, flag, text a user sets, the field's value then).
OVERRIDES: dict[str, tuple[str | None, str | None, str, Any]] = {
    "kafka.bootstrap": ("SHARDSINK_KAFKA_BOOTSTRAP", "--bootstrap", "broker:9093", "broker:9093"),
    "kafka.fetch_wait_ms": ("SHARDSINK_KAFKA_FETCH_WAIT_MS", None, "50", 50),
    "s3.endpoint": ("SHARDSINK_S3_ENDPOINT", "--s3-endpoint", "http://s3:9000", "http://s3:9000"),
    "s3.bucket": ("SHARDSINK_S3_BUCKET", "--bucket", "lake", "lake"),
    "s3.prefix": ("SHARDSINK_S3_PREFIX", "--s3-prefix", "team/a", "team/a"),
    "s3.client": ("SHARDSINK_S3_CLIENT", "--s3-client", "boto3", "boto3"),
    "checkpoint_dir": ("SHARDSINK_CHECKPOINT_DIR", "--checkpoint-dir", "/ckpt", "/ckpt"),
    "descs_topic": ("SHARDSINK_TOPIC_DESCS", "--descs-topic", "d2", "d2"),
    "batches_topic": ("SHARDSINK_TOPIC_BATCHES", "--batches-topic", "b2", "b2"),
    "frontiers_topic": ("SHARDSINK_TOPIC_FRONTIERS", "--frontiers-topic", "f2", "f2"),
    "trigger_ms": ("SHARDSINK_TRIGGER_MS", "--trigger-ms", "7", 7),
    "source_wait_ms": ("SHARDSINK_SOURCE_WAIT_MS", "--source-wait-ms", "0", 0),
    "catalog_poll_ms": ("SHARDSINK_CATALOG_POLL_MS", "--catalog-poll-ms", "250", 250),
    "spark_master": ("SHARDSINK_SPARK_MASTER", "--master", "spark://m:7077", "spark://m:7077"),
    "grace_ms": ("SHARDSINK_STAGED_GRACE_MS", "--grace-ms", "60000", 60_000),
    "only_sinks": (None, "--sink", "orders-sink", ("orders-sink",)),
    "faults": (
        "SHARDSINK_FAULTS",
        None,
        "error_p=0.5,latency_ms=5",
        Faults(error_p=0.5, latency_ms=5.0),
    ),
    "max_records_per_trigger": (
        "SHARDSINK_MAX_RECORDS_PER_TRIGGER",
        "--max-records-per-trigger",
        "42",
        42,
    ),
    "simulated_low_watermarks_file": (
        "SHARDSINK_TEST_LOW_WATERMARKS_FILE",
        None,
        "/tmp/lw.json",
        "/tmp/lw.json",
    ),
    "quarantine_after": ("SHARDSINK_QUARANTINE_AFTER", "--quarantine-after", "0", 0),
    "test_fail_on_row": ("SHARDSINK_TEST_FAIL_ON_ROW", None, "boom", "boom"),
    "s3_retry_ms": ("SHARDSINK_S3_RETRY_MS", "--s3-retry-ms", "0", 0),
    "sink_shard": ("SHARDSINK_SINK_SHARD", "--sink-shard", "1/2", SinkShard(1, 2)),
    "queries": ("SHARDSINK_QUERIES", "--queries", "per-sink", "per-sink"),
}
assert set(OVERRIDES) == set(DEFAULTS)


def get(settings: ServiceSettings, field: str) -> Any:
    """A field, ``kafka.bootstrap`` and ``s3.bucket`` included."""
    value: Any = settings
    for part in field.split("."):
        value = getattr(value, part)
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardsink-test", exit_on_error=False)
    ServiceSettings.add_arguments(p)
    return p


def test_every_field_of_the_settings_has_one_row_of_the_table() -> None:
    fields = [s.field for s in SETTINGS if s.field is not None and s.owner == "service"]
    assert len(fields) == len(set(fields)), fields
    own = {f.name for f in dataclasses.fields(ServiceSettings)} - {"kafka", "s3"}
    assert {f for f in fields if "." not in f} == own
    assert set(fields) == set(DEFAULTS)
    names = [s.env for s in SETTINGS if s.env is not None]
    assert len(names) == len(set(names)), (
        f"expected each variable once, found {sorted(n for n in names if names.count(n) > 1)}"
    )


def test_an_empty_environment_gives_the_defaults() -> None:
    settings = ServiceSettings.from_env_and_args(None, {})
    assert {f: get(settings, f) for f in DEFAULTS} == DEFAULTS
    # The dataclass defaults are the same ones.
    assert ServiceSettings(settings.kafka, settings.s3) == settings
    # And so are an argparse namespace with no flag given and a namespace without the flags
    # (the shardsink CLI's).
    assert ServiceSettings.from_env_and_args(parser().parse_args([]), {}) == settings
    assert ServiceSettings.from_env_and_args(argparse.Namespace(), {}) == settings
    assert faults_from_env({}) is None


@pytest.mark.parametrize(
    "field", sorted(f for f, (env, *_) in OVERRIDES.items() if env is not None)
)
def test_each_variable_sets_its_field(field: str) -> None:
    env, _, text, expected = OVERRIDES[field]
    assert env is not None
    settings = ServiceSettings.from_env_and_args(None, {env: text})
    assert get(settings, field) == expected
    # ... and only its field.
    assert {f: get(settings, f) for f in DEFAULTS if f != field} == {
        f: v for f, v in DEFAULTS.items() if f != field
    }


@pytest.mark.parametrize(
    "field", sorted(f for f, (_, flag, *_) in OVERRIDES.items() if flag is not None)
)
def test_each_flag_sets_its_field_and_beats_its_variable(field: str) -> None:
    env, flag, text, expected = OVERRIDES[field]
    assert flag is not None
    env_text = "1" if isinstance(expected, int) else "2/3" if isinstance(expected, SinkShard) else "shared" if field == "queries" else "obstore" if field == "s3.client" else "from-the-environment"
    environment = {env: env_text} if env is not None else {}
    settings = ServiceSettings.from_env_and_args(parser().parse_args([flag, text]), environment)
    assert get(settings, field) == expected
    # An empty flag counts as not given: the variable wins (an int flag refuses "").
    if env is not None and not isinstance(expected, int):
        empty = ServiceSettings.from_env_and_args(parser().parse_args([flag, ""]), environment)
        assert get(empty, field) == (SinkShard.parse(env_text) if isinstance(expected, SinkShard) else env_text)


def test_the_flags_are_the_services_flags_each_naming_its_variable_and_default() -> None:
    actions = {a.option_strings[0]: a for a in parser()._actions if a.dest != "help"}
    assert set(actions) == {
        "--bootstrap",
        "--s3-endpoint",
        "--bucket",
        "--s3-prefix",
        "--s3-client",
        "--checkpoint-dir",
        "--descs-topic",
        "--batches-topic",
        "--frontiers-topic",
        "--trigger-ms",
        "--source-wait-ms",
        "--catalog-poll-ms",
        "--master",
        "--grace-ms",
        "--max-records-per-trigger",
        "--quarantine-after",
        "--s3-retry-ms",
        "--sink",
        "--sink-shard",
        "--queries",
    }
    by_flag = {s.flag: s for s in SETTINGS if s.flag}
    for flag, action in actions.items():
        s = by_flag[flag]
        assert action.help and s.doc in action.help, flag
        if s.env is not None:
            assert f"({s.env}, default {s.shown_default})" in action.help, (flag, action.help)
    assert parser().parse_args(["--sink", "a", "--sink", "b"]).sink == ["a", "b"]
    assert ServiceSettings.from_env_and_args(
        parser().parse_args(["--sink", "a", "--sink", "b"]), {}
    ).only_sinks == ("a", "b")
    with pytest.raises(argparse.ArgumentError, match="invalid int value: 'soon'"):
        parser().parse_args(["--trigger-ms", "soon"])


def test_every_variable_is_documented_in_one_line_and_known() -> None:
    for name, doc in ENV_VARS.items():
        assert re.fullmatch(r"(SHARDSINK|AWS|PYSPARK|POD)_[A-Z0-9_]+", name), name
        assert doc.strip() and "\n" not in doc, name
        assert is_known_env(name)
    assert REQUIRED_ENV == ("SHARDSINK_KAFKA_BOOTSTRAP", "SHARDSINK_S3_BUCKET")
    assert is_known_env("SHARDSINK_KAFKA_SASL_PASSWORD_FILE") and not is_known_env(
        "SHARDSINK_NO_SUCH_SETTING"
    )


def _configuration_rows() -> dict[str, tuple[str, str, str]]:
    """docs/operations.md's configuration table: variable (or flag) -> (flag, default, meaning)."""
    text = OPERATIONS.read_text()
    section = text[text.index("\n## Configuration\n") :]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, tuple[str, str, str]] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        var, flag, default, meaning = (c.strip().strip("`") for c in line.strip("|").split("|"))
        if var not in ("Variable", "---"):
            rows[var or flag] = (flag, default, meaning)
    return rows


def _shown(value: Any) -> str:
    return "empty" if value in ("", None) else "none" if value == () else str(value)


def test_operations_md_lists_every_setting_with_its_default() -> None:
    rows = _configuration_rows()
    assert set(rows) == set(ENV_VARS) | {"--sink"}
    for s in SETTINGS:
        shown_flag, _, meaning = rows[s.env or s.flag or ""]
        assert (shown_flag, meaning.startswith(s.doc)) == (s.flag or "", True), s
    for field, value in DEFAULTS.items():
        env, flag, _, _ = OVERRIDES[field]
        assert rows[env or flag or ""][1] == _shown(value), field
    # The table is the rendered one, word for word.
    assert markdown_table() in OPERATIONS.read_text(), (
        "docs/operations.md's configuration table differs from services.runtime.settings.SETTINGS; "
        "replace it with the output of services.runtime.settings.markdown_table()"
    )


#: The controller's own settings: field -> (variable, flag, default value, text a user sets,
#: the field's value then).
CONTROLLER: dict[str, tuple[str, str, Any, str, Any]] = {
    "commands_topic": ("SHARDSINK_TOPIC_COMMANDS", "--commands-topic", "commands", "cmd2", "cmd2"),
    "responses_topic": ("SHARDSINK_TOPIC_RESPONSES", "--responses-topic", "responses", "rsp2", "rsp2"),
    "tick_ms": ("SHARDSINK_CONTROLLER_TICK_MS", "--tick-ms", 50, "7", 7),
    "head_refresh_ms": ("SHARDSINK_CONTROLLER_HEAD_REFRESH_MS", "--head-refresh-ms", 1000, "0", 0),
    "peek_timeout_ms": ("SHARDSINK_PEEK_TIMEOUT_MS", "--peek-timeout-ms", 30_000, "5", 5),
    "max_inline_bytes": ("SHARDSINK_PEEK_MAX_INLINE_BYTES", "--max-inline-bytes", 65_536, "10", 10),
    "reclaim_grace_ms": ("SHARDSINK_RECLAIM_GRACE_MS", "--reclaim-grace-ms", 0, "99", 99),
    "gc_interval_ms": ("SHARDSINK_GC_INTERVAL_MS", "--gc-interval-ms", 30_000, "11", 11),
    "spark.master": ("SHARDSINK_CONTROLLER_SPARK_MASTER", "--spark-master", None, "spark://m:7077", "spark://m:7077"),
    "spark.min_bytes": ("SHARDSINK_CONTROLLER_SPARK_MIN_BYTES", "--spark-min-bytes", 64 * 1024 * 1024, "12", 12),
    "spark.gc_min_objects": ("SHARDSINK_CONTROLLER_SPARK_GC_MIN_OBJECTS", "--spark-gc-min-objects", 10_000, "13", 13),
    "spark.timeout_ms": ("SHARDSINK_CONTROLLER_SPARK_TIMEOUT_MS", "--spark-timeout-ms", 600_000, "14", 14),
}


def controller_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServiceSettings.add_arguments(p)
    add_controller_arguments(p)
    return p


def controller_field(settings: Any, field: str) -> Any:
    return getattr(settings.spark, field[6:]) if field.startswith("spark.") else getattr(settings, field)


def test_the_controller_reads_its_settings_from_the_one_table() -> None:
    """Defaults (also the dataclasses' own), each variable, each flag beating its variable."""
    from services.controller.__main__ import settings_from
    from services.controller.model import ControllerSettings

    assert {s.field for s in SETTINGS if s.owner == "controller"} == set(CONTROLLER)
    defaults = settings_from(controller_parser().parse_args([]), {})
    bare = ControllerSettings(defaults.service)
    for field, (env, flag, default, text, value) in CONTROLLER.items():
        assert controller_field(defaults, field) == default == controller_field(bare, field), field
        from_env = settings_from(controller_parser().parse_args([]), {env: text})
        assert controller_field(from_env, field) == value, field
        from_flag = settings_from(controller_parser().parse_args([flag, text]), {env: "1"})
        assert controller_field(from_flag, field) == value, field
        assert env in ENV_VARS and flag in _configuration_rows()[env][0]
