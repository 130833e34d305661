"""The job spec: one frozen, validated description of a training job.

Every value a job can take is checked here, once, so the driver and the worker
loop never re-check input. Names (model, data, loss, optimizer, strategy) are checked against
the registries of :mod:`rayapp.spec.catalog`. Specs are built by :mod:`rayapp.spec.loader` from
defaults < job YAML < command-line flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rayapp.spec.catalog import DATASETS, LOSSES, MODELS, OPTIMIZERS, STRATEGIES
from rayapp.spec.checks import (
    check_bool,
    check_import_path,
    check_mapping,
    check_one_of,
    check_one_source,
    check_positive_int,
    check_positive_number,
    is_import_path,
)
from rayapp.spec.cluster import ClusterSpec
from rayapp.spec.errors import SpecError
from rayapp.spec.pipeline import PipelineSpec, check_pipeline

SCALINGS = ("strong", "weak")
PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINT_FORMATS = ("dcp", "full")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    kind: str | None = None
    """A built-in model: `linear` (the article's nn.Linear, the default) or `mlp`. Input and
    output sizes come from the data."""
    hidden: tuple[int, ...] = ()
    """Hidden layer widths of the `mlp`; must be empty for `linear`."""
    factory: str | None = None
    """Your own model instead: ``module:function`` returning an nn.Module, called with `args`.
    Imported from the job file's directory first, then installed packages."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `factory`."""

    def __post_init__(self) -> None:
        check_one_source("model", self.kind, self.factory)
        check_import_path("model.factory", self.factory)
        check_mapping("model.args", self.args)
        if self.factory is not None:
            if self.hidden:
                raise SpecError(
                    "model.hidden: only for built-in models; pass your factory's sizes in model.args"
                )
            return
        if self.args:
            raise SpecError(
                f"model.args: {self.args!r} is only for model.factory; built-in models take model.hidden"
            )
        if self.kind is None:
            object.__setattr__(self, "kind", "linear")
        MODELS.check(self.kind)
        if not isinstance(self.hidden, tuple):
            raise SpecError(
                f"model.hidden: {self.hidden!r} is not accepted; use a list of widths, e.g. [256, 256]"
            )
        for width in self.hidden:
            check_positive_int("model.hidden[]", width)
        hidden_rule = MODELS.get(self.kind).meta.get("hidden")
        if hidden_rule == "required" and not self.hidden:
            raise SpecError(
                f"model.hidden: [] is not accepted for kind {self.kind}; give at least one width, e.g. [256]"
            )
        if hidden_rule == "none" and self.hidden:
            raise SpecError(
                f"model.hidden: {list(self.hidden)} is not accepted for kind {self.kind}; remove it or use kind: mlp"
            )


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    kind: str | None = None
    """`random`: fresh Gaussian inputs and targets, as in the article (each rank its own batches).
    `synthetic`: a fixed, seeded regression set with a learnable target.
    `digits`: scikit-learn's bundled 8x8 handwritten digits (real data, 10 classes, test accuracy)."""
    features: int = 10
    """Input width (random/synthetic; digits always has 64)."""
    targets: int = 10
    """Output width (random/synthetic; digits always has 10 classes)."""
    steps_per_epoch: int = 100
    """Weak scaling: batches each worker trains per epoch, so the data set grows with the world size."""
    num_samples: int = 8192
    """Strong scaling: size of the fixed global training set, split across workers."""
    factory: str | None = None
    """Your own data instead: ``module:function`` returning a map-style Dataset, or (train, test),
    called with `args`. Each worker shards it with a DistributedSampler."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `factory`."""
    loader_workers: int = 0
    """DataLoader worker processes per training worker; 0 loads in the training process (best for
    in-memory tensors, which rayapp fetches a whole batch at a time)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.loader_workers, bool)
            or not isinstance(self.loader_workers, int)
            or self.loader_workers < 0
        ):
            raise SpecError(
                f"data.loader_workers: {self.loader_workers!r} is not accepted; use a whole number >= 0"
            )
        check_one_source("data", self.kind, self.factory)
        check_import_path("data.factory", self.factory)
        check_mapping("data.args", self.args)
        if self.factory is None and self.args:
            raise SpecError(f"data.args: {self.args!r} is only for data.factory")
        if self.factory is None and self.kind is None:
            object.__setattr__(self, "kind", "random")
        if self.kind is not None:
            DATASETS.check(self.kind)
        for name in ("features", "targets", "steps_per_epoch", "num_samples"):
            check_positive_int(f"data.{name}", getattr(self, name))

    @property
    def _meta(self) -> dict:
        # A user's data set: a fixed, real set whose labels the loss (train.loss) says.
        return (
            dict(DATASETS.get(self.kind).meta)
            if self.kind
            else {"classification": None, "fixed_size": True}
        )

    @property
    def input_size(self) -> int:
        return self._meta.get("input_size", self.features)

    @property
    def output_size(self) -> int:
        return self._meta.get("output_size", self.targets)

    @property
    def is_classification(self) -> bool | None:
        """True/False for built-ins; None for a user's data set (train.loss decides)."""
        return self._meta["classification"]

    @property
    def fixed_size(self) -> bool:
        """A real data set of a given size, which weak scaling cannot grow."""
        return self._meta["fixed_size"]


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    epochs: int = 10
    batch_size: int | None = 64
    """Weak scaling: samples per worker per step. Strong scaling: derived (global_batch_size / world_size)."""
    global_batch_size: int | None = None
    """Strong scaling: samples per step across all workers, fixed whatever the world size."""
    lr: float = 0.001
    optimizer: str = "sgd"
    loss: str | None = None
    """A built-in loss (mse, cross_entropy) or ``module:function`` returning a loss module/function;
    none: cross_entropy for labelled data, else mse."""
    loop: str | None = None
    """Your own per-worker loop, ``module:function(ctx)`` (see rayapp.train.context.TrainContext)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments your loop reads as ``ctx.args``."""
    script: str | None = None
    """A torchrun-style script each worker runs in a child process (``rayapp submit --script``)."""
    script_args: tuple[str, ...] = ()
    """Command-line arguments for the script (what follows ``--`` on the command line)."""
    precision: str = "fp32"
    """`fp32`, or mixed precision: `bf16` (autocast, GPUs and CPUs) or `fp16` (autocast with a
    GradScaler; GPUs only). Under FSDP, the parameters' compute dtype too (MixedPrecisionPolicy)."""
    compile: bool = False
    """torch.compile the model before the strategy wraps it."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients add up before each optimizer step."""
    grad_clip: float | None = None
    """Clip the gradients' global norm to this before each optimizer step; none: no clipping."""
    timing_every: int = 50
    """Steps between reads of the step timers (the only host-device syncs they make) and between
    samples of DDP's communication timings, which are scaled up to the epoch."""
    seed: int = 0
    scaling: str = "weak"
    """`weak`: each worker keeps its own batch and steps (the article's loop); `strong`: a fixed
    global data set and global batch are split across workers."""
    strategy: str = "ddp"
    """`ddp` (DistributedDataParallel), `fsdp` (FSDP2 fully_shard), `dp` (nn.DataParallel over the
    GPUs of one node, one process), `mp` (the model's layers split across two GPUs, one process) or
    `pp` (pipeline parallelism: one stage of the model's layers per worker, see `pipeline`)."""
    pipeline: PipelineSpec | None = None
    """Strategy pp's stages, micro-batches and schedule (YAML: a mapping); only for strategy pp."""

    def __post_init__(self) -> None:
        check_positive_int("train.epochs", self.epochs)
        check_positive_number("train.lr", self.lr)
        if not is_import_path(self.optimizer):
            OPTIMIZERS.check(self.optimizer)
        if self.loss is not None and not is_import_path(self.loss):
            LOSSES.check(self.loss)
        check_import_path("train.loop", self.loop)
        check_mapping("train.args", self.args)
        if self.script is not None and (
            not isinstance(self.script, str) or not self.script.strip()
        ):
            raise SpecError(
                f"train.script: {self.script!r} is not accepted; use the path of a Python script"
            )
        if self.script is not None and self.loop is not None:
            raise SpecError(
                "train.script and train.loop: give one; a script runs instead of any loop"
            )
        check_one_of("train.precision", self.precision, PRECISIONS)
        check_bool("train.compile", self.compile)
        check_positive_int("train.grad_accum_steps", self.grad_accum_steps)
        if self.grad_clip is not None:
            check_positive_number("train.grad_clip", self.grad_clip)
        check_positive_int("train.timing_every", self.timing_every)
        if not isinstance(self.script_args, tuple) or not all(
            isinstance(a, str) for a in self.script_args
        ):
            raise SpecError(
                f"train.script_args: {self.script_args!r} is not accepted; use a list of strings"
            )
        check_one_of("train.scaling", self.scaling, SCALINGS)
        STRATEGIES.check(self.strategy)
        if self.pipeline is not None and self.strategy != "pp":
            raise SpecError(
                f"train.pipeline: only for train.strategy pp, not {self.strategy!r}; remove it or use pp"
            )
        if self.strategy == "pp" and self.pipeline is None:
            object.__setattr__(self, "pipeline", PipelineSpec())
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"train.seed: {self.seed!r} is not accepted; use a whole number >= 0")
        if self.scaling == "weak":
            if self.batch_size is None:
                raise SpecError(
                    "train.batch_size: missing; weak scaling needs a per-worker batch size, e.g. 64"
                )
            check_positive_int("train.batch_size", self.batch_size)
            if self.global_batch_size is not None:
                raise SpecError(
                    f"train.global_batch_size: {self.global_batch_size!r} is not accepted with scaling weak "
                    "(the global batch is batch_size * world_size); remove it or use scaling: strong"
                )
        else:
            if self.global_batch_size is None:
                raise SpecError(
                    "train.global_batch_size: missing; strong scaling needs a fixed global batch, e.g. 512"
                )
            check_positive_int("train.global_batch_size", self.global_batch_size)


