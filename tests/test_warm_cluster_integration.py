"""`rayapp cluster up|status|down` and submits that reuse a warm cluster: real Ray nodes on this
machine, a real MLflow SQLite store, and the state file as a user's machine would have it."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
from conftest import (
    JOBS,
    alive,
    descendants,
    mlflow_client,
    only_run,
    run_rayapp,
    start_rayapp,
    wait_for_line,
)

from rayapp.launch import warm
from rayapp.launch.cluster import start_time

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    directory = tmp_path / "state"
    monkeypatch.setenv(warm.STATE_DIR_ENV, str(directory))
    yield directory
    record = None
    try:
        record = warm.find()
    finally:
        if record is not None:  # a failed assertion must not leave nodes running
            warm.down()


def driver_log(record: warm.WarmCluster) -> str:
    path = warm.driver_log(record)
    return f"\n--- {path}:\n" + (path.read_text()[-3000:] if path.exists() else "(none)")


def node_tree(record: warm.WarmCluster) -> list[int]:
    pids = list(record.leaders)
    for leader in record.leaders:
        pids += descendants(leader)
    return pids


def test_submits_reuse_the_warm_cluster_until_it_is_stopped(state_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_rayapp("cluster", "down", cwd=run_dir)
    assert result.returncode == 0 and "no warm cluster is running" in result.stdout

    result = run_rayapp("cluster", "up", "--nodes", "2", "--cpus-per-node", "1", cwd=run_dir)
    assert result.returncode == 0, result.stderr
    state = state_dir / warm.STATE_FILE_NAME
    assert stat.S_IMODE(state.stat().st_mode) == 0o600  # it holds the cluster's auth token
    record = warm.find()
    assert record is not None and record.alive and record.nodes == 2
    tree = node_tree(record)
    assert any("raylet" in open(f"/proc/{pid}/cmdline").read() for pid in tree if alive(pid))

    again = run_rayapp("cluster", "up", "--nodes", "2", cwd=run_dir)
    assert (
        again.returncode == 1
        and record.address in again.stderr
        and "already running" in again.stderr
    )

    # A variable Ray reads when imported, set otherwise than at `cluster up`: the preloaded driver
    # (imported under the old value) declines, and the command runs in its own process.
    too_many = run_rayapp(
        "submit",
        "--nodes",
        "3",
        "--epochs",
        "1",
        str(JOBS / "seed_linear.yaml"),
        cwd=run_dir,
        env={"RAY_DEDUP_LOGS": "0"},
    )
    assert too_many.returncode == 2
    assert (
        "running without the warm cluster's preloaded driver: RAY_DEDUP_LOGS set differently"
        in too_many.stderr
    ), result.stdout + result.stderr + driver_log(record)  # what the server served or declined
    assert "cluster.nodes: 3 is more than the warm cluster's 2 node(s)" in too_many.stderr

    driver = warm.preloaded_driver_socket()
    assert driver is not None and stat.S_IMODE(driver.stat().st_mode) == 0o600 and record.driver
    for _ in range(2):  # the second submit finds the cluster as the first left it
        result = run_rayapp(
            "submit", "--nodes", "2", "--epochs", "2", str(JOBS / "seed_linear.yaml"), cwd=run_dir
        )
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        assert (
            "using the warm cluster" in result.stdout and "starting embedded" not in result.stdout
        )
        assert "from its preloaded driver" in result.stdout, result.stdout + result.stderr
        assert warm.find() == record
    client = mlflow_client(run_dir)
    runs = client.search_runs([client.get_experiment_by_name("rayapp").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert {r.data.tags["rayapp.cluster"] for r in runs} == {"local-warm"}
    assert sorted(runs[0].data.tags["rayapp.node_ips"].split(",")) == ["127.0.0.2", "127.0.0.3"]

    status = run_rayapp("cluster", "status", cwd=run_dir)
    assert status.returncode == 0 and record.address in status.stdout
    assert f"preloaded driver: process {next(iter(record.driver))}" in status.stdout

    down = run_rayapp("cluster", "down", cwd=run_dir)
    assert down.returncode == 0 and "warm cluster stopped" in down.stdout
    assert not state.exists() and not driver.exists()
    assert not [pid for pid in tree if alive(pid)], (
        "processes of the warm cluster outlived `cluster down`"
    )
    assert not [pid for pid in record.driver if start_time(pid) == record.driver[pid]], (
        "the preloaded driver outlived it"
    )

    # With none running, submit starts its own cluster as before.
    cold = run_rayapp(
        "submit", "--nodes", "1", "--epochs", "1", str(JOBS / "seed_linear.yaml"), cwd=run_dir
    )
    assert cold.returncode == 0 and "starting embedded Ray cluster" in cold.stdout


def test_a_stale_record_is_detected_removed_and_said(state_dir, tmp_path):
    """After a reboot the record names processes that are gone (or pids now used by others)."""
    state_dir.mkdir()
    me = os.getpid()
    stale = {
        "address": "127.0.0.2:6379",
        "head_ip": "127.0.0.2",
        "nodes": 2,
        "cpus_per_node": 1,
        "gpus_per_node": 0,
        "token": "x",
        "log_dir": str(tmp_path / "logs"),
        "temp_dirs": [],
        "started_at": 0.0,
        # this test's own pid with another start time: a reused pid must not be taken for a node
        "leaders": {str(me): str(int(start_time(me)) - 1)},
    }
    (state_dir / warm.STATE_FILE_NAME).write_text(json.dumps(stale))
    result = run_rayapp("cluster", "status", cwd=tmp_path)
    assert result.returncode == 0
    assert (
        "removed a stale warm-cluster record" in result.stdout
        and "no warm cluster is running" in result.stdout
    )
    assert not (state_dir / warm.STATE_FILE_NAME).exists()
    assert alive(me)


def test_a_command_in_the_preloaded_driver_is_the_command(state_dir, tmp_path):
    """What a user sees of a command run in a child of the preloaded driver is what the command
    does in its own process: its working directory, its streams, its exit status, its one-line
    errors, and Ctrl-C stopping its run (the MLflow run marked KILLED, the driver's child gone)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text((JOBS / "seed_linear.yaml").read_text())
    unbuffered = {"PYTHONUNBUFFERED": "1"}  # as start_rayapp runs the command below
    up = run_rayapp("cluster", "up", "--nodes", "2", cwd=run_dir)
    assert up.returncode == 0, up.stderr
    record = warm.find()
    assert record is not None and warm.preloaded_driver_socket() is not None

    # Bad input: the exit status and the one-line error come back through the command.
    bad = run_rayapp(
        "submit", "--nodes", "2", "--epochs", "0", "job.yaml", cwd=run_dir, env=unbuffered
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr == "rayapp: error: train.epochs: 0 is not accepted; use a whole number >= 1\n"
    missing = run_rayapp("submit", "--nodes", "2", "no-such-job.yaml", cwd=run_dir, env=unbuffered)
    assert missing.returncode != 0 and "no-such-job.yaml" in missing.stderr
    served = (Path(record.log_dir) / "preloaded-driver.log").read_text()
    assert served.count("submit --nodes 2") == 2, served

    # Two submits at once, one node each: the server forks a child for each, and both runs finish,
    # each in the store of its own command's directory.
    directories = [tmp_path / "first", tmp_path / "second"]
    for directory in directories:
        directory.mkdir()
    both = [
        start_rayapp("submit", "--nodes", "1", "--epochs", "1", str(run_dir / "job.yaml"), cwd=d)
        for d in directories
    ]
    try:
        outputs = [process.communicate(timeout=85)[0] for process in both]
    finally:
        for process in both:
            if process.poll() is None:
                process.kill()
    assert [process.returncode for process in both] == [0, 0], outputs
    for directory, output in zip(directories, outputs, strict=True):
        assert "from its preloaded driver" in output, output
        assert only_run(mlflow_client(directory)).info.status == "FINISHED"
    served = (Path(record.log_dir) / "preloaded-driver.log").read_text()
    assert served.count("submit --nodes 1") == 2 and "declined" not in served, served

    # Ctrl-C: sent to the command, it reaches the run in the driver's child.
    process = start_rayapp("submit", "--nodes", "2", "--epochs", "200", "job.yaml", cwd=run_dir)
    try:
        lines = wait_for_line(process, "  1/200  loss")
        assert any("from its preloaded driver" in line for line in lines), lines
        children = [pid for pid in descendants(next(iter(record.driver)))]
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-3000:]
    assert "interrupted;" in output and "Traceback" not in output
    assert children and not [pid for pid in children if alive(pid)], (
        "the run's process outlived Ctrl-C"
    )
    run = only_run(mlflow_client(run_dir))  # in the command's directory, not the driver's
    assert run.info.status == "KILLED"
    assert (
        warm.find() == record and warm.preloaded_driver_socket() is not None
    )  # the driver serves on


def test_a_warm_cluster_without_its_preloaded_driver(state_dir, tmp_path):
    up = run_rayapp("cluster", "up", "--nodes", "1", "--no-preloaded-driver", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    record = warm.find()
    assert record is not None and not record.driver and warm.preloaded_driver_socket() is None
    status = run_rayapp("cluster", "status", cwd=tmp_path)
    assert "preloaded driver: not running (submits start their own)" in status.stdout
    assert not (state_dir / warm.DRIVER_SOCKET_NAME).exists()
