"""One function per parallel strategy, registered by name in :mod:`rayapp.spec.catalog`.

Each takes the plain model and the worker's device, and returns a :class:`Placement`: the model
to train and the devices a batch enters on and the loss is taken on (they differ only when the
model spans devices). The loop calls :func:`apply_strategy` and never branches on the name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayapp.spec import STRATEGIES, JobSpec
from rayapp.train.builders import import_object

PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""train.precision -> the dtype autocast computes in (None: no autocast)."""


@dataclass(frozen=True)
class Placement:
    model: nn.Module
    input_device: torch.device
    """Where each batch's inputs go."""
    output_device: torch.device
    """Where the model's outputs come out, so where targets go and the loss is taken."""


def apply_strategy(spec: JobSpec, model: nn.Module, device: torch.device) -> Placement:
    """The job's strategy applied to `model`; moves it to `device` first unless the strategy places
    it."""
    apply = import_object(STRATEGIES.get(spec.train.strategy).target)
    if spec.train.strategy == "pp":  # keeps one stage of the model: only that moves to the device
        return apply(model, device=device, spec=spec)
    if not spec.single_process:
        model = model.to(device)
    if spec.train.strategy == "fsdp":
        return apply(model, device=device, param_dtype=PRECISION_DTYPES[spec.train.precision])
    return apply(model, device=device)


def apply_ddp(model: nn.Module, *, device: torch.device) -> Placement:
    """Replicate the model; DDP's built-in all-reduce averages the gradients."""
    device_ids = [device.index] if device.type == "cuda" else None
    return Placement(DistributedDataParallel(model, device_ids=device_ids), device, device)


def apply_fsdp(
    model: nn.Module, *, device: torch.device, param_dtype: torch.dtype | None = None
) -> Placement:
    """Shard parameters, gradients and optimizer state (FSDP2 `fully_shard`).

    Works with NCCL on GPUs and Gloo on CPUs. Each Linear layer becomes its own
    shard unit so that only one layer's full parameters exist at a time; the root
    call then covers whatever is left (e.g. a bare nn.Linear). With mixed precision, parameters
    are gathered in `param_dtype` for compute and gradients reduced in fp32 (MixedPrecisionPolicy).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()  # fully_shard's default: compute in the parameters' dtype
    )
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return Placement(model, device, device)


def apply_dp(model: nn.Module, *, device: torch.device) -> Placement:
    """nn.DataParallel: one process scatters each batch over every GPU of the node (the article's
    DP)."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        raise RuntimeError(
            "strategy 'dp' needs at least 2 CUDA GPUs on the node; "
            f"this worker sees {gpus}; use ddp"
        )
    first = torch.device("cuda:0")
    return Placement(nn.DataParallel(model.to(first), device_ids=list(range(gpus))), first, first)


class TwoDeviceModel(nn.Module):
    """The model's layers split in two halves on two GPUs; activations cross between them (the
    article's MP)."""

    def __init__(self, model: nn.Sequential, first: torch.device, second: torch.device) -> None:
        super().__init__()
        layers = list(model.children())
        cut = len(layers) // 2
        self.first, self.second = first, second
        self.front = nn.Sequential(*layers[:cut]).to(first)
        self.back = nn.Sequential(*layers[cut:]).to(second)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(inputs.to(self.first)).to(self.second))


def apply_mp(model: nn.Module, *, device: torch.device) -> Placement:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2 or not isinstance(model, nn.Sequential):
        raise RuntimeError(
            f"strategy 'mp' needs an mlp model and 2 CUDA GPUs on the node; this worker sees {gpus}"
        )
    first, second = torch.device("cuda:0"), torch.device("cuda:1")
    return Placement(TwoDeviceModel(model, first, second), first, second)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: the whole model under DDP, its shard under FSDP."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total
