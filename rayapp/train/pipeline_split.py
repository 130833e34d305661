"""The pipeline's cut: an nn.Sequential's layers split into contiguous stages.

A parameterless layer (a ReLU) stays with the layer before it; the stages' largest parameter count
is as small as it can be. Layers keep their names ("2.weight" on stage 1), so each stage's state
dict has keys of its own and a DCP checkpoint holds every stage side by side.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

__all__ = ["balanced_split", "layer_units", "split_model"]


def layer_units(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The children of an nn.Sequential as the units a split may not cut: each layer with
    parameters, followed by the parameterless layers after it (leading ones go with the first)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            "strategy pp splits an nn.Sequential by its layers; "
            f"the model is {type(model).__name__}: "
            "use model.kind mlp, or a model.factory returning an nn.Sequential"
        )
    units: list[list[tuple[str, nn.Module]]] = []
    for name, child in model.named_children():
        if units and (not _param_count(child) or not any(_param_count(m) for _, m in units[-1])):
            units[-1].append((name, child))
        else:
            units.append([(name, child)])
    return units


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_split(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """`sizes` cut into `parts` contiguous, non-empty [start, end) ranges whose largest sum is as
    small as it can be (ties: the earliest cut). Exact, by dynamic programming over the cut
    points."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layer unit(s) into {parts} stage(s)")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest-part sum of sizes[:i] cut into k parts; cut[k][i]: its last
    # cut
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, end = [], n
    for k in range(parts, 0, -1):
        ranges.append((cut[k][end], end))
        end = cut[k][end]
    return ranges[::-1]


def split_model(model: nn.Module, stages: int) -> list[nn.Sequential]:
    """Every stage of `model`, as nn.Sequentials whose layers keep their names in the model."""
    units = layer_units(model)
    if len(units) < stages:
        raise ValueError(
            f"strategy pp: the model has {len(units)} layer(s) with parameters to split, "
            f"fewer than train.pipeline.stages {stages}; use a deeper model or fewer stages"
        )
    ranges = balanced_split([sum(_param_count(m) for _, m in unit) for unit in units], stages)
    return [
        nn.Sequential(OrderedDict(layer for unit in units[start:end] for layer in unit))
        for start, end in ranges
    ]
