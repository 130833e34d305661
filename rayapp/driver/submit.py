"""The driver: connect to (or start) a Ray cluster, open the MLflow run, build the TorchTrainer,
fit.

The driver only builds Ray Train objects and watches; the training itself is in
:mod:`rayapp.train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tenacity

from rayapp.driver.session import ProgressCallback, progress_pump, ray_cluster
from rayapp.driver.signals import raise_on_termination
from rayapp.driver.trainer import build_trainer, storage_path, trial_name
from rayapp.driver.watchdog import explain_collective_timeout, hang_watch, heartbeat_settings
from rayapp.errors import RayappError, cause_line
from rayapp.launch import working_dir
from rayapp.launch.doctor import preflight
from rayapp.launch.node_check import check_nodes
from rayapp.launch.preflight import check_capacity, check_precision, resolve_backend
from rayapp.spec import JobSpec, SpecError
from rayapp.tracking.run import (
    TAG_CLUSTER,
    check_tracking_access,
    close_run,
    credentials_from_env,
    environment_tags,
    fallback_path,
    job_params,
    log_run_metrics,
    open_run,
    resolve_tracking_uri,
)
from rayapp.train.config import WorkerConfig

CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
CONTROLLER_POLL_S = "0.2"


@dataclass(frozen=True)
class SubmitResult:
    run_id: str
    experiment: str
    tracking_uri: str
    backend: str
    wall_time_s: float
    final_metrics: dict


@dataclass(frozen=True, kw_only=True)
class SubmitOptions:
    job_file: str | None = None
    """Recorded as a tag, with the git sha of its directory."""
    parent_run_id: str | None = None
    """Nest this run under a sweep's parent run."""
    schedule_timeout_s: float = 0.0
    """How long to wait for the cluster to grow to the requested size before failing."""
    verbose: bool = False
    """Forward worker and Ray Train logs to this terminal."""
    on_progress: ProgressCallback | None = None
    """Called in a background thread with each epoch's metrics from rank 0."""
    on_status: Callable[[str], None] | None = None
    """Called with short status lines (cluster starting, workers scheduled...)."""
    preflight: bool = False
    """Check every node (versions, GPUs, storage path, MLflow) before training; `rayapp doctor
    --quick`."""


