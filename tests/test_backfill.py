"""Epochs a job checkpointed but never sent to MLflow, filled in from the newest checkpoint (real
SQLite store)."""

from __future__ import annotations

import time

import pytest
from conftest import migrated_store
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from rayapp.tracking.backfill import HISTORY_FILE, backfill_epochs, newest_history, write_history
from rayapp.tracking.run import open_run


def epoch_metrics(epoch: int) -> dict[str, float]:
    return {"loss": 1.0 / (epoch + 1), "epoch_time_s": 0.5 + epoch}


@pytest.fixture
def run(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    run_id = open_run(tracking_uri=uri, experiment="backfill", run_name="r", params={}, tags={})
    client = MlflowClient(uri)
    # epochs 0 and 1 reached MLflow before the job stopped
    now = int(time.time() * 1000)
    client.log_batch(
        run_id, metrics=[Metric(k, v, now, e) for e in (0, 1) for k, v in epoch_metrics(e).items()]
    )
    return uri, run_id


def checkpoint(trial_dir, name: str, run_id: str, epoch: int) -> None:
    directory = trial_dir / name
    directory.mkdir(parents=True)
    write_history(
        str(directory),
        run_id=run_id,
        epoch=epoch,
        history=[epoch_metrics(e) for e in range(epoch + 1)],
    )


def test_epochs_of_the_newest_checkpoint_that_mlflow_lacks_are_logged_once(run, tmp_path):
    uri, run_id = run
    trial = tmp_path / "results" / "job-1234abcd"
    checkpoint(trial, "checkpoint_2026-12-03_10-00-01.000", run_id, epoch=2)
    checkpoint(trial, "checkpoint_2026-12-03_10-00-02.000", run_id, epoch=4)
    cut_short = trial / "checkpoint_2026-12-03_10-00-03.000"  # being written when the job stopped
    cut_short.mkdir()
    (cut_short / HISTORY_FILE).write_text('{"run_id": "')

    assert backfill_epochs(uri, run_id, str(trial)) == [2, 3, 4]
    client = MlflowClient(uri)
    for key in ("loss", "epoch_time_s"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(e, epoch_metrics(e)[key]) for e in range(5)]
    assert backfill_epochs(uri, run_id, str(trial)) == []  # a second pass finds nothing missing


def test_nothing_is_logged_from_another_runs_checkpoint_or_from_no_checkpoint(run, tmp_path):
    uri, run_id = run
    trial = tmp_path / "trial"
    assert newest_history(str(trial)) is None  # not there at all
    checkpoint(trial, "checkpoint_a", "some-other-run", epoch=6)
    assert backfill_epochs(uri, run_id, str(trial)) == []
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")) == [0, 1]


def test_the_driver_names_the_filled_in_epochs_as_spans():
    from rayapp.driver.submit import _spans

    assert _spans([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"
    assert _spans([3]) == "3"
