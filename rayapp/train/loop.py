"""The entry point every Ray Train worker runs, and rayapp's built-in training loop.

Ray Train has already formed the torch.distributed process group (NCCL or Gloo) when
:func:`train_loop_per_worker` starts. It builds the worker's :class:`TrainContext`, runs the
job's loop (the built-in :func:`standard_loop`, or the user's ``train.loop``), then writes the
end-of-run records. Read :func:`standard_loop` top to bottom: set-up, the epoch loop, the step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rayapp.tracking.logger import NullLogger, RunLogger
from rayapp.train import system_metrics
from rayapp.train.builders import import_object
from rayapp.train.collectives import evaluate
from rayapp.train.config import WorkerConfig
from rayapp.train.context import TrainContext
from rayapp.train.data import build_datasets
from rayapp.train.model_export import exports_model, log_trained_model_or_warn
from rayapp.train.models import build_loss, build_model, build_optimizer

FLUSH_ON_ERROR_S = 10.0
STATE_DICT_ARTIFACTS = "state_dict"
"""The run's artifact folder for model_state_dict.pt, the full trained state dict."""


def train_loop_per_worker(config: dict) -> None:
    worker_config: WorkerConfig = config["worker_config"]
    loop_started = time.perf_counter()
    os.environ.update(
        worker_config.mlflow_credentials
    )  # for MLflow's clients here and in a script's child

    import ray.train
    from ray.train.torch import get_device

    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = get_device()
    if (
        context.get_local_rank() == 0 and rank != 0
    ):  # rank 0 imports MLflow for its logger just below
        system_metrics.preload(
            tracking_uri=worker_config.tracking_uri,
            interval_s=worker_config.spec.tracking.system_metrics_s,
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    logger = (
        RunLogger(
            worker_config.tracking_uri,
            worker_config.run_id,
            worker_config.fallback_path,
            worker_config.tell,
        )
        if rank == 0
        else NullLogger()
    )
    ctx = TrainContext(
        worker_config,
        logger,
        rank=rank,
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        device=device,
        loop_started=loop_started,
    )
    try:
        job_loop(worker_config)(ctx)
        ctx.end_loop()  # the epoch a `break` left: logged and checkpointed now
        ctx.finish_checkpoints()  # the last async save's write: whole before the run ends
        ctx.close()
        finish(ctx, loop_started)
    except Exception:
        ctx.close()
        # Epochs still queued for MLflow go out before the error ends this worker. A worker killed
        # outright cannot do this; a restarted one logs those epochs from its checkpoint's history.
        _tell_if_undelivered(worker_config, logger.close(timeout_s=FLUSH_ON_ERROR_S))
        raise


def job_loop(worker_config: WorkerConfig) -> Callable[[TrainContext], None]:
    """The user's script, else the loop the job names (train.loop, ``module:function``), else
    the built-in one."""
    train = worker_config.spec.train
    if train.script:
        from rayapp.train.script import script_loop

        return script_loop
    return import_object(train.loop) if train.loop else standard_loop


def standard_loop(ctx: TrainContext) -> None:
    """rayapp's loop for registered models and data sets: supervised training, one loss."""
    spec = ctx.spec
    if spec.train.strategy == "pp":  # one stage of the model per worker, batches in micro-batches
        from rayapp.train.pipeline import pipeline_loop

        return pipeline_loop(ctx)

    # -- set-up: data, model, strategy, optimizer
    datasets = build_datasets(spec)
    loader = ctx.loader(datasets.train)
    model = ctx.prepare(build_model(spec))
    optimizer = build_optimizer(spec, model)
    loss_fn = build_loss(spec)
    classification = spec.data.is_classification or spec.loss == "cross_entropy"

    for _epoch in ctx.epochs(model, optimizer):
        loss_sum = torch.zeros((), device=ctx.output_device)
        steps = 0
        for inputs, targets in ctx.batches(loader):
            with ctx.compute():
                with ctx.autocast():
                    loss = loss_fn(model(inputs), targets)
                ctx.backward(loss)
                ctx.step(
                    optimizer
                )  # clips and steps every train.grad_accum_steps; zeroes the gradients
            loss_sum += loss.detach()  # no .item(): that would wait for the device every step
            steps += 1

        # -- end of epoch: loss averaged over ranks; the test set, when there is one
        metrics = {"loss": ctx.mean(loss_sum / max(steps, 1))}
        if datasets.test is not None:
            metrics.update(
                evaluate(
                    model,
                    datasets.test,
                    loss_fn,
                    batch_size=spec.batch_size_at(ctx.world_size),
                    input_device=ctx.input_device,
                    output_device=ctx.output_device,
                    classification=classification,
                )
            )
        ctx.log_epoch(metrics)


def finish(ctx: TrainContext, loop_started: float) -> None:
    """End-of-run records: final metrics, the full state dict and the resolved spec as artifacts,
    and the trained model as the run's MLflow Model (:mod:`rayapp.train.model_export`)."""
    spec, logger = ctx.spec, ctx.logger
    # A loop that stopped early ends at its own last epoch; a script reports no epochs to rayapp.
    last_epoch = ctx.last_epoch if ctx.last_epoch is not None else spec.train.epochs - 1
    finals = {"total_time_s": time.perf_counter() - loop_started}
    if ctx.last_epoch is not None:  # the goodput parts; the driver adds the wall time and the rest
        finals.update(ctx.goodput_parts())
    if ctx.prepared:  # a script trains in its own process: rayapp holds no model to measure
        finals["param_bytes_per_rank"] = ctx.parameter_bytes()
    logger.log_metrics(finals, step=last_epoch)
    if spec.train.strategy == "pp":  # each rank holds one stage of the model: gather them
        from rayapp.train.pipeline import full_model_state

        model_state = full_model_state(ctx)
    else:
        model_state = ctx.final_model_state()  # every rank: a collective under FSDP
    if ctx.is_chief:
        with tempfile.TemporaryDirectory() as directory:
            if model_state is not None:
                model_path = os.path.join(directory, "model_state_dict.pt")
                torch.save(model_state, model_path)
                # Not under "model": runs:/ID/model is the MLflow Model logged below.
                logger.log_artifact(model_path, STATE_DICT_ARTIFACTS)
            spec_path = os.path.join(directory, "job_spec.json")
            with open(spec_path, "w") as handle:
                json.dump(dataclasses.asdict(spec), handle, indent=2)
            logger.log_artifact(spec_path)
    undelivered = logger.close(write_cost_step=last_epoch)
    _tell_if_undelivered(ctx.config, undelivered)
    # After the flush, so that the logged model takes the run's final metrics with it; not when
    # MLflow stayed unreachable (its client would retry for minutes).
    if ctx.is_chief and model_state is not None and undelivered is None and exports_model(spec):
        log_trained_model_or_warn(ctx.config, model_state, step=last_epoch)


def _tell_if_undelivered(worker_config: WorkerConfig, undelivered: Path | None) -> None:
    if undelivered is None:
        return
    import ray

    worker_config.tell(
        f"MLflow stayed unreachable; undelivered metrics and artifacts are saved in {undelivered} "
        f"(node {ray.util.get_node_ip_address()}). Deliver them later with: "
        f"rayapp import-metrics {undelivered} --tracking-uri {worker_config.tracking_uri}"
    )
