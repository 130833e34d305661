"""train.pipeline: strategy pp's options, and its checks against the whole job."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rayapp.spec.catalog import STRATEGIES
from rayapp.spec.errors import SpecError
from rayapp.spec.fields import SECTION_CONFIG, WholeNumber, section

Schedule = Literal["gpipe", "1f1b"]


@section("train.pipeline")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class PipelineSpec:
    """train.pipeline, for strategy pp: the model's layers in `stages` (default: one per worker),
    each batch in `microbatches`, run by `schedule`: gpipe (all forwards, then all backwards) or
    1f1b (one forward, one backward: fewer activations held). Idle share of an ideal pipeline:
    (stages - 1) / (microbatches + stages - 1)."""

    stages: WholeNumber | None = Field(
        default=None, ge=2, description="Pipeline stages, one per worker (default: the world size)."
    )
    microbatches: WholeNumber = Field(
        default=4,
        ge=1,
        description="Micro-batches each batch is split into (>= stages keeps the bubble small).",
    )
    schedule: Schedule = Field(
        default="gpipe",
        description="gpipe: all forwards, then all backwards; 1f1b: fewer activations.",
    )


def _shown(value: Any) -> str:
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    )


def pipeline_shapes(nodes: int, workers_per_node: int) -> tuple[int, ...]:
    """The stage counts pp accepts: one pipeline over every worker, or (2 nodes or more, 2 workers
    or more each) one pipeline per node, the pipelines data-parallel across the nodes: the run's
    2-D mesh with a pipeline along each ``shard`` row and each stage's copies along ``replicate``.
    A pipeline never spans part of a node: its neighbours' activations would cross the network
    while workers of the same node sat in other pipelines."""
    world = nodes * workers_per_node
    if nodes >= 2 and workers_per_node >= 2:
        return (world, workers_per_node)
    return (world,)


def check_pipeline(job: Any) -> None:
    """Strategy pp against the whole job (a JobSpec, whose train.pipeline.stages is filled in)."""
    pipe, world = job.train.pipeline, job.world_size
    for dotted, (accepted, why) in STRATEGIES.get("pp").meta["only_with"].items():
        part, _, key = dotted.partition(".")
        if (value := getattr(getattr(job, part), key)) not in accepted:
            raise SpecError(
                f"{dotted}: {_shown(value)} is not accepted with train.strategy 'pp' ({why}); "
                f"use {' or '.join(map(_shown, accepted))}"
            )
    if pipe.stages is None and world < 2:
        raise SpecError(
            f"train.strategy: 'pp' is not accepted with world_size {world}: it runs one stage per "
            "worker, 2 or more; use --nodes 2 (or more), or ddp"
        )
    nodes, per_node = job.cluster.nodes, job.cluster.workers_per_node
    shapes = pipeline_shapes(nodes, per_node)
    if pipe.stages not in shapes:
        per_node_pipelines = (
            f", or one pipeline per node with the nodes data-parallel (stages {per_node}, the "
            "run's 2-D mesh)"
            if len(shapes) > 1
            else ""
        )
        raise SpecError(
            f"train.pipeline.stages: {pipe.stages} is not accepted with world_size {world} (nodes "
            f"{nodes} * workers_per_node {per_node}); strategy pp runs one stage per worker, in "
            f"one pipeline over every worker (stages {world}){per_node_pipelines}: use stages "
            f"{' or '.join(map(str, shapes))}, or {pipe.stages} workers"
        )
    layers = (
        len(job.model.hidden) + 1
    )  # the Linear layers of a built-in model; a factory's is checked when built
    if job.model.factory is None and layers < pipe.stages:
        raise SpecError(
            f"model.kind: {job.model.kind!r} with hidden {list(job.model.hidden)} has {layers} "
            "layer(s) "
            f"to split, fewer than train.pipeline.stages {pipe.stages}; use kind mlp with at least "
            f"{pipe.stages - 1} hidden widths, or a model.factory returning an nn.Sequential"
        )
    if job.batch_size_per_worker % pipe.microbatches:
        raise SpecError(
            f"train.pipeline.microbatches: {pipe.microbatches} does not divide the batch of "
            f"{job.batch_size_per_worker} each pipeline takes; use a divisor of it"
        )
