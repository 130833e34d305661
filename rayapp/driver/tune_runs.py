"""The MLflow side of a sweep that Ray Tune drives: a Tune callback that follows each trial's run
from the driver, and the best trial's tags on the parent run.

The callback is pickled with the sweep's state for `--resume`, so it holds plain data only and
speaks through the ``rayapp.tune`` logger, whose lines the command shows.
"""

from __future__ import annotations

import json
import logging
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from ray.tune import Callback

from rayapp.driver.trainer import storage_path, trial_name
from rayapp.driver.tune_trial import TAG_STOPPED_BY, find_trial_run, trial_runs
from rayapp.spec import JobSpec
from rayapp.spec.loader import spec_document
from rayapp.spec.overrides import OVERRIDES
from rayapp.tracking.backfill import backfill_epochs
from rayapp.tracking.run import TAG_EARLY_STOPPED, close_run

LOG = logging.getLogger("rayapp.tune")
TAG_STOPPED_AFTER = "rayapp.tune.stopped_after_epoch"
"""On an early-stopped trial's run: the last epoch (1-based) the scheduler saw."""
TAG_BEST = "rayapp.tune.best"
TAG_BEST_RUN = "rayapp.tune.best_run_id"
TAG_BEST_TRIAL = "rayapp.tune.best_trial_id"
TAG_BEST_CONFIG = "rayapp.tune.best_config"
TAG_BEST_SUBMIT = "rayapp.tune.best_submit"
BEST_JOB_ARTIFACT = "best_job.yaml"
FLAG_OF_FIELD = {row.field: row.flag for row in OVERRIDES}


class TrialRunCallback(Callback):
    """Closes the run of a trial the scheduler stopped early (its actor ended with its training,
    so nothing in the trial can) and tells the terminal each trial's epochs."""

    def __init__(
        self, *, tracking_uri: str, parent_run_id: str, metric: str, epochs: int, scheduler: str
    ) -> None:
        self.tracking_uri = tracking_uri
        self.parent_run_id = parent_run_id
        self.metric = metric
        self.epochs = epochs
        self.scheduler = scheduler

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        value = result.get(self.metric)
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "-"
        LOG.info(
            "trial %s epoch %s/%s  %s %s  (%s)",
            trial.trial_id,
            int(result.get("epoch", -1)) + 1,
            self.epochs,
            self.metric,
            shown,
            describe_config(trial.config),
        )

    def on_trial_complete(self, iteration: int, trials: list, trial, **info: Any) -> None:
        run_id = find_trial_run(self.tracking_uri, self.parent_run_id, trial.trial_id)
        if run_id is None:
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        epoch = int((trial.last_result or {}).get("epoch", -1)) + 1
        if client.get_run(run_id).info.status != "RUNNING":
            # The trial ran to its end and closed its run itself.
            LOG.info("trial %s finished after epoch %s/%s", trial.trial_id, epoch, self.epochs)
            return
        client.set_tag(run_id, TAG_EARLY_STOPPED, "true")
        client.set_tag(run_id, TAG_STOPPED_BY, self.scheduler)
        client.set_tag(run_id, TAG_STOPPED_AFTER, str(epoch))
        # FINISHED, as a loop that stops itself early (ctx.stop()) ends: the run is complete
        # up to the epoch it stopped at; the tags say it stopped.
        close_run(self.tracking_uri, run_id, "FINISHED")
        LOG.info(
            "trial %s stopped early by %s after epoch %s/%s",
            trial.trial_id,
            self.scheduler,
            epoch,
            self.epochs,
        )

    def on_trial_error(self, iteration: int, trials: list, trial, **info: Any) -> None:
        LOG.info("trial %s failed: %s", trial.trial_id, _first_line(trial.error_file))


