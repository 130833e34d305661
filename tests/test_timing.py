"""The DDP comm clock, on a real single-rank Gloo process group in the test process.

One rank is enough for what is tested here: DDP still runs its gradient all-reduce through
Gloo, and its reducer still timestamps it. Two-rank figures come from the integration tests.
"""

from __future__ import annotations

import math
import socket
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayapp.train.timing import DdpCommClock


@pytest.fixture
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


def test_counts_each_step_once_and_within_its_wall_time(gloo_group):
    model = DistributedDataParallel(_model())
    clock = DdpCommClock(model)
    inputs = torch.randn(32, 64)

    started = time.perf_counter()
    for _ in range(5):
        _step(model, inputs)
        clock.step_finished()
        clock.step_finished()  # a second read of the same step adds nothing
    elapsed = time.perf_counter() - started
    five_steps = clock.take_total_s()

    assert 0 < five_steps < elapsed
    assert clock.take_total_s() == 0.0  # taking clears

    # DDP recomputes the last step's figures at the next forward; they must not count again.
    model(inputs)
    clock.step_finished()
    assert clock.take_total_s() == 0.0


def test_each_step_adds_its_own_span(gloo_group):
    model = DistributedDataParallel(_model())
    clock = DdpCommClock(model)
    inputs = torch.randn(32, 64)
    for _ in range(2):  # the first steps rebuild DDP's buckets and run slow
        _step(model, inputs)
        clock.step_finished()
    clock.take_total_s()
    per_step = []
    for _ in range(6):
        _step(model, inputs)
        clock.step_finished()
        per_step.append(clock.take_total_s())
    assert all(span > 0 for span in per_step)

    for _ in range(6):
        _step(model, inputs)
        clock.step_finished()
    # six steps' worth (about 6x the median), not the last one only (about 1x)
    assert clock.take_total_s() > 3 * statistics.median(per_step)


def test_a_model_without_ddp_reports_nan():
    clock = DdpCommClock(_model())
    clock.step_finished()
    assert math.isnan(clock.take_total_s())
