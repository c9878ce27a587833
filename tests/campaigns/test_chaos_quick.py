"""The quick fault campaign (``make chaos ARGS=--quick``) as part of ``make test`` (about 3
minutes on 2 cores).

``bench/chaos.py --quick`` runs on its own embedded stack: the services (all three in one
process) and the controller as processes, SIGKILLed a few times at random points, with S3
faults (errors, timeouts, PUTs that land and report a timeout, latency) and control-message
delivery errors injected into every service (``SHARDSINK_FAULTS``), network faults on the
paths to S3 and the broker (a partition of each and a black hole of the broker, healed), two
sink replicas racing on one shard (one switched from read-only to writing mid-run), a
subscribe through the controller, and peeks and appends sent to the controller throughout
(the command prober). Its history checker compares every shard state, every append's
contents, the shard at sampled uppers, the subscribe's output and every peek's rows with the
reference model; it exits 0 only if nothing diverged. This test asserts that exit code and the summary it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.timeout(1800)
def test_quick_fault_campaign_finds_no_divergence(tmp_path: Path) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("SHARDSINK_FAULTS", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--work-dir", str(tmp_path / "chaos")],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"expected a JSON summary on stdout, found none; stderr tail:\n{proc.stderr[-4000:]}"
    summary = json.loads(lines[-1])
    print(json.dumps({k: v for k, v in summary.items() if k != "logs"}))
    assert proc.returncode == 0, (
        f"expected the campaign to finish without divergence (exit 0), found exit {proc.returncode}: "
        f"{summary.get('error')}; divergences {summary.get('divergences')}\n{proc.stderr[-4000:]}"
    )
    assert summary["ok"] is True and summary["divergences"] == []
    assert summary["kills"] >= 4 and set(summary["kills_by_service"]) == {"services", "controller"}
    assert summary["appends"] > 0 and summary["states_missing"] == 0
    assert summary["append_contents_checked"] > 0 and summary["uppers_checked"] > 0
    # every description appended started at the shard's upper at its append (its lower, from
    # the token the minter gave it, against the state before the append)
    assert summary["description_lowers_checked"] == summary["appends"]
    assert summary["subscribe_changes"] > 0 and summary["subscribe_last_progress"] >= summary["final_upper"]
    assert summary["switched_read_only_at_upper"] is not None
    # Network faults behind the stack's proxies (issue 32): each healed, and the sink resumed
    # (the run fails otherwise); the seconds from heal to the next upper are reported.
    assert [(f["fault"], f["path"]) for f in summary["network_faults"]] == [
        ("partition", "s3"), ("partition", "kafka"), ("blackhole", "kafka")]
    assert all(f["heal_to_upper_s"] is not None for f in summary["network_faults"])
    assert summary["heal_to_upper_p50_s"] is not None and summary["heal_to_upper_max_s"] >= summary["heal_to_upper_p50_s"]
    # Peeks and appends through the controller throughout the kills and the network faults:
    # every peek equal to the model, every command answered within the bound after its heal.
    assert summary["commands_sent"] > 0 and summary["peeks_checked"] > 0
    assert summary["peek_mismatches"] == 0 and summary["commands_unanswered_after_heal"] == 0
    assert summary["commands_wrong_errors"] == 0 and summary["side_appends_landed"] > 0
    assert "chaos: OK" in proc.stderr
