"""One optimizer step as the job's settings want it: mixed precision, loss scaling, gradient
accumulation without needless all-reduces, clipping, and step-level metrics at log points."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from rayapp.spec import JobSpec
from rayapp.tracking.logger import NullLogger
from rayapp.train.strategies import PRECISION_DTYPES

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class Stepper:
    def __init__(
        self,
        spec: JobSpec,
        device: torch.device,
        logger: NullLogger,
        *,
        world_size: int,
        samples_seen: Callable[[], int],
    ) -> None:
        self.spec, self.device, self.logger, self.world_size = spec, device, logger, world_size
        self._samples_seen = samples_seen
        self.global_step = 0
        self._micro_steps = 0
        self._last_loss: torch.Tensor | None = None
        self._log_clock = (
            time.perf_counter(),
            0,
        )  # (when, samples seen) at the last step-level log
        self._scaler = torch.amp.GradScaler(device.type) if spec.train.precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = PRECISION_DTYPES[self.spec.train.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self._last_loss = loss.detach()
        loss = loss / self.spec.train.grad_accum_steps
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        stepping = self.stepping_next()
        self._micro_steps += 1
        if not stepping:
            return False
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if self.spec.train.grad_clip is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grad_norm(params, self.spec.train.grad_clip)
        if self._scaler is not None:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        every = self.spec.tracking.log_every_steps
        if every and self.global_step % every == 0:
            self._log_step_metrics()
        return True

    def stepping_next(self) -> bool:
        """Whether the coming micro-step ends in an optimizer step."""
        return (self._micro_steps + 1) % self.spec.train.grad_accum_steps == 0

    def gradient_sync(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """Around a micro-step that ends in no optimizer step: skip the gradient all-reduce (DDP's
        no_sync, FSDP2's requires_gradient_sync); the last micro-step reduces the sum."""
        if self.stepping_next() or model is None:
            return contextlib.nullcontext()
        from torch.distributed.fsdp import FSDPModule

        no_sync = getattr(model, "no_sync", None)  # DDP
        if no_sync is not None:
            return no_sync()
        if isinstance(model, FSDPModule):  # FSDP2
            return _fsdp_no_sync(model)
        return contextlib.nullcontext()

    def _log_step_metrics(self) -> None:
        """step_loss and step_samples_per_s (this rank's samples x world size) since the last log;
        reading the loss is the one device sync, at log points only."""
        now, samples = time.perf_counter(), self._samples_seen()
        then, samples_then = self._log_clock
        self._log_clock = (now, samples)
        metrics = {
            "step_samples_per_s": (samples - samples_then) * self.world_size / max(now - then, 1e-9)
        }
        if self._last_loss is not None:
            metrics["step_loss"] = self._last_loss.item()
        self.logger.log_metrics(metrics, step=self.global_step)


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most `max_norm`; returns that norm.

    torch's clip_grad_norm_ stacks the per-parameter norms, which DTensors on different meshes
    refuse: under tp and fsdp+tp the split layers live on the 2-D mesh and a layer the plan
    leaves whole on its ``replicate`` dim alone. So the norm is taken per mesh (a DTensor norm,
    made whole with full_tensor: the shards' sums of squares added over their ranks), the meshes'
    norms combine into one, and each mesh's gradients are scaled by it."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_mesh.setdefault(getattr(parameter.grad, "device_mesh", None), []).append(parameter)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
