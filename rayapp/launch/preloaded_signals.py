"""Every signal of the warm cluster's preloaded driver is handled here, and nowhere else.

Three processes take part (rayapp.cli.preloaded tells the whole story):

- the command the user runs, which hands itself over to the server: Ctrl-C, SIGTERM and SIGHUP
  sent to it reach the child that runs it (:class:`Forwarder`);
- the server: SIGTERM ends it (`rayapp cluster down`), and the kernel reaps its children
  (:func:`serve_until_terminated`);
- the child: Python's own dispositions, as the command would have had them in its own process
  (:func:`as_the_command`), and SIGTERM to itself when the command is gone
  (:func:`terminate_when_closed`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Forwarder:
    """The command's side. From :meth:`install` on, a signal that comes before the child's pid is
    known is held; :meth:`forward_to` passes the held ones and every later one to the child;
    :meth:`restore` (the server declined or is gone: the command runs here after all) puts the
    previous handlers back and raises the held signals again here, so no Ctrl-C is lost or
    handled twice."""

    def __init__(self) -> None:
        self._held: list[int] = []
        self._child: int | None = None
        self._previous: dict[int, object] = {}
        # Ignored here (nohup, a background job's SIGINT), ignored there: not forwarded.
        self.sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def install(self) -> None:
        for signum in FORWARDED:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def forward_to(self, child: int) -> None:
        self._child = child
        for signum in self._held:
            _send(child, signum)
        self._held.clear()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        held, self._held = self._held, []
        for signum in held:
            signal.raise_signal(signum)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._child is None:
            self._held.append(signum)
        else:
            _send(self._child, signum)


def serve_until_terminated(on_terminate: Callable[[], None]) -> None:
    """The server's dispositions: SIGTERM calls on_terminate (which must not return), and the
    kernel reaps the children, so none becomes a zombie and the server never waits on one."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: on_terminate())


def as_the_command(sigint_ignored: bool) -> None:
    """In a forked child: the dispositions Python gives a new process (Ctrl-C raises
    KeyboardInterrupt unless the command inherited it ignored), not the server's."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)


def terminate_when_closed(connection: socket.socket) -> None:
    """In a forked child: SIGTERM to itself once the command's end of `connection` closes (the
    command was killed, its terminal closed), so its run ends as a stopped one."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while connection.recv(64):
                pass
        os.kill(os.getpid(), signal.SIGTERM)  # to the process: the main thread may take it

    threading.Thread(target=watch, name="rayapp-command-watch", daemon=True).start()


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
