"""Ctrl-C, SIGTERM and SIGHUP during a `rayapp tune` sweep: Ray Tune ends the sweep its graceful
way (the trials stopped, the sweep's state saved for `--resume`), and the driver knows it was
interrupted.

Left to itself, Tune catches the first SIGINT, saves the sweep and returns from fit() as if the
sweep had ended, its trials TERMINATED: the driver could not tell an interrupted sweep from a
finished one. So Tune's own SIGINT handler is turned off (TUNE_DISABLE_SIGINT_HANDLER) and the
driver's handler records the signal, then calls the handler Tune keeps on SIGUSR1 while it runs,
which is its graceful stop. A second signal, or one that comes while Tune is not running, raises
at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

from rayapp.driver.signals import HANDLED, Terminated

TUNE_SIGINT_ENV = "TUNE_DISABLE_SIGINT_HANDLER"
TUNE_STOP_SIGNAL = signal.SIGUSR1
"""Tune installs its graceful-stop handler on SIGUSR1 for as long as fit() runs."""


@dataclass
class SweepInterrupts:
    signum: int | None = None
    """The signal that interrupted the sweep, None while none has."""
    at_ms: int | None = None
    """When it came (milliseconds since the epoch, as MLflow stamps a run's end)."""
    fitting: bool = False

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    def raise_interrupt(self) -> None:
        """The interruption as the CLI reports it: KeyboardInterrupt for Ctrl-C (exit 130),
        Terminated for SIGTERM and SIGHUP (128 + the signal)."""
        if self.signum is None or self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(self.signum)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        tune_stop = signal.getsignal(TUNE_STOP_SIGNAL)
        first = not self.interrupted
        self.signum = self.signum or signum
        if first:
            self.at_ms = int(time.time() * 1000)
        if first and self.fitting and callable(tune_stop):
            tune_stop(TUNE_STOP_SIGNAL, frame)
            return
        self.raise_interrupt()

    @contextlib.contextmanager
    def fit(self) -> Iterator[None]:
        """Around Tuner.fit(): a signal now asks Tune to stop."""
        self.fitting = True
        try:
            yield
        finally:
            self.fitting = False


@contextlib.contextmanager
def sweep_interrupts() -> Iterator[SweepInterrupts]:
    """The driver's handlers for the sweep's length (main thread only: elsewhere signals stay as
    they are). A signal the process was started ignoring (SIGINT in a background job) stays
    ignored."""
    interrupts = SweepInterrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    signums = [signal.SIGINT, *HANDLED]
    previous = {signum: signal.getsignal(signum) for signum in [*signums, TUNE_STOP_SIGNAL]}
    previous_env = os.environ.get(TUNE_SIGINT_ENV)
    os.environ[TUNE_SIGINT_ENV] = "1"
    for signum in signums:
        if previous[signum] is not signal.SIG_IGN or signum == signal.SIGTERM:
            signal.signal(signum, interrupts.handle)
    try:
        yield interrupts
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if previous_env is None:
            os.environ.pop(TUNE_SIGINT_ENV, None)
        else:
            os.environ[TUNE_SIGINT_ENV] = previous_env
