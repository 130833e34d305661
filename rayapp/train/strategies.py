"""One function per parallel strategy, registered by name in :mod:`rayapp.spec.catalog`.

Each takes the plain model and the worker's device, and returns a :class:`Placement`: the model
to train and the devices a batch enters on and the loss is taken on (they differ only when the
model spans devices). The loop calls :func:`apply_strategy` and never branches on the name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from rayapp.spec import STRATEGIES, JobSpec
from rayapp.spec.mesh import uses_mesh
from rayapp.train.builders import import_object
from rayapp.train.tensor_parallel import plan_for

PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""train.precision -> the dtype autocast computes in (None: no autocast)."""


@dataclass(frozen=True)
class Placement:
    model: nn.Module
    input_device: torch.device
    """Where each batch's inputs go."""
    output_device: torch.device
    """Where the model's outputs come out, so where targets go and the loss is taken."""


def apply_strategy(
    spec: JobSpec, model: nn.Module, device: torch.device, mesh: DeviceMesh | None = None
) -> Placement:
    """The job's strategy applied to `model`; moves it to `device` first unless the strategy places
    it. hsdp, tp and fsdp+tp train over `mesh`, the run's (replicate, shard) device mesh."""
    apply = import_object(STRATEGIES.get(spec.train.strategy).target)
    if spec.train.strategy == "pp":  # keeps one stage of the model: only that moves to the device
        return apply(model, device=device, spec=spec)
    if not spec.single_process:
        model = model.to(device)
    param_dtype = PRECISION_DTYPES[spec.train.precision]
    if uses_mesh(spec.train.strategy):
        if mesh is None:
            raise ValueError(f"strategy {spec.train.strategy!r} needs the run's device mesh")
        return apply(model, device=device, mesh=mesh, param_dtype=param_dtype)
    if spec.train.strategy == "fsdp":
        return apply(model, device=device, param_dtype=param_dtype)
    return apply(model, device=device)


def apply_ddp(model: nn.Module, *, device: torch.device) -> Placement:
    """Replicate the model; DDP's built-in all-reduce averages the gradients."""
    device_ids = [device.index] if device.type == "cuda" else None
    return Placement(DistributedDataParallel(model, device_ids=device_ids), device, device)


def apply_fsdp(
    model: nn.Module,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
) -> Placement:
    """Shard parameters, gradients and optimizer state (FSDP2 `fully_shard`) over every rank, or
    over `mesh` (1-D: shard over it; 2-D (replicate, shard): HSDP).

    Works with NCCL on GPUs and Gloo on CPUs. Each Linear layer becomes its own
    shard unit so that only one layer's full parameters exist at a time; the root
    call then covers whatever is left (e.g. a bare nn.Linear). With mixed precision, parameters
    are gathered in `param_dtype` for compute and gradients reduced in fp32 (MixedPrecisionPolicy).
    """
    from torch.distributed.fsdp import fully_shard

    policy = _mixed_precision(param_dtype)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Placement(model, device, device)


def apply_hsdp(
    model: nn.Module, *, device: torch.device, mesh: DeviceMesh, param_dtype: torch.dtype | None
) -> Placement:
    """HSDP: FSDP2 over the 2-D mesh. Parameters are sharded over ``shard`` (the workers of a node:
    all-gathers and reduce-scatters stay inside the node) and replicated over ``replicate`` (the
    nodes: one all-reduce of each shard's gradients crosses the network)."""
    return apply_fsdp(model, device=device, param_dtype=param_dtype, mesh=mesh)


def apply_tp(
    model: nn.Module, *, device: torch.device, mesh: DeviceMesh, param_dtype: torch.dtype | None
) -> Placement:
    """Tensor parallelism over ``shard`` (the model's plan, rayapp.train.tensor_parallel), then
    data parallelism over ``replicate``: every parameter's gradient averaged across the nodes
    (replicate(), DDP's all-reduce on the FSDP2 machinery, which accepts DTensor parameters)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    _tensor_parallel(model, mesh)
    replicate(model, mesh=mesh["replicate"], mp_policy=_mixed_precision(param_dtype))
    return Placement(model, device, device)


def apply_fsdp_tp(
    model: nn.Module, *, device: torch.device, mesh: DeviceMesh, param_dtype: torch.dtype | None
) -> Placement:
    """2-D parallelism: tensor parallelism over ``shard`` (inside a node), then FSDP2 sharding of
    the tensor-parallel shards over ``replicate`` (across nodes). Order matters: fully_shard wraps
    the DTensor parameters parallelize_module made."""
    _tensor_parallel(model, mesh)
    return apply_fsdp(model, device=device, param_dtype=param_dtype, mesh=mesh["replicate"])


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    shard = mesh["shard"]
    parallelize_module(model, shard, plan_for(model, shard.size()))


def _mixed_precision(param_dtype: torch.dtype | None):  # -> MixedPrecisionPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()  # fully_shard's default: compute in the parameters' dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


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
    """Bytes of parameters this rank holds: the whole model under DDP, its shard under FSDP, HSDP
    and tensor parallelism (a DTensor's local part)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total
