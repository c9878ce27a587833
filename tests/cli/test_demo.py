"""``make demo`` (``python -m services.demo``) as a newcomer runs it: it passes its own model
check, and its terminal stays quiet: no Java stack trace, no librdkafka connection lines, and
only a handful of lines on stderr (issue 15, item 9)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: A line of a Java stack trace, or the line that names a Java exception or error.
JAVA_TRACE = re.compile(r"^\s+at [\w$.<>]+\(|^\s*Caused by: |\b(java|javax|scala|org\.apache)\.[\w$.]+(Exception|Error)\b")


@pytest.mark.slow
@pytest.mark.stack  # make demo starts the embedded stack and Spark itself
@pytest.mark.timeout(600)
def test_the_demo_passes_and_its_stderr_holds_no_java_trace_or_kafka_noise() -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", "services.demo", "--steps", "4", "--updates-per-step", "200"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("demo passed: "), last
    summary = json.loads(last.split(": ", 1)[1])
    assert summary["ok"] is True and summary["verified_steps"] == 4 and summary["updates_produced"] == 800
    err = proc.stderr.splitlines()
    traces = [line for line in err if JAVA_TRACE.search(line)]
    assert traces == [], "\n".join(err[:80])
    kafka = [line for line in err if "|FAIL|" in line or "Connection refused" in line]
    assert kafka == [], "\n".join(kafka[:10])
    # No JVM notice (the incubating vector module Spark's launcher adds: services/runtime/jvm.py
    # filters it); what is left are the services' own start lines (one per query).
    assert not [line for line in err if "incubator" in line], "\n".join(err)
    assert len(err) <= 8, "\n".join(err)
