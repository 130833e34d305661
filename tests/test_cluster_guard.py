"""rayapp.launch.cluster_guard on real processes, without Ray: a stand-in node (a process leading a
session of its own, with a child, as `ray start --block` runs its daemons) is stopped when the
process that named it to a guard is SIGKILLed, and left running when that process released its
guard first. The same on a real embedded cluster: tests/test_cluster_guard_integration.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayapp.launch.processes import descendants, kill_and_wait, start_time

# An owner: starts a guard and a stand-in node (bash in a new session, waiting on a sleep), names
# the node and a temp dir to the guard, says which processes it made, then waits to be killed.
OWNER = """
import json, subprocess, sys, time
from pathlib import Path
from rayapp.launch.cluster_guard import ClusterGuard

log_dir, release = Path(sys.argv[1]), sys.argv[2] == "release"
guard = ClusterGuard(log_dir / "guard.log")
node = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], start_new_session=True)
guard.watch_leader(node.pid)
guard.remove_on_exit(str(log_dir / "temp"))
if release:
    guard.release()
print(json.dumps({"node": node.pid, "guard": guard.pid}), flush=True)
time.sleep(300)
"""


def gone(processes: dict[int, str]) -> bool:
    return all(start_time(pid) != started for pid, started in processes.items())


@pytest.mark.parametrize("release", [False, True], ids=["killed", "released"])
def test_a_guard_stops_its_owners_nodes_unless_released(tmp_path: Path, release: bool):
    (tmp_path / "temp").mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), "release" if release else "keep"],
        stdout=subprocess.PIPE,
        text=True,
    )
    made: dict[int, str] = {}
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline())
        node = {pids["node"]: start_time(pids["node"]) or ""}
        deadline = time.monotonic() + 10
        while len(descendants(list(node))) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # bash has not started its sleep yet
        made = {**descendants([owner.pid]), **descendants(list(node))}
        assert pids["node"] in made and len(made) >= 2, made

        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        # A guard acts on its pipe's end at once: this node stops within a second (see "killed").
        deadline = time.monotonic() + (3 if release else 20)
        while not gone(made) and time.monotonic() < deadline:
            time.sleep(0.1)
        if release:
            assert start_time(pids["guard"]) is None, "a released guard did not exit"
            assert not gone(node) and (tmp_path / "temp").exists()
        else:
            assert gone(made), f"left running after the owner died: {made}"
            assert not (tmp_path / "temp").exists(), "the guard did not remove the temp dir"
            assert "stopping its nodes" in (tmp_path / "guard.log").read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        kill_and_wait(made, timeout_s=10)  # whatever of it is left when an assertion failed


def test_the_guard_reads_release_and_leader_messages_in_order(tmp_path: Path):
    """A release ends the guard at once: leaders named before it are left alone."""
    from rayapp.launch.cluster_guard import guard

    node = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = start_time(node.pid)
        guard(
            [
                json.dumps({"leader": node.pid, "started": started}) + "\n",
                json.dumps({"temp_dir": str(tmp_path)}) + "\n",
                json.dumps({"release": True}) + "\n",
            ]
        )
        assert node.poll() is None and tmp_path.exists()
        guard([json.dumps({"leader": node.pid, "started": started}) + "\n"])  # then the end
        assert node.wait(timeout=20) == -signal.SIGTERM
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
