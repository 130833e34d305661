"""The built-in entries of every registry. Builders live in :mod:`rayapp.train`; only their import
paths and the metadata the spec validates against are here, so reading a job needs no torch.
Strategy pp's own options (``train.pipeline``) are in :mod:`rayapp.spec.pipeline`."""

from __future__ import annotations

from typing import Literal, get_args

from rayapp.spec.registry import Registry

# The names each field accepts, as types: what validation, `rayapp schema` and the CLI's choices
# read. Each registry below holds the builder of every one of them.
ModelKind = Literal["linear", "mlp"]
DataKind = Literal["random", "synthetic", "digits"]
LossName = Literal["mse", "cross_entropy"]
OptimizerName = Literal["sgd", "adam", "adamw"]
StrategyName = Literal["ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "dp", "mp", "pp"]

MODELS = Registry("model.kind", get_args(ModelKind))
MODELS.register(
    "linear",
    "rayapp.train.models:build_linear",
    "nn.Linear(in, out): the article's model",
    hidden="none",
)
MODELS.register(
    "mlp",
    "rayapp.train.models:build_mlp",
    "Linear+ReLU layers of model.hidden widths",
    hidden="required",
)

DATASETS = Registry("data.kind", get_args(DataKind))
DATASETS.register(
    "random",
    "rayapp.train.data:random_regression",
    "fresh Gaussian inputs and targets, as in the article: nothing to learn, only work to do",
    classification=False,
    fixed_size=False,
)
DATASETS.register(
    "synthetic",
    "rayapp.train.data:synthetic_regression",
    "a fixed, seeded regression set whose target a model can learn",
    classification=False,
    fixed_size=False,
)
DIGITS_TOTAL_SAMPLES = 1797
DIGITS_TEST_SAMPLES = round(
    DIGITS_TOTAL_SAMPLES * 0.2
)  # a fixed 80/20 split keeps accuracy comparable
DATASETS.register(
    "digits",
    "rayapp.train.data:digits",
    "scikit-learn's bundled 8x8 handwritten digits (real data, 10 classes, 80/20 split)",
    classification=True,
    fixed_size=True,
    input_size=64,
    output_size=10,
    train_samples=DIGITS_TOTAL_SAMPLES - DIGITS_TEST_SAMPLES,
)

LOSSES = Registry("train.loss", get_args(LossName))
LOSSES.register("mse", "torch.nn:MSELoss", "mean squared error (regression)")
LOSSES.register(
    "cross_entropy", "torch.nn:CrossEntropyLoss", "cross entropy over class logits (classification)"
)

OPTIMIZERS = Registry("train.optimizer", get_args(OptimizerName))
OPTIMIZERS.register("sgd", "torch.optim:SGD")
OPTIMIZERS.register("adam", "torch.optim:Adam")
OPTIMIZERS.register("adamw", "torch.optim:AdamW")

STRATEGIES = Registry("train.strategy", get_args(StrategyName))
STRATEGIES.register(
    "ddp", "rayapp.train.strategies:apply_ddp", "DistributedDataParallel: one replica per worker"
)
STRATEGIES.register(
    "fsdp",
    "rayapp.train.strategies:apply_fsdp",
    "FSDP2 fully_shard: parameters sharded over workers",
)
# The strategies below train over the run's 2-D device mesh (rayapp.train.mesh): dim "replicate"
# spans the nodes, dim "shard" the workers of one node, so what talks most stays inside a node.
STRATEGIES.register(
    "hsdp",
    "rayapp.train.strategies:apply_hsdp",
    "hybrid sharding: FSDP2 shards parameters within a node and replicates them across nodes",
    mesh=True,
)
STRATEGIES.register(
    "tp",
    "rayapp.train.strategies:apply_tp",
    "tensor parallelism within a node (column-/row-wise linear pairs), data parallel across nodes",
    mesh=True,
    tensor_parallel=True,
)
STRATEGIES.register(
    "fsdp+tp",
    "rayapp.train.strategies:apply_fsdp_tp",
    "tensor parallelism within a node, FSDP2 sharding across nodes",
    mesh=True,
    tensor_parallel=True,
)
STRATEGIES.register(
    "dp",
    "rayapp.train.strategies:apply_dp",
    "nn.DataParallel over the GPUs of one node, one process",
    single_process=True,
    min_gpus=2,
)
STRATEGIES.register(
    "mp",
    "rayapp.train.strategies:apply_mp",
    "the model's layers split across two GPUs of one node, one process",
    single_process=True,
    min_gpus=2,
    needs_sequential=True,
)
STRATEGIES.register(
    "pp",
    "rayapp.train.pipeline:apply_pp",
    "pipeline parallelism: the model's layers in stages, one per worker, fed micro-batches "
    "(train.pipeline)",
    # Settings pp cannot honour: (what it accepts, why).
    only_with={
        "train.loop": ((None,), "it runs rayapp's built-in loop"),
        "train.script": ((None,), "it runs rayapp's built-in loop"),
        "train.compile": ((False,), "its stages are not compiled"),
        "train.grad_accum_steps": ((1,), "train.pipeline.microbatches splits each batch instead"),
        "train.grad_clip": (
            (None,),
            "each stage sees only its own gradients, not their global norm",
        ),
        "train.precision": (
            ("fp32", "bf16"),
            "fp16's loss scaling is not applied inside the pipeline schedule",
        ),
        "checkpoint.format": (("dcp",), "each stage saves its own part of the model"),
        "tracking.log_every_steps": ((0,), "step-level metrics would count every stage's samples"),
    },
)
