"""EmbeddedCluster.stop() on a real two-node cluster: when it returns, every process the cluster ran
is gone."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import alive, cmdline, connect, descendants

from rayapp.launch.cluster import OBJECT_STORE_BYTES, EmbeddedCluster, free_port
from rayapp.launch.processes import start_time, stop_leaders

DEFAULT_DASHBOARD_PORT = 8265
"""Where a plain `ray start --head` serves its dashboard."""

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


@contextlib.contextmanager
def users_own_cluster(dashboard_port: int | None) -> Iterator[str]:
    """A user's own `ray start --head` beside rayapp's clusters, without token auth (what `ray
    start` gives where no token file exists), its dashboard on dashboard_port (None: Ray's default,
    8265); yields the dashboard's URL once its State API answers. Its records (temp dir) are its
    own, and it is stopped, every process of it, on exit."""
    temp_dir = tempfile.mkdtemp(prefix="rayapp-")  # short: Ray's socket paths live below it
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("RAY_AUTH_", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"))
    }
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # stop at once, not after a 30 s drain
    dashboard_url = f"http://127.0.0.1:{dashboard_port or DEFAULT_DASHBOARD_PORT}"
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.250",  # apart from the embedded nodes (127.0.0.2, ...)
        f"--port={free_port()}",
        "--num-cpus=0",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        *([f"--dashboard-port={dashboard_port}"] if dashboard_port else []),
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    with open(log_path, "w") as log:
        leader = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    started = start_time(leader.pid)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{dashboard_url}/api/v0/actors?limit=1", timeout=5):
                    break
            except OSError:
                if leader.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the user's own cluster did not start: {log_path.read_text()}")
                time.sleep(1)
        yield dashboard_url
    finally:
        if started is not None:
            stop_leaders({leader.pid: started})
        leader.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ask_workers_about_themselves(workers: int, patience_s: float) -> list[tuple[str, str, str]]:
    """Each of `workers` actors, one per node, asks Ray's State API about itself as Ray Train's
    placement-group cleaner asks about the controller: ray.util.state.get_actor without an address.
    Each answers (the addresses it was given, the state found or "not found" or "no answer", the
    error), retrying errors for patience_s (a dashboard's HTTP server comes up some seconds after
    the nodes)."""
    import ray

    class Asker:
        def ask_about_itself(self) -> tuple[str, str, str]:
            from ray.util.state import get_actor

            addresses = f"RAY_API_SERVER_ADDRESS={os.environ.get('RAY_API_SERVER_ADDRESS')}"
            addresses += f" RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}"
            own_id = ray.get_runtime_context().get_actor_id()
            assert own_id is not None  # asked from inside an actor
            deadline = time.monotonic() + patience_s
            while True:
                try:
                    state = get_actor(own_id, timeout=5)
                    return addresses, state.state if state else "not found", ""
                except Exception as exc:
                    if time.monotonic() > deadline:
                        return addresses, "no answer", f"{type(exc).__name__}: {exc}"
                    time.sleep(1)

    asker = ray.remote(num_cpus=0)(Asker)
    actors = [asker.options(scheduling_strategy="SPREAD").remote() for _ in range(workers)]
    asks = [actor.ask_about_itself.remote() for actor in actors]  # type: ignore[attr-defined]
    return ray.get(asks, timeout=120)


def test_ray_state_lookups_from_a_worker_find_their_own_cluster(monkeypatch):
    """Ray Train's placement-group cleaner asks Ray's State API about the controller once a second,
    from a worker, with no address: Ray then takes RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else
    the last cluster `ray start` recorded in /tmp/ray. Here the shell names other clusters:
    RAY_ADDRESS one that is gone (as a stale record would: every lookup waits out its timeout and
    each run's end waits for the cleaner, 12 s), and RAY_API_SERVER_ADDRESS the dashboard of the
    user's own cluster, running beside ours, as `ray start --head` tells its users to set it. That
    cluster knows none of our actors: its "not found" would tell the cleaner that the controller is
    dead, and the cleaner would remove the placement group of a training still running, killing its
    workers. Unless the nodes carry their own cluster's addresses. With the dashboard, whose State
    API answers."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens on the discard port
    with users_own_cluster(free_port()) as users_dashboard:
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", users_dashboard)
        cluster = EmbeddedCluster(nodes=2, cpus_per_node=1, include_dashboard=True)
        cluster.start()
        try:
            connect(cluster)
            answers = ask_workers_about_themselves(workers=2, patience_s=60)
        finally:
            ray.shutdown()
            cluster.stop()
    own = f"RAY_API_SERVER_ADDRESS={cluster.address} RAY_ADDRESS={cluster.address}"
    assert answers == [(own, "ALIVE", "")] * 2


@pytest.mark.slow  # 20-30 s: outside the README command's 15 minutes, run by .ci/run
def test_without_the_dashboard_state_lookups_never_reach_another_cluster():
    """Without the dashboard the head serves no State API, yet Ray records an address for it in
    the cluster, where the workers' lookups go. A plain `ray start --head` begun afterwards on this
    machine, its dashboard on Ray's default port, must not be asked in our cluster's stead: it knows
    none of our actors, and its "not found" would make Ray Train's placement-group cleaner remove a
    running training's placement group. The lookup is refused instead, which the cleaner takes for
    a State API not up yet (it keeps watching)."""
    import ray

    cluster = EmbeddedCluster(nodes=1, cpus_per_node=1)
    cluster.start()
    try:
        connect(cluster)
        with users_own_cluster(None):
            [(_, answer, error)] = ask_workers_about_themselves(workers=1, patience_s=0)
    finally:
        ray.shutdown()
        cluster.stop()
    assert (answer, error.split(":")[0]) == ("no answer", "ServerUnavailable"), error
