"""The processes of the clusters rayapp starts: found by parentage, told apart by start time.

A pid alone names a process only until it exits and the number is reused, so every process
rayapp may signal is recorded with its start time and signalled only while that still matches.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil


def start_time(pid: int) -> str | None:
    """The process's start time (milliseconds since the epoch, as text), or None once it has
    exited (a zombie has exited).

    Compared with a snapshot, it tells the same process from a later one that reuses the pid."""
    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return str(round(process.create_time() * 1000))
    except psutil.Error:  # gone, or not ours to read
        return None


def descendants(roots: list[int]) -> dict[int, str]:
    """Every live process below the roots (children started in new sessions included), pid ->
    start time."""
    found: dict[int, str] = {}
    for root in roots:
        try:
            children = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            started = start_time(child.pid)
            if started is not None:
                found[child.pid] = started
    return found


def kill_and_wait(tree: dict[int, str], *, timeout_s: float) -> None:
    """SIGKILL what is left of a snapshot of the cluster's processes, and wait until it has exited.

    Ray workers run in process groups of their own, so the SIGKILL to each node's group misses them;
    left alone they exit when they notice their raylet is gone, which can take seconds."""

    def survivors() -> list[int]:
        return [pid for pid, started in tree.items() if start_time(pid) == started]

    for pid in survivors():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.05)
