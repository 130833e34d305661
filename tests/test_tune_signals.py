"""How a signal reaches a `rayapp tune` sweep: while Tune runs, the first one asks Tune to stop
(through the handler Tune keeps on SIGUSR1) and is remembered; a second one, or one outside
Tune's run, raises at once. Real signals sent to this process; Tune's handler is stood in for by a
recording one (Tune itself is exercised in tests/test_tune_integration.py)."""

from __future__ import annotations

import os
import signal

import pytest

from rayapp.driver.signals import Terminated
from rayapp.driver.tune_signals import TUNE_SIGINT_ENV, sweep_interrupts


@pytest.fixture
def tune_stop_handler():
    """A stand-in for the handler Tune installs on SIGUSR1 while fit() runs."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGUSR1, previous)


def test_ctrl_c_while_tune_runs_asks_tune_to_stop_and_a_second_one_raises(tune_stop_handler):
    with sweep_interrupts() as interrupts:
        assert os.environ[TUNE_SIGINT_ENV] == "1"  # Tune leaves SIGINT to the driver
        with interrupts.fit():
            os.kill(os.getpid(), signal.SIGINT)
            assert tune_stop_handler == [signal.SIGUSR1]
            assert interrupts.interrupted
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_interrupt()
    assert tune_stop_handler == [signal.SIGUSR1]


def test_sigterm_while_tune_runs_stops_it_and_is_reported_as_sigterm(tune_stop_handler):
    with sweep_interrupts() as interrupts, interrupts.fit():
        os.kill(os.getpid(), signal.SIGTERM)
    assert tune_stop_handler == [signal.SIGUSR1]
    with pytest.raises(Terminated) as raised:
        interrupts.raise_interrupt()
    assert raised.value.exit_code == 143


def test_a_signal_outside_tunes_run_raises_at_once(tune_stop_handler):
    with sweep_interrupts(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert tune_stop_handler == []


def test_the_handlers_and_tunes_setting_are_put_back_and_an_ignored_sigint_stays_ignored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's SIGINT
    try:
        with sweep_interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert {s: signal.getsignal(s) for s in before} == before
    assert TUNE_SIGINT_ENV not in os.environ
