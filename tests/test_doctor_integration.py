"""`rayapp doctor --nodes 2` on a real embedded cluster: every node's facts, the pair's all-reduce
figures, exit 0; and `--address` given a Jobs API URL is bad input."""

from __future__ import annotations

import re

import pytest
from conftest import run_rayapp

pytestmark = pytest.mark.integration


def test_doctor_prints_nodes_and_the_pairs_bandwidth_on_a_healthy_cluster(tmp_path):
    result = run_rayapp("doctor", "--nodes", "2", cwd=tmp_path, timeout=90)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "2 node(s)" in output and "127.0.0.2" in output and "127.0.0.3" in output
    pair = re.search(r"127\.0\.0\.2 - 127\.0\.0\.3\s*│\s*([\d.]+)\s*│\s*([\d,]+)\s*│\s*ok", output)
    assert pair is not None, output[-3000:]
    latency_ms, bandwidth_mb_s = float(pair[1]), float(pair[2].replace(",", ""))
    assert 0 < latency_ms < 1000 and bandwidth_mb_s > 1, (latency_ms, bandwidth_mb_s)
    assert "healthy" in output
    # the checks' marker files are gone again
    assert not list((tmp_path / "rayapp_results").glob(".rayapp-shared-check-*"))


def test_a_jobs_api_address_is_bad_input(tmp_path):
    result = run_rayapp("doctor", "--address", "http://127.0.0.1:8265", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "--address: 'http://127.0.0.1:8265' is a Jobs API URL" in result.stderr
    assert "Traceback" not in result.stderr
