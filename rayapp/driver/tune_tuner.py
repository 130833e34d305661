"""The Ray Tune side of a `rayapp tune` sweep: the Tuner (a new sweep, or Tune's restore of an
interrupted one), the sweep that `--resume` continues, and what ASHA needs of the cluster."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rayapp.driver.tune_runs import TrialRunCallback
from rayapp.driver.tune_space import Param, param_space
from rayapp.driver.tune_trial import TAG_TUNE, TAG_TUNE_PATH, TrialPlan, run_trial
from rayapp.errors import RayappError
from rayapp.spec import JobSpec, SpecError

ASHA_REDUCTION_FACTOR = 2
"""Each ASHA rung (after epoch 1, 2, 4, ...) keeps the better half of the trials that reached
it: a sweep of a handful of trials still stops some (Tune's default, 4, keeps a quarter)."""
TRIAL_ACTOR_MEMORY = 256 * 2**20
"""Bytes each trial's Tune actor asks the scheduler for (it drives the trial's training)."""
STATE_API_TIMEOUT_S = 10
STATE_API_WAIT_S = 15.0
"""How long a cluster's State API may take to answer after its head started."""


def build_tuner(
    plan: TrialPlan,
    params: list[Param],
    options: Any,
    path: str,
    callback: TrialRunCallback,
    resume: bool,
):
    """The sweep's Tuner; `options` is the command's TuneOptions."""
    from ray import tune

    # The trial actor takes no CPU: its TorchTrainer's workers hold the cluster's CPUs, and a
    # trial that held one would keep a worker from being placed. Tune needs some resource in a
    # trial's request; the memory the actor does use (torch, Ray Train and MLflow imported).
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, plan=plan), {"CPU": 0, "memory": TRIAL_ACTOR_MEMORY}
    )
    if resume:
        # Tune's own restore: finished trials stay, unfinished and failed ones run again (each in
        # its run, from its Ray Train checkpoint), the scheduler's state as it was.
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True)
    scheduler = None
    if options.scheduler == "asha":
        scheduler = tune.schedulers.ASHAScheduler(
            time_attr="training_iteration",
            # Below the last epoch, and never stopping at it: a trial that reaches its last epoch
            # ends as the job does (its run closed and its model logged by the trial).
            max_t=max(1, plan_epochs(plan) - 1),
            grace_period=1,
            reduction_factor=ASHA_REDUCTION_FACTOR,
            stop_last_trials=False,
        )
    directory = Path(path)
    return tune.Tuner(
        trainable,
        param_space=param_space(params),
        tune_config=tune.TuneConfig(
            metric=options.metric,
            mode=options.mode,
            num_samples=options.samples,
            max_concurrent_trials=options.concurrent,
            scheduler=scheduler,
            # A stopped trial's actor must end, taking its TorchTrainer with it.
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=directory.name,
            storage_path=str(directory.parent),
            callbacks=[callback],
            verbose=0,
        ),
    )


def plan_epochs(plan: TrialPlan) -> int:
    return int(plan.document["train"]["epochs"])


def interrupted_sweep(tracking_uri: str, base: JobSpec) -> tuple[str, str, str]:
    """The newest sweep of this job in its experiment that did not finish: its parent run, its
    Tune directory and its scheduler; a SpecError when there is none."""
    from mlflow.tracking import MlflowClient
    from ray import tune

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(base.tracking.experiment)
    runs = (
        client.search_runs(
            [experiment.experiment_id],
            filter_string=(
                f"tags.`{TAG_TUNE}` = 'true' and params.job = '{base.name}' "
                "and attributes.status != 'FINISHED'"
            ),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if experiment is not None
        else []
    )
    if not runs:
        raise SpecError(
            f"--resume: no unfinished sweep of job {base.name!r} in experiment "
            f"{base.tracking.experiment!r}; leave --resume out to start one"
        )
    run = runs[0]
    path = run.data.tags.get(TAG_TUNE_PATH, "")
    if not path or not tune.Tuner.can_restore(path):
        raise SpecError(
            f"--resume: sweep {run.info.run_id} has no saved state at {path!r} to continue from; "
            "leave --resume out to start a new sweep"
        )
    return run.info.run_id, path, run.data.params.get("scheduler", "fifo")


def check_state_api() -> None:
    """ASHA's stop ends a trial's Tune actor, and Ray Train's controller with it, before the
    controller can release its workers' placement group. Ray Train's placement-group cleaner then
    frees those CPUs, but it learns that the controller died only from Ray's State API (the
    dashboard): on a cluster without one, every stopped trial keeps its CPUs and the next trials
    wait for them for ever. Refuse such a cluster before the sweep starts."""
    import ray
    from ray.util.state import list_nodes

    address = ray.get_runtime_context().gcs_address
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    deadline = time.monotonic() + STATE_API_WAIT_S
    while True:
        try:
            answered = list_nodes(
                address=address, timeout=STATE_API_TIMEOUT_S, raise_on_missing_output=False
            )
            break
        except Exception as exc:  # RayStateApiException, ConnectionError: nothing serves it
            if time.monotonic() < deadline:  # a dashboard that has just started
                time.sleep(1.0)
                continue
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RayappError(_no_state_api(address, cause)) from None
    if not alive <= {node.node_id for node in answered}:
        raise RayappError(
            _no_state_api(address, "the State API that answered is another cluster's")
        )


def _no_state_api(address: str, cause: str) -> str:
    return (
        f"--scheduler asha: the Ray cluster at {address} serves no Ray State API ({cause}); "
        "Ray Train frees the CPUs of a trial ASHA stopped only through it, so later trials would "
        "wait for ever. Start the cluster's head with its dashboard (`ray start --head "
        "--include-dashboard=true`; a warm cluster: `rayapp cluster down`, then `rayapp cluster "
        "up`), or use --scheduler fifo"
    )
