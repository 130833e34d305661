"""The job's train section: the loop, its optimizer and loss, batch sizes, precision, and the
parallel strategy (with strategy pp's own options, ``train.pipeline``)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from rayapp.spec.catalog import LossName, OptimizerName, StrategyName
from rayapp.spec.errors import SpecError
from rayapp.spec.fields import (
    SECTION_CONFIG,
    ImportPath,
    NonBlank,
    NonNegativeNumber,
    PositiveNumber,
    Switch,
    Text,
    WholeNumber,
    given_fields,
    section,
    with_fields,
)
from rayapp.spec.pipeline import PipelineSpec

Scaling = Literal["strong", "weak"]
Precision = Literal["fp32", "bf16", "fp16"]
SCALINGS: tuple[str, ...] = get_args(Scaling)
PRECISIONS: tuple[str, ...] = get_args(Precision)
WEAK_BATCH_SIZE = 64


@section("train")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class TrainSpec:
    epochs: WholeNumber = Field(default=10, ge=1, description="Epochs to train.")
    batch_size: WholeNumber | None = Field(
        default=None,
        ge=1,
        description=f"Per-worker batch, weak scaling (default {WEAK_BATCH_SIZE}); strong scaling "
        "derives it (global_batch_size / world_size).",
    )
    global_batch_size: WholeNumber | None = Field(
        default=None,
        ge=1,
        description="Global batch, strong scaling: samples per step across all workers, "
        "whatever the world size.",
    )
    lr: PositiveNumber = Field(default=0.001, description="Learning rate.")
    optimizer: OptimizerName | ImportPath = Field(
        default="sgd", description="A built-in optimizer, or module:function returning one."
    )
    loss: LossName | ImportPath | None = Field(
        default=None,
        description="A built-in loss, or module:function returning a loss module or function; "
        "default: cross_entropy for labelled data, else mse.",
    )
    loop: ImportPath | None = Field(
        default=None,
        description="Your own per-worker loop, module:function(ctx) (rayapp.train.context).",
        examples=["mytrain:train_loop"],
    )
    args: dict[Text, Any] = Field(
        default_factory=dict, description="Keyword arguments your loop reads as ctx.args."
    )
    script: NonBlank | None = Field(
        default=None,
        description="Run this torchrun-style script on every worker instead of a loop; its "
        "arguments follow --.",
        examples=["train.py"],
    )
    script_args: tuple[Text, ...] = Field(
        default=(), description="Command-line arguments for the script."
    )
    precision: Precision = Field(
        default="fp32",
        description="bf16/fp16 train in mixed precision (autocast; fp16 with a gradient scaler, "
        "GPUs only).",
    )
    compile: Switch = Field(
        default=False, description="torch.compile the model (after the strategy wraps it)."
    )
    grad_accum_steps: WholeNumber = Field(
        default=1,
        ge=1,
        description="Micro-batches whose gradients add up before each optimizer step.",
    )
    grad_clip: PositiveNumber | None = Field(
        default=None, description="Clip the gradients' global norm to this before each step."
    )
    timing_every: WholeNumber = Field(
        default=50,
        ge=1,
        description="Steps between reads of the step timers (their only device syncs) and between "
        "samples of DDP's communication timings, which are scaled up to the epoch.",
    )
    seed: WholeNumber = Field(default=0, ge=0, description="Seed for data, weights and shuffling.")
    scaling: Scaling = Field(
        default="weak",
        description="weak: each worker keeps its own batch and steps (the article's loop); "
        "strong: a fixed global data set and batch are split across workers.",
    )
    strategy: StrategyName = Field(
        default="ddp",
        description="ddp (DistributedDataParallel), fsdp (FSDP2), hsdp (FSDP2 sharded within a "
        "node, replicated across nodes), tp (tensor parallel within a node), fsdp+tp, dp "
        "(nn.DataParallel, one node), mp (layers split across two GPUs) or pp (pipeline stages, "
        "train.pipeline).",
    )
    pipeline: PipelineSpec | None = Field(
        default=None, description="Strategy pp's stages, micro-batches and schedule."
    )
    hang_timeout_s: NonNegativeNumber | None = Field(
        default=None,
        description="Seconds with no rank finishing a step before the run is called hung: every "
        "rank's stack goes to MLflow (hang/), the ranks outside the collective the others wait in "
        "are named, and the run restarts (max_failures) or fails; 0: off; default: 600 until the "
        "first epoch ends, then 10x the longest pause between steps so far, at least 300.",
    )
    collective_timeout_s: PositiveNumber = Field(
        default=1800,
        description="Seconds a collective (all-reduce, barrier) may wait for its peers before it "
        "raises (the process group's timeout): a lost peer fails the run instead of blocking it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_strategy_and_scaling(cls, data: Any) -> Any:
        """Weak scaling's per-worker batch and strategy pp's options have defaults of their own."""
        fields = given_fields(data)
        if fields is None:
            return data
        if fields.get("scaling", "weak") == "weak" and fields.get("batch_size") is None:
            fields["batch_size"] = WEAK_BATCH_SIZE
        if fields.get("strategy") == "pp" and fields.get("pipeline") is None:
            fields["pipeline"] = {}
        return with_fields(data, fields)

    @model_validator(mode="after")
    def _settings_agree(self) -> TrainSpec:
        if self.script is not None and self.loop is not None:
            raise SpecError(
                "train.script and train.loop: give one; a script runs instead of any loop"
            )
        if self.pipeline is not None and self.strategy != "pp":
            raise SpecError(
                f"train.pipeline: only for train.strategy pp, not {self.strategy!r}; remove it or "
                "use pp"
            )
        if self.scaling == "weak" and self.global_batch_size is not None:
            raise SpecError(
                f"train.global_batch_size: {self.global_batch_size!r} is not accepted with "
                "scaling weak "
                "(the global batch is batch_size * world_size); remove it or use scaling: strong"
            )
        if self.scaling == "strong" and self.batch_size is not None:
            raise SpecError(
                f"train.batch_size: {self.batch_size!r} is not accepted with scaling strong "
                "(it is global_batch_size / world_size); set train.global_batch_size "
                "(--global-batch-size) instead"
            )
        if self.scaling == "strong" and self.global_batch_size is None:
            raise SpecError(
                "train.global_batch_size: missing; strong scaling needs a fixed global batch, "
                "e.g. 512"
            )
        return self
