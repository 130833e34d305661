"""Timing for the training loop, honest about asynchronous devices without stalling them.

CUDA kernels run asynchronously: a host clock read after a launch measures the launch, not the
work, and synchronising the device to read it would stop the host from queuing the next step
while the GPU works. So on GPUs a step's marks are CUDA events recorded into the stream, taken
from a pool that is reused, and read only when an interval of ``train.timing_every`` steps ends
(and at the epoch's end). The interval read is the one before the last, whose events finished
long ago, so even that read does not wait for the device. Waiting for data is a host-side phase
(the loader, the copy launch) and is timed with the host clock, without a sync. On CPUs every
mark is a host clock reading.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def synchronize(device: torch.device) -> None:
    """A CPU-GPU sync point; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostTimer:
    """Accumulates the host-clock durations of a repeated phase within one epoch."""

    def __init__(self) -> None:
        self._total_s = 0.0
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            self._total_s += time.perf_counter() - self._started
            self._started = None

    def total_s(self) -> float:
        return self._total_s


class EventPool:
    """CUDA timing events made once and recorded again, step after step."""

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self.made = 0

    def take(self) -> torch.cuda.Event:
        if self._free:
            return self._free.pop()
        self.made += 1
        return torch.cuda.Event(enable_timing=True)

    def give_back(self, events: list[torch.cuda.Event]) -> None:
        self._free.extend(events)


Mark = float | torch.cuda.Event
"""A moment in a step: a host clock reading on CPUs, a recorded CUDA event on GPUs."""


@dataclass
class _Step:
    begin: Mark
    compute_start: Mark
    ready: Mark | None = None
    end: Mark | None = None


class DeviceTimer(HostTimer):
    """The steps of one epoch: the compute phase's total (forward, backward, optimizer step), and
    each step's own time, from asking for its batch until its gradients were ready.

    A step's own time leaves out what the rank then waits for the slower ranks in the gradient
    all-reduce: there every rank waits for the slowest, so whole steps take equally long on every
    rank, and only the part before the wait tells a straggler apart. Where no gradient-ready mark
    comes (no hooked parameter, e.g. a loop rayapp holds no model of), it runs to the compute's end.
    Under FSDP a shard's gradient is ready only after its reduce-scatter, so that wait is inside.

    start()/stop() bracket the compute phase; mark_step_begin() marks the batch request and
    mark_ready() the gradients (both optional). Marks are read every `read_every` steps and when
    the totals are asked for (call total_s() and step_times_s() at the epoch's end)."""

    def __init__(self, device: torch.device, read_every: int = 50) -> None:
        super().__init__()
        self._cuda = device.type == "cuda"
        self._read_every = read_every
        self._pool = EventPool()
        self._pending: list[_Step] = []
        self._open: _Step | None = None
        self._begin: Mark | None = None
        self._compute_s = 0.0
        self._step_times_s: list[float] = []

    @property
    def events_made(self) -> int:
        """CUDA events this timer has made: bounded by the pool, not by the steps timed."""
        return self._pool.made

    def mark_step_begin(self) -> None:
        """The step's batch is being asked for."""
        self._begin = self._now()

    def start(self) -> None:
        now = self._now()
        begin, self._begin = self._begin, None
        self._open = _Step(begin=now if begin is None else begin, compute_start=now)

    def mark_ready(self) -> None:
        """This step's gradients are ready (before any wait for other ranks)."""
        if self._open is not None:
            self._open.ready = self._now()

    def stop(self) -> None:
        if self._open is None:
            return
        self._open.end = self._now()
        self._pending.append(self._open)
        self._open = None
        if len(self._pending) >= 2 * self._read_every:
            # Read the older interval only: its events finished long ago, so this does not wait.
            self._read(self._pending[: self._read_every])
            del self._pending[: self._read_every]

    def total_s(self) -> float:
        """Seconds in the compute phase this epoch (reads every mark left: a sync on GPUs)."""
        self._read_all()
        return self._compute_s

    def step_times_s(self) -> list[float]:
        """Each step's own time this epoch, in order (reads every mark left: a sync on GPUs)."""
        self._read_all()
        return list(self._step_times_s)

    def _now(self) -> Mark:
        if not self._cuda:
            return time.perf_counter()
        event = self._pool.take()
        event.record()
        return event

    def _read_all(self) -> None:
        if self._pending:
            self._read(self._pending)
            self._pending = []

    def _read(self, steps: list[_Step]) -> None:
        if self._cuda:
            steps[-1].end.synchronize()  # type: ignore[union-attr]
        for step in steps:
            self._compute_s += _seconds(step.compute_start, step.end)
            self._step_times_s.append(
                _seconds(step.begin, step.end if step.ready is None else step.ready)
            )
            if self._cuda:
                marks = {step.begin, step.compute_start, step.ready, step.end} - {None}
                self._pool.give_back(list(marks))  # type: ignore[arg-type]


