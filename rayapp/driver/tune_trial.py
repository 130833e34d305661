"""One `rayapp tune` trial: a Ray Tune function trainable that runs the job's normal distributed
training (a TorchTrainer of its own, as Ray Train 2 runs under Tune) in a child MLflow run.

It runs in a Tune trial actor, not in the driver: everything it needs comes in a
:class:`TrialPlan`. Each epoch rank 0 reports to Ray Train reaches Tune through Ray Train's
``TuneReportCallback``, so a scheduler (ASHA) can stop the trial after any epoch; the driver then
closes its run and, once the sweep is over, logs the epochs its rank 0 had not sent from its last
checkpoint (:mod:`rayapp.driver.tune_runs`), since a stopped trial's actor is ended with its
training and runs nothing more here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from rayapp.driver.trainer import build_trainer, storage_path, trial_name
from rayapp.driver.tune_space import trial_overrides
from rayapp.spec.loader import build_spec
from rayapp.tracking.run import TAG_CLUSTER, close_run, fallback_path, job_params, open_run
from rayapp.train.config import WorkerConfig

TAG_TUNE = "rayapp.tune"
"""On the parent run of a sweep ("true")."""
TAG_TRIAL_ID = "rayapp.tune.trial_id"
"""On each trial's child run: Ray Tune's trial id, by which a resumed trial finds its run."""
TAG_TUNE_PATH = "rayapp.tune.path"
"""On the parent run: the Tune experiment's directory, which `--resume` restores."""
TAG_STOPPED_BY = "rayapp.tune.stopped_by"
"""On a trial's run that the scheduler stopped early: the scheduler (asha)."""


@dataclass(frozen=True)
class TrialPlan:
    """What every trial shares, handed to each Tune trial actor."""

    document: dict[str, Any]
    """The job as resolved from its YAML and the command's flags (a job document)."""
    fields: list[str]
    """The tuned field paths: the keys of each trial's config."""
    backend: str
    tracking_uri: str
    parent_run_id: str
    cluster_label: str
    tags: dict[str, str]
    """Tags every trial's run carries (versions, job file, git sha)."""
    messages: Any
    """The driver's progress queue (a ray.util.queue.Queue): rank 0's warnings reach the
    terminal by it, as a submitted job's do."""
    ray_train_env: dict[str, str]
    """The driver's Ray Train settings (controller polling, ...): Ray Train takes them from the
    process that calls fit(), here the trial actor."""
    mlflow_credentials: dict[str, str] = field(default_factory=dict, repr=False)


def trial_spec(plan: TrialPlan, config: dict[str, Any]):
    """The job as this trial runs it: the shared job with the trial's sampled values."""
    return build_spec(plan.document, trial_overrides(config, plan.fields))


def run_trial(config: dict[str, Any], plan: TrialPlan) -> None:
    """Train the job with this trial's values, in the trial's MLflow run (opened, or on resume
    reopened, here), and close the run when training ends."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    for name, value in plan.ray_train_env.items():
        os.environ.setdefault(name, value)
    started_at = time.time()
    spec = trial_spec(plan, config)
    trial_id = tune.get_context().get_trial_id()
    run_id = _trial_run(plan, spec, trial_id, config)
    trainer = build_trainer(
        spec,
        plan.backend,
        WorkerConfig(
            spec=spec,
            run_id=run_id,
            tracking_uri=plan.tracking_uri,
            # The trial's own start: its time to first step is its own, not the sweep's.
            submitted_at=started_at,
            cluster_ready_at=started_at,
            fallback_path=fallback_path(
                storage_path(spec.cluster.storage_path), trial_name(spec, run_id), run_id
            ),
            mlflow_credentials=plan.mlflow_credentials,
            progress=plan.messages,
        ),
        callbacks=[TuneReportCallback()],
    )
    try:
        trainer.fit()
    except BaseException:
        # A trial the scheduler stopped ends here too (its training torn down with it), after
        # the driver closed its run as stopped early: only a run still open failed.
        if _run_status(plan.tracking_uri, run_id) == "RUNNING":
            close_run(plan.tracking_uri, run_id, "FAILED")
        raise
    close_run(plan.tracking_uri, run_id, "FINISHED")


def _run_status(tracking_uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return str(MlflowClient(tracking_uri).get_run(run_id).info.status)


def _trial_run(plan: TrialPlan, spec: Any, trial_id: str, config: dict[str, Any]) -> str:
    """The trial's child run: the one an interrupted sweep left (reopened; Ray Train resumes it
    from its last checkpoint, as the run's name is the same), else a new one."""
    from mlflow.tracking import MlflowClient

    existing = find_trial_run(plan.tracking_uri, plan.parent_run_id, trial_id)
    if existing is not None:
        MlflowClient(plan.tracking_uri).update_run(existing, status="RUNNING")
        return existing
    values = trial_overrides(config, plan.fields)
    return open_run(
        tracking_uri=plan.tracking_uri,
        experiment=spec.tracking.experiment,
        run_name=f"{spec.name}-{trial_id}",
        params={
            **job_params(spec, plan.backend),
            **{f"tune.{k}": str(v) for k, v in values.items()},
        },
        tags={TAG_CLUSTER: plan.cluster_label, TAG_TRIAL_ID: trial_id, **plan.tags},
        parent_run_id=plan.parent_run_id,
    )


def find_trial_run(tracking_uri: str, parent_run_id: str, trial_id: str) -> str | None:
    """The child run of `parent_run_id` that trial `trial_id` trains in, if it has one."""
    runs = trial_runs(tracking_uri, parent_run_id)
    return next((r.info.run_id for r in runs if r.data.tags.get(TAG_TRIAL_ID) == trial_id), None)


def trial_runs(tracking_uri: str, parent_run_id: str) -> list:
    """Every trial run of the sweep, oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    return list(
        client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
            order_by=["attributes.start_time ASC"],
            max_results=10_000,
        )
    )
