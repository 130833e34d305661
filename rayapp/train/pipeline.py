"""Pipeline parallelism (``train.strategy: pp``): the model's layers cut into stages, one per
worker, in one pipeline over every worker or one per node, the pipelines data-parallel
(:mod:`rayapp.train.pipeline_mesh`).

:func:`apply_pp` (the strategy's entry in :mod:`rayapp.spec.catalog`) keeps this rank's stage of an
nn.Sequential: its children, grouped so a parameterless layer (a ReLU) stays with the layer before
it, are split into ``train.pipeline.stages`` contiguous parts with the largest part's parameter
count as small as it can be. Layers keep their names ("2.weight" on stage 1), so each stage's state
dict has keys of its own and a DCP checkpoint holds every stage side by side.

:func:`pipeline_loop` is the built-in loop under pp (:func:`rayapp.train.loop.standard_loop` hands
over to it). It trains through the same :class:`TrainContext` as every loop (resume, exactly-once
epochs, timings, checkpoints) and runs each batch with torch.distributed.pipelining's GPipe or 1F1B
schedule over the process group Ray Train formed (Gloo on CPUs, NCCL on GPUs). All stages of a
pipeline read the same batches (they are one data-parallel replica): stage 0 feeds the inputs, the
last stage takes the targets and the loss, and the loss is averaged over the pipelines' last stages
so rank 0 logs it. With several pipelines each reads its own share of the data and each stage's
gradients are averaged with its copies before the step.

Per epoch, beside the standard metrics: ``pipeline_bubble`` (measured: the share of each stage's
schedule time spent outside its own forward, backward and loss, averaged over stages) against
``pipeline_bubble_ideal`` ((S - 1) / (M + S - 1)), and ``stage_<i>_compute_time_s`` and
``stage_<i>_peak_mem_mb`` of every stage, gathered to rank 0; at the end, ``stage_<i>_param_bytes``.
``comm_time_s`` is the time each stage spent in the schedule's activation and gradient send/recv:
everything in a schedule step but the stage's own compute (the slowest stage's, as for DDP). A
blocking receive cannot tell waiting for the neighbouring stage from moving the bytes, so this is
transfer plus waiting, the idle time whose share is the bubble.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from rayapp.spec import JobSpec
from rayapp.tracking.run import TAG_MESH
from rayapp.train import collectives
from rayapp.train.data import build_datasets, build_loader, shard_sampler
from rayapp.train.mesh import describe
from rayapp.train.models import build_loss, build_model, build_optimizer
from rayapp.train.pipeline_mesh import PipelinePlace, average_gradients, pipeline_place
from rayapp.train.pipeline_split import split_model
from rayapp.train.strategies import Placement, local_parameter_bytes
from rayapp.train.timing import DeviceTimer

TIMED_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad")
"""A stage's own compute inside a schedule step (the loss is timed through the loss function)."""


def apply_pp(model: nn.Module, *, device: torch.device, spec: JobSpec) -> Placement:
    """This rank's stage of `model`, on `device` (the other stages' layers are dropped here).
    Pipelines are blocks of consecutive ranks (:mod:`rayapp.train.pipeline_mesh`)."""
    pipe = spec.train.pipeline
    assert pipe is not None and pipe.stages is not None  # the spec resolves a pp job's stages
    stage = split_model(model, pipe.stages)[dist.get_rank() % pipe.stages]
    return Placement(stage.to(device), device, device)


# ---- timing ----------------------------------------------------------------------------


class StageClock:
    """This stage's schedule time and compute time in the current epoch (CUDA events on GPUs).

    It also stands in for TrainContext's gradient-communication clock (``step_finished``,
    ``take_total_s``, the interface of rayapp.train.timing.DdpCommClock), so the epoch's
    ``comm_time_s`` is the schedule's time outside compute: its send/recv, waits included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.schedule, self.compute = DeviceTimer(self.device), DeviceTimer(self.device)
        self._figures: tuple[float, float] | None = None

    def timed(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.compute.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute.stop()

        return wrapper

    def figures(self) -> tuple[float, float]:
        """(schedule seconds, compute seconds) of the epoch so far; read once, at its end."""
        if self._figures is None:
            self._figures = (self.schedule.total_s(), self.compute.total_s())
        return self._figures

    def step_finished(self) -> None:
        pass

    def take_total_s(self) -> float:
        schedule_s, compute_s = self.figures()
        self._reset()
        return max(schedule_s - compute_s, 0.0)


# ---- the loop --------------------------------------------------------------------------


def make_schedule(
    spec: JobSpec,
    model: nn.Module,
    loss_fn: Callable,
    *,
    rank: int,
    device: torch.device,
    clock: StageClock,
    group: dist.ProcessGroup | None = None,
):
    """This rank's PipelineStage (stage `rank` of the pipeline whose process group is `group`,
    default: every rank) in the job's schedule, with its compute timed by `clock`."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipe = spec.train.pipeline
    assert pipe is not None and pipe.stages is not None  # the spec resolves a pp job's stages
    stage = PipelineStage(model, rank, pipe.stages, device, group=group)
    for name in TIMED_STAGE_METHODS:
        if hasattr(stage, name):
            setattr(stage, name, clock.timed(getattr(stage, name)))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[pipe.schedule]
    # scale_grads: each micro-batch's mean loss is backpropagated and the gradients divided by M, so
    # they are the gradients of the whole batch's mean loss, as without a pipeline.
    return kind(stage, pipe.microbatches, loss_fn=clock.timed(loss_fn), scale_grads=True)


