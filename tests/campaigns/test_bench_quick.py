"""The quick benchmark suite (``make bench ARGS=--quick``) as part of ``make test``.

Runs ``bench/run_all.py --quick`` (every benchmark at its quick sizes, each against the
baseline it measures in the same run) into a temporary results directory and a copy of
BENCHMARKS.md, and checks what a reader of the results relies on: every benchmark finished
and printed its figures, the machine is described, the plot is a PNG, and the table between
the markers was rewritten with every headline figure while the rest of the file was kept.
Speed is not asserted here: the figures are measurements, published by ``make bench``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The headline figures each benchmark must print (numbers), and what the table shows of them.
FIGURES = {
    "bench-shard": ["cas_p50_ms", "baseline_put_p50_ms", "append_updates_per_s", "snapshot_1m_rows_s",
                    "snapshot_1m_rows_mixed_versions_s", "batches_after_10k_appends"],
    "bench-kafka": ["raw_produce_records_per_s", "raw_consume_records_per_s", "source_records_per_s",
                    "sink_records_per_s"],
    "bench-sink": ["sink_updates_per_s", "baseline_updates_per_s", "freshness_p50_s", "freshness_p99_s",
                   "recovery_s", "correction_peak_ratio", "baseline_recovery_s", "recovery_vs_baseline",
                   # the delta-rs peer on the same topic and S3 server (issue 31)
                   "sink_vs_deltalake", "freshness_vs_deltalake", "snapshot_1m_vs_deltalake",
                   "deltalake_updates_per_s", "deltalake_freshness_p50_s", "deltalake_read_1m_s",
                   "deltalake_snapshot_1m_s"],
    "bench-controller": ["peek_1m_rows_s", "subscribe_lag_p50_s", "subscribe_lag_p99_s", "compaction_mb_per_s",
                         "compaction_cpu_bound_mb_per_s", "spark_read_1m_rows_s",
                         # the peers on the same merged parts (issue 31)
                         "compaction_vs_duckdb", "compaction_vs_polars", "compaction_local_mb_per_s",
                         "duckdb_mb_per_s", "polars_mb_per_s"],
}


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.timeout(1800)
def test_quick_bench_suite_writes_results_plot_and_table(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    shutil.copy(REPO / "BENCHMARKS.md", md)
    before = md.read_text()
    results = tmp_path / "results"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--quick", "--results-dir", str(results), "--markdown", str(md)],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, f"expected every quick benchmark to finish (exit 0), found {proc.returncode}:\n{proc.stderr[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["failed"] == []
    res = json.loads((results / "latest.json").read_text())
    assert res["quick"] is True and res["timestamp"] == summary["timestamp"]
    m = res["machine"]
    assert m["cores"] >= 1 and m["memory_gib"] > 0 and m["python"] and m["pyspark"] and m["pyarrow"]
    for bench, keys in FIGURES.items():
        figs = res["benchmarks"][bench]
        assert "error" not in figs, f"{bench}: {figs.get('error')}"
        for k in keys:
            assert isinstance(figs.get(k), (int, float)), f"expected {bench} to print a number {k}, found {figs.get(k)!r}"
    scale = res["benchmarks"]["bench-scale"]
    assert "error" not in scale, scale.get("error")
    assert [p["partitions"] for p in scale["partitions"]] == [1, 2, 4, 8]
    assert all(p["updates_per_s"] > 0 for p in scale["partitions"])
    png = (results / "latest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    after = md.read_text()
    head, _, rest = before.partition("<!-- bench:begin -->")
    assert after.startswith(head), "expected the text before the table kept"
    assert after.endswith(rest.partition("<!-- bench:end -->")[2]), "expected the text after the table kept"
    table = after.split("<!-- bench:begin -->", 1)[1].split("<!-- bench:end -->", 1)[0]
    assert summary["timestamp"] in table and "ARGS=--quick" in table
    for k in ("cas_p50_ms", "source_records_per_s", "sink_updates_per_s", "freshness_p50_s", "peek_1m_rows_s",
              "subscribe_lag_p50_s"):
        assert k in table, f"expected {k} in the table"
    assert "with 8 partition(s)" in table
