"""FLOPs of a training step, and the peak FLOP rate they are measured against (for MFU).

A step's FLOPs are counted once, on the first batch, with torch's FlopCounterMode (the matrix
products and convolutions of forward and backward, as the model really runs them), unless the
model states ``flops_per_sample`` itself. The peak is the device's dense rate for the job's
precision from a table of vendor datasheet figures, or, for CPUs and GPUs not in the table, a
short matrix product measured on the node.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

# Dense (no 2:4 sparsity) peaks in TFLOP/s from NVIDIA's datasheets; fp32 is the plain FP32
# rate, tf32 the tensor-core rate torch uses for fp32 matmuls when TF32 is allowed. The first
# pattern that matches the device's name wins, so the narrower names come first.
_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (
        r"H100.*(PCIe|PCIE)",
        "H100 PCIe",
        {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    ),
    (r"H100.*NVL", "H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100", "H100 SXM", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H200.*NVL", "H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"GH200", "GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H200", "H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"A10G", "A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 35.0}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"L40S", "L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"V100.*(PCIe|PCIE)", "V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", "V100 SXM2", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", "T4", {"fp16": 65.0, "fp32": 8.1}),
]

MEASURE_BUDGET_S = 0.25
"""How long the matrix-product measurement may run on each rank (once per attempt)."""


@dataclass(frozen=True)
class Peak:
    tflops: float
    """One device's (one rank's) peak, TFLOP/s."""
    source: str
    """Where it came from: ``table:H100 SXM bf16`` or ``measured:matmul``."""


def table_peak(device_name: str, precision: str) -> Peak | None:
    """The datasheet peak of a GPU by its name and the job's precision; None if not listed."""
    for pattern, label, peaks in _PEAKS:
        if re.search(pattern, device_name):
            tflops = peaks.get(precision)
            return None if tflops is None else Peak(tflops, f"table:{label} {precision}")
    return None


def matmul_precision(precision: str) -> str:
    """The job's precision as the table names it: fp32 matmuls run as TF32 where torch allows."""
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """The rate of square matrix products in `dtype` on `device`, over about MEASURE_BUDGET_S."""
    size = 4096 if device.type == "cuda" else 512
    with torch.no_grad():
        left = torch.randn(size, size, device=device).to(dtype)
        right = torch.randn(size, size, device=device).to(dtype)
        torch.mm(left, right)  # warm-up: kernel choice, allocation
        _sync(device)
        products, started = 0, time.perf_counter()
        while True:
            torch.mm(left, right)
            products += 1
            if products % 4 == 0:
                _sync(device)
                elapsed = time.perf_counter() - started
                if elapsed >= MEASURE_BUDGET_S:
                    break
    return 2 * size**3 * products / elapsed / 1e12


def device_peak(device: torch.device, precision: str) -> Peak:
    """This rank's peak: the table's for a listed GPU, else measured on the node."""
    precision = matmul_precision(precision) if device.type == "cuda" else precision
    if device.type == "cuda":
        listed = table_peak(torch.cuda.get_device_name(device), precision)
        if listed is not None:
            return listed
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 autocast is GPU-only: CPU runs of the job use fp32
    return Peak(measure_matmul_tflops(device, dtype), "measured:matmul")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
