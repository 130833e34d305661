"""The training loop every Ray Train worker runs.

Ray Train has already formed the torch.distributed process group (NCCL or Gloo) when
:func:`train_loop_per_worker` starts. Read it top to bottom: set-up, resume, the epoch
loop (timing and logging marked), then the end-of-run records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from rayapp.tracking.backfill import read_history, write_history
from rayapp.train.data import build_datasets
from rayapp.train.models import build_loss, build_model, build_optimizer
from rayapp.spec import JobSpec
from rayapp.train.strategies import apply_ddp, apply_dp, apply_fsdp, apply_mp, local_parameter_bytes
from rayapp.train.timing import DdpCommClock, Stopwatch, synchronize
from rayapp.tracking.run import TAG_ATTEMPTS, TAG_NODE_IDS, TAG_NODE_IPS, NullLogger, RunLogger

CHECKPOINT_FILE = "state.pt"
FLUSH_ON_ERROR_S = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the driver hands to each worker; Ray pickles it once per worker."""

    spec: JobSpec
    run_id: str
    tracking_uri: str
    submitted_at: float
    """Driver wall clock at submission, for time_to_first_step_s."""
    fallback_path: str = ""
    """Where rank 0 writes MLflow records the tracking server could not take by the end."""
    progress: Any = None
    """A ray.util.queue.Queue that rank 0 feeds with per-epoch progress and warnings, or None."""

    def tell(self, message: str) -> None:
        """A warning for the person at the submitting terminal."""
        if self.progress is not None:
            self.progress.put_nowait({"message": message})


def train_loop_per_worker(config: dict) -> None:
    worker_config: WorkerConfig = config["worker_config"]
    loop_started = time.perf_counter()

    import ray.train
    from ray.train.torch import get_device

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = get_device()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    logger = (
        RunLogger(worker_config.tracking_uri, worker_config.run_id, worker_config.fallback_path, worker_config.tell)
        if rank == 0
        else NullLogger()
    )
    try:
        _train(worker_config, logger, rank=rank, world_size=world_size, device=device, loop_started=loop_started)
    except Exception:
        # Epochs still queued for MLflow go out before the error ends this worker. A worker killed
        # outright cannot do this; a restarted one logs those epochs from its checkpoint's history.
        _tell_if_undelivered(worker_config, logger.close(timeout_s=FLUSH_ON_ERROR_S))
        raise


def _train(worker_config: WorkerConfig, logger, *, rank: int, world_size: int, device, loop_started: float) -> None:
    import ray.train

    spec = worker_config.spec

    # -- set-up: data, model, strategy, optimizer
    datasets = build_datasets(spec)
    sampler = DistributedSampler(
        datasets.train, num_replicas=world_size, rank=rank, shuffle=True, seed=spec.train.seed, drop_last=True
    )
    loader = DataLoader(datasets.train, batch_size=spec.batch_size_per_worker, sampler=sampler, drop_last=True)
    model = build_model(spec).to(device)
    if spec.train.strategy == "fsdp":
        model = apply_fsdp(model, device=device)
    elif spec.train.strategy == "dp":
        model = apply_dp(model, device=device)
    elif spec.train.strategy == "mp":
        model = apply_mp(model, device=device)
    else:
        model = apply_ddp(model, device=device)
    comm_clock = DdpCommClock(model)  # reports NaN for strategies without DDP's reducer
    optimizer = build_optimizer(spec, model)
    loss_fn = build_loss(spec)
    # Under mp the batch enters on the first GPU and the loss is taken on the second.
    input_device = getattr(model, "first", device)
    output_device = getattr(model, "second", device)

    # -- resume: a restarted worker group continues from the last checkpoint, in the same MLflow run
    start_epoch, history = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, CHECKPOINT_FILE), map_location="cpu", weights_only=False)
            saved = read_history(directory)
        _load_state(model, optimizer, state)
        start_epoch, history = saved["epoch"] + 1, saved["history"]
    # Counted in the run itself, so a restart before the first checkpoint counts too.
    attempt = logger.previous_attempts() + 1
    nodes_used = _record_placement(logger, world_size, attempt=attempt)
    if rank == 0 and nodes_used != spec.cluster.nodes:
        # SPREAD (several workers per node) is a preference, not a rule: say where workers landed.
        worker_config.tell(
            f"workers landed on {nodes_used} node(s), not the {spec.cluster.nodes} asked for; "
            "per-node figures in this run do not describe that many nodes"
        )
    # After a restart, each epoch is logged once: epochs checkpointed whose metrics never reached
    # MLflow are logged from the checkpoint; epochs logged but not checkpointed (the failure came
    # between the two) are re-run from the checkpoint, deterministically, and not logged again.
    already_logged = logger.logged_epochs() if attempt > 1 else set()
    for epoch, metrics in enumerate(history):
        if epoch not in already_logged:
            logger.log_epoch(epoch, metrics)

    first_step_done = attempt > 1  # time to first step is the first attempt's
    samples_per_epoch = spec.steps_per_epoch * spec.batch_size_per_worker * world_size
    for epoch in range(start_epoch, spec.train.epochs):
        sampler.set_epoch(epoch)
        data_watch, compute_watch = Stopwatch(device), Stopwatch(device)
        loss_sum = torch.zeros((), device=device)
        comm_clock.take_total_s()  # drop anything recorded outside this epoch
        synchronize(device)
        epoch_started = time.perf_counter()

        data_watch.start()
        for inputs, targets in loader:
            inputs, targets = inputs.to(input_device, non_blocking=True), targets.to(output_device, non_blocking=True)
            data_watch.stop()

            compute_watch.start()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            comm_clock.step_finished()
            loss_sum += loss.detach()
            compute_watch.stop()

            if not first_step_done:
                first_step_done = True
                logger.log_metrics({"time_to_first_step_s": time.time() - worker_config.submitted_at})
            data_watch.start()
        data_watch.stop()
        synchronize(device)
        epoch_time = time.perf_counter() - epoch_started

        # -- timing and logging: loss averaged over ranks; times are the slowest rank's
        comm_time = comm_clock.take_total_s()
        mean_loss = _all_reduce_mean(loss_sum / spec.steps_per_epoch, world_size)
        epoch_time, compute_time, data_time, comm_time, peak_mem = _all_reduce_max(
            [epoch_time, compute_watch.total_s, data_watch.total_s, comm_time, _peak_memory_mb(device)], device
        )
        metrics = {
            "loss": mean_loss,
            "epoch_time_s": epoch_time,
            "samples_per_s": samples_per_epoch / epoch_time,
            "compute_time_s": compute_time,
            "comm_time_s": comm_time,
            "data_time_s": data_time,
            "peak_mem_mb": peak_mem,
        }
        if datasets.test is not None:
            metrics["test_accuracy"] = _accuracy(model, datasets.test, input_device)
        history.append(metrics)

        # -- checkpoint first, then MLflow: a failure between them re-logs from the checkpoint on resume
        state = _report_with_checkpoint(
            model, optimizer, epoch=epoch, history=history, run_id=worker_config.run_id, rank=rank
        )
        if epoch not in already_logged:
            logger.log_epoch(epoch, metrics)
        if rank == 0 and worker_config.progress is not None:
            worker_config.progress.put_nowait({"epoch": epoch, **metrics})

    # -- end of run
    finals = {"total_time_s": time.perf_counter() - loop_started, "param_bytes_per_rank": local_parameter_bytes(model)}
    logger.log_metrics(finals, step=spec.train.epochs - 1)
    if start_epoch >= spec.train.epochs:  # resumed after the last epoch's checkpoint: nothing trained here
        state = _state_dict(model, optimizer)  # a collective under FSDP: every rank takes part
    if rank == 0:
        with tempfile.TemporaryDirectory() as directory:
            model_path = os.path.join(directory, "model_state_dict.pt")
            torch.save(state["model"], model_path)
            logger.log_artifact(model_path, "model")
            spec_path = os.path.join(directory, "job_spec.json")
            with open(spec_path, "w") as handle:
                json.dump(dataclasses.asdict(spec), handle, indent=2)
            logger.log_artifact(spec_path)
    _tell_if_undelivered(worker_config, logger.close(write_cost_step=spec.train.epochs - 1))


