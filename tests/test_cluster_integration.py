"""EmbeddedCluster.stop() on a real two-node cluster: when it returns, every process the cluster ran
is gone."""

from __future__ import annotations

import os

import pytest
from conftest import alive, cmdline, connect, descendants

from rayapp.launch.cluster import EmbeddedCluster

pytestmark = pytest.mark.integration


def test_stop_returns_only_after_every_cluster_process_has_exited():
    import ray

    cluster = EmbeddedCluster(nodes=2, cpus_per_node=1)
    cluster.start()
    try:
        connect(cluster)

        @ray.remote(num_cpus=1)
        class Spawner:
            """A worker that starts a process of its own, as a data loader or a user's tool
            would."""

            def start_child(self) -> tuple[int, int]:
                import subprocess

                self.child = subprocess.Popen(["sleep", "300"])
                return os.getpid(), self.child.pid

        # One per node, detached like some of Ray Train's own actors: such a worker outlives the
        # driver and runs in a process group of its own, so it exits only once it notices that
        # its raylet is gone, unless stop() sees to it.
        actors = [
            Spawner.options(
                scheduling_strategy="SPREAD", lifetime="detached", name=f"spawner-{i}"
            ).remote()
            for i in range(2)
        ]
        pids = ray.get([actor.start_child.remote() for actor in actors])
        leaders = list(cluster._processes)
        # Below the nodes' `ray start` leaders, not below this process: pytest's own children
        # (an earlier test's server still exiting) are not the cluster's.
        cluster_pids = {leader.pid for leader in leaders}
        cluster_pids |= {pid for leader in leaders for pid in descendants(leader.pid)}
        assert {pid for pair in pids for pid in pair} <= cluster_pids
    finally:
        ray.shutdown()
        cluster.stop()
    # No grace period: stop() itself waits for the stragglers.
    survivors = {pid: cmdline(pid) for pid in cluster_pids if alive(pid)}
    assert not survivors, f"processes of the cluster outlived stop(): {survivors}"
    # Each `ray start --block` leader stopped its own daemons on SIGTERM (it exits 1), rather than
    # sitting out Ray's 30 s node drain, which detached actors keep from ending, until stop()
    # SIGKILLs it.
    assert [leader.returncode for leader in leaders] == [1, 1], "a node was SIGKILLed, not stopped"


def test_ray_state_lookups_from_a_worker_find_their_own_cluster(monkeypatch):
    """Ray Train's placement-group cleaner asks Ray's State API about the controller once a second,
    from a worker, with no address: Ray then takes RAY_ADDRESS, else the last cluster `ray start`
    recorded in /tmp/ray. Here the shell names another cluster, one that is gone (as a stale record
    would): unless the nodes carry their own cluster's address, every lookup waits out its timeout
    and each run's end waits for the cleaner (12 s). With the dashboard, whose State API answers."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens on the discard port
    cluster = EmbeddedCluster(nodes=2, cpus_per_node=1, include_dashboard=True)
    cluster.start()
    try:
        connect(cluster)

        @ray.remote(num_cpus=0)
        class Asker:
            def ask_about_itself(self) -> tuple[str, str]:
                import time

                from ray.util.state import get_actor

                deadline = time.monotonic() + 60
                while True:  # the dashboard's HTTP server comes up some seconds after the nodes
                    try:
                        state = get_actor(ray.get_runtime_context().get_actor_id(), timeout=5)
                        return os.environ.get(
                            "RAY_ADDRESS", ""
                        ), state.state if state else "not found"
                    except Exception as exc:
                        if time.monotonic() > deadline:
                            return os.environ.get("RAY_ADDRESS", ""), f"{type(exc).__name__}: {exc}"
                        time.sleep(1)

        actors = [Asker.options(scheduling_strategy="SPREAD").remote() for _ in range(2)]
        answers = ray.get([actor.ask_about_itself.remote() for actor in actors], timeout=120)
    finally:
        ray.shutdown()
        cluster.stop()
    assert answers == [(cluster.address, "ALIVE")] * 2
