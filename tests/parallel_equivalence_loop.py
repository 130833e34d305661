"""A training loop for tests/test_parallelism_integration.py: in one set of Ray Train workers, the
job's own strategy trains through rayapp's TrainContext (as the built-in loop does), then each other
strategy trains the same model, from the same seed, on the same batches and the same device mesh,
and its per-epoch loss goes to the run as ``<strategy>_loss`` (and its parameter bytes per rank as
``<strategy>_param_bytes_per_rank``). One job start instead of five keeps the comparison fast."""

from __future__ import annotations

import dataclasses

import torch

from rayapp.spec.pipeline import PipelineSpec
from rayapp.train import collectives
from rayapp.train.data import build_datasets, build_loader, shard_sampler
from rayapp.train.models import build_loss, build_model, build_optimizer
from rayapp.train.pipeline import StageBatches, StageClock, apply_pp, make_schedule, run_step
from rayapp.train.strategies import apply_strategy, local_parameter_bytes

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "pp")


def train_loop(ctx) -> None:
    spec = ctx.spec
    datasets = build_datasets(spec)
    loss_fn = build_loss(spec)

    # -- the job's strategy, through everything rayapp gives a loop
    loader = ctx.loader(datasets.train)
    model = ctx.prepare(build_model(spec))
    optimizer = build_optimizer(spec, model)
    for _epoch in ctx.epochs(model, optimizer):
        loss_sum, steps = torch.zeros(()), 0
        for inputs, targets in ctx.batches(loader):
            with ctx.compute():
                loss = loss_fn(model(inputs), targets)
                ctx.backward(loss)
                ctx.step(optimizer)
            loss_sum, steps = loss_sum + loss.detach(), steps + 1
        ctx.log_epoch({"loss": ctx.mean(loss_sum / steps)})

    # -- every other strategy, in turn, on the same data and mesh
    for strategy in STRATEGIES:
        if strategy == spec.train.strategy:
            continue
        train = pipeline_curve if strategy == "pp" else curve
        losses, param_bytes = train(ctx, strategy, datasets.train, loss_fn)
        for epoch, value in enumerate(losses):
            ctx.logger.log_metrics({f"{strategy}_loss": value}, step=epoch)
        ctx.logger.log_metrics({f"{strategy}_param_bytes_per_rank": param_bytes})


def with_strategy(spec, strategy: str, **train):
    """The job under another strategy, trained by this loop rather than by a loop of its own."""
    fields = {"strategy": strategy, "loop": None, **train}
    return dataclasses.replace(spec, train=dataclasses.replace(spec.train, **fields))


def curve(ctx, strategy: str, dataset, loss_fn) -> tuple[list[float], int]:
    """Per-epoch mean loss of `strategy` (ddp, fsdp, hsdp, tp) over the same global batches."""
    spec = with_strategy(ctx.spec, strategy)
    model = apply_strategy(spec, build_model(spec), ctx.device, ctx.mesh).model
    optimizer = build_optimizer(spec, model)
    replicas = spec.data_parallel_at(ctx.world_size)
    share = ctx.rank if replicas == ctx.world_size else ctx.mesh.get_local_rank("replicate")
    batch_size = spec.batch_size_at(ctx.world_size)  # global batch / replicas
    loader = build_loader(spec, dataset, rank=share, world_size=replicas, batch_size=batch_size)
    losses = []
    for epoch in range(spec.train.epochs):
        shard_sampler(loader).set_epoch(epoch)
        loss_sum, steps = torch.zeros(()), 0
        for inputs, targets in loader:
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_sum, steps = loss_sum + loss.detach(), steps + 1
        losses.append(collectives.mean_over_ranks(loss_sum / steps, ctx.device))
    return losses, local_parameter_bytes(model)


def pipeline_curve(ctx, strategy: str, dataset, loss_fn) -> tuple[list[float], int]:
    """The same under pp: one stage per rank, every stage reading the same (whole) batches."""
    stages = ctx.world_size
    spec = with_strategy(ctx.spec, strategy, pipeline=PipelineSpec(stages=stages))
    rank, device = ctx.rank, ctx.device
    first, last = rank == 0, rank == stages - 1
    model = apply_pp(build_model(spec), device=device, spec=spec).model
    optimizer = build_optimizer(spec, model)
    clock = StageClock(device)
    schedule = make_schedule(spec, model, loss_fn, rank=rank, device=device, clock=clock)
    loader = build_loader(spec, dataset, rank=0, world_size=1)
    losses = []
    for epoch in range(spec.train.epochs):
        shard_sampler(loader).set_epoch(epoch)
        loss_sum, steps = torch.zeros(()), 0
        for batch in StageBatches(loader, first=first, last=last):
            loss_sum += run_step(schedule, batch, first=first, last=last, device=device)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        losses.append(collectives.sum_over_ranks(float(loss_sum) / steps, device))
    return losses, local_parameter_bytes(model)
