"""`rayapp tune` on real embedded clusters with a real MLflow SQLite store: ASHA stopping weak
trials (their nodes freed for the next ones, their epochs in their runs), the best trial tagged and
its model scoring as its run says; and a sweep stopped by Ctrl-C, then resumed."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    JOBS,
    alive,
    cmdline,
    descendants,
    load_logged_model,
    mlflow_client,
    run_rayapp,
    start_rayapp,
    wait_for_line,
)

from rayapp.launch.cluster import EmbeddedCluster
from rayapp.spec.loader import load_spec
from rayapp.train.data import build_datasets

pytestmark = pytest.mark.integration
# Each trial starts a Tune actor, a Ray Train controller and a worker (new processes, torch
# imported in each): about 30 s a trial here, so a scenario of three trials takes two minutes.
slow = pytest.mark.slow

GOOD_LR = 0.003
EPOCHS = 8
BATCH = 16
"""90 steps an epoch, about 0.2 s here. ASHA's stop reaches a trial's workers asynchronously,
through Tune (under a second): a trial stopped after epoch 1 may train an epoch or two more, not
all eight."""


def tune_args(workdir: Path, space: str, *more: str) -> list[str]:
    return [
        "tune",
        str(JOBS / "digits_mlp.yaml"),
        "--param",
        f"train.lr={space}",
        "--global-batch-size",
        str(BATCH),
        "--metric",
        "test_accuracy",
        "--mode",
        "max",
        "--nodes-per-trial",
        "1",
        "--concurrent",
        "1",
        "--tracking-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--storage-path",
        str(workdir / "results"),
        *more,
    ]


def sweep_runs(workdir: Path):
    """The one parent run and its children (oldest first)."""
    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("rayapp")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    (parent,) = [r for r in runs if r.data.tags.get("rayapp.tune") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == len(children) + 1
    return client, parent, children


def epochs_logged(client, run) -> list[int]:
    """The epochs (0-based steps) of the run's test_accuracy, in the order MLflow holds them."""
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "test_accuracy"))


