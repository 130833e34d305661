"""Small per-epoch collectives and measurements every loop shares."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist


def mean_over_ranks(value: torch.Tensor | float, device: torch.device) -> float:
    """The mean of a per-rank value over all ranks (a collective: every rank calls it)."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).detach().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return (tensor / dist.get_world_size()).item()


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def sum_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item()


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def placements(world_size: int) -> list[tuple[str, str, str]]:
    """(Ray node id, node IP, the interface Gloo/NCCL use) of every rank, in rank order (a
    collective)."""
    import ray

    from rayapp.train.socket_ifname import socket_ifnames

    mine = (
        ray.get_runtime_context().get_node_id(),
        ray.util.get_node_ip_address(),
        socket_ifnames(),
    )
    gathered: list[tuple[str, str, str] | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return gathered  # type: ignore[return-value]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    test_set,
    loss_fn,
    *,
    batch_size: int,
    input_device: torch.device,
    output_device: torch.device,
    classification: bool,
) -> dict[str, float]:
    """test_accuracy (classification) or test_loss of the model on a whole test set.

    Every rank evaluates the whole set (FSDP needs all ranks in each forward pass), so every rank
    gets the same figure with no collective; test sets are small next to training sets."""
    from torch.utils.data import DataLoader

    was_training = model.training
    model.eval()
    correct, loss_sum, seen = 0, 0.0, 0
    for inputs, targets in DataLoader(test_set, batch_size=max(batch_size, 256)):
        outputs = model(inputs.to(input_device))
        targets = targets.to(output_device)
        if classification:
            correct += (outputs.argmax(dim=1) == targets).sum().item()
        else:
            loss_sum += loss_fn(outputs, targets).item() * len(targets)
        seen += len(targets)
    model.train(was_training)
    if classification:
        return {"test_accuracy": correct / max(seen, 1)}
    return {"test_loss": loss_sum / max(seen, 1)}
