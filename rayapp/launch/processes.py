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

STOP_TIMEOUT_S = 15.0
"""How long a node's `ray start --block` leader gets to stop its daemons after SIGTERM, and its
processes to exit after SIGKILL."""


def start_time(pid: int) -> str | None:
    """When the process started, in milliseconds after the machine booted (as text), or None once
    it has exited (a zombie has exited).

    Compared with a snapshot, it tells the same process from a later one that reuses the pid.
    Counted from boot, not from the epoch: psutil's create_time() is the kernel's boot-relative
    start plus the boot time as the wall clock puts it now, so a clock step (NTP, a VM resumed)
    changed every process's figure, and `rayapp cluster down` then took a running warm cluster
    for a stale record, removed its files and left its processes running."""
    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return str(round((process.create_time() - psutil.boot_time()) * 1000))
    except psutil.Error:  # gone, or not ours to read
        return None


EPOCH_MS_BEFORE_BOOT_MS = 10**12
"""Start times above this (2001 onwards) are milliseconds since the epoch, as records written by
earlier versions hold them; boot-relative ones stay far below it."""


def from_epoch_ms(started: str) -> str:
    """A start time as :func:`start_time` gives it, from a record of either kind."""
    if not started.isdigit() or int(started) < EPOCH_MS_BEFORE_BOOT_MS:
        return started
    return str(int(started) - round(psutil.boot_time() * 1000))


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


def stop_leaders(leaders: dict[int, str]) -> None:
    """Stop embedded-cluster nodes this process did not start (a warm cluster's, or those of an
    owner that died), as :meth:`EmbeddedCluster.stop` does: SIGTERM each `ray start --block` leader,
    SIGKILL what is left of its session and of every process below it. Only these pids, and only
    while their start time still matches."""
    live = {pid: started for pid, started in leaders.items() if start_time(pid) == started}
    tree = descendants(list(live))
    for pid in reversed(list(live)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (
        any(start_time(pid) == started for pid, started in live.items())
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    for pid, started in live.items():
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each leader leads its own session: pgid == pid
    kill_and_wait({**tree, **live}, timeout_s=STOP_TIMEOUT_S)