@dataclass(frozen=True, kw_only=True)
class TrackingSpec:
    experiment: str = "rayapp"
    tracking_uri: str | None = None
    """MLflow tracking URI; none: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory."""
    log_every_steps: int = 0
    """Log step_loss and step_samples_per_s every N optimizer steps (step = global step); 0: off."""
    system_metrics_s: float = 10.0
    """Seconds between samples of each node's CPU, memory, network and GPU use (MLflow's system
    metrics, ``system/<node>/...``), taken by one worker per node; 0: off."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.log_every_steps, bool)
            or not isinstance(self.log_every_steps, int)
            or self.log_every_steps < 0
        ):
            raise SpecError(
                f"tracking.log_every_steps: {self.log_every_steps!r} is not accepted; "
                "use a whole number >= 0 (0 turns step-level metrics off)"
            )
        if (
            isinstance(self.system_metrics_s, bool)
            or not isinstance(self.system_metrics_s, (int, float))
            or not self.system_metrics_s >= 0
        ):
            raise SpecError(
                f"tracking.system_metrics_s: {self.system_metrics_s!r} is not accepted; "
                "use seconds >= 0 (0 turns system metrics off)"
            )
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            raise SpecError(
                f"tracking.experiment: {self.experiment!r} is not accepted; use a non-empty name"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    every_epochs: int = 1
    """Checkpoint after every K-th epoch, and always after the last."""
    format: str = "dcp"
    """`dcp`: torch.distributed.checkpoint, each rank writes its own shard (.distcp files) and
    resume may change the world size; `full`: rank 0 saves the gathered state dict (state.pt)."""
    async_save: bool = False
    """(YAML key `async`) DCP only: write in the background while the next epoch trains."""

    def __post_init__(self) -> None:
        check_positive_int("checkpoint.every_epochs", self.every_epochs)
        check_one_of("checkpoint.format", self.format, CHECKPOINT_FORMATS)
        check_bool("checkpoint.async", self.async_save)
        if self.async_save and self.format != "dcp":
            raise SpecError(
                "checkpoint.async: true is not accepted with format full; use format: dcp"
            )


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise SpecError(f"name: {self.name!r} is not accepted; use a non-empty job name")
        if self.data.kind is not None and self.data.fixed_size and self.train.scaling == "weak":
            raise SpecError(
                f"train.scaling: 'weak' is not accepted with data.kind {self.data.kind} (a fixed, real data set); "
                "use scaling: strong"
            )
        strategy = STRATEGIES.get(self.train.strategy).meta
        if strategy.get("single_process"):
            if self.cluster.world_size != 1:
                raise SpecError(
                    f"train.strategy: {self.train.strategy!r} runs one process on one node, not "
                    f"nodes {self.cluster.nodes} * workers_per_node {self.cluster.workers_per_node}; "
                    "use --nodes 1 --workers-per-node 1, or ddp/fsdp to spread over nodes"
                )
            if strategy.get("needs_sequential") and len(self.model.hidden) < 1:
                raise SpecError(
                    f"train.strategy: {self.train.strategy!r} splits the model's layers across two GPUs; use model.kind mlp"
                )
        if self.uses_standard_loop and self.data.factory is not None and self.train.loss is None:
            raise SpecError(
                "train.loss: missing; with data.factory name the loss: cross_entropy, mse or module:function"
            )
        if self.cluster.elastic and (
            self.train.pipeline is not None or self.train.strategy == "pp"
        ):
            raise SpecError(
                f"cluster.nodes: {self.cluster.nodes_label!r} (elastic) is not accepted with strategy pp, "
                "whose stages are fixed to the world size; use a fixed --nodes"
            )
        if self.train.pipeline is not None:
            check_pipeline(self)
        world = (
            self.data_parallel_size
        )  # every worker, unless pipeline stages share one data-parallel replica
        if self.train.scaling == "strong":
            gbs = self.train.global_batch_size
            if gbs % world:
                raise SpecError(
                    f"train.global_batch_size: {gbs} is not divisible by world_size {world} "
                    f"(nodes {self.cluster.nodes} * workers_per_node {self.cluster.workers_per_node}); "
                    "pick a global batch that is a multiple of the world size"
                )
            sizes = (
                range(self.cluster.min_world_size, self.cluster.world_size + 1)
                if self.cluster.elastic
                else ()
            )
            if any(gbs % size for size in sizes):
                raise SpecError(
                    f"train.global_batch_size: {gbs} is not divisible by every world size an elastic run "
                    f"may train at ({self.cluster.min_world_size} to {self.cluster.world_size}); pick a multiple "
                    f"of each, e.g. {math.lcm(*sizes) * max(1, gbs // math.lcm(*sizes))}"
                )
            per_rank_samples = (
                self.num_train_samples or gbs
            ) // world  # a user's data set: checked when built
            if per_rank_samples < gbs // world:
                raise SpecError(
                    f"data.num_samples: {self.num_train_samples} gives {per_rank_samples} samples per worker, "
                    f"fewer than one batch of {gbs // world}; raise num_samples or lower global_batch_size"
                )

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def data_parallel_size(self) -> int:
        """Workers that each read their own share of the data: all of them, but under strategy pp
        the stages of a pipeline read the same batches (one data-parallel replica)."""
        return (
            self.world_size // self.train.pipeline.stages
            if self.train.pipeline
            else self.world_size
        )

    @property
    def batch_size_per_worker(self) -> int:
        return self.batch_size_at(self.world_size)

    def batch_size_at(self, world_size: int) -> int:
        """Samples per worker per step when `world_size` workers train: an elastic run's world size
        changes, and under strong scaling the global batch, not the worker's, stays the same."""
        if self.train.scaling == "weak":
            return self.train.batch_size
        if self.train.pipeline:  # never elastic: the replicas are fixed by the stages
            return self.train.global_batch_size // self.data_parallel_size
        return self.train.global_batch_size // world_size

    @property
    def global_batch_size(self) -> int:
        return self.batch_size_per_worker * self.data_parallel_size

    @property
    def uses_standard_loop(self) -> bool:
        """rayapp's own loop trains the job (not the user's train.loop, nor a script)."""
        return self.train.loop is None and self.train.script is None

    @property
    def num_train_samples(self) -> int | None:
        """Training samples across all workers for one epoch; None for a user's data set (known once built)."""
        if self.data.factory is not None:
            return None
        if self.train.scaling == "weak":
            return self.data.steps_per_epoch * self.train.batch_size * self.data_parallel_size
        return DATASETS.get(self.data.kind).meta.get("train_samples", self.data.num_samples)

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
        """Optimizer steps each worker takes per epoch; None for a user's data set (known once built)."""
        if self.num_train_samples is None:
            return None
        return (self.num_train_samples // self.data_parallel_size) // self.batch_size_per_worker
