"""Each rank's heartbeat to the driver's hang watchdog (:mod:`rayapp.driver.watchdog`).

The training loop only counts: :meth:`Heartbeat.mark` after each step and epoch is a few integer
operations, no call into Ray. A daemon thread sends the count, with where this rank runs (node,
process, the training thread), every few seconds to the watchdog's actor. A rank stuck in a
collective or a sleep keeps sending the same count (the thread runs while the training thread
waits), so the watchdog sees "no step finished" rather than "no news"; a rank whose process is
gone stops sending, which reads the same.

Every rank also registers a faulthandler dump of all its threads on SIGUSR2 into a file named
after its process, so the watchdog can read its stack where py-spy may not attach (ptrace
forbidden for non-root users on some hosts).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

STACK_SIGNAL = signal.SIGUSR2
"""The signal on which a rank writes every thread's Python stack to :func:`stack_file`."""


def stack_file(pid: int) -> Path:
    """Where the process `pid` writes its stacks on STACK_SIGNAL (on its own node)."""
    return Path(tempfile.gettempdir()) / f"rayapp-stacks-{pid}.txt"


class Heartbeat:
    """Counts this rank's progress; a thread sends it to the watchdog every `interval_s`."""

    def __init__(self, watchdog: Any, rank: int, interval_s: float) -> None:
        import ray

        self._watchdog = watchdog
        self._interval_s = interval_s
        self._marks = 0
        self._epochs = 0
        self._last_mark = time.monotonic()
        self._longest_gap_s = 0.0
        self._stopped = threading.Event()
        context = ray.get_runtime_context()
        # The thread that runs the loop (Ray Train's training thread, not the process's main
        # thread): the watchdog reads this thread's stack.
        self._where = {
            "rank": rank,
            "pid": os.getpid(),
            "thread_id": threading.get_native_id(),  # as py-spy names threads
            "thread_ident": threading.get_ident(),  # as faulthandler names them
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "token": f"{os.getpid()}-{time.time_ns()}",
        }
        self._stack_output: IO[str] | None = None
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            self._stack_output = open(stack_file(os.getpid()), "w")  # noqa: SIM115 (kept open)
            faulthandler.register(STACK_SIGNAL, file=self._stack_output, all_threads=True)
        self._thread = threading.Thread(target=self._send, name="rayapp-heartbeat", daemon=True)
        self._thread.start()

    def mark(self, *, epoch_ended: bool = False) -> None:
        """A step (or an epoch) finished."""
        now = time.monotonic()
        self._longest_gap_s = max(self._longest_gap_s, now - self._last_mark)
        self._last_mark = now
        self._marks += 1
        if epoch_ended:
            self._epochs += 1

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self._interval_s + 1)
        if self._stack_output is not None:
            with contextlib.suppress(Exception):
                faulthandler.unregister(STACK_SIGNAL)
                self._stack_output.close()
                stack_file(os.getpid()).unlink(missing_ok=True)
            self._stack_output = None

    def _send(self) -> None:
        while True:
            report = {
                **self._where,
                "marks": self._marks,
                "epochs": self._epochs,
                "longest_gap_s": self._longest_gap_s,
            }
            try:
                self._watchdog.beat.remote(report)  # fire and forget: never wait on the driver
            except Exception as exc:  # the watchdog is gone (the driver is ending)
                logging.getLogger(__name__).debug("heartbeat not sent: %s", exc)
            if self._stopped.wait(self._interval_s):
                return


class NoHeartbeat:
    """The job has no watchdog (hang_timeout_s 0, or a script that reports no steps)."""

    def mark(self, *, epoch_ended: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def start(watchdog: Any, rank: int, interval_s: float) -> Heartbeat | NoHeartbeat:
    """This rank's heartbeat to `watchdog` (the actor handle in WorkerConfig), or a no-op."""
    return NoHeartbeat() if watchdog is None else Heartbeat(watchdog, rank, interval_s)
