"""``comm_bytes_per_step``: the bytes one training step's collectives moved on this rank, counted
from the collectives themselves as they are dispatched (not estimated from the model).

:class:`CollectiveBytes` is a TorchDispatchMode, like torch's CommDebugMode (which counts calls,
not bytes): every c10d collective (DDP's bucket all-reduce, FSDP2's all-gathers and
reduce-scatters, pipeline send/recv) and every functional collective (DTensor's redistributions
under tensor parallelism) passes through it. Each counts as the size of the whole buffer it works
on: an all-reduce's tensors, an all-gather's gathered output, a reduce-scatter's unscattered
input, what a send sends. A dispatch mode sees every operator, so it slows the step it watches:
the context counts one step per epoch, and the figure is the same for every step of a fixed model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = {"barrier", "monitored_barrier", "wait_tensor", "_wrap_tensor_autograd"}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def collective_bytes(op_name: str, args: tuple) -> int:
    """The bytes of the buffer the collective `op_name` works on, from its arguments: the larger of
    its first two tensor arguments (output and input, in either order), and for a functional
    all-gather, whose one tensor is this rank's part, that times the group size."""
    if op_name.startswith("all_gather_into_tensor") and len(args) > 1:
        return _tensor_bytes(args[0]) * int(args[1])
    return max((_tensor_bytes(arg) for arg in args[:2]), default=0)


class CollectiveBytes(TorchDispatchMode):
    """Counts, while active, the bytes of every collective this rank takes part in."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            # Let DTensor run first: the collectives it turns the operator into come back here.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "_opname", "")
        if getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self.total += collective_bytes(name, args)
            self.calls += 1
        return out
