"""`rayapp tune`: a hyperparameter search on Ray Tune, each trial the job's distributed training.

One MLflow parent run holds the sweep; every trial trains in a child run of it
(:mod:`rayapp.driver.tune_trial`). Trials run side by side on the cluster, at most `concurrent`
at a time, each on `nodes_per_trial` nodes; with ``scheduler="asha"`` Ray Tune's ASHA stops weak
trials between epochs. The best trial is tagged on the parent, with a `rayapp submit` line that
trains its configuration again. An interrupted sweep is continued by Tune's own restore
(`resume=True`), each unfinished trial in its own run, from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayapp.driver.session import progress_pump, ray_cluster
from rayapp.driver.signals import raise_on_termination
from rayapp.driver.submit import CONTROLLER_POLL_ENV, CONTROLLER_POLL_S, prepare_user_code
from rayapp.driver.trainer import storage_path
from rayapp.driver.tune_runs import (
    TrialRunCallback,
    backfill_trials,
    best_submit_line,
    mark_interrupted,
    tag_best,
)
from rayapp.driver.tune_signals import SweepInterrupts, sweep_interrupts
from rayapp.driver.tune_space import Param, check_params
from rayapp.driver.tune_trial import (
    TAG_STOPPED_BY,
    TAG_TUNE,
    TAG_TUNE_PATH,
    TrialPlan,
    find_trial_run,
    trial_runs,
)
from rayapp.driver.tune_tuner import build_tuner, check_state_api, interrupted_sweep
from rayapp.errors import RayappError
from rayapp.launch.preflight import check_capacity, check_precision, resolve_backend
from rayapp.spec import JobSpec, SpecError
from rayapp.spec.loader import build_spec, spec_document
from rayapp.tracking.run import (
    check_tracking_access,
    close_run,
    credentials_from_env,
    environment_tags,
    open_run,
    resolve_tracking_uri,
)

SCHEDULERS = ("fifo", "asha")
MODES = ("max", "min")


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    metric: str
    mode: str = "max"
    samples: int = 1
    """Trials drawn from the spaces (with grid spaces: per grid point, as Ray Tune counts)."""
    scheduler: str = "fifo"
    nodes_per_trial: int = 1
    concurrent: int = 1
    """Trials training at the same time; an embedded cluster gets nodes_per_trial x concurrent
    nodes."""
    resume: bool = False
    job_file: str | None = None
    flag_overrides: Mapping[str, Any] = field(default_factory=dict)
    """The command's own spec overrides (``train.epochs``: 3), repeated in the submit line."""
    verbose: bool = False
    on_status: Callable[[str], None] = lambda line: None


@dataclass(frozen=True)
class TuneResult:
    parent_run_id: str
    tracking_uri: str
    best_run_id: str
    best_config: dict[str, Any]
    best_value: float
    submit_line: str
    trials: int
    stopped_early: int


def check_options(base: JobSpec, params: list[Param], options: TuneOptions) -> None:
    """Everything about the sweep that can be wrong, as one SpecError line before anything
    starts."""
    if not params:
        raise SpecError("--param: give at least one, e.g. --param train.lr='loguniform(1e-4,1e-1)'")
    for name, value in (
        ("--samples", options.samples),
        ("--nodes-per-trial", options.nodes_per_trial),
        ("--concurrent", options.concurrent),
    ):
        if value < 1:
            raise SpecError(f"{name}: {value} is not accepted; use a whole number >= 1")
    if options.mode not in MODES:
        raise SpecError(f"--mode: {options.mode!r} is not accepted; use max or min")
    if options.scheduler not in SCHEDULERS:
        raise SpecError(f"--scheduler: {options.scheduler!r} is not accepted; use fifo or asha")
    if not options.metric.strip():
        raise SpecError(
            "--metric: empty; name a metric the job logs each epoch, e.g. test_accuracy"
        )
    if options.scheduler == "asha" and base.train.epochs < 2:
        raise SpecError(
            f"--scheduler asha: train.epochs is {base.train.epochs}; ASHA stops trials between "
            "epochs, so give --epochs 2 or more (or --scheduler fifo)"
        )
    address = base.cluster.address or ""
    if address.startswith(("http://", "https://")):
        raise SpecError(
            f"--address: {address!r} is a Ray Jobs API address; rayapp tune drives its trials "
            "from this machine, so give the cluster's Ray address (HOST:6379)"
        )
    document = spec_document(base)
    check_params(params, lambda values: build_spec(document, values))


