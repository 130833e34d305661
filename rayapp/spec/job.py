"""The job spec: one frozen, validated description of a training job.

Every value a job can take is checked here, once, so the driver and the worker loop never
re-check input: each section (:mod:`~rayapp.spec.sections`, :mod:`~rayapp.spec.training`,
:mod:`~rayapp.spec.cluster`) is a pydantic dataclass whose fields say what they accept, and the
rules across sections are below. Specs are built by :mod:`rayapp.spec.loader` from
defaults < job YAML < command-line flags.
"""

from __future__ import annotations

import dataclasses
import math

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass

from rayapp.spec.catalog import DATASETS, STRATEGIES
from rayapp.spec.cluster import ClusterSpec
from rayapp.spec.errors import SpecError
from rayapp.spec.fields import SECTION_CONFIG, NonBlank, Text, is_import_path, section
from rayapp.spec.mesh import check_tensor_parallel, is_tensor_parallel
from rayapp.spec.pipeline import PipelineSpec, check_pipeline
from rayapp.spec.sections import CheckpointSpec, DataSpec, ModelSpec, TrackingSpec
from rayapp.spec.training import PRECISIONS, SCALINGS, TrainSpec

__all__ = [
    "PRECISIONS",
    "SCALINGS",
    "CheckpointSpec",
    "ClusterSpec",
    "DataSpec",
    "JobSpec",
    "ModelSpec",
    "PipelineSpec",
    "SpecError",
    "TrackingSpec",
    "TrainSpec",
    "is_import_path",
]