def _first_line(error_file: str | None) -> str:
    """The exception's last line from Tune's error file (its traceback), for one terminal line."""
    if not error_file:
        return "see the trial's logs"
    try:
        with open(error_file, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return error_file
    return lines[-1] if lines else error_file


def describe_config(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={_short(value)}" for key, value in config.items())


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def mark_interrupted(
    tracking_uri: str, parent_run_id: str, interrupted_at_ms: int | None = None
) -> None:
    """Every trial run still RUNNING, and the parent, KILLED: `--resume` reopens them.

    A trial that Tune's stop tore down marks its own run FAILED as it ends, and may do so before
    this runs; a run FAILED at or after the interruption (`interrupted_at_ms`) was stopped by it,
    and is KILLED too."""
    for run in trial_runs(tracking_uri, parent_run_id):
        stopped_by_interrupt = (
            run.info.status == "FAILED"
            and interrupted_at_ms is not None
            and (run.info.end_time or 0) >= interrupted_at_ms
        )
        if run.info.status == "RUNNING" or stopped_by_interrupt:
            close_run(tracking_uri, run.info.run_id, "KILLED")
    close_run(tracking_uri, parent_run_id, "KILLED")


def backfill_trials(tracking_uri: str, parent_run_id: str, spec: JobSpec) -> None:
    """Each trial run's epochs that its rank 0 trained but never sent, from the trial's newest
    Ray Train checkpoint.

    rank 0 sends its epochs from a paced background thread; a trial that Tune stopped (ASHA, or
    Ctrl-C) was killed with its workers, usually before any of its epochs had gone out. Call it
    once the sweep's trial actors are gone: no worker can then be sending what is filled in."""
    root = storage_path(spec.cluster.storage_path).rstrip("/")
    for run in trial_runs(tracking_uri, parent_run_id):
        run_id = run.info.run_id
        try:
            epochs = backfill_epochs(tracking_uri, run_id, f"{root}/{trial_name(spec, run_id)}")
        except Exception as exc:  # MLflow unreachable: the checkpoints still hold the figures
            LOG.info(
                "trial run %s: its checkpointed epochs could not be logged (%s)",
                run_id,
                type(exc).__name__,
            )
            continue
        if epochs:
            LOG.debug("trial run %s: epochs %s logged from its checkpoint", run_id, epochs)


def tag_best(
    tracking_uri: str,
    parent_run_id: str,
    *,
    run_id: str,
    trial_id: str,
    config: Mapping[str, Any],
    metric: str,
    value: float,
    submit_line: str,
) -> None:
    """The best trial named on the parent (its run, trial, config and how to train it again) and
    marked on its own run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    client.set_tag(parent_run_id, TAG_BEST_RUN, run_id)
    client.set_tag(parent_run_id, TAG_BEST_TRIAL, trial_id)
    client.set_tag(parent_run_id, TAG_BEST_CONFIG, json.dumps(dict(config), sort_keys=True))
    client.set_tag(parent_run_id, TAG_BEST_SUBMIT, submit_line)
    client.log_metric(parent_run_id, f"best_{metric}", float(value))
    client.set_tag(run_id, TAG_BEST, "true")


def best_submit_line(
    best_spec: JobSpec,
    config: Mapping[str, Any],
    *,
    flag_overrides: Mapping[str, Any],
    job_file: str | None,
    tracking_uri: str,
    parent: str,
) -> str:
    """`rayapp submit` of the best configuration: the job file with flags when every value has
    one, else a job file written with the values (beside the job's, so its code still imports),
    which is also logged on the parent as best_job.yaml."""
    from mlflow.tracking import MlflowClient

    document = spec_document(best_spec)
    with tempfile.TemporaryDirectory() as directory:
        best_yaml = Path(directory) / BEST_JOB_ARTIFACT
        best_yaml.write_text(yaml.safe_dump(document, sort_keys=False))
        MlflowClient(tracking_uri).log_artifact(parent, str(best_yaml))
    values = {
        **{k: v for k, v in flag_overrides.items() if v is not None},
        "cluster.nodes": best_spec.cluster.nodes,
        **config,
    }
    if job_file and all(name in FLAG_OF_FIELD for name in values):
        words = ["rayapp", "submit", job_file]
        for name, value in values.items():
            words += [FLAG_OF_FIELD[name], _flag_text(value)]
        return shlex.join(words)
    folder = Path(job_file).parent if job_file else Path.cwd()
    path = folder / f"{best_spec.name}-best-{parent[:8]}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return shlex.join(["rayapp", "submit", str(path)])


def _flag_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
