"""Checks made before fitting, so impossible requests fail in seconds instead of waiting forever.

Ray Train waits for resources indefinitely (it retries worker-group start timeouts); a job
asking for 5 nodes on a 2-node cluster would hang. These checks compare the request with what
the cluster has now, waiting up to a schedule timeout for autoscaling or late nodes.
"""

from __future__ import annotations

import time

from rayapp.errors import RayappError
from rayapp.spec import JobSpec, SpecError


def resolve_backend(requested: str, *, gpus_in_cluster: float) -> str:
    """`auto` is nccl when the cluster has GPUs, else gloo; explicit choices are checked."""
    if requested == "auto":
        return "nccl" if gpus_in_cluster > 0 else "gloo"
    if requested == "nccl" and gpus_in_cluster <= 0:
        raise RayappError(
            "backend 'nccl' needs GPUs, and this cluster has none; use --backend gloo (or auto)"
        )
    if requested == "mpi":
        import torch.distributed as dist

        if not dist.is_mpi_available():
            raise RayappError(
                "backend 'mpi' is not available: this torch build has no MPI "
                "support; build PyTorch from source against an MPI library "
                "(USE_MPI=1), or use --backend gloo (CPU) / nccl (GPU)"
            )
    return requested


def shortfall(spec: JobSpec, nodes: list[dict], *, use_gpu: bool) -> str | None:
    """What the alive nodes lack for the request, in words; None when it fits."""
    per_node_cpus = spec.cluster.workers_per_node * spec.cluster.cpus_per_worker
    per_node_gpus = spec.cluster.workers_per_node if use_gpu else 0
    alive = [node for node in nodes if node.get("Alive")]
    fitting = [
        node
        for node in alive
        if node["Resources"].get("CPU", 0) >= per_node_cpus
        and node["Resources"].get("GPU", 0) >= per_node_gpus
    ]
    # An elastic run starts with its minimum and grows as nodes join.
    needed = spec.cluster.nodes if spec.cluster.min_nodes is None else spec.cluster.min_nodes
    if len(fitting) >= needed:
        return None
    need = f"{per_node_cpus} CPU" + (f" + {per_node_gpus} GPU" if per_node_gpus else "")
    return (
        f"--nodes {spec.cluster.nodes_label} with --workers-per-node "
        f"{spec.cluster.workers_per_node} needs "
        f"{'at least ' if spec.cluster.elastic else ''}{needed} node(s) with {need} each; "
        f"the cluster has {len(alive)} alive node(s), {len(fitting)} of them large enough"
    )


def check_capacity(spec: JobSpec, *, wait_s: float = 0.0, poll_s: float = 1.0) -> None:
    """Raise RayappError naming what is short, after waiting up to wait_s for the cluster to
    grow."""
    import ray

    use_gpu = spec.cluster.backend == "nccl" or (
        spec.cluster.backend == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )
    deadline = time.monotonic() + wait_s
    asked_autoscaler = False
    while True:
        missing = shortfall(spec, ray.nodes(), use_gpu=use_gpu)
        if missing is None:
            if asked_autoscaler:
                _request_bundles(None)
            return
        if wait_s > 0 and not asked_autoscaler:
            # An autoscaling cluster only grows for demand it sees; the job's placement group
            # does not exist yet, so state the demand explicitly.
            _request_bundles(spec, use_gpu=use_gpu)
            asked_autoscaler = True
        if time.monotonic() >= deadline:
            hint = (
                "lower --nodes, "
                "or pass --schedule-timeout SECONDS to wait for an autoscaling cluster"
            )
            raise RayappError(f"{missing}; {hint}")
        time.sleep(poll_s)


def _request_bundles(spec: JobSpec | None, *, use_gpu: bool = False) -> None:
    """Ask the autoscaler for one bundle per node (None clears the request). No-op without an
    autoscaler."""
    from ray.autoscaler.sdk import request_resources

    if spec is None:
        request_resources(bundles=[])
        return
    bundle = {"CPU": spec.cluster.workers_per_node * spec.cluster.cpus_per_worker}
    if use_gpu:
        bundle["GPU"] = spec.cluster.workers_per_node
    request_resources(bundles=[bundle] * spec.cluster.nodes)


def check_local_machine(spec: JobSpec) -> None:
    """For the embedded cluster, which runs on this machine: what the job needs that it lacks,
    as a SpecError before anything starts. A remote cluster is checked once connected."""
    if spec.cluster.address:
        return
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec.cluster.backend == "nccl" and not gpus:
        raise SpecError(
            "cluster.backend: "
            "'nccl' is not accepted on this machine (no CUDA GPU); use gloo or auto"
        )
    if spec.single_process and gpus < 2:
        raise SpecError(
            f"train.strategy: {spec.train.strategy!r} needs at least 2 CUDA GPUs on one node and "
            f"this machine has {gpus}; use ddp or fsdp (they run on CPUs too)"
        )
    if spec.cluster.backend == "mpi" and not dist.is_mpi_available():
        raise SpecError(
            "cluster.backend: 'mpi' is not available in this torch "
            "build (no MPI support); build PyTorch from source against "
            "an MPI library (USE_MPI=1), or use gloo (CPU) / nccl (GPU)"
        )
    if spec.train.precision == "fp16" and not gpus:
        raise SpecError(
            "train.precision: 'fp16' is not accepted on CPUs (no CUDA GPU here; fp16 needs loss "
            "scaling on a GPU); use bf16, which CPUs run, or fp32"
        )


def check_precision(spec: JobSpec, backend: str) -> None:
    """fp16 trains on GPUs only; on a connected cluster the backend says whether it has any."""
    if spec.train.precision == "fp16" and backend != "nccl":
        raise SpecError(
            "train.precision: "
            f"'fp16' is not accepted on a {backend} (CPU) cluster; use bf16 or fp32"
        )