@slow
def test_asha_stops_weak_trials_frees_their_node_and_tags_the_best(workdir: Path):
    """One node, one trial at a time: the good trial runs first and reaches every rung; each weak
    one is below the rung's median after epoch 1 and is stopped. The second weak trial can only
    start on the CPU the first one held, so the sweep ends only if a stopped trial's placement
    group is freed (Ray Train's cleaner, through the cluster's State API)."""
    result = run_rayapp(
        *tune_args(
            workdir, f"grid({GOOD_LR},1e-6,2e-6)", "--epochs", str(EPOCHS), "--scheduler", "asha"
        ),
        cwd=workdir,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 trial(s), 2 stopped early" in result.stdout, result.stdout

    client, parent, children = sweep_runs(workdir)
    assert len(children) == 3
    assert parent.info.status == "FINISHED"
    assert {r.info.status for r in children} == {"FINISHED"}
    assert [float(r.data.params["tune.train.lr"]) for r in children] == [GOOD_LR, 1e-6, 2e-6]

    good, *stopped = children
    assert "rayapp.early_stopped" not in good.data.tags
    assert epochs_logged(client, good) == list(range(EPOCHS))
    for run in stopped:
        assert run.data.tags["rayapp.early_stopped"] == "true"
        assert run.data.tags["rayapp.tune.stopped_by"] == "asha"
        assert run.data.tags["rayapp.tune.stopped_after_epoch"] == "1"
        # Every epoch it trained, each once: at least the one ASHA judged it by, not its last.
        logged = epochs_logged(client, run)
        assert logged == list(range(len(logged))) and 1 <= len(logged) < EPOCHS, logged
        assert f"stopped early by asha after epoch 1/{EPOCHS}" in result.stdout

    best_id = parent.data.tags["rayapp.tune.best_run_id"]
    assert best_id == good.info.run_id
    best = client.get_run(best_id)
    assert best.data.tags["rayapp.tune.best"] == "true"
    assert json.loads(parent.data.tags["rayapp.tune.best_config"]) == {"train.lr": GOOD_LR}
    line = parent.data.tags["rayapp.tune.best_submit"]
    assert re.search(rf"rayapp submit \S*digits_mlp.yaml .*--nodes 1 --lr {GOOD_LR}$", line)
    assert f"--epochs {EPOCHS}" in line and f"--global-batch-size {BATCH}" in line
    assert line in result.stdout
    accuracy = best.data.metrics["test_accuracy"]
    assert parent.data.metrics["best_test_accuracy"] == pytest.approx(accuracy)
    assert accuracy >= 0.85

    # The best trial's model, as MLflow serves it, scores the test split as its run logged.
    model = load_logged_model(workdir, f"runs:/{best_id}/model")
    inputs, labels = build_datasets(load_spec(JOBS / "digits_mlp.yaml")).test[:]
    predicted = np.asarray(model.predict(inputs.numpy())).argmax(axis=1)
    assert abs((predicted == labels.numpy()).mean() - accuracy) <= 0.01


@slow
def test_ctrl_c_saves_the_sweep_and_resume_finishes_it_in_the_same_runs(workdir: Path):
    """Two trials, one after the other: Ctrl-C while the second trains. The parent and the
    second trial's run end KILLED, exit 130, nothing of the cluster left. --resume continues the
    same parent: the first trial is not trained again, the second goes on from its checkpoint in
    its own run, every epoch in it once."""
    epochs = 16  # about 6 s of training a trial: Ctrl-C after epoch 2 leaves most of them
    args = tune_args(workdir, "grid(0.003,0.01)", "--epochs", str(epochs))
    process = start_rayapp(*args, cwd=workdir)
    try:
        # Generous: a trial takes about 30 s to start here, twice that when the machine is busy.
        wait_for_line(process, f"_00000 finished after epoch {epochs}/{epochs}", timeout=300)
        wait_for_line(process, f"_00001 epoch 2/{epochs}", timeout=240)
        started = descendants(process.pid)
        assert any("raylet" in cmdline(pid) for pid in started)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-3000:]
    assert "continue it with the same command and --resume" in output
    assert "interrupted; training stopped" in output and "Traceback" not in output
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if alive(pid)], "processes of the cluster outlived rayapp"

    client, parent, (first, second) = sweep_runs(workdir)
    assert parent.info.status == "KILLED"
    assert (first.info.status, second.info.status) == ("FINISHED", "KILLED")
    assert epochs_logged(client, first) == list(range(epochs))
    trained = epochs_logged(client, second)  # sent by rank 0 or filled in from the checkpoint
    assert trained == list(range(len(trained))) and 2 <= len(trained) < epochs, trained

    resumed = run_rayapp(*args, "--resume", cwd=workdir, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming sweep {parent.info.run_id}" in resumed.stdout
    assert "_00000 epoch" not in resumed.stdout  # the finished trial is not trained again
    assert "2 trial(s), 0 stopped early" in resumed.stdout

    client, parent_after, (first_after, second_after) = sweep_runs(workdir)
    assert parent_after.info.run_id == parent.info.run_id
    assert parent_after.info.status == "FINISHED"
    assert first_after.info.run_id == first.info.run_id
    assert first_after.info.end_time == first.info.end_time
    assert epochs_logged(client, first_after) == list(range(epochs))
    assert second_after.info.run_id == second.info.run_id
    assert second_after.info.status == "FINISHED"
    assert epochs_logged(client, second_after) == list(range(epochs))
    assert int(second_after.data.tags["rayapp.resumed_from_epoch"]) >= 1
    assert parent_after.data.tags["rayapp.tune.best_run_id"] in {
        first.info.run_id,
        second.info.run_id,
    }


@pytest.mark.slow  # 20-30 s: outside the README command's 15 minutes, run by .ci/run
def test_asha_is_refused_on_a_cluster_without_the_state_api(workdir: Path):
    """A cluster whose dashboard is off cannot free a stopped trial's CPUs: the sweep is refused
    in one line before any trial starts, instead of waiting for ever."""
    with EmbeddedCluster(nodes=1, cpus_per_node=1, include_dashboard=False) as cluster:
        result = run_rayapp(
            *tune_args(workdir, "grid(0.003,0.01)", "--epochs", "2", "--scheduler", "asha"),
            "--address",
            cluster.address,
            cwd=workdir,
            env=cluster.auth_env,
            timeout=120,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"rayapp: error: --scheduler asha: the Ray cluster at {cluster.address}")
    assert "serves no Ray State API" in line and "--include-dashboard=true" in line
    assert "trial" not in result.stdout
    client = mlflow_client(workdir)
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
