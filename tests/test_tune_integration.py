"""`rayapp tune` on a real embedded cluster (the session's warm one: 2 nodes of 1 CPU; two
1-worker trials at a time) with a real MLflow SQLite store: one parent run, a child run per trial
with its epochs, ASHA stopping a weak trial before its last epoch, and the best trial's model
scoring as its run says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import JOBS, load_logged_model, mlflow_client, run_rayapp

from rayapp.spec.loader import load_spec
from rayapp.train.data import build_datasets

pytestmark = pytest.mark.integration

# One good learning rate and two that barely move the weights in an epoch (test accuracy near
# chance). Trials 0 and 1 start together; whichever reaches epoch 1 second is stopped if it is the
# weak one, and trial 2 (weak) reaches epoch 1 after both, below their mean: ASHA (halving) stops
# at least one trial after epoch 1 whatever the order.
GOOD_LR = 0.003
SPACE = f"grid({GOOD_LR},1e-6,2e-6)"
EPOCHS = 3
BATCH = 16
"""Small batches (90 steps an epoch): ASHA's stop after epoch 1 reaches the trial's workers
(asynchronously, through Tune) while epochs are left to skip."""


def test_tune_runs_trials_as_child_runs_stops_weak_ones_and_tags_the_best(
    workdir: Path, warm_cluster
):
    result = run_rayapp(
        "tune",
        str(JOBS / "digits_mlp.yaml"),
        "--param",
        f"train.lr={SPACE}",
        "--epochs",
        str(EPOCHS),
        "--global-batch-size",
        str(BATCH),
        "--metric",
        "test_accuracy",
        "--mode",
        "max",
        "--scheduler",
        "asha",
        "--nodes-per-trial",
        "1",
        "--concurrent",
        "2",
        "--tracking-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--storage-path",
        str(workdir / "results"),
        cwd=workdir,
        env=warm_cluster,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "using the warm cluster" in result.stdout

    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("rayapp")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("rayapp.tune") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and len(runs) == 4
    assert parent.info.status == "FINISHED"
    assert {r.info.status for r in children} == {"FINISHED"}
    assert sorted(float(r.data.params["tune.train.lr"]) for r in children) == sorted(
        [GOOD_LR, 1e-6, 2e-6]
    )

    def epochs_logged(run) -> int:
        return len(client.get_metric_history(run.info.run_id, "test_accuracy"))

    stopped = [r for r in children if r.data.tags.get("rayapp.early_stopped") == "true"]
    assert stopped, "ASHA stopped no trial"
    for run in stopped:
        assert run.data.tags["rayapp.tune.stopped_by"] == "asha"
        assert float(run.data.params["tune.train.lr"]) != GOOD_LR
        assert epochs_logged(run) < EPOCHS
        assert int(run.data.tags["rayapp.tune.stopped_after_epoch"]) < EPOCHS
    for run in children:
        if run not in stopped:
            assert epochs_logged(run) == EPOCHS

    best_id = parent.data.tags["rayapp.tune.best_run_id"]
    best = client.get_run(best_id)
    assert float(best.data.params["tune.train.lr"]) == GOOD_LR
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