@section("")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class JobSpec:
    name: NonBlank = Field(description="The job's name (default: the job file's name).")
    description: Text | None = Field(default=None, description="What the job is, for people.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    # Before train: train.pipeline.stages defaults to the cluster's world size.
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)

    @field_validator("train")
    @classmethod
    def _one_stage_per_worker(cls, train: TrainSpec, info: ValidationInfo) -> TrainSpec:
        """Strategy pp's stages, when the job does not say: the world size (2 or more; with
        fewer workers check_pipeline says pp cannot run)."""
        cluster = info.data.get("cluster")
        if train.pipeline is None or train.pipeline.stages is not None or cluster is None:
            return train
        if cluster.world_size < 2:
            return train
        stages = dataclasses.replace(train.pipeline, stages=cluster.world_size)
        return dataclasses.replace(train, pipeline=stages)

    @model_validator(mode="after")
    def _sections_agree(self) -> JobSpec:
        if self.data.kind is not None and self.data.fixed_size and self.train.scaling == "weak":
            raise SpecError(
                f"train.scaling: 'weak' is not accepted with data.kind {self.data.kind} (a fixed, "
                "real data set); "
                "use scaling: strong"
            )
        strategy = STRATEGIES.get(self.train.strategy).meta
        if strategy.get("single_process"):
            if self.cluster.world_size != 1:
                raise SpecError(
                    f"train.strategy: {self.train.strategy!r} runs one process on one node, not "
                    f"nodes {self.cluster.nodes} * workers_per_node "
                    f"{self.cluster.workers_per_node}; "
                    "use --nodes 1 --workers-per-node 1, or ddp/fsdp to spread over nodes"
                )
            if strategy.get("needs_sequential") and len(self.model.hidden) < 1:
                raise SpecError(
                    f"train.strategy: {self.train.strategy!r} splits the model's layers across "
                    "two GPUs; use model.kind mlp"
                )
        if self.uses_standard_loop and self.data.factory is not None and self.train.loss is None:
            raise SpecError(
                "train.loss: missing; with data.factory name the loss: cross_entropy, mse or "
                "module:function"
            )
        if self.cluster.elastic and self.train.pipeline is not None:
            raise SpecError(
                f"cluster.nodes: {self.cluster.nodes_label!r} (elastic) is not accepted with "
                "strategy pp, "
                "whose stages are fixed to the world size; use a fixed --nodes"
            )
        if self.train.pipeline is not None:
            check_pipeline(self)
        check_tensor_parallel(self)
        if self.train.scaling == "strong":
            self._check_global_batch()
        return self

    def _check_global_batch(self) -> None:
        gbs = self.train.global_batch_size or 0
        world = self.data_parallel_size  # every worker, unless pipeline stages share a replica
        cluster = self.cluster
        if gbs % world:
            raise SpecError(
                f"train.global_batch_size: {gbs} is not divisible by world_size {world} "
                f"(nodes {cluster.nodes} * workers_per_node {cluster.workers_per_node}); "
                "pick a global batch that is a multiple of the world size"
            )
        sizes = range(cluster.min_world_size, cluster.world_size + 1) if cluster.elastic else ()
        if any(gbs % size for size in sizes):
            lcm = math.lcm(*sizes)
            raise SpecError(
                f"train.global_batch_size: {gbs} is not divisible by every world size an elastic "
                "run "
                f"may train at ({cluster.min_world_size} to {cluster.world_size}); pick a multiple "
                f"of each, e.g. {lcm * max(1, gbs // lcm)}"
            )
        # A user's data set is checked when built.
        per_rank_samples = (self.num_train_samples or gbs) // world
        if per_rank_samples < gbs // world:
            raise SpecError(
                f"data.num_samples: {self.num_train_samples} gives {per_rank_samples} samples per "
                "worker, "
                f"fewer than one batch of {gbs // world}; raise num_samples or lower "
                "global_batch_size"
            )

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def data_parallel_size(self) -> int:
        """Workers that each read their own share of the data: all of them, but under strategy pp
        the stages of a pipeline read the same batches (one data-parallel replica), and under tp
        and fsdp+tp the workers of a node do (one replica per node)."""
        return self.data_parallel_at(self.world_size)

    def data_parallel_at(self, world_size: int) -> int:
        """Data-parallel replicas when `world_size` workers train (an elastic run's changes)."""
        pipeline = self.train.pipeline
        if pipeline:
            return world_size // (pipeline.stages or 1)
        if is_tensor_parallel(self.train.strategy):
            return world_size // self.cluster.workers_per_node
        return world_size

    @property
    def batch_size_per_worker(self) -> int:
        return self.batch_size_at(self.world_size)

    def batch_size_at(self, world_size: int) -> int:
        """Samples per worker per step when `world_size` workers train: an elastic run's world size
        changes, and under strong scaling the global batch, not the worker's, stays the same."""
        train = self.train
        if train.scaling == "weak":
            assert train.batch_size is not None  # weak scaling's batch always has a value
            return train.batch_size
        assert train.global_batch_size is not None  # strong scaling's batch always has a value
        if train.pipeline:  # never elastic: the replicas are fixed by the stages
            return train.global_batch_size // self.data_parallel_size
        return train.global_batch_size // self.data_parallel_at(world_size)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size_per_worker * self.data_parallel_size

    @property
    def uses_standard_loop(self) -> bool:
        """rayapp's own loop trains the job (not the user's train.loop, nor a script)."""
        return self.train.loop is None and self.train.script is None

    @property
    def num_train_samples(self) -> int | None:
        """Training samples across all workers for one epoch; None for a user's data set (known
        once built)."""
        if self.data.kind is None:  # the user's data.factory
            return None
        if self.train.scaling == "weak":
            return self.data.steps_per_epoch * self.batch_size_per_worker * self.data_parallel_size
        samples: int = DATASETS.get(self.data.kind).meta.get("train_samples", self.data.num_samples)
        return samples

    @property
    def loss(self) -> str:
        """The loss: train.loss, else the data's natural one."""
        return self.train.loss or ("cross_entropy" if self.data.is_classification else "mse")

    @property
    def single_process(self) -> bool:
        """One worker process driving several GPUs of one node (dp, mp)."""
        return bool(STRATEGIES.get(self.train.strategy).meta.get("single_process"))

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps each worker takes per epoch; None for a user's data set (known once
        built)."""
        if self.num_train_samples is None:
            return None
        return (self.num_train_samples // self.data_parallel_size) // self.batch_size_per_worker
