"""FLOPs, peaks and MFU, and the per-rank step-time figures, on a real single-rank Gloo group in
the test process (the per-epoch collectives run through it). Two-rank figures, checked against
an independent FLOP count, come from tests/test_strategies_integration.py."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
from conftest import JOBS
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayapp.spec.loader import build_spec, load_spec
from rayapp.tracking.logger import NullLogger
from rayapp.tracking.run import TAG_PEAK_TFLOPS_SOURCE
from rayapp.train.config import WorkerConfig
from rayapp.train.context import TrainContext
from rayapp.train.efficiency import EpochEfficiency, step_time_stats, step_to_count
from rayapp.train.flops import device_peak, table_peak

# Linear(64, 256) -> ReLU -> Linear(256, 8) on inputs that need no gradient: forward 2 x MACs,
# weight gradients 2 x MACs, input gradient of the second layer only (the first has no use).
MACS = 64 * 256 + 256 * 8
FLOPS_PER_SAMPLE = 2 * MACS + 2 * MACS + 2 * 256 * 8


@pytest.fixture(scope="module", autouse=True)
def gloo_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class RecordingLogger(NullLogger):
    def __init__(self) -> None:
        self.metrics: list[dict] = []
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics, step=0):
        self.metrics.append(dict(metrics))

    def set_tags(self, tags):
        self.tags.update(tags)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, samples: int = 32) -> None:
    model(torch.randn(samples, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_flops_counted_on_the_first_step_give_tflops_and_mfu():
    logger = RecordingLogger()
    efficiency = EpochEfficiency(device=torch.device("cpu"), precision="fp32", logger=logger)
    model = _model()
    ddp = DistributedDataParallel(model)
    ready = []
    efficiency.watch(model, ddp, lambda: ready.append(True))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(1, 4):
        with efficiency.counting_step(lambda step=step: 32 * step):  # 32 samples a step
            _step(ddp, optimizer)
    assert len(ready) == 3  # the first parameter's gradient: once per backward

    metrics = efficiency.epoch_metrics(
        samples=96, step_times_s=[0.1, 0.2, 0.3], epoch_time_s=2.0, rank=0
    )
    assert metrics["tflops_per_s"] == pytest.approx(FLOPS_PER_SAMPLE * 96 / 2.0 / 1e12)
    assert metrics["peak_tflops"] > 0
    assert metrics["mfu"] == pytest.approx(metrics["tflops_per_s"] / metrics["peak_tflops"])
    assert logger.tags == {TAG_PEAK_TFLOPS_SOURCE: "measured:matmul"}
    assert metrics["rank0_step_time_median_s"] == pytest.approx(0.2)
    assert 0.2 < metrics["rank0_step_time_p95_s"] <= 0.3


def test_a_model_that_states_its_flops_per_sample_is_not_counted():
    model = _model()
    model.flops_per_sample = 1e6
    efficiency = EpochEfficiency(
        device=torch.device("cpu"), precision="fp32", logger=RecordingLogger()
    )
    efficiency.watch(model, model, lambda: None)
    with efficiency.counting_step(lambda: 32):
        _step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    metrics = efficiency.epoch_metrics(samples=1000, step_times_s=[], epoch_time_s=1.0, rank=0)
    assert metrics["tflops_per_s"] == pytest.approx(1e9 / 1e12)
    assert math.isnan(metrics["rank0_step_time_median_s"])  # no steps timed


def test_which_step_is_counted():
    assert step_to_count(build_spec({}, {}).train) == 1
    assert step_to_count(load_spec(JOBS / "mlp_pipeline.yaml").train) == 2  # strategy pp
    assert step_to_count(build_spec({"train": {"compile": True}}, {}).train) is None


def test_a_later_counted_step_is_counted_with_its_own_samples():
    efficiency = EpochEfficiency(
        device=torch.device("cpu"), precision="fp32", logger=RecordingLogger(), counted_step=2
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = 0
    for samples in (32, 16, 64):  # the second step's 16 samples are the ones counted
        seen += samples
        with efficiency.counting_step(lambda seen=seen: seen):
            _step(model, optimizer, samples)
    metrics = efficiency.epoch_metrics(samples=112, step_times_s=[], epoch_time_s=1.0, rank=0)
    assert metrics["tflops_per_s"] == pytest.approx(FLOPS_PER_SAMPLE * 112 / 1e12)


def test_the_context_counts_flops_and_marks_gradients_in_its_steps():
    spec = build_spec({"train": {"lr": 1.0, "timing_every": 2}}, {})
    config = WorkerConfig(spec=spec, run_id="r", tracking_uri="sqlite://", submitted_at=0.0)
    ctx = TrainContext(
        config,
        RecordingLogger(),
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        loop_started=0.0,
    )
    model = ctx.prepare(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(16, 64), torch.randn(16, 8))] * 5
    for inputs, targets in ctx.batches(batches):
        with ctx.compute():
            ctx.backward(nn.functional.mse_loss(model(inputs), targets))
            ctx.step(optimizer)
    timer = ctx._compute_timer
    steps = timer.step_times_s()
    assert len(steps) == 5 and all(0 < step for step in steps)
    assert sum(steps) < timer.total_s() + ctx._data_timer.total_s()  # ends at the gradients
    metrics = ctx._efficiency.epoch_metrics(
        samples=80, step_times_s=steps, epoch_time_s=1.0, rank=0
    )
    assert metrics["tflops_per_s"] == pytest.approx(FLOPS_PER_SAMPLE * 80 / 1e12)


@pytest.mark.parametrize(
    ("name", "precision", "source", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", "table:H100 SXM bf16", 989.4),
        ("NVIDIA H100 PCIe", "fp16", "table:H100 PCIe fp16", 756.5),
        ("NVIDIA H200", "bf16", "table:H200 bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "fp32", "table:A100 fp32", 19.5),
        ("NVIDIA A10G", "bf16", "table:A10G bf16", 70.0),
        ("NVIDIA A10", "bf16", "table:A10 bf16", 125.0),
        ("NVIDIA L4", "bf16", "table:L4 bf16", 121.0),
        ("NVIDIA L40S", "bf16", "table:L40S bf16", 362.0),
        ("Tesla V100-SXM2-16GB", "fp16", "table:V100 SXM2 fp16", 125.0),
        ("Tesla T4", "fp32", "table:T4 fp32", 8.1),
    ],
)
def test_peak_table_by_device_name_and_precision(name, precision, source, tflops):
    peak = table_peak(name, precision)
    assert peak is not None and (peak.source, peak.tflops) == (source, tflops)


def test_peaks_the_table_lacks_are_left_to_measurement():
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert table_peak("Some Future GPU", "bf16") is None
    measured = device_peak(torch.device("cpu"), "bf16")
    assert measured.source == "measured:matmul" and measured.tflops > 0


def test_step_time_median_and_p95():
    times = [float(i) for i in range(1, 101)]
    median, p95 = step_time_stats(times)
    assert median == 50.5 and p95 == pytest.approx(95.05)
    assert step_time_stats([0.5]) == (0.5, 0.5)
