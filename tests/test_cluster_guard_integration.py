"""A real two-node embedded cluster whose owner is SIGKILLed (as the OOM killer ends a `rayapp
submit`): its nodes stop by themselves within seconds, every Ray process of them with them. A
detached cluster (a warm one, `rayapp cluster up`) runs on after its starter is SIGKILLed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cmdline, wait_for_line

from rayapp.launch.processes import descendants, kill_and_wait, start_time, stop_leaders

pytestmark = pytest.mark.integration

OWNER_GONE_STOP_S = 30.0
"""The guard SIGTERMs the leaders at once, and they stop their daemons in a few seconds; the rest is
room for a busy machine."""

# The owner: a driver on a cluster of its own, as a submit is; "detach" leaves the cluster as
# `rayapp cluster up` does. It prints its nodes' leaders and dirs, then waits to be killed.
OWNER = """
import json, sys, time
import ray
from rayapp.launch.cluster import EmbeddedCluster

cluster = EmbeddedCluster(nodes=2, cpus_per_node=1)
cluster.start()
cluster.prepare_client()
ray.init(address=cluster.address, _node_ip_address=cluster.head_ip, log_to_driver=False)
cluster.wait_for_nodes()
# As during a run: every `ray start` has finished starting its node and blocks (a node's raylet
# joins the cluster some seconds before its `ray start` acts on SIGTERM).
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not all(
    "block forever" in cluster._node_log(i).read_text() for i in range(cluster.nodes)
):
    time.sleep(0.2)
facts = {"leaders": cluster.leaders, "temp_dirs": cluster.temp_dirs}
facts["log_dir"] = str(cluster.log_dir)
if sys.argv[1] == "detach":
    ray.shutdown()
    cluster.detach()
print("cluster up " + json.dumps(facts), flush=True)
time.sleep(300)
"""


def program(pid: int) -> str:
    """The process's name ("raylet", "gcs_server", "ray", "python"); "" once it has gone."""
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def still_running(processes: dict[int, str]) -> dict[int, str]:
    return {pid: started for pid, started in processes.items() if start_time(pid) == started}


class Owner:
    """The owner process, what it started, and the cleanup of all of it."""

    def __init__(self, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", OWNER, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.leaders: dict[int, str] = {}
        self.made: dict[int, str] = {}
        self.dirs: list[str] = []

    def wait_until_up(self) -> None:
        line = wait_for_line(self.process, "cluster up ", timeout=180)[-1]
        facts = json.loads(line.split("cluster up ", 1)[1])
        self.leaders = {int(pid): started for pid, started in facts["leaders"].items()}
        self.dirs = [*facts["temp_dirs"], facts["log_dir"]]
        # Every process the owner started (its guard included), and everything below the nodes.
        self.made = {**descendants([self.process.pid]), **descendants(list(self.leaders))}
        self.made.update(self.leaders)
        raylets = [pid for pid in self.made if program(pid) == "raylet"]
        assert len(self.leaders) == 2 and len(raylets) >= 2, {p: cmdline(p) for p in self.made}

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def clean_up(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        stop_leaders(self.leaders)
        kill_and_wait(self.made, timeout_s=15)
        for directory in self.dirs:
            shutil.rmtree(directory, ignore_errors=True)


def test_a_killed_owners_nodes_stop_by_themselves():
    owner = Owner("keep")
    try:
        owner.wait_until_up()
        owner.kill()
        began = time.monotonic()
        while still_running(owner.made) and time.monotonic() - began < OWNER_GONE_STOP_S:
            time.sleep(0.2)
        left = {pid: cmdline(pid) for pid in still_running(owner.made)}
        assert not left, f"running {OWNER_GONE_STOP_S:.0f} s after the owner was killed: {left}"
        assert not any(Path(d).exists() for d in owner.dirs[:-1]), "temp dirs left behind"
        print(f"the nodes stopped {time.monotonic() - began:.1f} s after the owner was killed")
    finally:
        owner.clean_up()


@pytest.mark.slow  # 20-30 s: outside the README command's 15 minutes, run by .ci/run
def test_a_detached_cluster_outlives_its_killed_starter():
    owner = Owner("detach")
    try:
        owner.wait_until_up()
        owner.kill()
        # Longer than a guard takes to stop nodes (the test above): none may have acted.
        time.sleep(5)
        daemons = {
            pid: started
            for pid, started in owner.made.items()
            if pid in owner.leaders or program(pid) in ("raylet", "gcs_server")
        }
        assert len(daemons) >= 5, {pid: cmdline(pid) for pid in owner.made}
        assert still_running(daemons) == daemons, "a detached node stopped with its starter"
        # Released at detach: no guard, nor anything else of the starter's, is left waiting.
        strays = set(still_running(owner.made)) - set(descendants(list(owner.leaders)))
        assert strays == set(owner.leaders), {pid: cmdline(pid) for pid in strays}
    finally:
        owner.clean_up()