def submit(spec: JobSpec, options: SubmitOptions = SubmitOptions()) -> SubmitResult:
    """Run one training job to completion and return where its MLflow run is."""
    import ray

    submitted_at = time.time()
    raise_on_termination()
    status = options.on_status or (lambda _: None)
    # Ray Train's controller takes one reported result per poll, every 2 s by default, and a worker
    # that reports again blocks until then: every epoch shorter than 2 s was stretched to 2 s
    # (measured: 2.01 s wall per 0.6 s epoch; 0.62 s at 0.2 s polling). Ray passes this variable
    # on to the controller; a value the user set wins.
    os.environ.setdefault(CONTROLLER_POLL_ENV, CONTROLLER_POLL_S)
    tracking_uri = resolve_tracking_uri(spec.tracking.tracking_uri)
    check_tracking_access(
        tracking_uri
    )  # a refused password fails here, not after the cluster started
    spec, job_env = prepare_user_code(spec, options.job_file, status)
    run_id: str | None = None
    fallback: str | None = None
    outcome = "FAILED"
    try:
        with ray_cluster(
            spec, verbose=options.verbose, status=status, runtime_env=job_env
        ) as cluster:
            cluster_ready_at = time.time()
            check_capacity(spec, wait_s=options.schedule_timeout_s)
            backend = resolve_backend(
                spec.cluster.backend, gpus_in_cluster=ray.cluster_resources().get("GPU", 0)
            )
            check_precision(spec, backend)
            if options.preflight:
                preflight(
                    storage_path(spec.cluster.storage_path),
                    tracking_uri,
                    credentials=credentials_from_env(),
                    on_status=status,
                )
            if spec.cluster.address:  # a real cluster, whose nodes may be other machines
                status("checking from every node: storage path, MLflow, packages")
                check_nodes(
                    storage_path(spec.cluster.storage_path),
                    tracking_uri,
                    credentials=credentials_from_env(),
                )
            run_id = open_run(
                tracking_uri=tracking_uri,
                experiment=spec.tracking.experiment,
                run_name=f"{spec.name}-n{spec.cluster.nodes}",
                params=job_params(spec, backend),
                tags={TAG_CLUSTER: cluster.label, **environment_tags(options.job_file)},
                parent_run_id=options.parent_run_id,
            )
            log_run_metrics(
                tracking_uri, run_id, {"startup_cluster_s": cluster_ready_at - submitted_at}
            )
            fallback = fallback_path(
                storage_path(spec.cluster.storage_path), trial_name(spec, run_id), run_id
            )
            watch = None
            try:
                with (
                    progress_pump(options.on_progress) as progress_queue,
                    hang_watch(
                        spec, tracking_uri=tracking_uri, run_id=run_id, status=status
                    ) as watch,
                ):
                    status(
                        f"training on {spec.world_size} worker(s) across {spec.cluster.nodes} "
                        f"node(s), backend {backend}"
                    )
                    trainer = build_trainer(
                        spec,
                        backend,
                        WorkerConfig(
                            spec=spec,
                            run_id=run_id,
                            tracking_uri=tracking_uri,
                            submitted_at=submitted_at,
                            cluster_ready_at=cluster_ready_at,
                            fallback_path=fallback,
                            progress=progress_queue,
                            mlflow_credentials=credentials_from_env(),
                            **heartbeat_settings(watch),
                        ),
                    )
                    result = _fit_interruptibly(trainer)
                outcome = "FINISHED"
                _log_goodput(tracking_uri, run_id, submitted_at, status)
            except KeyboardInterrupt:
                outcome = "KILLED"
                # Marked now, while Ray is still up: fit() goes on in its thread, and its first
                # call into Ray after ray.shutdown() makes Ray end this process on the spot, which
                # can come before the close in `finally` (a stopped job's run stayed RUNNING).
                _mark_ended_quickly(tracking_uri, run_id, outcome)
                raise
            except Exception as exc:
                lost = cluster.lost_nodes()
                cause = (
                    f"node {', '.join(lost)} was lost ({cause_line(exc)})"
                    if lost
                    else explain_collective_timeout(cause_line(exc), spec)
                )
                hang = watch.failure_line() if watch is not None else None
                cause = hang or cause
                raise RayappError(
                    f"training failed: {cause} (MLflow run {run_id} marked FAILED)"
                ) from exc
    finally:
        # Only now, with the workers gone: none of them can still be writing the epochs filled in
        # here.
        if run_id is not None and fallback is not None:
            if outcome != "FINISHED":
                _backfill_from_checkpoint(spec, tracking_uri, run_id, status)
            _close_run_or_save(tracking_uri, run_id, outcome, fallback, status)
    return SubmitResult(
        run_id=run_id,
        experiment=spec.tracking.experiment,
        tracking_uri=tracking_uri,
        backend=backend,
        wall_time_s=time.time() - submitted_at,
        final_metrics=dict(result.metrics or {}),
    )


def prepare_user_code(
    spec: JobSpec, job_file: str | None, status: Callable[[str], None]
) -> tuple[JobSpec, dict | None]:
    """Check the user's code the job names and plan its upload, before any cluster starts.

    Returns the spec as the workers run it (a script's path relative to the working dir they
    start in) and the job's Ray runtime_env (None when no code of the user's travels)."""
    from rayapp.train.user_code import check_user_code

    code_dir = working_dir.code_directory(spec, job_file)
    if spec.train.script is not None:
        script = _script_path(spec.train.script, job_file)
        if code_dir is None or not script.is_relative_to(code_dir):
            raise SpecError(
                f"train.script: {spec.train.script!r} is outside the "
                f"working directory {str(code_dir)!r} that travels to the "
                "workers; pass --working-dir with a directory that holds it"
            )
        spec = dataclasses.replace(
            spec,
            train=dataclasses.replace(spec.train, script=script.relative_to(code_dir).as_posix()),
        )
    check_user_code(spec, code_dir)
    if code_dir is None:
        return spec, None
    if working_dir.came_with_the_ray_job():
        status(f"your code came with the Ray job, in {code_dir}")
        return spec, None
    upload = working_dir.plan(code_dir)
    for relative, size in upload.large_files:
        status(
            f"left out of the code upload: {relative} "
            f"({size / 2**20:.0f} MiB; put data in shared storage)"
        )
    status(
        f"your code travels to the workers from {upload.path} "
        f"({upload.total_bytes / 2**10:.0f} KiB)"
    )
    return spec, upload.runtime_env()


