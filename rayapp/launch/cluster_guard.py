"""Stops an embedded cluster's nodes when the process that started them dies, however it dies.

Each node's `ray start --block` leader runs in a session of its own, so that a terminal's Ctrl-C
does not reach it and teardown signals exactly its processes; nothing then stops the nodes when
their owner dies without running :meth:`EmbeddedCluster.stop` (SIGKILL, the OOM killer), and a
laptop is left with raylets that hold their memory for ever.

So the owner starts this module beside its nodes, as a small process in a session of its own too,
and holds the write end of a pipe to its stdin, over which it names each leader it starts (pid and
start time) and each temp dir. The kernel closes that end when the owner exits, by any means; the
guard then reads EOF, stops the leaders as `rayapp cluster down` stops a warm cluster's
(:func:`stop_leaders`: SIGTERM each, SIGKILL what is left of its session) and removes the temp
dirs. The node logs are kept: they may tell why the owner died. A cluster that stops normally, or
is detached to run on (a warm cluster), releases its guard, which then exits and touches nothing.

Not PR_SET_PDEATHSIG on each leader: it fires when the *thread* that started the leader exits
(keep_nodes_up restarts nodes from a thread of its own), it needs Popen's preexec_fn, which is not
safe in a process with threads (Ray's driver has many), and a detached node could not shed it.
Not a wrapper process per node either: the leader's pid, its session and its exit code are what
stop(), the warm cluster's record and the tests rely on, and stay the `ray start` process's.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from rayapp.launch.processes import start_time, stop_leaders

RELEASE_TIMEOUT_S = 5.0


class ClusterGuard:
    """The owner's end: a guard process that stops the leaders named to it once this process
    exits, unless released first."""

    def __init__(self, log_path: Path) -> None:
        with open(log_path, "a") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                # Not in the owner's process group: a Ctrl-C or a group kill meant for the owner
                # must leave the guard to clean up after it.
                start_new_session=True,
            )
        assert self._process.stdin is not None
        self._messages = self._process.stdin
        # Nodes start from the caller's thread and from keep_nodes_up's watchdog thread.
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch_leader(self, pid: int) -> None:
        """Stop this `ray start --block` process (and its session) if the owner dies."""
        started = start_time(pid)
        if started is not None:  # None: it has exited already, nothing is left to stop
            self._send({"leader": pid, "started": started})

    def remove_on_exit(self, directory: str) -> None:
        """Remove this temp dir after stopping the leaders, if the owner dies."""
        self._send({"temp_dir": directory})

    def release(self) -> None:
        """Stop guarding (the nodes are stopped, or detached to run on) and wait for the guard to
        exit."""
        self._send({"release": True})
        with self._lock, contextlib.suppress(OSError):
            self._messages.close()
        try:
            self._process.wait(timeout=RELEASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, message: dict[str, object]) -> None:
        with self._lock:
            # A guard that died (killed by hand) or was released guards nothing: the owner goes on,
            # and stops its nodes itself as long as it lives.
            with contextlib.suppress(OSError, ValueError):
                self._messages.write(json.dumps(message) + "\n")
                self._messages.flush()


def guard(messages: Iterable[str]) -> None:
    """The guard process: read the owner's messages (JSON lines) until release (exit) or their end
    (the owner died: stop the leaders, remove the temp dirs)."""
    leaders: dict[int, str] = {}
    temp_dirs: list[str] = []
    for line in messages:
        message = json.loads(line)
        if message.get("release"):
            return
        if "leader" in message:
            leaders[int(message["leader"])] = str(message["started"])
        if "temp_dir" in message:
            temp_dirs.append(str(message["temp_dir"]))
    began = time.monotonic()
    print(f"the cluster's owner exited; stopping its nodes {list(leaders)}", flush=True)
    stop_leaders(leaders)
    for directory in temp_dirs:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"nodes stopped in {time.monotonic() - began:.1f} s", flush=True)


if __name__ == "__main__":
    guard(sys.stdin)
