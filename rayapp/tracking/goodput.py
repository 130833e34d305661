"""The goodput metrics of a run: their names, and the breakdown the driver logs at the end.

The workers measure the parts (:mod:`rayapp.train.goodput` keeps their ledger); the driver adds
``run_wall_s``, from submission until training ended, and takes ``goodput_other_s`` as what no
part measured, so that the parts add up to the wall time; ``goodput`` is compute over wall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

RUN_WALL = "run_wall_s"
GOODPUT = "goodput"
OTHER = "goodput_other_s"
MEASURED_PARTS = (
    "goodput_startup_s",
    "goodput_compute_s",
    "goodput_comm_s",
    "goodput_data_s",
    "goodput_checkpoint_s",
    "goodput_restart_lost_s",
)
"""What the workers measure, in the order a stacked bar draws them; other comes last."""
PARTS = (*MEASURED_PARTS, OTHER)


def breakdown(run_wall_s: float, measured: Mapping[str, float]) -> dict[str, float]:
    """``run_wall_s``, the measured parts (an unmeasured one as 0), ``goodput_other_s`` (the
    rest, so that the parts add up to the wall time) and ``goodput``."""
    parts = {name: _finite_or_zero(measured.get(name, math.nan)) for name in MEASURED_PARTS}
    other = run_wall_s - sum(parts.values())
    return {
        RUN_WALL: run_wall_s,
        **parts,
        OTHER: other,
        GOODPUT: parts["goodput_compute_s"] / run_wall_s if run_wall_s > 0 else math.nan,
    }


def _finite_or_zero(value: float) -> float:
    return value if math.isfinite(value) else 0.0
