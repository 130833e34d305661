"""The Ray Train objects for a job: ScalingConfig, TorchConfig, RunConfig and the TorchTrainer."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from rayapp.spec import JobSpec
from rayapp.train.config import WorkerConfig
from rayapp.train.loop import train_loop_per_worker


def trial_name(spec: JobSpec, run_id: str) -> str:
    """Ray Train's run directory under storage_path: the job and the MLflow run it belongs to."""
    return f"{spec.name}-{run_id[:8]}"


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus_per_worker(spec: JobSpec) -> int:
    """One GPU per worker, except dp/mp, whose single process drives every GPU of its node."""
    if not spec.single_process:
        return 1
    import ray

    return (
        int(
            max(
                (node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]),
                default=1,
            )
        )
        or 1
    )


def build_trainer(
    spec: JobSpec, backend: str, worker_config: WorkerConfig, *, callbacks: list | None = None
):
    """callbacks: Ray Train callbacks of the run (a tune trial's, which pass each report on)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayapp.train.torch_config import PinnedInterfaceTorchConfig

    use_gpu = backend == "nccl"
    # One worker per node: STRICT_SPREAD guarantees distinct nodes. Several per node: SPREAD,
    # with the embedded cluster sized so each node holds exactly workers_per_node of them.
    placement = "STRICT_SPREAD" if spec.cluster.workers_per_node == 1 else "SPREAD"
    # Elastic: Ray Train starts (and restarts after a lost node) with as many workers as the
    # cluster holds now, from min to max, and grows as nodes return. Ray Train v2 (Ray's default)
    # takes the range and the resize interval; mypy reads ray.train's v1 classes, which do not.
    num_workers: Any = spec.world_size
    elastic: dict[str, Any] = {}
    if spec.cluster.elastic:
        num_workers = (spec.cluster.min_world_size, spec.world_size)
        elastic = {"elastic_resize_monitor_interval_s": spec.cluster.resize_interval_s}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"worker_config": worker_config},
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            **elastic,
            use_gpu=use_gpu,
            resources_per_worker={
                "CPU": spec.cluster.cpus_per_worker,
                **({"GPU": _gpus_per_worker(spec)} if use_gpu else {}),
            },
            placement_strategy=placement,
        ),
        # A collective that waits longer for a peer raises instead of blocking forever. Gloo/NCCL
        # on each worker bind the interface of its node's Ray address, not the one the host name
        # resolves to (loopback on stock Debian/Ubuntu).
        torch_config=PinnedInterfaceTorchConfig(
            backend=backend, timeout_s=math.ceil(spec.train.collective_timeout_s)
        ),
        run_config=RunConfig(  # type: ignore[call-arg]  # v2's RunConfig has worker_runtime_env
            name=trial_name(spec, worker_config.run_id),
            storage_path=storage_path(spec.cluster.storage_path),
            failure_config=FailureConfig(max_failures=spec.cluster.failures_allowed),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            worker_runtime_env=_worker_env(),
            callbacks=callbacks,
        ),
    )


def _worker_env() -> dict | None:
    """rayapp settings from the submitting shell that the workers need, also on a remote cluster."""
    from rayapp.tracking.outbox import GRACE_ENV

    env_vars = {name: os.environ[name] for name in (GRACE_ENV,) if name in os.environ}
    return {"env_vars": env_vars} if env_vars else None


def storage_path(path: str) -> str:
    """URIs (s3://, gs://) pass through; local paths become absolute for every worker."""
    if "://" in path:
        return path
    resolved = Path(path).expanduser().resolve()
    resolved.mkdir(parents=True, exist_ok=True)
    return str(resolved)
