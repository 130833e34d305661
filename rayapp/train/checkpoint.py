"""Checkpoints through Ray Train: model, optimizer and extra state plus the epoch history.

Two formats (checkpoint.format):

- ``dcp`` (default): torch.distributed.checkpoint. Each rank writes only what it holds (its
  FSDP shard; DDP's replicated tensors once, by rank 0) as ``.distcp`` files into a local
  directory and reports it; Ray Train merges every rank's files into one checkpoint directory
  in storage. Loading reshards, so a job may resume on a different world size.
- ``full``: every rank gathers the full state dict to CPU and rank 0 saves ``state.pt``: simple,
  one file, but every rank holds the whole model and optimizer state for a moment.

Beside the state each checkpoint holds ``history.json`` (the run id, the epoch and every epoch's
metrics so far), which resume and the driver's backfill read without torch, and ``goodput.json``
(the run's time ledger, :mod:`rayapp.train.goodput`). Every rank reports once per epoch (Ray Train
requires equal counts), with or without a checkpoint.

With ``checkpoint.async`` (DCP only) training pauses only while DCP's ``async_save`` copies the
state to CPU memory (the staging copy); the files are written in a background thread, over a
process group of their own (Gloo), so the write's collectives never interleave with training's.
Ray Train uploads the directory, and registers the checkpoint, only once that write has ended:
a crash while it runs leaves the previous checkpoint the one to resume from. The next save, and
the end of the run, wait for the write before them (a failed write raises there).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from rayapp.spec import JobSpec
from rayapp.tracking.backfill import read_history, write_history

CHECKPOINT_FILE = "state.pt"
DCP_METADATA = ".metadata"
GOODPUT_FILE = "goodput.json"
STOPPED_MARKER = "stopped_early"
"""An empty file in the checkpoint of the epoch where the loop stopped early."""


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool
) -> tuple[dict, dict]:
    """Model and optimizer state: full and on CPU, or as each rank holds it (a collective under
    FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    model_state, optim_state = get_state_dict(
        model, [optimizer] if optimizer is not None else [], options=options
    )
    return model_state, (optim_state if optimizer is not None else {})


def full_model_state(model: nn.Module) -> dict:
    """The whole model's state dict on CPU, for the model artifact (a collective under FSDP)."""
    return _state_dicts(model, None, full=True)[0]


class BackgroundWrite:
    """The one DCP write of an async save that may still be running, and the process group such
    writes use. Every rank holds one for the run."""

    def __init__(self) -> None:
        self._future: Future | None = None
        self._group: Any = None

    def wait(self) -> None:
        """Until the running write (if any) has ended; raises what it raised."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def start(self, state: dict, directory: str) -> Future:
        """Stage `state` (the pause training takes) and write it into `directory` in the
        background, after the previous write has ended (a collective)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()  # two writes at once would interleave their collectives on one group
        if self._group is None:  # every rank gets here at the same save: new_group is collective
            self._group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=directory, process_group=self._group)
        assert isinstance(future, Future)  # the default stager stages before returning
        self._future = future
        return future


def save(
    spec: JobSpec,
    directory: str,
    model: nn.Module,
    optimizer,
    extra: Mapping[str, Any],
    *,
    rank: int,
    background: BackgroundWrite | None = None,
) -> Future | None:
    """Write this rank's part of the checkpoint into `directory` (a collective). With
    `background` (DCP only), the state is staged now and written in the background: the
    returned future ends with the write."""
    extra_state = {name: obj.state_dict() for name, obj in extra.items()}
    if spec.checkpoint.format == "full":
        model_state, optim_state = _state_dicts(model, optimizer, full=True)
        if rank == 0:
            torch.save(
                {"model": model_state, "optimizer": optim_state, "extra": extra_state},
                os.path.join(directory, CHECKPOINT_FILE),
            )
        return None
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _state_dicts(model, optimizer, full=False)
    state = {"model": model_state, "optimizer": optim_state}
    written = None
    if background is not None:
        written = background.start(state, directory)
    else:
        dcp.save(state, checkpoint_id=directory)
    if rank == 0 and extra_state:  # schedulers and scalers: small, the same on every rank
        torch.save(extra_state, os.path.join(directory, "extra.pt"))
    return written