def _seconds(start: Mark, end: Mark | None) -> float:
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    return float(start.elapsed_time(end)) / 1000.0


class DdpCommClock:
    """Gradient-communication time of a DDP model, per epoch, sampled from DDP's reducer timer.

    DDP's C++ reducer timestamps, in the iterations it samples, the launch of the first gradient
    bucket's all-reduce and the moment the last one has finished (CUDA events on GPUs, the clock
    on CPUs). The clock has it sample every `every`-th iteration (DDP itself always samples its
    first ten), reads the span after its third step and every `every`-th one, and scales the
    median of the latest RECENT sampled spans (a window across epochs: one slow sample, common on
    shared CPUs, does not make an epoch's figure) to the steps whose gradients were all-reduced.
    Only those reads touch DDP's logger; on GPUs each is a device sync (DDP's own logging syncs at
    its sampled iterations too).
    Timing each bucket from a Python comm hook instead replaced DDP's built-in C++ all-reduce with
    a Python call and a completion callback per bucket, about 5% of a small model's step on Gloo.

    The interface is DDP's logging hook (`_get_ddp_logging_data`), which torch marks as a
    prototype: where it is missing or changes shape, the clock reports NaN rather than a wrong
    figure, and training is unaffected.
    """

    FIRST_SAMPLE = 3
    """DDP rebuilds its buckets in its first iterations; the first sample comes after them."""
    RECENT = 8

    def __init__(self, ddp_model: nn.Module, every: int = 50) -> None:
        self._ddp_model = ddp_model
        self._ddp_logger = getattr(ddp_model, "logger", None)
        self._every = every
        self._synced_steps = 0  # DDP's own count: iterations whose gradients it all-reduced
        self._last_iteration: int | None = None
        self._recent_ns: collections.deque[int] = collections.deque(maxlen=self.RECENT)
        self._epoch_synced_steps = 0
        self._working = self._ddp_logger is not None
        if self._working:
            try:
                ddp: Any = ddp_model  # a DistributedDataParallel here, whatever nn.Module says
                ddp._set_ddp_runtime_logging_sample_rate(every)
            except (AttributeError, RuntimeError, ValueError):
                self._working = False

    def sampled(self, synced_step: int) -> bool:
        """Whether the clock reads DDP's figures after the given all-reduced step (1-based)."""
        return synced_step == self.FIRST_SAMPLE or synced_step % self._every == 0

    def step_finished(self) -> None:
        """Counts the step just finished and reads DDP's figures if it is sampled. Call after
        backward, inside any ``no_sync()``: a micro-step that all-reduced nothing is not counted."""
        if not self._working or not getattr(self._ddp_model, "require_backward_grad_sync", True):
            return
        self._synced_steps += 1
        self._epoch_synced_steps += 1
        if not self.sampled(self._synced_steps):
            return
        try:
            # DDP itself records a sampled iteration's figures at the next forward pass; recording
            # them now keeps an epoch's last sample in that epoch.
            ddp_logger: Any = self._ddp_logger
            ddp_logger.set_runtime_stats_and_log()
            stats = ddp_logger._get_ddp_logging_data().ints_map
            iteration, span_ns = stats["iteration"], stats["backward_comm_time"]
        except (AttributeError, KeyError, RuntimeError):
            self._working = False
            return
        if iteration != self._last_iteration:  # a stale figure (misaligned count) is not new
            self._last_iteration = iteration
            self._recent_ns.append(span_ns)

    def take_total_s(self) -> float:
        """Estimated seconds of gradient communication since the last call: the recent samples'
        median span times the all-reduced steps (NaN if unmeasurable); starts the count anew."""
        steps, self._epoch_synced_steps = self._epoch_synced_steps, 0
        if not self._working:
            return float("nan")
        if steps == 0:
            return 0.0
        if not self._recent_ns:
            return float("nan")
        return statistics.median(self._recent_ns) * steps / 1e9
