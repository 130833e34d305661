"""train.pipeline: strategy pp's options, and its checks against the whole job."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rayapp.spec.catalog import STRATEGIES
from rayapp.spec.checks import check_one_of, check_positive_int
from rayapp.spec.errors import SpecError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """train.pipeline, for strategy pp: the model's layers in `stages` (default: one per worker),
    each batch in `microbatches`, run by `schedule`: gpipe (all forwards, then all backwards) or
    1f1b (one forward, one backward: fewer activations held). Idle share of an ideal pipeline:
    (stages - 1) / (microbatches + stages - 1)."""

    stages: int | None = None
    microbatches: int = 4
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        if self.stages is not None and (
            isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2
        ):
            raise SpecError(
                f"train.pipeline.stages: {self.stages!r} is not accepted; use a whole number >= 2"
            )
        check_positive_int("train.pipeline.microbatches", self.microbatches)
        check_one_of("train.pipeline.schedule", self.schedule, SCHEDULES)


def _shown(value: Any) -> str:
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    )


def check_pipeline(job: Any) -> None:
    """Strategy pp against the whole job (a JobSpec); fills in train.pipeline.stages (the world size)."""
    pipe, world = job.train.pipeline, job.world_size
    for dotted, (accepted, why) in STRATEGIES.get("pp").meta["only_with"].items():
        section, _, key = dotted.partition(".")
        if (value := getattr(getattr(job, section), key)) not in accepted:
            raise SpecError(
                f"{dotted}: {_shown(value)} is not accepted with train.strategy 'pp' ({why}); "
                f"use {' or '.join(map(_shown, accepted))}"
            )
    if pipe.stages is None and world < 2:
        raise SpecError(
            f"train.strategy: 'pp' is not accepted with world_size {world}: it runs one stage per "
            "worker, 2 or more; use --nodes 2 (or more), or ddp"
        )
    if pipe.stages is None:
        object.__setattr__(job.train, "pipeline", pipe := replace(pipe, stages=world))
    elif pipe.stages != world:
        raise SpecError(
            f"train.pipeline.stages: {pipe.stages} is not accepted with world_size {world} (nodes "
            f"{job.cluster.nodes} * workers_per_node {job.cluster.workers_per_node}); strategy pp "
            f"runs one stage per worker: use stages {world}, or {pipe.stages} workers"
        )
    layers = (
        len(job.model.hidden) + 1
    )  # the Linear layers of a built-in model; a factory's is checked when built
    if job.model.factory is None and layers < pipe.stages:
        raise SpecError(
            f"model.kind: {job.model.kind!r} with hidden {list(job.model.hidden)} has {layers} layer(s) "
            f"to split, fewer than train.pipeline.stages {pipe.stages}; use kind mlp with at least "
            f"{pipe.stages - 1} hidden widths, or a model.factory returning an nn.Sequential"
        )
    if job.batch_size_per_worker % pipe.microbatches:
        raise SpecError(
            f"train.pipeline.microbatches: {pipe.microbatches} does not divide the batch of "
            f"{job.batch_size_per_worker} each pipeline takes; use a divisor of it"
        )
