"""rayapp.launch.processes on real processes: a tree with a child in a session of its own (as Ray
starts its workers) is found whole, killed whole, and a recorded start time no longer matches
once its process has gone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rayapp.launch.processes import descendants, from_epoch_ms, kill_and_wait, start_time


def test_a_tree_is_found_and_killed_whole():
    # bash waits on two sleeps, one of them in a new session (not in bash's process group)
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & setsid sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 2, found
        assert all(started == start_time(pid) for pid, started in found.items())
        assert start_time(parent.pid) is not None

        kill_and_wait(found, timeout_s=10)
        assert all(start_time(pid) is None for pid in found)  # gone, or an unreaped zombie
        parent.wait(timeout=10)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_start_time_tells_a_process_from_an_exited_one():
    child = subprocess.Popen(["true"])
    child.wait()
    assert start_time(child.pid) is None
    assert start_time(os.getpid()) == start_time(os.getpid())
    assert descendants([child.pid]) == {}


def test_start_time_counts_from_boot_not_from_the_wall_clock():
    # The kernel's own figure: /proc/PID/stat's 22nd field, clock ticks after boot. A wall-clock
    # step changes psutil's create_time() but not this, nor start_time.
    after_command = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()
    ticks_after_boot = int(after_command[19])  # field 22; fields 1-2 are before ")"
    expected_ms = ticks_after_boot * 1000 / os.sysconf("SC_CLK_TCK")
    started = start_time(os.getpid())
    assert started is not None and abs(int(started) - expected_ms) <= 10


def test_a_start_time_recorded_since_the_epoch_is_read_as_one_since_boot():
    # What a warm-cluster record written by an earlier version holds.
    import psutil

    since_epoch = str(round(psutil.Process().create_time() * 1000))
    assert from_epoch_ms(since_epoch) == start_time(os.getpid())
    assert from_epoch_ms(start_time(os.getpid()) or "") == start_time(os.getpid())
