"""Where a rank sits under strategy pp, and the data-parallel step between pipelines.

pp runs either one pipeline over every worker (``train.pipeline.stages`` = the world size) or, on
2 nodes or more, one pipeline per node (stages = ``cluster.workers_per_node``): the run's 2-D mesh
(:mod:`rayapp.train.mesh`) with a pipeline along each ``shard`` row, so activations pass between
workers of one node, and the copies of each stage along ``replicate``, one per node, which average
their gradients after every step (the only traffic between nodes). Ray Train numbers workers node
by node, so a pipeline is a block of consecutive ranks: stage s of pipeline r is rank
``r * stages + s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class PipelinePlace:
    stage: int
    """This rank's stage in its pipeline (0 feeds the inputs, stages - 1 takes the loss)."""
    stages: int
    replica: int
    """Which pipeline this rank is in: the share of the data it reads."""
    replicas: int
    pipeline_group: Any = None
    """The process group of this rank's pipeline; None: the default group (one pipeline)."""
    replica_group: Any = None
    """The group of this stage's copies in every pipeline; None when there is one pipeline."""

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline."""
        return self.replica * self.stages + stage


def pipeline_place(ctx: Any) -> PipelinePlace:
    """This rank's place, from the job's stages and the run's mesh (a collective the first time
    the mesh is asked for, when there are several pipelines)."""
    stages = ctx.spec.train.pipeline.stages
    replicas = ctx.world_size // stages
    if replicas == 1:
        return PipelinePlace(stage=ctx.rank, stages=stages, replica=0, replicas=1)
    mesh = ctx.mesh  # (replicate, shard) = (nodes, workers per node) = (pipelines, stages)
    return PipelinePlace(
        stage=mesh.get_local_rank("shard"),
        stages=stages,
        replica=mesh.get_local_rank("replicate"),
        replicas=replicas,
        pipeline_group=mesh.get_group("shard"),
        replica_group=mesh.get_group("replicate"),
    )


def average_gradients(model: nn.Module, place: PipelinePlace) -> None:
    """Each of this stage's gradients averaged over its copies in the other pipelines, in one
    all-reduce of them all, flattened: every pipeline then steps with the gradient of the global
    batch's mean loss, as one pipeline on the whole batch would. Nothing to do with one
    pipeline."""
    if place.replica_group is None:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=place.replica_group)  # SUM: Gloo has no AVG
    flat /= place.replicas
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
