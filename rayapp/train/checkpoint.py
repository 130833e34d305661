"""Checkpoints through Ray Train: model and optimizer state plus the epoch history, once per epoch.

Every rank reports once per epoch (Ray Train requires equal counts); rank 0 attaches the
checkpoint. Beside the state dict each checkpoint holds ``history.json`` (the run id, the epoch
and every epoch's metrics so far), which resume and the driver's backfill read without torch.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Mapping, Optional

import torch
from torch import nn

from rayapp.tracking.backfill import read_history, write_history

CHECKPOINT_FILE = "state.pt"


def full_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Mapping[str, Any]) -> dict:
    """Full (unsharded) model and optimizer state on CPU, and the state of extra objects (a
    scheduler, a scaler); a collective under FSDP, so every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    return {
        "model": model_state,
        "optimizer": optim_state if optimizer is not None else {},
        "extra": {name: obj.state_dict() for name, obj in extra.items()},
    }


def load_full_state(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Mapping[str, Any], state: dict
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    # A stateless optimizer (plain SGD) saves no tensors, and torch refuses to load such a full
    # state dict; its hyperparameters come from the spec anyway.
    if optimizer is not None and state["optimizer"].get("state"):
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    for name, obj in extra.items():
        if name in state.get("extra", {}):
            obj.load_state_dict(state["extra"][name])


def latest() -> Optional[tuple[dict, dict]]:
    """(state, saved history) of the checkpoint Ray Train restarted this worker group from, or None."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, CHECKPOINT_FILE), map_location="cpu", weights_only=False)
        return state, read_history(directory)


def report_epoch(state: dict, *, epoch: int, history: list[dict], run_id: str, rank: int) -> None:
    """Report the epoch to Ray Train from every rank, with rank 0 attaching the checkpoint."""
    import ray.train
    from ray.train import Checkpoint

    metrics = {"epoch": epoch, **history[-1]}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        torch.save(state, os.path.join(directory, CHECKPOINT_FILE))
        # Beside the weights, not in them: the driver reads it without torch or the state dict's size.
        write_history(directory, run_id=run_id, epoch=epoch, history=history)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
