"""The job's model, data, tracking and checkpoint sections. Names (model and data kinds) are the
``Literal`` types of :mod:`rayapp.spec.catalog`, whose registries hold their builders."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, model_validator
from pydantic.dataclasses import dataclass

from rayapp.spec.catalog import DATASETS, MODELS, DataKind, ModelKind
from rayapp.spec.errors import SpecError
from rayapp.spec.fields import (
    SECTION_CONFIG,
    ImportPath,
    NonBlank,
    Number,
    Switch,
    Text,
    WholeNumber,
    given_fields,
    section,
    with_fields,
)

Width = Annotated[WholeNumber, Field(ge=1)]
ModelName = Annotated[
    str,
    Strict(),
    # MLflow's model registry refuses '/' and ':' in a name (they separate parts of models:/ URIs).
    Field(pattern=r"^[^/:]*[^/:\s][^/:]*$", json_schema_extra={"format": "model-name"}),
]
Arguments = Annotated[
    dict[Text, Any],
    Field(description="Keyword arguments for `factory`.", examples=[{"hidden": 48}]),
]


def check_one_source(path: str, kind: object, factory: object) -> None:
    if kind is not None and factory is not None:
        raise SpecError(
            f"{path}.factory: {factory!r} is not accepted together with {path}.kind {kind!r}; "
            f"give one of them: kind for a built-in, factory for your own"
        )


def _kind_unless_given(data: Any, kind: str) -> Any:
    """A section's document with `kind` set when it names neither a kind nor a factory."""
    fields = given_fields(data)
    if fields is None or fields.get("kind") is not None or fields.get("factory") is not None:
        return data
    return with_fields(data, {**fields, "kind": kind})


@section("model")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class ModelSpec:
    kind: ModelKind | None = Field(
        default=None,
        description="A built-in model (default linear: the article's nn.Linear); input and "
        "output sizes come from the data.",
    )
    hidden: tuple[Width, ...] = Field(
        default=(),
        description="Hidden layer widths of the mlp; empty for linear.",
        examples=[[256, 256]],
    )
    factory: ImportPath | None = Field(
        default=None,
        description="Your own model instead: module:function returning an nn.Module, called "
        "with `args`; imported from the job file's directory first, then installed packages.",
        examples=["mymodels:build"],
    )
    args: Arguments = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _built_in_by_default(cls, data: Any) -> Any:
        return _kind_unless_given(data, "linear")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        check_one_source("model", self.kind, self.factory)
        if self.factory is not None:
            if self.hidden:
                raise SpecError(
                    "model.hidden: only for built-in models; pass your factory's sizes in "
                    "model.args"
                )
            return self
        if self.args:
            raise SpecError(
                f"model.args: {self.args!r} is only for model.factory; built-in models take "
                "model.hidden"
            )
        hidden_rule = MODELS.get(self.kind or "linear").meta.get("hidden")
        if hidden_rule == "required" and not self.hidden:
            raise SpecError(
                f"model.hidden: [] is not accepted for kind {self.kind}; give at least one width, "
                "e.g. [256]"
            )
        if hidden_rule == "none" and self.hidden:
            raise SpecError(
                f"model.hidden: {list(self.hidden)} is not accepted for kind {self.kind}; remove "
                "it or use kind: mlp"
            )
        return self


@section("data")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class DataSpec:
    kind: DataKind | None = Field(
        default=None,
        description="A built-in data set (default random): random, fresh Gaussian batches as in "
        "the article; synthetic, a fixed, seeded, learnable regression set; digits, "
        "scikit-learn's 8x8 handwritten digits (10 classes, test accuracy).",
    )
    features: WholeNumber = Field(default=10, ge=1, description="Input width (random, synthetic).")
    targets: WholeNumber = Field(default=10, ge=1, description="Output width (random, synthetic).")
    steps_per_epoch: WholeNumber = Field(
        default=100,
        ge=1,
        description="Weak scaling: batches each worker trains per epoch, so the data set grows "
        "with the world size.",
    )
    num_samples: WholeNumber = Field(
        default=8192,
        ge=1,
        description="Strong scaling: size of the fixed global training set, split across workers.",
    )
    factory: ImportPath | None = Field(
        default=None,
        description="Your own data instead: module:function returning a map-style Dataset, or "
        "(train, test), called with `args`; each worker takes its shard.",
        examples=["mydata:load"],
    )
    args: Arguments = Field(default_factory=dict)
    loader_workers: WholeNumber = Field(
        default=0,
        ge=0,
        description="DataLoader worker processes per training worker; 0 loads in the training "
        "process (best for in-memory tensors).",
    )

    @model_validator(mode="before")
    @classmethod
    def _built_in_by_default(cls, data: Any) -> Any:
        return _kind_unless_given(data, "random")

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        check_one_source("data", self.kind, self.factory)
        if self.factory is None and self.args:
            raise SpecError(f"data.args: {self.args!r} is only for data.factory")
        return self

    @property
    def _meta(self) -> dict[str, Any]:
        # A user's data set: a fixed, real set whose labels the loss (train.loss) says.
        if self.kind is None:
            return {"classification": None, "fixed_size": True}
        return dict(DATASETS.get(self.kind).meta)

    @property
    def input_size(self) -> int:
        size: int = self._meta.get("input_size", self.features)
        return size

    @property
    def output_size(self) -> int:
        size: int = self._meta.get("output_size", self.targets)
        return size

    @property
    def is_classification(self) -> bool | None:
        """True/False for built-ins; None for a user's data set (train.loss decides)."""
        labelled: bool | None = self._meta["classification"]
        return labelled

    @property
    def fixed_size(self) -> bool:
        """A real data set of a given size, which weak scaling cannot grow."""
        return bool(self._meta["fixed_size"])


@section("tracking")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class TrackingSpec:
    experiment: NonBlank = Field(default="rayapp", description="MLflow experiment name.")
    tracking_uri: NonBlank | None = Field(
        default=None,
        description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.",
    )
    log_every_steps: WholeNumber = Field(
        default=0,
        ge=0,
        description="Log step_loss and step_samples_per_s every N optimizer steps; 0: off.",
    )
    system_metrics_s: Number = Field(
        default=10.0,
        ge=0,
        description="Seconds between per-node CPU/memory/network/GPU samples (MLflow's system "
        "metrics, system/<node>/...); 0: off.",
    )
    register_model: ModelName | None = Field(
        default=None,
        description="Register the trained model (logged as the run's MLflow Model `model`) as a "
        "new version of this registered model.",
        examples=["digits-classifier"],
    )


@section("checkpoint")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class CheckpointSpec:
    every_epochs: WholeNumber = Field(
        default=1,
        ge=1,
        description="Checkpoint after every K-th epoch (and always after the last).",
    )
    format: Literal["dcp", "full"] = Field(
        default="dcp",
        description="dcp: torch.distributed.checkpoint, each rank writes its shard and resume may "
        "change the world size; full: rank 0 saves the gathered state dict.",
    )
    async_save: Switch = Field(
        default=False,
        alias="async",
        description="DCP only: write in the background while the next epoch trains.",
    )

    @model_validator(mode="after")
    def _async_needs_dcp(self) -> CheckpointSpec:
        if self.async_save and self.format != "dcp":
            raise SpecError(
                "checkpoint.async: true is not accepted with format full; use format: dcp"
            )
        return self
