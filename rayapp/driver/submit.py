"""The driver: connect to (or start) a Ray cluster, open the MLflow run, build the TorchTrainer, fit.

The driver only builds Ray Train objects and watches; the training itself is in
:mod:`rayapp.worker`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from rayapp.launch.cluster import EmbeddedCluster
from rayapp.errors import RayappError
from rayapp.launch.preflight import check_capacity, resolve_backend
from rayapp.spec import JobSpec
from rayapp.tracking.run import (
    TAG_CLUSTER,
    close_run,
    environment_tags,
    fallback_path,
    job_params,
    open_run,
    resolve_tracking_uri,
)
from rayapp.train.loop import WorkerConfig, train_loop_per_worker

ProgressCallback = Callable[[dict], None]
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
    job_file: Optional[str] = None
    """Recorded as a tag, with the git sha of its directory."""
    parent_run_id: Optional[str] = None
    """Nest this run under a sweep's parent run."""
    schedule_timeout_s: float = 0.0
    """How long to wait for the cluster to grow to the requested size before failing."""
    verbose: bool = False
    """Forward worker and Ray Train logs to this terminal."""
    on_progress: Optional[ProgressCallback] = None
    """Called in a background thread with each epoch's metrics from rank 0."""
    on_status: Optional[Callable[[str], None]] = None
    """Called with short status lines (cluster starting, workers scheduled...)."""


def submit(spec: JobSpec, options: SubmitOptions = SubmitOptions()) -> SubmitResult:
    """Run one training job to completion and return where its MLflow run is."""
    import ray

    submitted_at = time.time()
    status = options.on_status or (lambda _: None)
    # Ray Train's controller takes one reported result per poll, every 2 s by default, and a worker
    # that reports again blocks until then: every epoch shorter than 2 s was stretched to 2 s
    # (measured: 2.01 s wall per 0.6 s epoch; 0.62 s at 0.2 s polling). Ray passes this variable
    # on to the controller; a value the user set wins.
    os.environ.setdefault(CONTROLLER_POLL_ENV, CONTROLLER_POLL_S)
    tracking_uri = resolve_tracking_uri(spec.tracking.tracking_uri)
    run_id: Optional[str] = None
    fallback: Optional[str] = None
    outcome = "FAILED"
    try:
        with _ray_cluster(spec, verbose=options.verbose, status=status) as cluster_label:
            check_capacity(spec, wait_s=options.schedule_timeout_s)
            backend = resolve_backend(spec.cluster.backend, gpus_in_cluster=ray.cluster_resources().get("GPU", 0))
            run_id = open_run(
                tracking_uri=tracking_uri,
                experiment=spec.tracking.experiment,
                run_name=f"{spec.name}-n{spec.cluster.nodes}",
                params=job_params(spec, backend),
                tags={TAG_CLUSTER: cluster_label, **environment_tags(options.job_file)},
                parent_run_id=options.parent_run_id,
            )
            fallback = fallback_path(_storage_path(spec.cluster.storage_path), _trial_name(spec, run_id), run_id)
            try:
                with _progress_pump(options.on_progress) as progress_queue:
                    status(f"training on {spec.world_size} worker(s) across {spec.cluster.nodes} node(s), backend {backend}")
                    trainer = _build_trainer(
                        spec,
                        backend,
                        WorkerConfig(
                            spec=spec,
                            run_id=run_id,
                            tracking_uri=tracking_uri,
                            submitted_at=submitted_at,
                            fallback_path=fallback,
                            progress=progress_queue,
                        ),
                    )
                    result = _fit_interruptibly(trainer)
                outcome = "FINISHED"
            except KeyboardInterrupt:
                outcome = "KILLED"
                raise
            except Exception as exc:
                raise RayappError(f"training failed: {_first_line(exc)} (MLflow run {run_id} marked FAILED)") from exc
    finally:
        # Only now, with the workers gone: none of them can still be writing the epochs filled in here.
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


def _trial_name(spec: JobSpec, run_id: str) -> str:
    """Ray Train's run directory under storage_path: the job and the MLflow run it belongs to."""
    return f"{spec.name}-{run_id[:8]}"


def _backfill_from_checkpoint(spec: JobSpec, tracking_uri: str, run_id: str, status: Callable[[str], None]) -> None:
    """Log the epochs rank 0 checkpointed but did not get to send before the job ended."""
    from rayapp.tracking.backfill import backfill_epochs

    trial_dir = f"{_storage_path(spec.cluster.storage_path).rstrip('/')}/{_trial_name(spec, run_id)}"
    try:
        epochs = backfill_epochs(tracking_uri, run_id, trial_dir)
    except Exception as exc:  # MLflow unreachable: the checkpoints still hold the figures
        status(f"could not log the last checkpoint's epochs to MLflow ({type(exc).__name__}); they stay in {trial_dir}")
        return
    if epochs:
        status(f"logged epoch(s) {_spans(epochs)} to MLflow from the last checkpoint: "
               "they had not been sent when the job stopped")


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'"""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _close_run_or_save(tracking_uri: str, run_id: str, outcome: str, fallback: str, status: Callable[[str], None]) -> None:
    """Mark the run's end; if the server is gone, keep the status with the other undelivered records."""
    from rayapp.tracking.outbox import CLIENT_ENV, Record, append_fallback

    os.environ.update(CLIENT_ENV)  # fail each try in seconds; the retries are here
    for delay in (0, 2, 5):
        time.sleep(delay)
        try:
            close_run(tracking_uri, run_id, outcome)
            return
        except Exception:
            continue
    append_fallback(Path(fallback), [Record("status", run_id, values={"status": outcome})])
    status(
        f"MLflow is unreachable: run {run_id} could not be marked {outcome}; saved to {fallback}. "
        f"Deliver later with: rayapp import-metrics {fallback} --tracking-uri {tracking_uri}"
    )


