"""The public package ``shardsink``: what users import is the implementation's own objects,
the CLI is reachable from it, and the CLI lives in one package (none of it under ``shared/``
or ``services/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import shardsink
import shared.catalog
import shared.errors
from shared.io import client

ROOT = Path(__file__).resolve().parents[2]


def test_the_read_api_is_the_clients_own_objects() -> None:
    assert shardsink.open_collection is client.open_collection
    assert shardsink.Change is client.Change
    assert shardsink.Progress is client.Progress
    assert shardsink.Collection is client.Collection
    assert shardsink.Subscription is client.Subscription
    assert shardsink.ErrorRow is client.ErrorRow
    assert set(client.__all__) <= set(shardsink.__all__)
    assert "open_collection" in dir(shardsink)


def test_the_spark_reader_is_exported_lazily() -> None:
    """``import shardsink`` does not import pyspark (the CLI imports it on every start); the
    Spark reader's names are the data source module's own functions."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, shardsink; assert 'pyspark' not in sys.modules, 'pyspark imported'"
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True)
    from shared.spark import shardsink_source as spark_shardsink

    assert shardsink.read_collection is spark_shardsink.read_collection
    assert shardsink.register_spark_source is spark_shardsink.register_shardsink_source
    assert {"read_collection", "register_spark_source"} <= set(shardsink.__all__)


def test_every_public_error_is_the_core_class_and_a_shardsink_error() -> None:
    errors = [n for n in shardsink.__all__ if n.endswith("Error")]
    core = {n for n in vars(shared.errors) if n.endswith("Error")}
    assert core <= set(errors), sorted(core - set(errors))
    for name in errors:
        cls = getattr(shardsink, name)
        assert cls is getattr(shared.errors, name, None) or cls is getattr(shared.catalog, name, None), name
        assert issubclass(cls, shardsink.ShardsinkError), name
    try:
        shardsink.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("expected AttributeError for an unknown name")


def test_python_m_shardsink_is_the_cli_with_every_command_group() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "shardsink", "--help"], capture_output=True, text=True, env=env, timeout=120, check=True
    ).stdout
    for command in ("collection", "sink", "produce", "append", "peek", "tail", "status", "up"):
        assert command in out, (command, out)


def test_the_cli_lives_in_one_package_and_not_in_the_core_or_the_services() -> None:
    stray = sorted(str(p.relative_to(ROOT)) for d in ("shared", "services") for pat in ("cli.py", "cli_*.py") for p in (ROOT / d).rglob(pat))
    assert stray == []
    modules = {p.stem for p in (ROOT / "shardsink" / "cli").glob("*.py")}
    assert {"main", "catalog", "data", "produce", "stack", "common", "util"} <= modules
