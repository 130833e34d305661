"""TrainContext's step controls on a real single-rank Gloo group in the test process: gradient
accumulation matches one large batch, clipping bounds the update, mixed precision autocasts,
step-level metrics are logged every N steps. Ray is not needed for these."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rayapp.spec.loader import build_spec
from rayapp.tracking.logger import NullLogger
from rayapp.train.config import WorkerConfig
from rayapp.train.context import TrainContext


@pytest.fixture(scope="module", autouse=True)
def gloo_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class RecordingLogger(NullLogger):
    """Keeps what rank 0 would send to MLflow (the outbox itself is tested in test_outbox.py)."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=0):
        self.metrics.append((step, dict(metrics)))


def context(**overrides) -> TrainContext:
    spec = build_spec({"train": {"lr": 1.0}}, {key: value for key, value in overrides.items()})
    config = WorkerConfig(spec=spec, run_id="r", tracking_uri="sqlite://", submitted_at=0.0)
    return TrainContext(
        config,
        RecordingLogger(),
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        loop_started=0.0,
    )


def one_step(ctx, model, optimizer, inputs, targets) -> bool:
    with ctx.compute():
        with ctx.autocast():
            loss = nn.functional.mse_loss(model(inputs), targets)
        ctx.backward(loss)
        return ctx.step(optimizer)


def test_accumulated_micro_batches_match_one_large_batch():
    torch.manual_seed(0)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 2)
    ctx = context(**{"train.grad_accum_steps": 2})
    model = ctx.prepare(nn.Linear(4, 2))
    reference = nn.Linear(4, 2)
    reference.load_state_dict(model.module.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.module.weight.detach().clone()

    assert one_step(ctx, model, optimizer, inputs[:4], targets[:4]) is False
    assert torch.equal(model.module.weight, before), "stepped before the last micro-batch"
    assert one_step(ctx, model, optimizer, inputs[4:], targets[4:]) is True
    assert ctx.global_step == 1

    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(inputs), targets).backward()
    reference_optimizer.step()
    torch.testing.assert_close(model.module.weight, reference.weight)
    assert all(p.grad is None for p in model.parameters()), "gradients not cleared after the step"


def test_clipping_bounds_the_update():
    ctx = context(**{"train.grad_clip": 0.01})
    model = ctx.prepare(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update = -clipped gradient
    before = [p.detach().clone() for p in model.parameters()]
    one_step(ctx, model, optimizer, 100 * torch.randn(16, 4), 100 * torch.randn(16, 2))
    change = torch.sqrt(
        sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before, strict=True))
    )
    assert 0 < change <= 0.01 + 1e-6


def test_bf16_autocasts_the_forward_pass_on_cpu():
    ctx = context(**{"train.precision": "bf16"})
    model = ctx.prepare(nn.Linear(4, 2))
    with ctx.autocast():
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    with context().autocast():
        assert nn.Linear(4, 2)(torch.randn(3, 4)).dtype == torch.float32


def test_step_metrics_every_n_steps():
    ctx = context(**{"tracking.log_every_steps": 2})
    model = ctx.prepare(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in ctx.batches([(torch.randn(8, 4), torch.randn(8, 2))] * 5):
        pass
    for _ in range(5):
        one_step(ctx, model, optimizer, torch.randn(8, 4), torch.randn(8, 2))
    logged = [(step, metrics) for step, metrics in ctx.logger.metrics if "step_loss" in metrics]
    assert [step for step, _ in logged] == [2, 4]
    assert all(
        metrics["step_samples_per_s"] >= 0 and metrics["step_loss"] > 0 for _, metrics in logged
    )