def run_tune(base: JobSpec, params: list[Param], options: TuneOptions) -> TuneResult:
    """Run the sweep to its end and return the best trial. When a signal interrupts it, Tune
    saves it (to be continued with resume=True), its runs end KILLED, and KeyboardInterrupt
    (Ctrl-C) or Terminated (SIGTERM, SIGHUP) is raised."""
    check_options(base, params, options)
    raise_on_termination()
    status = options.on_status
    os.environ.setdefault(CONTROLLER_POLL_ENV, CONTROLLER_POLL_S)
    # Tune's legacy reporter, which verbose=0 silences (its newer one prints a header and a
    # table per failed trial at any verbosity): the command prints each trial's epochs itself.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    tracking_uri = resolve_tracking_uri(base.tracking.tracking_uri)
    check_tracking_access(tracking_uri)
    base, job_env = prepare_user_code(base, options.job_file, status)
    trial_base = _with_nodes(base, options.nodes_per_trial)
    resumed = interrupted_sweep(tracking_uri, base) if options.resume else None
    sweep = _Sweep(parent=resumed[0] if resumed else None)
    try:
        results = _run_sweep(
            sweep, base, trial_base, params, options, tracking_uri, resumed, job_env
        )
    except BaseException:
        # The cluster is down or the driver gone from it: no trial can still be sending epochs.
        if sweep.parent is not None:
            backfill_trials(tracking_uri, sweep.parent, trial_base)
            mark_interrupted(tracking_uri, sweep.parent, sweep.interrupts.at_ms)
        raise
    assert sweep.parent is not None and sweep.plan is not None
    backfill_trials(tracking_uri, sweep.parent, trial_base)
    if sweep.interrupts.interrupted:
        mark_interrupted(tracking_uri, sweep.parent, sweep.interrupts.at_ms)
        status(f"sweep interrupted; continue it with the same command and --resume ({sweep.path})")
        sweep.interrupts.raise_interrupt()
    try:
        result = _finish(tracking_uri, sweep.parent, results, sweep.plan, options)
    except BaseException:
        close_run(tracking_uri, sweep.parent, "FAILED")
        raise
    close_run(tracking_uri, sweep.parent, "FINISHED")
    return result


@dataclass
class _Sweep:
    """What the sweep's clean-up needs of it, filled in as it starts."""

    parent: str | None
    path: str = ""
    plan: TrialPlan | None = None
    interrupts: SweepInterrupts = field(default_factory=SweepInterrupts)


def _run_sweep(
    sweep: _Sweep,
    base: JobSpec,
    trial_base: JobSpec,
    params: list[Param],
    options: TuneOptions,
    tracking_uri: str,
    resumed: tuple[str, str, str] | None,
    job_env: dict | None,
) -> Any:
    """The sweep on its cluster, from start (or Tune's restore) to Tune's end of it; the cluster
    is stopped (or the driver disconnected from it) on return."""
    import ray
    from mlflow.tracking import MlflowClient

    status = options.on_status
    scheduler = resumed[2] if resumed else options.scheduler
    cluster_spec = _with_nodes(base, options.nodes_per_trial * options.concurrent)
    with ray_cluster(
        cluster_spec,
        verbose=options.verbose,
        status=status,
        runtime_env=job_env,
        state_api=scheduler == "asha",
    ) as cluster:
        check_capacity(trial_base)
        if scheduler == "asha":
            check_state_api()
        backend = resolve_backend(
            base.cluster.backend, gpus_in_cluster=ray.cluster_resources().get("GPU", 0)
        )
        check_precision(base, backend)
        if resumed is None:
            sweep.parent = _open_parent(tracking_uri, trial_base, params, options)
            sweep.path = (
                f"{storage_path(base.cluster.storage_path)}/tune-{base.name}-{sweep.parent[:8]}"
            )
            MlflowClient(tracking_uri).set_tag(sweep.parent, TAG_TUNE_PATH, sweep.path)
        else:
            sweep.parent, sweep.path = resumed[0], resumed[1]
            MlflowClient(tracking_uri).update_run(sweep.parent, status="RUNNING")
            status(f"resuming sweep {sweep.parent} from {sweep.path}")
        # Rank 0's warnings (a model that could not be logged, ...); Tune reports the epochs.
        with (
            progress_pump(lambda item: _show_message(item, status)) as messages,
            sweep_interrupts() as sweep.interrupts,
        ):
            sweep.plan = TrialPlan(
                document=spec_document(trial_base),
                fields=[param.field for param in params],
                backend=backend,
                tracking_uri=tracking_uri,
                parent_run_id=sweep.parent,
                cluster_label=cluster.label,
                tags=environment_tags(options.job_file),
                messages=messages,
                ray_train_env={k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")},
                mlflow_credentials=credentials_from_env(),
            )
            # On resume Tune restores the sweep's own callback with the rest of its state.
            callback = TrialRunCallback(
                tracking_uri=tracking_uri,
                parent_run_id=sweep.parent,
                metric=options.metric,
                epochs=base.train.epochs,
                scheduler=scheduler,
            )
            tuner = build_tuner(sweep.plan, params, options, sweep.path, callback, bool(resumed))
            with sweep.interrupts.fit():
                return tuner.fit()


def _show_message(item: dict, status: Callable[[str], None]) -> None:
    if "message" in item:
        status(f"warning: {item['message']}")


def _with_nodes(spec: JobSpec, nodes: int) -> JobSpec:
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, nodes=nodes))


