"""One function per parallel strategy. Each takes a plain model already on its device."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Replicate the model; DDP's built-in all-reduce averages the gradients."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def apply_fsdp(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Shard parameters, gradients and optimizer state (FSDP2 `fully_shard`).

    Works with NCCL on GPUs and Gloo on CPUs. Each Linear layer becomes its own
    shard unit so that only one layer's full parameters exist at a time; the root
    call then covers whatever is left (e.g. a bare nn.Linear).
    """
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model:
            fully_shard(module)
    fully_shard(model)
    return model


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: the whole model under DDP, its shard under FSDP."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def apply_dp(model: nn.Module, *, device: torch.device) -> nn.Module:
    """nn.DataParallel: one process scatters each batch over every GPU of the node (the article's DP)."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        raise RuntimeError(f"strategy 'dp' needs at least 2 CUDA GPUs on the node; this worker sees {gpus}; use ddp")
    return nn.DataParallel(model.to("cuda:0"), device_ids=list(range(gpus)))


class TwoDeviceModel(nn.Module):
    """The model's layers split in two halves on two GPUs; activations cross between them (the article's MP)."""

    def __init__(self, model: nn.Sequential, first: torch.device, second: torch.device) -> None:
        super().__init__()
        layers = list(model.children())
        cut = len(layers) // 2
        self.first, self.second = first, second
        self.front = nn.Sequential(*layers[:cut]).to(first)
        self.back = nn.Sequential(*layers[cut:]).to(second)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(inputs.to(self.first)).to(self.second))


def apply_mp(model: nn.Module, *, device: torch.device) -> nn.Module:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2 or not isinstance(model, nn.Sequential):
        raise RuntimeError(f"strategy 'mp' needs an mlp model and 2 CUDA GPUs on the node; this worker sees {gpus}")
    return TwoDeviceModel(model, torch.device("cuda:0"), torch.device("cuda:1"))
