"""Triton's own load generator, perf_analyzer, against the standalone server.

perf_analyzer reads /v2 (extensions), the model's /config and /metadata, sends binary
tensors, and reads /stats when "statistics" is advertised: a short run that exits 0 and
reports throughput is the acceptance test that those pieces fit together. Skipped when the
binary is absent (install it with tools/install-perf-analyzer.sh).
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def perf_analyzer() -> str | None:
    candidates = [os.environ.get("PERF_ANALYZER"),
                  str(Path.home() / ".cache" / "perf_analyzer" / "perf_analyzer"),
                  shutil.which("perf_analyzer")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    return None


PERF_ANALYZER = perf_analyzer()

requires_perf_analyzer = pytest.mark.skipif(
    PERF_ANALYZER is None,
    reason="perf_analyzer not found (set PERF_ANALYZER, or run "
           "tools/install-perf-analyzer.sh, which installs ~/.cache/perf_analyzer/perf_analyzer)")


def run(args: list[str], tmp_path: Path) -> tuple[str, list[dict]]:
    """Run perf_analyzer briefly; its stdout and the rows of its CSV report. Stability is a
    speed question (benchmarks/): any windows count as stable here, so a busy CI machine
    cannot fail a test of what the server answers."""
    report = tmp_path / "report.csv"
    cmd = [PERF_ANALYZER, *args, "--measurement-interval", "500", "--max-trials", "8",
           "--stability-percentage", "10000", "-f", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    with report.open() as f:
        return proc.stdout, list(csv.DictReader(f))


@requires_perf_analyzer
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_server(standalone, tmp_path, protocol):
    port = standalone.http_port if protocol == "http" else standalone.grpc_port
    stdout, rows = run(["-m", "linear", "-u", f"127.0.0.1:{port}", "-i", protocol,
                        "--concurrency-range", "1:4:3"], tmp_path)
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 4]      # perf_analyzer sorts rows by throughput
    assert all(float(r["Inferences/Second"]) > 0 for r in rows)
    # perf_analyzer's server-side section comes from the statistics extension
    assert "Server:" in stdout and "Successful request count" in stdout


@requires_perf_analyzer
def test_perf_analyzer_batches_of_two_on_a_two_input_model(standalone, tmp_path):
    stdout, rows = run(["-m", "simple", "-u", f"127.0.0.1:{standalone.http_port}", "-b", "2",
                        "--concurrency-range", "2"], tmp_path)
    assert len(rows) == 1 and float(rows[0]["Inferences/Second"]) > 0
    assert "Inference count" in stdout
