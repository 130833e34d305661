"""Per-epoch efficiency figures that every rank contributes to: the model FLOP rate and MFU
(model FLOPs utilisation), and each rank's step times for the straggler view.

Metrics, logged with each epoch (rank 0 logs them; see README, "What lands in MLflow"):

- ``tflops_per_s``: model FLOPs of all ranks together per second of the epoch (slowest rank's).
- ``peak_tflops``: the peak of all ranks together; its source is the tag
  ``rayapp.peak_tflops_source`` (``table:H100 SXM bf16``, ``measured:matmul``).
- ``mfu``: tflops_per_s / peak_tflops.
- ``rank<N>_step_time_median_s`` and ``rank<N>_step_time_p95_s``: rank N's own step times
  (see rayapp.train.timing.DeviceTimer), median and 95th percentile over the epoch's steps.
- ``rank<N>_link_s``: on 3 nodes or more, the link of the node whose first rank is N, timed at
  the epoch's end (rayapp.train.link_probe).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from rayapp.spec import TrainSpec
from rayapp.tracking.logger import NullLogger
from rayapp.tracking.run import TAG_PEAK_TFLOPS_SOURCE
from rayapp.train.flops import Peak, device_peak
from rayapp.train.link_probe import LinkProbe


def step_to_count(train: TrainSpec) -> int | None:
    """Which step of an attempt has its FLOPs counted: the first; under pp the second (the first
    sets the stages up with autograd.grad calls FlopCounterMode cannot follow); none under
    train.compile (FlopCounterMode does not trace through compiled code)."""
    if train.compile:
        return None
    return 2 if train.strategy == "pp" else 1


class EpochEfficiency:
    def __init__(
        self,
        *,
        device: torch.device,
        precision: str,
        logger: NullLogger,
        counted_step: int | None = 1,
    ) -> None:
        """counted_step: the step of the attempt whose FLOPs are counted (1: the first); None:
        none (FlopCounterMode does not trace through torch.compile'd models)."""
        self._device, self._precision, self._logger = device, precision, logger
        self._flops_per_sample: float | None = None
        self._flops_per_step: float | None = None  # a loop that gives rayapp no batches
        self._counted_step = counted_step
        self._count_pending = counted_step is not None
        self._steps, self._samples_seen = 0, 0
        self._peak: Peak | None = None
        self._ready_hook: torch.utils.hooks.RemovableHandle | None = None
        self._link_probe: LinkProbe | None = None

    def place(self, node_ids: list[str], rank: int, timeout_s: float) -> None:
        """Where every rank runs (their node ids, in rank order), for timing each node's link; a
        collective, once per attempt."""
        self._link_probe = LinkProbe(node_ids, rank, timeout_s)

    def watch(
        self, model: nn.Module, prepared: nn.Module, on_grads_ready: Callable[[], None]
    ) -> None:
        """Take `model`'s own ``flops_per_sample`` (forward and backward FLOPs of one sample) if it
        states one; call `on_grads_ready` when `prepared`'s gradients are ready in each backward.

        The first parameter is (nearly always) the last to get its gradient in backward, so its
        post-accumulate hook marks the end of the rank's own backward work, before the wait for
        the last all-reduce; one Python call per step, no device sync."""
        declared = getattr(model, "flops_per_sample", None)
        if declared is not None:
            self._flops_per_sample = float(declared)
            self._count_pending = False
        first = next((p for p in prepared.parameters() if p.requires_grad), None)
        if self._ready_hook is not None:
            self._ready_hook.remove()
        if first is not None:
            self._ready_hook = first.register_post_accumulate_grad_hook(lambda _: on_grads_ready())

    @contextlib.contextmanager
    def counting_step(self, samples_seen: Callable[[], int]) -> Iterator[None]:
        """Around every step, its batch already taken (`samples_seen`: the attempt's samples so
        far): the counted step's FLOPs are counted with FlopCounterMode; the others pass."""
        seen, self._steps = samples_seen(), self._steps + 1
        samples, self._samples_seen = seen - self._samples_seen, seen
        if not self._count_pending or self._steps != self._counted_step:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._count_pending = False
        with FlopCounterMode(display=False) as counter:
            yield
        flops = counter.get_total_flops()
        if samples > 0:
            self._flops_per_sample = flops / samples
        else:
            self._flops_per_step = float(flops)

    def epoch_metrics(
        self, *, samples: int, step_times_s: list[float], epoch_time_s: float, rank: int
    ) -> dict[str, float]:
        """The epoch's figures (collectives: every rank calls this at the epoch's end)."""
        if self._peak is None:  # once per attempt, on every rank at the same moment
            self._peak = device_peak(self._device, self._precision)
            if rank == 0:
                self._logger.set_tags({TAG_PEAK_TFLOPS_SOURCE: self._peak.source})
        if self._flops_per_sample is not None:
            flops = self._flops_per_sample * samples
        elif self._flops_per_step is not None:
            flops = self._flops_per_step * len(step_times_s)
        else:
            flops = math.nan
        total = torch.tensor([flops, self._peak.tflops], dtype=torch.float64, device=self._device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        all_flops, peak_tflops = total.tolist()
        tflops = all_flops / epoch_time_s / 1e12 if epoch_time_s > 0 else math.nan
        metrics = {"tflops_per_s": tflops, "peak_tflops": peak_tflops, "mfu": tflops / peak_tflops}
        link_s = self._link_probe.measure() if self._link_probe is not None else math.nan
        gathered = gather_step_time_stats(step_times_s, self._device, link_s)
        for other, (median, p95, link) in enumerate(gathered):
            metrics[f"rank{other}_step_time_median_s"] = median
            metrics[f"rank{other}_step_time_p95_s"] = p95
            if math.isfinite(link):  # node leaders only
                metrics[f"rank{other}_link_s"] = link
        return metrics


def step_time_stats(step_times_s: list[float]) -> tuple[float, float]:
    """Median and 95th percentile (linear between the nearest steps); NaN for no steps."""
    if not step_times_s:
        return math.nan, math.nan
    if len(step_times_s) == 1:
        return step_times_s[0], step_times_s[0]
    p95 = statistics.quantiles(step_times_s, n=20, method="inclusive")[18]
    return statistics.median(step_times_s), p95


def gather_step_time_stats(
    step_times_s: list[float], device: torch.device, link_s: float = math.nan
) -> list[list[float]]:
    """Every rank's (median, p95, link_s), in rank order (a collective)."""
    mine = torch.tensor(
        [*step_time_stats(step_times_s), link_s], dtype=torch.float64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [tensor.tolist() for tensor in gathered]
