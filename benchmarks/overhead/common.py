"""What every module of the benchmark shares: where things are, the targets, the console, and how a
step fails."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "benchmarks" / "torchrun_ddp.py"
EXPERIMENT = "bench-overhead"
LOG_COST_EXPERIMENT = "bench-overhead-logcost"
TARGET_RATIO = 1.05
TARGET_LOG_SHARE = 0.01
PROG = "benchmarks.overhead"
RAY_PROCESSES = "Ray daemons and actors"

console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 130)


class StepFailed(RuntimeError):
    """A step of the benchmark failed; the message is one line."""


def fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