def _script_path(script: str, job_file: str | None) -> Path:
    """The script as given (--script: relative to the current directory), else, for a job file's
    train.script, relative to that file's directory."""
    candidates = [Path(script).expanduser()]
    if job_file and not candidates[0].is_absolute():
        candidates.append(Path(job_file).parent / script)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise SpecError(
        f"train.script: {script!r} does not exist; pass the path of a Python training script "
        "(--script: relative to the current directory; in a job file: to the file's directory)"
    )


def _fit_interruptibly(trainer):
    """trainer.fit() in a helper thread, so Ctrl-C reaches this driver as KeyboardInterrupt.

    In the main thread, Ray Train installs its own SIGINT handler, which exits the process
    from inside fit(); the driver could then neither mark the MLflow run KILLED nor stop the
    cluster. From a helper thread fit() installs none; on Ctrl-C the caller's cleanup runs and
    ray.shutdown() takes the controller and workers down with the driver.
    """
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="rayapp-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _log_goodput(
    tracking_uri: str, run_id: str, submitted_at: float, status: Callable[[str], None]
) -> None:
    """The run's wall time, from submission until training ended, and where it went: the parts
    rank 0 logged at the end (rayapp.train.goodput), the rest as goodput_other_s, and goodput."""
    from mlflow.tracking import MlflowClient

    from rayapp.tracking.goodput import MEASURED_PARTS, breakdown

    run_wall_s = time.time() - submitted_at
    try:
        logged = MlflowClient(tracking_uri).get_run(run_id).data.metrics
        if not any(name in logged for name in MEASURED_PARTS):
            return  # a loop that trained no epochs through rayapp (a script) measured none
        log_run_metrics(tracking_uri, run_id, breakdown(run_wall_s, logged))
    except Exception as exc:  # MLflow unreachable: the run's own metrics are already saved
        status(f"could not log the run's goodput to MLflow ({type(exc).__name__})")


def _backfill_from_checkpoint(
    spec: JobSpec, tracking_uri: str, run_id: str, status: Callable[[str], None]
) -> None:
    """Log the epochs rank 0 checkpointed but did not get to send before the job ended."""
    from rayapp.tracking.backfill import backfill_epochs

    trial_dir = f"{storage_path(spec.cluster.storage_path).rstrip('/')}/{trial_name(spec, run_id)}"
    try:
        epochs = backfill_epochs(tracking_uri, run_id, trial_dir)
    except Exception as exc:  # MLflow unreachable: the checkpoints still hold the figures
        status(
            "could not log the last checkpoint's epochs to MLflow "
            f"({type(exc).__name__}); they stay in {trial_dir}"
        )
        return
    if epochs:
        status(
            f"logged epoch(s) {_spans(epochs)} to MLflow from the last checkpoint: "
            "they had not been sent when the job stopped"
        )


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'"""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _mark_ended_quickly(tracking_uri: str, run_id: str, outcome: str) -> None:
    """One short try at the run's end status; `finally` tries again, with retries and the fallback
    file, once the workers are gone."""
    from rayapp.tracking.outbox import CLIENT_ENV

    os.environ.update(CLIENT_ENV)  # seconds, not MLflow's minutes of retries
    with contextlib.suppress(Exception):
        close_run(tracking_uri, run_id, outcome)


def _close_run_or_save(
    tracking_uri: str, run_id: str, outcome: str, fallback: str, status: Callable[[str], None]
) -> None:
    """Mark the run's end; if the server is gone, keep the status with the other undelivered
    records."""
    from rayapp.tracking.outbox import CLIENT_ENV, Record, append_fallback

    os.environ.update(CLIENT_ENV)  # fail each try in seconds; the retries are here
    try:
        tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3),
            wait=tenacity.wait_chain(tenacity.wait_fixed(2), tenacity.wait_fixed(5)),
            reraise=True,
        )(close_run, tracking_uri, run_id, outcome)
        return
    except Exception:  # the server stayed away through the tries: keep the status for later
        pass
    append_fallback(Path(fallback), [Record("status", run_id, values={"status": outcome})])
    status(
        f"MLflow is unreachable: run {run_id} could not be marked {outcome}; saved to {fallback}. "
        f"Deliver later with: rayapp import-metrics {fallback} --tracking-uri {tracking_uri}"
    )