# ---- helpers -------------------------------------------------------------------------


def _tell_if_undelivered(worker_config: WorkerConfig, undelivered: Optional[Path]) -> None:
    if undelivered is None:
        return
    import ray

    worker_config.tell(
        f"MLflow stayed unreachable; undelivered metrics and artifacts are saved in {undelivered} "
        f"(node {ray.util.get_node_ip_address()}). Deliver them later with: "
        f"rayapp import-metrics {undelivered} --tracking-uri {worker_config.tracking_uri}"
    )


def _record_placement(logger, world_size: int, *, attempt: int) -> int:
    """Every rank says which Ray node it runs on; rank 0 records the list in rank order.

    Returns the number of distinct nodes the workers run on."""
    import ray

    mine = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
    placements: list[Optional[tuple[str, str]]] = [None] * world_size
    dist.all_gather_object(placements, mine)
    logger.set_tags(
        {
            TAG_NODE_IDS: ",".join(p[0] for p in placements),
            TAG_NODE_IPS: ",".join(p[1] for p in placements),
            TAG_ATTEMPTS: str(attempt),
        }
    )
    return len({node_id for node_id, _ in placements})


def _all_reduce_mean(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return (value / world_size).item()


def _all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@torch.no_grad()
def _accuracy(model: torch.nn.Module, test_set, device: torch.device) -> float:
    # Every rank evaluates (FSDP needs all ranks in the forward pass); the set is small.
    inputs, labels = test_set.tensors
    predictions = model(inputs.to(device)).argmax(dim=1)
    return (predictions == labels.to(predictions.device)).float().mean().item()


def _state_dict(model, optimizer) -> dict:
    """Full (unsharded) model and optimizer state on CPU; a collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": model_state, "optimizer": optim_state}


def _load_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    # A stateless optimizer (plain SGD) saves no tensors, and torch refuses to load such a full
    # state dict; its hyperparameters come from the spec anyway.
    if state["optimizer"].get("state"):
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def _report_with_checkpoint(model, optimizer, *, epoch: int, history: list, run_id: str, rank: int) -> dict:
    """Every rank reports once per epoch (Ray Train requires equal counts); rank 0 attaches the checkpoint.

    Returns the full state dict it saved, which the end of the run reuses for the model artifact."""
    import ray.train
    from ray.train import Checkpoint

    state = _state_dict(model, optimizer)
    metrics = {"epoch": epoch, **history[-1]}
    if rank != 0:
        ray.train.report(metrics)
        return state
    with tempfile.TemporaryDirectory() as directory:
        torch.save(state, os.path.join(directory, CHECKPOINT_FILE))
        # Beside the weights, not in them: the driver reads it without torch or the state dict's size.
        write_history(directory, run_id=run_id, epoch=epoch, history=history)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
    return state

