"""The goodput accounting: the ledger the workers keep across a restart, and the breakdown the
driver logs (rayapp.train.goodput). A run's timeline is written out in seconds here, so each
part has a value worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from rayapp.tracking.goodput import MEASURED_PARTS, PARTS, breakdown
from rayapp.train.goodput import FirstStep, GoodputLedger

SUBMITTED = 1000.0


def test_a_run_without_restarts_counts_start_up_epochs_and_saves_once_each():
    ledger = GoodputLedger()
    # First step ends 12 s after submission; of epoch 0's timers, 0.5 s of data and 0.3 s of
    # compute were that first step's, which start-up owns.
    ledger.first_step(
        FirstStep(ended_at=SUBMITTED + 12.0, data_s=0.5, compute_s=0.3),
        attempt=1,
        submitted_at=SUBMITTED,
        resumed=False,
    )
    ledger.add_epoch(
        compute_s=5.3,
        comm_s=1.0,
        data_s=1.5,
        first_step=FirstStep(ended_at=SUBMITTED + 12.0, data_s=0.5, compute_s=0.3),
    )
    ledger.add_checkpoint(0.4)
    ledger.add_epoch(compute_s=5.0, comm_s=1.0, data_s=1.0)
    ledger.add_checkpoint(0.6)

    parts = ledger.metrics()
    assert parts["goodput_startup_s"] == pytest.approx(12.0)
    assert parts["goodput_compute_s"] == pytest.approx((5.0 - 1.0) + (5.0 - 1.0))
    assert parts["goodput_comm_s"] == pytest.approx(2.0)
    assert parts["goodput_data_s"] == pytest.approx(2.0)
    assert parts["goodput_checkpoint_s"] == pytest.approx(1.0)
    assert parts["goodput_restart_lost_s"] == 0.0


def test_a_restart_loses_what_came_after_the_checkpoint_it_resumes_from():
    ledger = GoodputLedger()
    ledger.first_step(
        FirstStep(ended_at=SUBMITTED + 10.0, data_s=0.0, compute_s=0.0),
        attempt=1,
        submitted_at=SUBMITTED,
        resumed=False,
    )
    ledger.add_epoch(compute_s=4.0, comm_s=1.0, data_s=1.0)
    # Epoch 0's checkpoint takes the ledger at t = 20 s, through a JSON file as a checkpoint does.
    saved = json.loads(json.dumps(ledger.to_saved(SUBMITTED + 20.0)))
    ledger.add_checkpoint(0.5)
    ledger.add_epoch(compute_s=4.0, comm_s=1.0, data_s=1.0)  # epoch 1: lost with the attempt

    restored = GoodputLedger.from_saved(saved)
    # The restored attempt's first step ends at t = 50 s: 30 s since the ledger was saved, which
    # holds epoch 1 (never checkpointed), the failure, the restart and the first step again.
    first = FirstStep(ended_at=SUBMITTED + 50.0, data_s=0.2, compute_s=0.1)
    restored.first_step(first, attempt=2, submitted_at=SUBMITTED, resumed=True)
    restored.add_epoch(compute_s=4.1, comm_s=1.0, data_s=1.2, first_step=first)

    parts = restored.metrics()
    assert parts["goodput_restart_lost_s"] == pytest.approx(30.0)
    assert parts["goodput_startup_s"] == pytest.approx(10.0)  # the first attempt's, kept
    assert parts["goodput_compute_s"] == pytest.approx(3.0 + 3.0)  # epochs 0 and 1, once each
    assert parts["goodput_data_s"] == pytest.approx(2.0)
    # Epoch 0's save went into the checkpoint after the ledger did: it falls in the lost window.
    assert parts["goodput_checkpoint_s"] == 0.0
    assert restored.saved_at is None  # a second restart measures from its own checkpoint


def test_a_restart_before_any_checkpoint_loses_everything_after_the_first_step():
    ledger = GoodputLedger()  # fresh: the restored attempt found no checkpoint
    ledger.first_step(
        FirstStep(ended_at=SUBMITTED + 40.0, data_s=0.0, compute_s=0.0),
        attempt=2,
        submitted_at=SUBMITTED,
        resumed=False,
        startup_s=12.0,  # the first attempt's time to first step, as the run recorded it
    )
    assert ledger.startup_s == 12.0
    assert ledger.restart_lost_s == pytest.approx(40.0 - 12.0)


def test_unmeasured_communication_stays_inside_compute():
    ledger = GoodputLedger()
    ledger.add_epoch(compute_s=3.0, comm_s=math.nan, data_s=0.5)
    assert ledger.compute_s == 3.0 and ledger.comm_s == 0.0


def test_the_breakdown_adds_up_to_the_wall_time_and_goodput_is_compute_over_wall():
    measured = dict.fromkeys(MEASURED_PARTS, 2.0) | {"goodput_compute_s": 30.0}
    measured["goodput_restart_lost_s"] = math.nan  # unmeasured: counted as 0, not as NaN
    result = breakdown(60.0, {**measured, "loss": 0.1})
    assert set(result) == {"run_wall_s", "goodput", *PARTS}
    assert sum(result[name] for name in PARTS) == pytest.approx(60.0)
    assert result["goodput_other_s"] == pytest.approx(60.0 - 30.0 - 4 * 2.0)
    assert result["goodput_restart_lost_s"] == 0.0
    assert result["goodput"] == pytest.approx(0.5)


def test_the_breakdown_shows_parts_that_exceed_the_wall_as_negative_other():
    """Other is the remainder, never floored: a measured part larger than the wall shows."""
    result = breakdown(10.0, {"goodput_compute_s": 11.0})
    assert result["goodput_other_s"] == pytest.approx(-1.0)