def _first_line(exc: BaseException) -> str:
    """Ray wraps worker errors in long multi-line reports; the cause's last line is what a person needs."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


@contextlib.contextmanager
def _ray_cluster(spec: JobSpec, *, verbose: bool, status: Callable[[str], None]) -> Iterator[str]:
    """Connect to spec.cluster.address, or start and finally stop an embedded cluster; yields its label."""
    import ray

    address = spec.cluster.address
    try:
        if address:
            status(f"connecting to Ray cluster at {address}")
            try:
                ray.init(address=address, log_to_driver=verbose, logging_level="ERROR" if not verbose else "INFO")
            except Exception as exc:  # ConnectionError, timeouts, bad scheme
                raise RayappError(f"cannot connect to Ray cluster at {address!r}: {_first_line(exc)}") from None
            yield address
            return
        cpus_per_node = spec.cluster.workers_per_node * spec.cluster.cpus_per_worker
        status(f"starting embedded Ray cluster: {spec.cluster.nodes} node(s) x {cpus_per_node} CPU(s)")
        with EmbeddedCluster(
            nodes=spec.cluster.nodes, cpus_per_node=cpus_per_node, gpus_per_node=_local_gpus() // spec.cluster.nodes
        ) as cluster:
            cluster.prepare_client()
            try:
                ray.init(
                    address=cluster.address,
                    _node_ip_address=cluster.head_ip,
                    log_to_driver=verbose,
                    logging_level="ERROR" if not verbose else "INFO",
                )
            except Exception as exc:
                raise RayappError(
                    f"cannot connect to the embedded Ray cluster at {cluster.address}: {_first_line(exc)}; "
                    f"node logs are in {cluster.log_dir}"
                ) from None
            cluster.wait_for_nodes()
            try:
                yield "local"
            finally:
                ray.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _progress_pump(on_progress: Optional[ProgressCallback]) -> Iterator[object]:
    """A Ray queue that rank 0 fills; a driver thread drains it into on_progress."""
    if on_progress is None:
        yield None
        return
    from ray.util.queue import Queue

    # num_cpus=0: the queue must never compete with training workers for a CPU slot.
    queue = Queue(actor_options={"num_cpus": 0})
    done = "rayapp-progress-done"

    def drain() -> None:
        # One blocking get at a time rather than polling with a timeout: on a small machine
        # every needless call into the queue actor takes CPU from the training workers.
        while True:
            try:
                item = queue.get(block=True)
            except Exception:  # the queue actor is gone (cluster shutting down)
                return
            if item == done:
                return
            on_progress(item)

    thread = threading.Thread(target=drain, name="rayapp-progress", daemon=True)
    thread.start()
    try:
        yield queue
    finally:
        # Put after everything rank 0 put, so the drain shows every epoch before it stops.
        with contextlib.suppress(Exception):
            queue.put(done, timeout=5)
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            queue.shutdown()


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus_per_worker(spec: JobSpec) -> int:
    """One GPU per worker, except dp/mp, whose single process drives every GPU of its node."""
    if not spec.single_process:
        return 1
    import ray

    return int(max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=1)) or 1


def _build_trainer(spec: JobSpec, backend: str, worker_config: WorkerConfig):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = backend == "nccl"
    # One worker per node: STRICT_SPREAD guarantees distinct nodes. Several per node: SPREAD,
    # with the embedded cluster sized so each node holds exactly workers_per_node of them.
    placement = "STRICT_SPREAD" if spec.cluster.workers_per_node == 1 else "SPREAD"
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"worker_config": worker_config},
        scaling_config=ScalingConfig(
            num_workers=spec.world_size,
            use_gpu=use_gpu,
            resources_per_worker={
                "CPU": spec.cluster.cpus_per_worker,
                **({"GPU": _gpus_per_worker(spec)} if use_gpu else {}),
            },
            placement_strategy=placement,
        ),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(
            name=_trial_name(spec, worker_config.run_id),
            storage_path=_storage_path(spec.cluster.storage_path),
            failure_config=FailureConfig(max_failures=spec.cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            worker_runtime_env=_worker_env(),
        ),
    )


def _worker_env() -> Optional[dict]:
    """rayapp settings from the submitting shell that the workers need, also on a remote cluster."""
    from rayapp.tracking.outbox import GRACE_ENV

    env_vars = {name: os.environ[name] for name in (GRACE_ENV,) if name in os.environ}
    return {"env_vars": env_vars} if env_vars else None


def _storage_path(path: str) -> str:
    """URIs (s3://, gs://) pass through; local paths become absolute for every worker."""
    if "://" in path:
        return path
    resolved = Path(path).expanduser().resolve()
    resolved.mkdir(parents=True, exist_ok=True)
    return str(resolved)