def _open_parent(
    tracking_uri: str, trial_base: JobSpec, params: list[Param], options: TuneOptions
) -> str:
    return open_run(
        tracking_uri=tracking_uri,
        experiment=trial_base.tracking.experiment,
        run_name=f"tune-{trial_base.name}",
        params={
            "job": trial_base.name,
            "samples": str(options.samples),
            "metric": options.metric,
            "mode": options.mode,
            "scheduler": options.scheduler,
            "nodes_per_trial": str(options.nodes_per_trial),
            "concurrent": str(options.concurrent),
            "epochs": str(trial_base.train.epochs),
            **{f"space.{param.field}": f"{param.kind}{param.values}" for param in params},
        },
        tags={TAG_TUNE: "true", **environment_tags(options.job_file)},
    )


def _finish(
    tracking_uri: str,
    parent: str,
    results: Any,
    plan: TrialPlan,
    options: TuneOptions,
) -> TuneResult:
    """Name the best trial on the parent run and say how to train it again."""
    if results.num_errors == len(results):
        raise RayappError(
            f"every trial failed ({len(results)}); the first: "
            f"{_trial_error(results)} (MLflow parent run {parent})"
        )
    best = results.get_best_result(
        metric=options.metric, mode=options.mode, scope="last", filter_nan_and_inf=True
    )
    if best is None or best.metrics is None or options.metric not in best.metrics:
        raise RayappError(
            f"no trial reported {options.metric!r}; name a metric the job logs each epoch "
            f"(e.g. test_accuracy, test_loss, loss) (MLflow parent run {parent})"
        )
    trial_id = best.metrics["trial_id"]
    run_id = find_trial_run(tracking_uri, parent, trial_id)
    if run_id is None:
        raise RayappError(f"the best trial {trial_id} has no MLflow run under {parent}")
    config = {name: best.config[name] for name in plan.fields}
    best_spec = build_spec(plan.document, config)
    submit_line = best_submit_line(
        best_spec,
        config,
        flag_overrides=options.flag_overrides,
        job_file=options.job_file,
        tracking_uri=tracking_uri,
        parent=parent,
    )
    tag_best(
        tracking_uri,
        parent,
        run_id=run_id,
        trial_id=trial_id,
        config=config,
        metric=options.metric,
        value=best.metrics[options.metric],
        submit_line=submit_line,
    )
    runs = trial_runs(tracking_uri, parent)
    return TuneResult(
        parent_run_id=parent,
        tracking_uri=tracking_uri,
        best_run_id=run_id,
        best_config=config,
        best_value=float(best.metrics[options.metric]),
        submit_line=submit_line,
        trials=len(runs),
        stopped_early=sum(1 for run in runs if run.data.tags.get(TAG_STOPPED_BY)),
    )


def _trial_error(results: Any) -> str:
    errors = [str(error).strip().splitlines() for error in results.errors]
    return next((lines[-1] for lines in errors if lines), "no error recorded")
