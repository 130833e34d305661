"""Tensor-parallel plans (torch.distributed.tensor.parallel) for strategies tp and fsdp+tp.

A plan maps a module's dotted name to how it is split over the workers of a node: a column-wise
Linear (its output features split, so each rank computes a slice of the activations) followed by
a row-wise one (its input features split; one all-reduce sums the partial outputs) keeps the
activations between them sharded and costs one all-reduce per pair in each direction.

Where the plan comes from:

- a model that defines ``tensor_parallel_plan()`` (returning ``{name: ColwiseParallel() |
  RowwiseParallel() | ...}``) brings its own; a ``model.factory`` or a loop's model does this, as
  examples/char_gpt's CharGPT does;
- rayapp's built-in MLP (an nn.Sequential of Linear and activation layers): its Linear layers pair
  up in order, column-wise then row-wise; an odd last Linear stays whole (replicated).

Anything else has no plan, and :func:`plan_for` says so in one line.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class TensorParallelError(ValueError):
    """A model tp cannot split: no plan, or a width that does not divide by the tp size."""


def plan_for(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The model's plan, checked against `tp_size` (the workers of a node)."""
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        plan = dict(own())
    elif isinstance(model, nn.Sequential):
        plan = sequential_plan(model)
    else:
        plan = {}
    if not plan:
        raise TensorParallelError(
            f"model {type(model).__name__} has no tensor-parallel plan; give it a "
            "tensor_parallel_plan() method returning {module name: ColwiseParallel() or "
            "RowwiseParallel()}, or use ddp, fsdp or hsdp"
        )
    check_divides(model, plan, tp_size)
    return plan


def sequential_plan(model: nn.Sequential) -> dict[str, ParallelStyle]:
    """Column-/row-wise pairs of an nn.Sequential's Linear layers, in order; {} when it holds
    anything but Linear layers and parameterless ones (activations, dropout)."""
    linears = []
    for name, layer in model.named_children():
        if isinstance(layer, nn.Linear):
            linears.append(name)
        elif any(True for _ in layer.parameters()):
            return {}
    plan: dict[str, ParallelStyle] = {}
    for column, row in zip(linears[0::2], linears[1::2], strict=False):
        plan[column], plan[row] = ColwiseParallel(), RowwiseParallel()
    return plan


def check_divides(model: nn.Module, plan: dict[str, Any], tp_size: int) -> None:
    """Every split dimension divides by `tp_size`: a column-wise Linear's output features, a
    row-wise one's input features (an Embedding's: its embedding dim, its vocabulary)."""
    for name, style in plan.items():
        layer = model.get_submodule(name)
        weight = getattr(layer, "weight", None)
        if weight is None or weight.dim() != 2:
            continue
        # nn.Linear keeps (out, in); column-wise splits dim 0 of a Linear's weight, row-wise dim 1;
        # an Embedding's weight (vocab, dim) splits the other way round.
        dim = 0 if isinstance(style, ColwiseParallel) else 1
        if isinstance(layer, nn.Embedding):
            dim = 1 - dim
        size = weight.shape[dim]
        if size % tp_size:
            kind = "column" if isinstance(style, ColwiseParallel) else "row"
            raise TensorParallelError(
                f"layer {name!r} ({type(layer).__name__}) has {size} features to split {kind}-wise,"
                f" which does not divide by the tensor-parallel size {tp_size} "
                "(cluster.workers_per_node); use a multiple of it or another workers_per_node"
            )
