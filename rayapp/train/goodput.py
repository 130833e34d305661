"""Goodput: where a run's wall time went, from submission to the end, and what share of it
trained the model.

The workers keep a ledger of the useful training time, epoch by epoch (the slowest rank's
phases, as every epoch's metrics are) and save by save; it travels in every checkpoint, so
after a restart the ledger holds the epochs the run kept and nothing of the attempt that
died. What that attempt did after its last checkpoint, and the restart itself, is measured
as one window: from the moment the ledger went into the checkpoint the restart resumed from
(or, with none yet, the end of the first step) to the end of the restored attempt's first
step. The driver adds the wall time and takes ``goodput_other_s`` as what no part measured
(evaluation, logging, gaps between epochs, the end-of-run records, teardown), so the parts
add up to ``run_wall_s``.

The names are those MLflow shows:

- ``goodput_startup_s``: submission until the first attempt's first step was done (the cluster,
  the workers, the model's set-up, the first batch, the first step).
- ``goodput_compute_s``: forward, backward and optimizer steps, the all-reduce taken out.
- ``goodput_comm_s``: the gradient all-reduce DDP measured inside the step (its span, which
  backward overlaps in part: an upper bound of the exposed communication; 0 where unmeasured,
  and then inside compute).
- ``goodput_data_s``: waiting for batches.
- ``goodput_checkpoint_s``: the part of the saves training waited for (all of a sync save; the
  staging copy and the wait for the previous save of an async one).
- ``goodput_restart_lost_s``: the windows above, one per restart.
- ``goodput_other_s``: the rest; ``goodput`` = compute / wall.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from rayapp.tracking.goodput import MEASURED_PARTS


@dataclass(frozen=True)
class FirstStep:
    """An attempt's first step: when it ended (wall clock), and what of it the epoch's timers
    also hold, which belongs to start-up or the restart instead."""

    ended_at: float
    data_s: float
    compute_s: float


@dataclass
class GoodputLedger:
    """The measured parts so far, in seconds; every rank keeps the same one."""

    startup_s: float = math.nan
    compute_s: float = 0.0
    comm_s: float = 0.0
    data_s: float = 0.0
    checkpoint_s: float = 0.0
    restart_lost_s: float = 0.0
    saved_at: float | None = None
    """Wall clock when this ledger went into a checkpoint (None in a running attempt's own)."""

    def add_epoch(
        self,
        *,
        compute_s: float,
        comm_s: float,
        data_s: float,
        first_step: FirstStep | None = None,
    ) -> None:
        """One epoch's phases; `first_step`: the attempt's first step fell in this epoch, and is
        counted as start-up or restart, not here."""
        comm_s = comm_s if math.isfinite(comm_s) else 0.0  # unmeasured: it stays inside compute
        if first_step is not None:
            compute_s -= first_step.compute_s
            data_s -= first_step.data_s
        self.compute_s += max(compute_s - comm_s, 0.0)
        self.comm_s += comm_s
        self.data_s += max(data_s, 0.0)

    def add_checkpoint(self, blocking_s: float) -> None:
        self.checkpoint_s += blocking_s

    def first_step(
        self,
        step: FirstStep,
        *,
        attempt: int,
        submitted_at: float,
        resumed: bool,
        startup_s: float = math.nan,
    ) -> None:
        """An attempt's first step is done: the first attempt's ends start-up; a restored
        attempt's ends the window lost to the restart. `resumed`: the attempt resumed from a
        checkpoint (whose ledger this is); `startup_s`: the first attempt's start-up as the run
        recorded it, for a restart that had no checkpoint to resume from."""
        if attempt == 1:
            self.startup_s = step.ended_at - submitted_at
            return
        if resumed and self.saved_at is not None:
            lost_since = self.saved_at
        else:  # nothing kept: everything after the first attempt's first step was lost
            self.startup_s = startup_s
            lost_since = submitted_at + (startup_s if math.isfinite(startup_s) else 0.0)
        self.restart_lost_s += max(step.ended_at - lost_since, 0.0)
        self.saved_at = None

    def to_saved(self, now: float) -> dict[str, float | None]:
        """The ledger as a checkpoint holds it, stamped with when it went in."""
        return {**dataclasses.asdict(self), "saved_at": now}

    @classmethod
    def from_saved(cls, saved: Mapping[str, float | None] | None) -> GoodputLedger:
        if not saved:
            return cls()
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in saved.items() if name in names})  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """The measured parts under their MLflow names."""
        return dict(
            zip(
                MEASURED_PARTS,
                (
                    self.startup_s,
                    self.compute_s,
                    self.comm_s,
                    self.data_s,
                    self.checkpoint_s,
                    self.restart_lost_s,
                ),
                strict=True,
            )
        )
