"""`rayapp runs` and `rayapp ui` against a real MLflow SQLite store (no Ray needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from click.testing import CliRunner
from conftest import migrated_store

from rayapp.cli import main
from rayapp.launch.cluster import free_port
from rayapp.tracking.logger import RunLogger
from rayapp.tracking.run import close_run, open_run


def logged_run(uri: str) -> str:
    run_id = open_run(
        tracking_uri=uri,
        experiment="rayapp",
        run_name="seed_linear-n2",
        params={"job": "seed_linear", "nodes": "2", "world_size": "2", "strategy": "ddp"},
        tags={},
    )
    logger = RunLogger(uri, run_id, fallback_path="/nonexistent/x.jsonl")
    for epoch, seconds in enumerate([3.0, 1.0, 2.0]):
        logger.log_epoch(epoch, {"loss": 1.0 / (epoch + 1), "epoch_time_s": seconds})
    logger.log_metrics({"total_time_s": 6.5, "time_to_first_step_s": 12.34}, step=2)
    assert logger.close() is None
    close_run(uri, run_id, "FINISHED")
    return run_id


def test_runs_table(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    run_id = logged_run(uri)
    result = CliRunner().invoke(main, ["runs", "--tracking-uri", uri], terminal_width=200)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if run_id[:12] in line)
    assert "FINISHED" in row and "seed_linear-n2" in row
    assert "0.33333" in row  # final loss
    assert "1.500" in row  # median epoch time without the first epoch: median(1.0, 2.0)
    assert "6.5" in row
    assert "startup s" in result.output and "12.3" in row  # time to first step


def test_ui_serves_the_store(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    logged_run(uri)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rayapp", "ui", "--tracking-uri", uri, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/health", timeout=2
                ) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert process.poll() is None, process.stdout.read().decode()
                time.sleep(0.5)
        else:
            raise AssertionError("rayapp ui did not answer within 90 s")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=rayapp"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert b'"name": "rayapp"' in response.read().replace(b'":"', b'": "')
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the UI and the workers it started
        process.wait(timeout=30)
