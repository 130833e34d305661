"""MLflow runs: the names later reports rely on, and opening and closing a job's run.

The driver opens one run per job (params, tags, final status); during training only rank 0
writes to it, through :class:`rayapp.tracking.logger.RunLogger`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayapp.spec import JobSpec
from rayapp.spec.mesh import mesh_label

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

EPOCH_METRICS = (
    "loss",
    "epoch_time_s",
    "samples_per_s",
    "compute_time_s",
    "comm_time_s",
    "data_time_s",
    "peak_mem_mb",
    "world_size",
)
"""Logged every epoch; world_size is the workers that trained it (an elastic run's changes)."""
FINAL_METRICS = ("total_time_s", "time_to_first_step_s", "param_bytes_per_rank")
STARTUP_METRICS = ("startup_cluster_s", "startup_workers_s", "time_to_first_step_s")
"""Where the time before training goes: the cluster started or connected (driver), every worker's
loop started (after the cluster), the first optimizer step done (since `rayapp submit` began)."""
WRITE_COST_METRICS = ("mlflow_write_s", "mlflow_write_cpu_s", "mlflow_writes")
"""Rank 0's MLflow writes in one attempt, all but the one carrying these: wall time, the sending
thread's CPU time, and the number of writes."""
TAG_NODE_IDS = "rayapp.node_ids"
TAG_NODE_IPS = "rayapp.node_ips"
TAG_CLUSTER = "rayapp.cluster"
TAG_MESH = "rayapp.mesh"
"""The device mesh the workers built (hsdp, tp, fsdp+tp), e.g. replicate=2,shard=2."""
TAG_ATTEMPTS = "rayapp.attempts"
TAG_RANK_EXIT_CODES = "rayapp.rank_exit_codes"
"""A --script job's exit code on each rank, in rank order."""
TAG_PEAK_TFLOPS_SOURCE = "rayapp.peak_tflops_source"
"""Where the run's peak_tflops came from: ``table:<GPU> <precision>`` or ``measured:matmul``."""
TAG_EARLY_STOPPED = "rayapp.early_stopped"
"""Set ("true") when the job's loop stopped before its last epoch (``break`` or ``ctx.stop()``)."""
TAG_RESUMED_FROM_EPOCH = "rayapp.resumed_from_epoch"
"""The epoch of the checkpoint the latest attempt resumed from (absent: it started afresh)."""
TAG_PARENT = "mlflow.parentRunId"
EPOCH_MARKER_METRIC = "epoch_time_s"
"""Logged for every epoch by every loop, built-in or the user's: its steps say which epochs a run
holds."""
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(uri: str | None) -> str:
    """Flag or job > $MLFLOW_TRACKING_URI > ./mlflow.db, with relative SQLite paths made absolute.

    Ray workers do not run in the submitter's directory, so a relative path would
    point each of them at a different, empty store.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def default_artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live beside the database file, not in whichever cwd made them."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        return Path(tracking_uri[len(prefix) :]).parent.joinpath("mlartifacts").as_uri()
    return None


def job_params(spec: JobSpec, backend: str) -> dict[str, str]:
    return {
        "job": spec.name,
        # 1:2 for an elastic run: never mistaken for a fixed size
        "nodes": spec.cluster.nodes_label,
        "workers_per_node": str(spec.cluster.workers_per_node),
        "world_size": spec.cluster.world_label,
        "backend": backend,
        "strategy": spec.train.strategy,
        "mesh": mesh_label(spec.cluster),  # the device mesh: nodes x workers per node
        "epochs": str(spec.train.epochs),
        "batch_size": str(spec.batch_size_per_worker),
        "global_batch_size": str(spec.global_batch_size),
        "lr": str(spec.train.lr),
        "seed": str(spec.train.seed),
        "scaling": spec.train.scaling,
        "precision": spec.train.precision,
        "compile": str(spec.train.compile),
        "grad_accum_steps": str(spec.train.grad_accum_steps),
        "grad_clip": str(spec.train.grad_clip),
        "checkpoint_every": str(spec.checkpoint.every_epochs),
        "checkpoint_format": spec.checkpoint.format
        + (" async" if spec.checkpoint.async_save else ""),
        "optimizer": spec.train.optimizer,
        "loss": spec.loss,
        "model": spec.model.factory
        or f"{spec.model.kind}{list(spec.model.hidden) if spec.model.hidden else ''}",
        "data": spec.data.factory
        or str(spec.data.kind),  # what the built-in loop trains; a user's loop builds its own
        # A user's data set is sized when built; rank 0 logs the figures as metrics then.
        "steps_per_epoch": str(spec.steps_per_epoch)
        if spec.steps_per_epoch is not None
        else "auto",
        "train_samples": str(spec.num_train_samples)
        if spec.num_train_samples is not None
        else "auto",
        **({"loop": spec.train.loop} if spec.train.loop else {}),
        **({"script": spec.train.script} if spec.train.script else {}),
    }


def environment_tags(job_file: str | None) -> dict[str, str]:
    import mlflow
    import ray
    import torch

    tags = {
        "rayapp.torch_version": torch.__version__,
        "rayapp.ray_version": ray.__version__,
        "rayapp.mlflow_version": mlflow.__version__,
        "rayapp.python_version": platform.python_version(),
    }
    if job_file:
        tags["rayapp.job_file"] = str(job_file)
        sha = _git_sha(Path(job_file).resolve().parent)
        if sha:
            tags["mlflow.source.git.commit"] = sha
            tags["rayapp.git_sha"] = sha
    return tags


def _git_sha(directory: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
"""What the MLflow UI reads to open an experiment in its model-training view (not the GenAI one)."""


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """The experiment's id, created if need be, tagged as a model-training experiment unless the
    user gave it a kind of their own."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        if TAG_EXPERIMENT_KIND not in experiment.tags:
            client.set_experiment_tag(
                experiment.experiment_id, TAG_EXPERIMENT_KIND, TRAINING_EXPERIMENT_KIND
            )
        return experiment.experiment_id
    return client.create_experiment(
        name,
        artifact_location=default_artifact_location(tracking_uri),
        tags={TAG_EXPERIMENT_KIND: TRAINING_EXPERIMENT_KIND},
    )


def log_run_metrics(
    tracking_uri: str, run_id: str, metrics: Mapping[str, float], step: int = 0
) -> None:
    """A few metrics the driver logs itself (startup phases), in one write."""
    import time

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    MlflowClient(tracking_uri).log_batch(
        run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
    )


def open_run(
    *,
    tracking_uri: str,
    experiment: str,
    run_name: str,
    params: Mapping[str, str],
    tags: Mapping[str, str],
    parent_run_id: str | None = None,
) -> str:
    """Create a RUNNING run with its params and tags; returns its id."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment, tracking_uri)
    all_tags = dict(tags)
    if parent_run_id:
        all_tags[TAG_PARENT] = parent_run_id
    run_id: str = client.create_run(experiment_id, run_name=run_name, tags=all_tags).info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return run_id


def close_run(tracking_uri: str, run_id: str, status: str) -> None:
    """status: FINISHED, FAILED or KILLED."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_terminated(run_id, status=status)


UI_TRAINING_VIEW = "workflowType=machine_learning"
MLFLOW_CREDENTIAL_ENV = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
ACCESS_CHECK_TIMEOUT_S = 10.0


def credentials_from_env() -> dict[str, str]:
    """The MLflow credentials of this shell, for the workers (they travel in memory, not as
    params)."""
    return {name: os.environ[name] for name in MLFLOW_CREDENTIAL_ENV if os.environ.get(name)}


def _server_get(tracking_uri: str, path: str, params: Mapping[str, Any]) -> Any | None:
    """One GET of the tracking server's REST API with this shell's credentials and a short timeout
    (MLflow's own client retries for minutes); None when the server does not answer."""
    import requests

    from rayapp.tracking.access import request_auth

    auth, headers = request_auth(credentials_from_env())
    try:
        return requests.get(
            f"{tracking_uri.rstrip('/')}{path}",
            params=params,
            auth=auth,
            headers=headers,
            timeout=ACCESS_CHECK_TIMEOUT_S,
            verify=os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true",
        )
    except requests.RequestException:
        return None


def check_tracking_access(tracking_uri: str) -> None:
    """For a tracking server: fail now, before any cluster starts, if it refuses this shell's
    requests (credentials, or a Host header outside its --allowed-hosts). A server that does not
    answer is left to the run's own retries and outbox."""
    from rayapp.tracking.access import ask_server, is_server_uri, refusal

    if not is_server_uri(tracking_uri):
        return
    from rayapp.errors import RayappError

    credentials = credentials_from_env()
    problem = refusal(tracking_uri, ask_server(tracking_uri, credentials), credentials)
    if problem:
        raise RayappError(problem)


def run_page_url(tracking_uri: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI when the store is a tracking server, else None (also when
    the server does not answer now: the store line still says where the run is)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    response = _server_get(tracking_uri, "/api/2.0/mlflow/runs/get", {"run_id": run_id})
    if response is None or response.status_code != 200:
        return None
    experiment_id = response.json()["run"]["info"]["experiment_id"]
    # MLflow 3's UI opens in its GenAI view unless told otherwise; rayapp's runs are model training.
    return (
        f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{UI_TRAINING_VIEW}"
    )


def fallback_path(storage_path: str, trial_name: str, run_id: str) -> str:
    """Where undelivered MLflow records go: beside the checkpoints when storage is a local or NFS
    path; in this node's temp directory when it is an object store (s3://, gs://)."""
    from rayapp.tracking.outbox import FALLBACK_SUFFIX

    base = Path(tempfile.gettempdir()) / "rayapp" if "://" in storage_path else Path(storage_path)
    return str(base / trial_name / f"{run_id}{FALLBACK_SUFFIX}")
