"""The run's device mesh as the spec sees it, and the checks the mesh strategies (hsdp, tp,
fsdp+tp) need before anything starts.

The mesh has two named dims: ``replicate`` (one coordinate per node) and ``shard`` (one per worker
of a node): nodes x cluster.workers_per_node. Tensor parallelism (tp, fsdp+tp) splits layers over
the ``shard`` dim, so the workers of one node compute on the same batches and only the nodes read
shares of the data of their own.
"""

from __future__ import annotations

from typing import Any

from rayapp.spec.catalog import STRATEGIES
from rayapp.spec.errors import SpecError

MESH_DIMS = ("replicate", "shard")


def uses_mesh(strategy: str) -> bool:
    """Whether the strategy trains over the 2-D mesh (hsdp, tp, fsdp+tp)."""
    return bool(STRATEGIES.get(strategy).meta.get("mesh"))


def is_tensor_parallel(strategy: str) -> bool:
    """Whether the strategy splits layers over the workers of a node (tp, fsdp+tp)."""
    return bool(STRATEGIES.get(strategy).meta.get("tensor_parallel"))


def mesh_label(cluster: Any) -> str:
    """The mesh as the MLflow run records it, e.g. ``replicate=2,shard=2`` (an elastic run's
    node range, ``replicate=1:2``, stands for the sizes it may train at)."""
    return f"replicate={cluster.nodes_label},shard={cluster.workers_per_node}"


def tensor_parallel_widths(hidden: tuple[int, ...] | list[int]) -> list[int]:
    """The widths the built-in MLP's plan splits: its Linear layers pair up (column-wise, then
    row-wise), and each pair splits the width between them: hidden[0], hidden[2], ..."""
    return list(hidden[0::2])


def check_tensor_parallel(job: Any) -> None:
    """A built-in model under tp or fsdp+tp: it has a plan, and each width it splits divides by the
    workers of a node (a factory's model is checked when built)."""
    strategy, tp_size = job.train.strategy, job.cluster.workers_per_node
    if job.model.factory is not None or not is_tensor_parallel(strategy):
        return
    if not job.model.hidden:
        raise SpecError(
            f"train.strategy: {strategy!r} needs a model with a tensor-parallel plan; model.kind "
            f"{job.model.kind!r} (one Linear layer) has none; use kind mlp, or a model.factory "
            "whose model has tensor_parallel_plan()"
        )
    for width in tensor_parallel_widths(job.model.hidden):
        if width % tp_size:
            raise SpecError(
                f"model.hidden: width {width} of {list(job.model.hidden)} does not divide by the "
                f"tensor-parallel size {tp_size} (cluster.workers_per_node) that {strategy!r} "
                f"splits it over; use widths that are multiples of {tp_size}"
            )
