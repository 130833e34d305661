"""The job spec: one frozen, validated description of a training job.

Every value a job can take is checked here, once, so the driver and the worker
loop never re-check input. Names (model, data, loss, optimizer, strategy) are checked against
the registries of :mod:`rayapp.spec.catalog`. Specs are built by :mod:`rayapp.spec.loader` from
defaults < job YAML < command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rayapp.spec.catalog import DATASETS, LOSSES, MODELS, OPTIMIZERS, STRATEGIES
from rayapp.spec.errors import SpecError

BACKENDS = ("auto", "nccl", "gloo", "mpi")
SCALINGS = ("strong", "weak")


def _one_of(field_name: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise SpecError(f"{field_name}: {value!r} is not accepted; use one of: {', '.join(accepted)}")


def _positive_int(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{field_name}: {value!r} is not accepted; use a whole number >= 1")


def _positive_number(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise SpecError(f"{field_name}: {value!r} is not accepted; use a number > 0")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    kind: str = "linear"
    """`linear` (the article's nn.Linear) or `mlp`. Input and output sizes come from the data."""
    hidden: tuple[int, ...] = ()
    """Hidden layer widths of the `mlp`; must be empty for `linear`."""

    def __post_init__(self) -> None:
        MODELS.check(self.kind)
        if not isinstance(self.hidden, tuple):
            raise SpecError(f"model.hidden: {self.hidden!r} is not accepted; use a list of widths, e.g. [256, 256]")
        for width in self.hidden:
            _positive_int("model.hidden[]", width)
        hidden_rule = MODELS.get(self.kind).meta.get("hidden")
        if hidden_rule == "required" and not self.hidden:
            raise SpecError(f"model.hidden: [] is not accepted for kind {self.kind}; give at least one width, e.g. [256]")
        if hidden_rule == "none" and self.hidden:
            raise SpecError(
                f"model.hidden: {list(self.hidden)} is not accepted for kind {self.kind}; remove it or use kind: mlp"
            )


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    kind: str = "random"
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

    def __post_init__(self) -> None:
        DATASETS.check(self.kind)
        for name in ("features", "targets", "steps_per_epoch", "num_samples"):
            _positive_int(f"data.{name}", getattr(self, name))

    @property
    def input_size(self) -> int:
        return DATASETS.get(self.kind).meta.get("input_size", self.features)

    @property
    def output_size(self) -> int:
        return DATASETS.get(self.kind).meta.get("output_size", self.targets)

    @property
    def is_classification(self) -> bool:
        return DATASETS.get(self.kind).meta["classification"]

    @property
    def fixed_size(self) -> bool:
        """A real data set of a given size, which weak scaling cannot grow."""
        return DATASETS.get(self.kind).meta["fixed_size"]


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    epochs: int = 10
    batch_size: Optional[int] = 64
    """Weak scaling: samples per worker per step. Strong scaling: derived (global_batch_size / world_size)."""
    global_batch_size: Optional[int] = None
    """Strong scaling: samples per step across all workers, fixed whatever the world size."""
    lr: float = 0.001
    optimizer: str = "sgd"
    loss: Optional[str] = None
    """A built-in loss (mse, cross_entropy); none: cross_entropy for labelled data, else mse."""
    seed: int = 0
    scaling: str = "weak"
    """`weak`: each worker keeps its own batch and steps (the article's loop); `strong`: a fixed
    global data set and global batch are split across workers."""
    strategy: str = "ddp"
    """`ddp` (DistributedDataParallel), `fsdp` (FSDP2 fully_shard), `dp` (nn.DataParallel over the
    GPUs of one node, one process) or `mp` (the model's layers split across two GPUs, one process)."""

    def __post_init__(self) -> None:
        _positive_int("train.epochs", self.epochs)
        _positive_number("train.lr", self.lr)
        OPTIMIZERS.check(self.optimizer)
        if self.loss is not None:
            LOSSES.check(self.loss)
        _one_of("train.scaling", self.scaling, SCALINGS)
        STRATEGIES.check(self.strategy)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"train.seed: {self.seed!r} is not accepted; use a whole number >= 0")
        if self.scaling == "weak":
            if self.batch_size is None:
                raise SpecError("train.batch_size: missing; weak scaling needs a per-worker batch size, e.g. 64")
            _positive_int("train.batch_size", self.batch_size)
            if self.global_batch_size is not None:
                raise SpecError(
                    f"train.global_batch_size: {self.global_batch_size!r} is not accepted with scaling weak "
                    "(the global batch is batch_size * world_size); remove it or use scaling: strong"
                )
        else:
            if self.global_batch_size is None:
                raise SpecError("train.global_batch_size: missing; strong scaling needs a fixed global batch, e.g. 512")
            _positive_int("train.global_batch_size", self.global_batch_size)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    nodes: int = 1
    """Ray nodes the workers are spread over (embedded: raylets started on this machine)."""
    workers_per_node: int = 1
    backend: str = "auto"
    """torch.distributed backend; `auto` picks nccl on GPUs and gloo on CPUs."""
    cpus_per_worker: int = 1
    address: Optional[str] = None
    """Existing Ray cluster (`ray://`, `HOST:PORT`, or a Jobs API `http://HOST:8265`); none: embedded cluster."""
    storage_path: str = "rayapp_results"
    """Where Ray Train keeps checkpoints; must be shared storage (NFS, s3://, gs://) on a real cluster."""
    max_failures: int = 0
    """Worker failures Ray Train recovers from (restarting from the last checkpoint)."""

    def __post_init__(self) -> None:
        _positive_int("cluster.nodes", self.nodes)
        _positive_int("cluster.workers_per_node", self.workers_per_node)
        _positive_int("cluster.cpus_per_worker", self.cpus_per_worker)
        _one_of("cluster.backend", self.backend, BACKENDS)
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise SpecError(f"cluster.max_failures: {self.max_failures!r} is not accepted; use a whole number >= 0")
        if not isinstance(self.storage_path, str) or not self.storage_path:
            raise SpecError(f"cluster.storage_path: {self.storage_path!r} is not accepted; use a directory or URI")
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise SpecError(f"cluster.address: {self.address!r} is not accepted; use HOST:PORT, ray://HOST:10001 or http://HOST:8265")

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node


