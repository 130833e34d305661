"""After an interrupted sweep, which trial runs end KILLED (and so are reopened by `--resume`): the
ones still RUNNING, and the ones a trial marked FAILED as Tune's stop tore it down, after the
interruption. A trial that failed before it stays FAILED. A real MLflow store (SQLite)."""

from __future__ import annotations

import time

from mlflow.tracking import MlflowClient

from rayapp.driver.tune_runs import mark_interrupted


def test_runs_stopped_by_the_interruption_end_killed_and_earlier_failures_stay(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweep")
    parent = client.create_run(experiment).info.run_id

    def trial() -> str:
        tags = {"mlflow.parentRunId": parent}
        return client.create_run(experiment, tags=tags).info.run_id

    failed_before, finished, running, failed_by_stop = trial(), trial(), trial(), trial()
    client.set_terminated(failed_before, "FAILED")
    client.set_terminated(finished, "FINISHED")
    time.sleep(0.01)
    interrupted_at_ms = int(time.time() * 1000)
    client.set_terminated(failed_by_stop, "FAILED")  # the trial's own end, torn down by Tune

    mark_interrupted(uri, parent, interrupted_at_ms)

    status = {run: client.get_run(run).info.status for run in (parent, *[
        failed_before, finished, running, failed_by_stop])}  # fmt: skip
    assert status == {
        parent: "KILLED",
        failed_before: "FAILED",
        finished: "FINISHED",
        running: "KILLED",
        failed_by_stop: "KILLED",
    }


def test_without_an_interruption_time_only_running_runs_are_killed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweep")
    parent = client.create_run(experiment).info.run_id
    failed = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    client.set_terminated(failed, "FAILED")

    mark_interrupted(uri, parent)

    assert client.get_run(failed).info.status == "FAILED"
    assert client.get_run(parent).info.status == "KILLED"
