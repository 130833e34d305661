"""SIGTERM and SIGHUP end a job the way Ctrl-C does.

A batch scheduler's time limit, systemd, Kubernetes and `timeout` send SIGTERM; a closed terminal
sends SIGHUP. Ray's own handler (installed by ray.init) exits on the spot, and its C++ handler
prints a raw stack dump, so neither the cluster nor the MLflow run would be closed. rayapp turns
both signals into :class:`Terminated`, a KeyboardInterrupt: the same clean-up runs (workers
stopped, epochs backfilled from the checkpoint, the run marked KILLED, the embedded cluster
stopped) and the CLI exits 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP).
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by a signal other than Ctrl-C's SIGINT."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum: int, frame) -> None:
    # Once is enough: a second signal during the clean-up must not cut the clean-up short.
    for handled in HANDLED:
        signal.signal(handled, signal.SIG_IGN)
    raise Terminated(signum)


def raise_on_termination() -> None:
    """Install the handlers (main thread only; a no-op elsewhere). Call again after ray.init, which
    installs its own."""
    if threading.current_thread() is not threading.main_thread():
        return
    for handled in HANDLED:
        if signal.getsignal(handled) is not signal.SIG_IGN or handled == signal.SIGTERM:
            signal.signal(handled, _raise_terminated)