@dataclass(frozen=True, kw_only=True)
class TrackingSpec:
    experiment: str = "rayapp"
    tracking_uri: Optional[str] = None
    """MLflow tracking URI; none: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory."""

    def __post_init__(self) -> None:
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            raise SpecError(f"tracking.experiment: {self.experiment!r} is not accepted; use a non-empty name")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise SpecError(f"name: {self.name!r} is not accepted; use a non-empty job name")
        if self.data.fixed_size and self.train.scaling == "weak":
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
        world = self.cluster.world_size
        if self.train.scaling == "strong":
            gbs = self.train.global_batch_size
            if gbs % world:
                raise SpecError(
                    f"train.global_batch_size: {gbs} is not divisible by world_size {world} "
                    f"(nodes {self.cluster.nodes} * workers_per_node {self.cluster.workers_per_node}); "
                    "pick a global batch that is a multiple of the world size"
                )
            per_rank_samples = self.num_train_samples // world
            if per_rank_samples < gbs // world:
                raise SpecError(
                    f"data.num_samples: {self.num_train_samples} gives {per_rank_samples} samples per worker, "
                    f"fewer than one batch of {gbs // world}; raise num_samples or lower global_batch_size"
                )

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def batch_size_per_worker(self) -> int:
        if self.train.scaling == "weak":
            return self.train.batch_size
        return self.train.global_batch_size // self.world_size

    @property
    def global_batch_size(self) -> int:
        return self.batch_size_per_worker * self.world_size

    @property
    def num_train_samples(self) -> int:
        """Training samples across all workers for one epoch."""
        if self.train.scaling == "weak":
            return self.data.steps_per_epoch * self.train.batch_size * self.world_size
        return DATASETS.get(self.data.kind).meta.get("train_samples", self.data.num_samples)

    @property
    def loss(self) -> str:
        """The loss name: train.loss, else the data's natural one."""
        return self.train.loss or ("cross_entropy" if self.data.is_classification else "mse")

    @property
    def single_process(self) -> bool:
        """One worker process driving several GPUs of one node (dp, mp)."""
        return bool(STRATEGIES.get(self.train.strategy).meta.get("single_process"))

    @property
    def steps_per_epoch(self) -> int:
        return (self.num_train_samples // self.world_size) // self.batch_size_per_worker