def load(directory: str, model: nn.Module, optimizer, extra: Mapping[str, Any]) -> None:
    """Restore from a checkpoint directory of either format (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if os.path.exists(os.path.join(directory, DCP_METADATA)):
        import torch.distributed.checkpoint as dcp

        model_state, optim_state = _state_dicts(model, optimizer, full=False)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=directory)  # in place, resharded to this world size
        options = StateDictOptions(full_state_dict=False)
        extra_path = os.path.join(directory, "extra.pt")
        extra_state = (
            torch.load(extra_path, weights_only=False) if os.path.exists(extra_path) else {}
        )
    else:
        state = torch.load(
            os.path.join(directory, CHECKPOINT_FILE), map_location="cpu", weights_only=False
        )
        options = StateDictOptions(full_state_dict=True)
        extra_state = state.get("extra", {})
    set_model_state_dict(model, state["model"], options=options)
    # A stateless optimizer (plain SGD) has no tensors, and torch refuses to load such a full
    # state dict; its hyperparameters come from the spec anyway.
    if optimizer is not None and state["optimizer"].get("state"):
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    for name, obj in extra.items():
        if name in extra_state:
            obj.load_state_dict(extra_state[name])


def restore(model: nn.Module, optimizer, extra: Mapping[str, Any]) -> dict | None:
    """Load the checkpoint Ray Train restarted this worker group from; returns its saved history
    (run_id, epoch, history, and stopped: whether the loop had stopped early there), or None when
    the job starts fresh."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        load(directory, model, optimizer, extra)
        saved = read_history(directory)
        saved["stopped"] = os.path.exists(os.path.join(directory, STOPPED_MARKER))
        goodput_path = os.path.join(directory, GOODPUT_FILE)
        if os.path.exists(goodput_path):  # checkpoints from before the ledger have none
            with open(goodput_path, encoding="utf-8") as handle:
                saved["goodput"] = json.load(handle)
        return saved


def report_epoch(
    spec: JobSpec,
    metrics: dict,
    *,
    save_now: bool,
    model: nn.Module,
    optimizer,
    extra: Mapping[str, Any],
    history: list[dict],
    epoch: int,
    run_id: str,
    rank: int,
    stopped: bool = False,
    goodput: Mapping[str, Any] | None = None,
    background: BackgroundWrite | None = None,
) -> None:
    """Report the epoch to Ray Train from every rank, with this rank's part of a checkpoint when
    `save_now`; `stopped` marks the checkpoint as the last of a loop that stopped early, so a
    restart does not train past it; `goodput` is the run's time ledger, saved beside the history.
    With checkpoint.async (and `background`) the write and the upload run in the background."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    report = {"epoch": epoch, **metrics}
    if not save_now:
        ray.train.report(report)
        return
    directory = tempfile.mkdtemp(prefix="rayapp-ckpt-")
    try:
        background = background if spec.checkpoint.async_save else None
        written = save(spec, directory, model, optimizer, extra, rank=rank, background=background)
        if rank == 0:
            # Beside the weights, not in them: the driver reads it without torch or the state's
            # size.
            write_history(directory, run_id=run_id, epoch=epoch, history=history)
            if goodput is not None:
                with open(os.path.join(directory, GOODPUT_FILE), "w", encoding="utf-8") as handle:
                    json.dump(dict(goodput), handle)
            if stopped:
                open(os.path.join(directory, STOPPED_MARKER), "w").close()
        if written is None:
            mode, upload = CheckpointUploadMode.SYNC, None
        else:
            mode, upload = CheckpointUploadMode.ASYNC, _upload_once_written(written)
        ray.train.report(
            report,
            checkpoint=Checkpoint.from_directory(directory),
            checkpoint_dir_name=f"checkpoint_epoch_{epoch:06d}",
            checkpoint_upload_mode=mode,
            checkpoint_upload_fn=upload,
        )
    finally:
        if not spec.checkpoint.async_save:  # an async upload deletes the directory once it is done
            shutil.rmtree(directory, ignore_errors=True)


def _upload_once_written(written: Future):
    """Ray Train's upload of an async save, in its upload thread: first the end of DCP's write
    (a failed write raises there, and Ray Train fails the run rather than register it), then the
    copy to storage as Ray Train makes it for a synchronous save."""
    import ray.train

    def upload(checkpoint, checkpoint_dir_name: str):
        written.result()
        storage = ray.train.get_context().get_storage()  # Ray's developer API
        return storage.persist_current_checkpoint(checkpoint, checkpoint_dir_name)

    return upload
