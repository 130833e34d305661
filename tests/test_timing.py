"""Step timing without per-step device syncs: the DDP comm clock samples DDP's reducer every N
steps and scales, and the step timer keeps each step's marks until an interval ends. On a real
single-rank Gloo process group in the test process: DDP still runs its gradient all-reduce
through Gloo, and its reducer still timestamps it. Two-rank figures come from the integration
tests; the CUDA side (event pool, no sync between log points) from tests/test_timing_gpu.py.
"""

from __future__ import annotations

import math
import socket
import statistics
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayapp.train.timing import DdpCommClock, DeviceTimer

TIMING_MODULE = sys.modules[DdpCommClock.__module__].__file__


@pytest.fixture(scope="module")
def gloo_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _step(model: nn.Module, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()


class WatchedLogger:
    """DDP's real C++ logger, passed through, noting each call made from rayapp's timing module
    (DDP's own forward calls it too; those are not the clock's)."""

    def __init__(self, real, steps: list[int]) -> None:
        self._real, self._steps = real, steps
        self.clock_calls: list[tuple[int, str]] = []  # (step, method)
        self.spans_read: list[int] = []

    def __getattr__(self, name: str):
        attribute = getattr(self._real, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            result = attribute(*args, **kwargs)
            if sys._getframe(1).f_code.co_filename == TIMING_MODULE:
                self.clock_calls.append((self._steps[0], name))
                if name == "_get_ddp_logging_data":
                    self.spans_read.append(result.ints_map["backward_comm_time"])
            return result

        return call


def _watched(every: int) -> tuple[DistributedDataParallel, DdpCommClock, WatchedLogger, list[int]]:
    model = DistributedDataParallel(_model())
    step = [0]
    model.logger = WatchedLogger(model.logger, step)
    return model, DdpCommClock(model, every=every), model.logger, step


def test_the_clock_touches_ddps_logger_only_on_sampled_steps(gloo_group):
    model, clock, logger, step = _watched(every=5)
    inputs = torch.randn(32, 64)
    for step[0] in range(1, 13):
        _step(model, inputs)
        clock.step_finished()
    touched = sorted({at for at, _ in logger.clock_calls})
    assert touched == [3, 5, 10]  # the early sample after DDP's bucket rebuild, then every 5th
    assert all(clock.sampled(at) for at in touched)
    # Each sampled step: DDP records that iteration's figures, the clock reads them once.
    assert [name for _, name in logger.clock_calls] == [
        "set_runtime_stats_and_log",
        "_get_ddp_logging_data",
    ] * 3


def test_the_epochs_comm_time_is_the_median_sample_scaled_to_its_steps(gloo_group):
    model, clock, logger, step = _watched(every=4)
    inputs = torch.randn(32, 64)
    started = time.perf_counter()
    for step[0] in range(1, 13):
        _step(model, inputs)
        clock.step_finished()
    elapsed = time.perf_counter() - started
    total = clock.take_total_s()

    spans = logger.spans_read  # steps 3, 4, 8, 12: four distinct iterations
    assert len(spans) == 4 and all(span > 0 for span in spans)
    assert total == pytest.approx(statistics.median(spans) * 12 / 1e9)
    assert 0 < total < elapsed
    assert clock.take_total_s() == 0.0  # taking clears

    # An epoch too short for a sample of its own is scaled from the latest samples.
    for step[0] in range(13, 15):
        _step(model, inputs)
        clock.step_finished()
    assert clock.take_total_s() == pytest.approx(statistics.median(spans) * 2 / 1e9)


def test_one_slow_sample_does_not_make_the_epochs_figure(gloo_group):
    model = DistributedDataParallel(_model())
    step = [0]

    def allreduce_stalling_at_step_5(state, bucket):
        if step[0] == 5:
            time.sleep(0.05)  # a stall inside the sampled span, as a busy shared CPU makes one
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda future: future.value()[0])
        )

    model.register_comm_hook(None, allreduce_stalling_at_step_5)
    model.logger = WatchedLogger(model.logger, step)
    clock = DdpCommClock(model, every=1)
    inputs = torch.randn(32, 64)
    for step[0] in range(1, 10):
        _step(model, inputs)
        clock.step_finished()
    spans = model.logger.spans_read
    assert max(spans) >= 0.05e9 and len(spans) == 9  # every step sampled, each read once
    total = clock.take_total_s()
    recent = spans[-DdpCommClock.RECENT :]
    assert total == pytest.approx(statistics.median(recent) * 9 / 1e9)
    assert total < 9 * 0.01  # a mean would be at least 9 x 50 ms / 8


def test_micro_steps_under_no_sync_are_not_counted(gloo_group):
    model, clock, logger, step = _watched(every=100)
    inputs = torch.randn(32, 64)
    for step[0] in range(1, 7):  # accumulation over 2: every other micro-step all-reduces
        if step[0] % 2:
            with model.no_sync():
                _step(model, inputs)
                clock.step_finished()
        else:
            _step(model, inputs)
            clock.step_finished()
    # Three all-reduced steps: the third (micro-step 6) is the early sample, scaled to three.
    assert [at for at, name in logger.clock_calls if name == "_get_ddp_logging_data"] == [6]
    assert clock.take_total_s() == pytest.approx(logger.spans_read[0] * 3 / 1e9)


def test_a_run_shorter_than_the_first_sample_reports_nan_not_zero(gloo_group):
    model, clock, _, _ = _watched(every=50)
    for _ in range(2):
        _step(model, torch.randn(32, 64))
        clock.step_finished()
    assert math.isnan(clock.take_total_s())


def test_a_model_without_ddp_reports_nan():
    clock = DdpCommClock(_model())
    clock.step_finished()
    assert math.isnan(clock.take_total_s())


def test_step_time_runs_from_the_batch_request_to_the_gradients_ready():
    timer = DeviceTimer(torch.device("cpu"), read_every=2)
    for _ in range(5):
        timer.mark_step_begin()
        time.sleep(0.01)  # waiting for the batch
        timer.start()
        time.sleep(0.02)  # forward and backward
        timer.mark_ready()
        time.sleep(0.03)  # waiting for the other ranks' gradients
        timer.stop()
    steps = timer.step_times_s()
    assert len(steps) == 5
    assert all(0.03 <= step < 0.045 for step in steps), steps
    assert 5 * 0.05 <= timer.total_s() < 5 * 0.065


def test_without_a_ready_mark_or_batch_request_a_step_is_its_compute():
    timer = DeviceTimer(torch.device("cpu"), read_every=50)
    timer.start()
    time.sleep(0.02)
    timer.stop()
    (step,) = timer.step_times_s()
    assert step == pytest.approx(timer.total_s())
