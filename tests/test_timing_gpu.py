"""On a CUDA GPU: rayapp's step loop makes no host-device sync between log points, and the step
timer's CUDA events come from a pool that does not grow with the steps. A real DDP model on a
single-rank NCCL group in the test process, driven through TrainContext as the built-in loop
drives it. Skipped without CUDA (see conftest.py)."""

from __future__ import annotations

import contextlib
import math
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rayapp.spec.loader import build_spec
from rayapp.tracking.logger import NullLogger
from rayapp.train.config import WorkerConfig
from rayapp.train.context import TrainContext

pytestmark = pytest.mark.gpu

EVERY = 20
"""train.timing_every: steps EVERY, 2 x EVERY, ... are log points (DDP samples, timers read)."""


@pytest.fixture(scope="module")
def nccl_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@contextlib.contextmanager
def syncs_are_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_no_device_sync_between_log_points_and_a_bounded_event_pool(nccl_group):
    device = torch.device("cuda", 0)
    spec = build_spec({"train": {"lr": 0.01, "timing_every": EVERY}}, {})
    config = WorkerConfig(spec=spec, run_id="r", tracking_uri="sqlite://", submitted_at=0.0)
    ctx = TrainContext(
        config,
        NullLogger(),
        rank=0,
        world_size=1,
        local_rank=0,
        device=device,
        loop_started=0.0,
    )
    torch.manual_seed(0)
    model = ctx.prepare(nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 5 * EVERY
    data = [(torch.randn(64, 128, device=device), torch.randn(64, 16, device=device))] * steps
    loss_sum = torch.zeros((), device=device)

    for step, (inputs, targets) in enumerate(ctx.batches(data), start=1):
        # Steps 1-12: FLOPs counted, DDP samples its first ten iterations. After that, syncs are
        # allowed only at a log point and at the forward right after it (where DDP records the
        # sampled iteration); anywhere else the step fails.
        between_log_points = step > 12 and step % EVERY not in (0, 1)
        with syncs_are_errors() if between_log_points else contextlib.nullcontext():
            with ctx.compute():
                with ctx.autocast():
                    loss = nn.functional.mse_loss(model(inputs), targets)
                ctx.backward(loss)
                ctx.step(optimizer)
            loss_sum += loss.detach()

    timer = ctx._compute_timer
    step_times = timer.step_times_s()
    assert len(step_times) == steps and all(t > 0 for t in step_times)
    assert timer.total_s() > 0
    # Four marks a step at most, two intervals held: the pool, not the step count, bounds it.
    assert timer.events_made <= 4 * (2 * EVERY + 1) < 4 * steps
    comm = ctx._comm_clock.take_total_s()
    assert math.isfinite(comm) and comm > 0
    assert math.isfinite(loss_sum.item())
