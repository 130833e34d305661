"""Timing for the training loop.

Every clock read that closes a GPU phase synchronises the device first: CUDA kernels run
asynchronously, so without the sync the clock measures launch time, not work.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """A CPU-GPU sync point; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates the durations of repeated phases (data loading, compute) within one epoch."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.total_s = 0.0
        self._started: float | None = None

    def start(self) -> None:
        synchronize(self._device)
        self._started = time.perf_counter()

    def stop(self) -> None:
        synchronize(self._device)
        self.total_s += time.perf_counter() - self._started
        self._started = None

    def reset(self) -> None:
        self.total_s = 0.0


class CommTimer:
    """Wall time during which at least one gradient all-reduce was in flight.

    DDP launches one all-reduce per gradient bucket, overlapping them with the backward pass
    and with each other; summing their durations would count overlapping time twice, so the
    timer keeps their intervals and reports the length of their union. On CUDA/NCCL an
    interval ends when the completion callback runs, which follows the collective's stream,
    so the figure there is an upper bound.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def take_total_s(self) -> float:
        """The union length of the intervals recorded since the last call; clears them."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        total, current_start, current_end = 0.0, None, None
        for start, end in intervals:
            if current_end is None or start > current_end:
                if current_end is not None:
                    total += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        if current_end is not None:
            total += current_end - current_start
        return total


def timed_allreduce_hook(timer: CommTimer) -> Callable:
    """A DDP comm hook doing what DDP's default hook does (average gradients), timed."""

    # No annotations here: DDP inspects them at registration and rejects string (postponed) ones.
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        started = time.perf_counter()
        tensor = bucket.buffer().div_(world_size)
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finished(fut: torch.futures.Future) -> torch.Tensor:
            timer.record(started, time.perf_counter())
            return fut.value()[0]

        return future.then(finished)

    return hook