class StageBatches:
    """The job's batches as one stage needs them. Stage 0 gets each batch as the loader gives it
    (TrainContext counts its samples once); the other stages get ``{"target": ...}`` (the last stage
    its targets, the middle ones None), which TrainContext neither moves nor counts as samples."""

    def __init__(self, loader: DataLoader, *, first: bool, last: bool) -> None:
        self.loader, self.first, self.last = loader, first, last

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield batch if self.first else {"target": batch[-1] if self.last else None}


def run_step(
    schedule, batch: Any, *, first: bool, last: bool, device: torch.device
) -> torch.Tensor:
    """One batch through the pipeline; the batch's mean loss on the last stage, else 0."""
    if first:
        schedule.step(*batch[:-1])
        return torch.zeros((), device=device)
    if not last:
        schedule.step()
        return torch.zeros((), device=device)
    losses: list[torch.Tensor] = []
    schedule.step(target=batch["target"].to(device, non_blocking=True), losses=losses)
    return torch.stack([loss.detach().float() for loss in losses]).mean()


def pipeline_loop(ctx) -> None:
    """The built-in loop (supervised training, one loss) with this rank's stage of the model."""
    spec, pipe, device = ctx.spec, ctx.spec.train.pipeline, ctx.device
    place = pipeline_place(ctx)
    stages, first, last = place.stages, place.first, place.last
    if place.replicas > 1:
        ctx.logger.set_tags({TAG_MESH: describe(ctx.mesh)})

    # -- set-up: data (every stage of a pipeline reads the same batches: one data-parallel
    # replica), this rank's stage, optimizer, schedule
    datasets = build_datasets(spec)
    loader = build_loader(
        spec,
        datasets.train,
        rank=place.replica,
        world_size=place.replicas,
        pin_memory=device.type == "cuda",
    )
    model = ctx.prepare(build_model(spec))  # apply_pp: this rank's stage
    optimizer = build_optimizer(spec, model)
    hyperparameters = [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    loss_fn = build_loss(spec)
    clock = StageClock(device)
    ctx.measure_comm_with(clock)  # comm_time_s: this stage's send/recv, not DDP's reducer
    schedule = make_schedule(
        spec,
        model,
        loss_fn,
        rank=place.stage,
        device=device,
        clock=clock,
        group=place.pipeline_group,
    )
    batches = StageBatches(loader, first=first, last=last)
    classification = spec.data.is_classification or spec.loss == "cross_entropy"
    if pipe.microbatches < stages:
        ctx.tell(
            f"train.pipeline.microbatches {pipe.microbatches} < stages {stages}: each "
            f"stage idles at least {bubble_ideal(stages, pipe.microbatches):.0%} of "
            f"every step; use {stages} or more"
        )

    restored = False
    for epoch in ctx.epochs(
        model, optimizer
    ):  # a restart has loaded the checkpoint by the first epoch
        if not restored:
            restore_hyperparameters(optimizer, hyperparameters)
            restored = True
        shard_sampler(loader).set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        steps = 0
        for batch in ctx.batches(batches):
            with ctx.compute():
                clock.schedule.start()
                with ctx.autocast():
                    loss_sum += run_step(schedule, batch, first=first, last=last, device=device)
                average_gradients(model, place)  # between pipelines: comm, as the send/recv
                clock.schedule.stop()
                ctx.step(optimizer)
            steps += 1

        # -- end of epoch: the last stages' loss, the test set, and every stage's figures
        loss = collectives.sum_over_ranks(float(loss_sum) / max(steps, 1), device)
        metrics = {"loss": loss / place.replicas}
        if datasets.test is not None:
            metrics.update(
                evaluate(
                    model,
                    datasets.test,
                    loss_fn,
                    place=place,
                    device=device,
                    batch_size=spec.batch_size_per_worker,
                    classification=classification,
                )
            )
        metrics.update(
            stage_metrics(clock, device=device, place=place, microbatches=pipe.microbatches)
        )
        ctx.log_epoch(metrics)

    # -- once: how the split shared out the parameters (param_bytes_per_rank is rank 0's alone)
    sizes = gather_rows([local_parameter_bytes(model)], device=device, place=place)
    ctx.logger.log_metrics(
        {f"stage_{i}_param_bytes": row[0] for i, row in enumerate(sizes)},
        step=spec.train.epochs - 1,
    )


def restore_hyperparameters(optimizer: torch.optim.Optimizer, hyperparameters: list[dict]) -> None:
    """Put back the spec's learning rate, betas, ... after a resume. The stages' optimizers hold
    different parameters, so their param_groups differ under the same DCP keys, and DCP keeps one
    rank's copy: the others come back without their hyperparameters (their state tensors, keyed by
    parameter name, come back whole). The built-in loop never changes them, so the built ones are
    right."""
    for group, saved in zip(optimizer.param_groups, hyperparameters, strict=True):
        group.update(saved)


def bubble_ideal(stages: int, microbatches: int) -> float:
    """The idle share of every stage in a GPipe or 1F1B step with equal stages and free
    communication."""
    return (stages - 1) / (microbatches + stages - 1)


def gather_rows(
    values: list[float], *, device: torch.device, place: PipelinePlace
) -> list[list[float]]:
    """Every stage's `values` in this rank's pipeline, in stage order (a collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.zeros_like(mine) for _ in range(place.stages)]
    dist.all_gather(rows, mine, group=place.pipeline_group)
    return [row.tolist() for row in rows]


def stage_metrics(
    clock: StageClock, *, device: torch.device, place: PipelinePlace, microbatches: int
) -> dict[str, float]:
    """Every stage's compute time and peak memory in this rank's pipeline (a collective), and the
    measured and ideal bubble."""
    schedule_s, compute_s = clock.figures()
    rows = gather_rows(
        [schedule_s, compute_s, collectives.peak_memory_mb(device)], device=device, place=place
    )
    metrics = {"pipeline_bubble_ideal": bubble_ideal(place.stages, microbatches)}
    idle = []
    for index, (stage_schedule_s, stage_compute_s, peak_mb) in enumerate(rows):
        metrics[f"stage_{index}_compute_time_s"] = stage_compute_s
        metrics[f"stage_{index}_peak_mem_mb"] = peak_mb
        if stage_schedule_s > 0:
            idle.append(max(stage_schedule_s - stage_compute_s, 0.0) / stage_schedule_s)
    metrics["pipeline_bubble"] = sum(idle) / len(idle) if idle else float("nan")
    return metrics


# ---- evaluation and the final model ----------------------------------------------------

_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
)
_HEADER = 10  # ndim, up to 8 sizes, dtype


def _send(tensor: torch.Tensor, dst: int) -> None:
    header = [
        tensor.dim(),
        *tensor.shape,
        *[0] * (_HEADER - 2 - tensor.dim()),
        _DTYPES.index(tensor.dtype),
    ]
    dist.send(torch.tensor(header, dtype=torch.int64, device=tensor.device), dst)
    dist.send(tensor.contiguous(), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, *rest = header.tolist()
    tensor = torch.empty(rest[:ndim], dtype=_DTYPES[rest[-1]], device=device)
    dist.recv(tensor, src)
    return tensor


@torch.no_grad()
def evaluate(
    model: nn.Module,
    test_set,
    loss_fn,
    *,
    place: PipelinePlace,
    device: torch.device,
    batch_size: int,
    classification: bool,
) -> dict[str, float]:
    """test_accuracy or test_loss over the whole test set, each batch passed stage to stage (a
    plain forward, no micro-batches: a test set is small); every rank of a pipeline gets its last
    stage's figure (each pipeline evaluates the same model on the whole set)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, samples
    previous, following = place.rank_of(place.stage - 1), place.rank_of(place.stage + 1)
    for inputs, targets in DataLoader(test_set, batch_size=max(batch_size, 256)):
        outputs = model(inputs.to(device) if place.first else _recv(previous, device))
        if not place.last:
            _send(outputs, following)
            continue
        targets = targets.to(device)
        if classification:
            totals[0] += (outputs.argmax(dim=1) == targets).sum()
        else:
            totals[1] += loss_fn(outputs, targets).double() * len(targets)
        totals[2] += len(targets)
    dist.broadcast(totals, src=place.rank_of(place.stages - 1), group=place.pipeline_group)
    model.train(was_training)
    correct, loss_sum, seen = totals.tolist()
    if classification:
        return {"test_accuracy": correct / max(seen, 1)}
    return {"test_loss": loss_sum / max(seen, 1)}


def full_model_state(ctx) -> dict | None:
    """The whole trained model's state dict on rank 0, gathered from every stage (a collective);
    None on the other ranks. Keys are the unsplit model's, so it loads into the model as built."""
    stage: nn.Module | None = ctx.trained_model
    if stage is None:
        return None
    mine = {key: value.detach().cpu() for key, value in stage.state_dict().items()}
    gathered: list | None = [None] * dist.get_world_size() if ctx.is_chief else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return dict(
        sorted(merged.items(), key=lambda item: _layer_index(item[0]))
    )  # stable: weight, then bias


def _layer_index(key: str) -> float:
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else float("inf")
