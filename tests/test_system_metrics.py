"""A node's system-metrics sampler against real MLflow stores: every node gets figures, however
short its run, and samples taken while the server is down reach it once it is back."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import MlflowServer, migrated_store
from mlflow.tracking import MlflowClient

from rayapp.train import system_metrics

NODE = "127.0.0.9"
CPU = f"system/{NODE}/cpu_utilization_percentage"


def new_run(tracking_uri: str) -> str:
    client = MlflowClient(tracking_uri)
    return client.create_run(client.create_experiment("sampler")).info.run_id


# A worker's process as it is when its sampler starts: psutil not yet imported.
SHORT_RUN = """
import sys, time
from rayapp.train import system_metrics
sampler = system_metrics.start(
    run_id=sys.argv[1], tracking_uri=sys.argv[2], interval_s=30, node=sys.argv[3], resume=False
)
assert sampler is not None
busy_until = time.monotonic() + 0.5
while time.monotonic() < busy_until:  # the machine's CPU is busy while the sample is taken
    pass
started = time.monotonic()
system_metrics.stop(sampler)
print(time.monotonic() - started)
"""


def test_a_node_whose_work_ends_within_one_interval_still_logs_a_sample(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    done = subprocess.run(
        [sys.executable, "-c", SHORT_RUN, run_id, uri, NODE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # stop() cuts the interval short rather than waiting it out...
    assert float(done.stdout.split()[-1]) < 10
    # ...and the sample taken so far is written: a worker node whose share of a short run ends
    # before the first interval is not missing from the run...
    history = MlflowClient(uri).get_metric_history(run_id, CPU)
    assert [m.step for m in history] == [0]
    # ...and it measures the time it covers, not psutil's 0.0 for a first reading in a process
    assert history[0].value > 0, history


@pytest.mark.integration
@pytest.mark.slow
def test_samples_taken_while_the_server_is_down_are_written_when_it_is_back(tmp_path):
    server = MlflowServer(tmp_path).start()
    try:
        run_id = new_run(server.uri)
        sampler = system_metrics.start(
            run_id=run_id, tracking_uri=server.uri, interval_s=0.2, node=NODE, resume=False
        )
        time.sleep(1)
        server.stop()
        down_at = time.time()
        time.sleep(2)  # ~10 samples whose writes fail
        server.start()
        up_at = time.time()
        # It goes on sampling afterwards: wait (bounded) for a sample written after the restart.
        # A fixed sleep here measured the loaded machine: the first write after a restart can
        # take seconds.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            m.timestamp > up_at * 1000
            for m in MlflowClient(server.uri).get_metric_history(run_id, CPU)
        ):
            time.sleep(0.5)
        system_metrics.stop(sampler)
        history = MlflowClient(server.uri).get_metric_history(run_id, CPU)
    finally:
        server.stop()
    steps = sorted(m.step for m in history)
    # One value per sample, none lost or doubled: the sampler outlived the failed writes.
    assert steps == list(range(len(steps))), steps
    taken_while_down = [m for m in history if down_at * 1000 < m.timestamp < up_at * 1000]
    assert len(taken_while_down) >= 5, (len(taken_while_down), len(history))
    assert max(m.timestamp for m in history) > up_at * 1000, (up_at, history[-3:])
