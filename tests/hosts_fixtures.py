"""The test hosts' cluster that the `hosts` tests share: four hosts made with
rayapp.launch.testhosts (network namespaces on one bridge, 198.18.0.0/25, each with a private
/tmp, /dev/shm and home and its own sshd; host 1, a worker, has a second interface that routes
nowhere), `ray up` of cluster_configs/onprem.yaml over SSH on the first three, a real
`mlflow server` on the fourth, and the Jobs API reached through `ray dashboard`'s SSH tunnel
from this machine (the "laptop").

Each test module that uses it makes its own (:func:`hosts_cluster`, in a module-scoped fixture)
and everything is removed at its end, even when a test fails.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LEAN_MLFLOW_SERVER_ENV, REPO, run_rayapp

from rayapp.launch import netns, testhosts
from rayapp.launch.testhosts import TestHost, TestHosts
from rayapp.tracking.run import TAG_NODE_IPS
from rayapp.train.socket_ifname import TAG_SOCKET_IFNAMES

HEAD, TWO_INTERFACES, WORKER, MLFLOW = range(4)
MLFLOW_PORT = 5000
STORAGE = "/mnt/rayapp-shared/checkpoints"
"""RAYAPP_STORAGE_PATH in onprem.yaml: on the directory every host shares."""
BIN = Path(sys.executable).parent
RAY_PROCESS = re.compile(r"raylet|gcs_server|ray::|ray/dashboard|ray/_private|ray\.util\.client")


@dataclass
class Cluster:
    hosts: TestHosts
    config: Path
    env: dict[str, str]
    dashboard: str
    """The Jobs API through `ray dashboard`'s SSH tunnel, as docs/clusters.md has users reach it."""
    tracking_uri: str
    ray_up_s: float

    def host(self, index: int) -> TestHost:
        return self.hosts.hosts[index]

    @property
    def ray_hosts(self) -> list[TestHost]:
        return [self.host(HEAD), self.host(TWO_INTERFACES), self.host(WORKER)]

    def submit(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return run_rayapp(
            "submit",
            "--address",
            self.dashboard,
            "--tracking-uri",
            self.tracking_uri,
            "--storage-path",
            STORAGE,
            *args,
            cwd=REPO,
            env=self.env,
            inherit_env=False,  # the laptop's environment only, as start_submit
            timeout=timeout,
        )

    def start_submit(self, *args: str) -> subprocess.Popen:
        """`rayapp submit` as :meth:`submit` runs it, in the background (a process group of its
        own, for :func:`end_group`), its output merged into stdout."""
        return subprocess.Popen(
            [sys.executable, "-m", "rayapp", "submit", "--address", self.dashboard]
            + ["--tracking-uri", self.tracking_uri, "--storage-path", STORAGE, *args],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def mlflow(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)

    def only_run(self, experiment: str):
        client = self.mlflow()
        found = client.get_experiment_by_name(experiment)
        assert found is not None, f"experiment {experiment!r} is not on the MLflow server"
        runs = client.search_runs([found.experiment_id])
        assert len(runs) == 1, f"expected one run in {experiment!r}, found {len(runs)}"
        return runs[0]


def ray_processes(host: TestHost) -> dict[int, str]:
    return {pid: cmd for pid, cmd in host.processes().items() if RAY_PROCESS.search(cmd)}


def filled_onprem_config(hosts: TestHosts, directory: Path) -> Path:
    """cluster_configs/onprem.yaml with its CHANGE-ME values filled in, and nothing else changed."""
    head, workers, mlflow = hosts.hosts[HEAD], hosts.hosts[HEAD + 1 : MLFLOW], hosts.hosts[MLFLOW]
    text = (REPO / "cluster_configs" / "onprem.yaml").read_text()
    for old, new in [
        ("head_ip: 10.0.0.10", f"head_ip: {head.address}"),
        ("[10.0.0.11, 10.0.0.12]", "[" + ", ".join(w.address for w in workers) + "]"),
        ("ssh_user: CHANGE-ME-user", f"ssh_user: {hosts.user}"),
        # ssh reads ~ as the account's home, whatever HOME says: the key by its own path
        ("ssh_private_key: ~/.ssh/id_ed25519", f"ssh_private_key: {hosts.key}"),
        ("CHANGE-ME-mlflow-host", mlflow.address),
    ]:
        assert text.count(old) == 1, f"onprem.yaml no longer has {old!r}"
        text = text.replace(old, new)
    path = directory / "onprem.yaml"
    path.write_text(text)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def end_group(process: subprocess.Popen | None) -> None:
    """SIGTERM the process group a test started (then SIGKILL), by its pid."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass


def hosts_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster, for a module-scoped fixture to `yield from`; on the way out, `ray down`, the
    MLflow server ended and the hosts removed, and then nothing the hosts ran may be left."""
    require_test_hosts()
    work = tmp_path_factory.mktemp("hosts")
    ssh_dirs_before = set(Path("/tmp").glob("ray_ssh_*"))  # Ray's SSH control sockets
    hosts = testhosts.up(4, isolated_interface_on=TWO_INTERFACES, owner_pid=os.getpid())
    mlflow_server = tunnel = None
    config = None
    # The laptop's home, with the cluster's token where onprem.yaml expects it.
    home = work / "home"
    home.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RAY_", "MLFLOW_")) and key != "VIRTUAL_ENV"
    }
    env.update(HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0")
    # `ray up` keeps the cluster's state (cluster-rayapp-onprem.state) under here, not /tmp/ray.
    env["RAY_TMPDIR"] = str(work / "laptop-tmp")
    (work / "laptop-tmp").mkdir()
    try:
        for host in hosts.hosts[:MLFLOW]:
            shorten_gcs_reconnect_timeout(host)
        subprocess.run(
            [BIN / "ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True
        )
        mlflow_host = hosts.hosts[MLFLOW]
        address = f"{mlflow_host.address}:{MLFLOW_PORT}"
        mlflow_server = mlflow_host.popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                mlflow_host.address,
                "--port",
                str(MLFLOW_PORT),
                "--workers",
                "1",
                "--backend-store-uri",
                "sqlite:////tmp/mlflow.db",
                "--artifacts-destination",
                "/tmp/mlartifacts",
                # Clients name the server by its address; MLflow 3 refuses other Host headers.
                "--allowed-hosts",
                f"{address},{mlflow_host.address}",
            ],
            cwd="/",
            env={**env, **LEAN_MLFLOW_SERVER_ENV, "HOME": "/root"},  # the host's own home
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(work / "mlflow.log", "wb"),  # noqa: SIM115 - the server keeps it
        )
        config = filled_onprem_config(hosts, work)
        started = time.monotonic()
        log = work / "ray-up.log"
        with open(log, "w") as output:
            try:
                up = subprocess.run(
                    [BIN / "ray", "up", "-y", "--no-config-cache", str(config)],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=240,
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"ray up took over 240 s:\n{log.read_text()[-4000:]}")
        assert up.returncode == 0, f"ray up failed:\n{log.read_text()[-4000:]}"

        # The head's autoscaler starts the workers over SSH after `ray up` returns.
        def hosts_with_raylet() -> bool:
            return all(
                any("raylet" in cmd for cmd in ray_processes(host).values())
                for host in hosts.hosts[:MLFLOW]
            )

        wait_until(hosts_with_raylet, 180, "a raylet on the head and both workers", interval=1)
        ray_up_s = time.monotonic() - started
        port = free_port()
        tunnel = subprocess.Popen(
            [BIN / "ray", "dashboard", "--port", str(port), str(config)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(lambda: accepts("127.0.0.1", port), 60, "the dashboard tunnel")
        wait_until(lambda: accepts(mlflow_host.address, MLFLOW_PORT), 90, "the MLflow server")
        yield Cluster(
            hosts=hosts,
            config=config,
            env=env,
            dashboard=f"http://127.0.0.1:{port}",
            tracking_uri=f"http://{address}",
            ray_up_s=ray_up_s,
        )
    finally:
        end_group(tunnel)
        # Unless a test took the cluster down already (no Ray on the head: `ray down` would only
        # repeat itself, for seconds).
        if config is not None and ray_processes(hosts.hosts[HEAD]):
            subprocess.run(
                [BIN / "ray", "down", "-y", str(config)],
                cwd=REPO,
                env=env,
                capture_output=True,
                timeout=120,
            )
        end_group(mlflow_server)
        testhosts.down()
        for directory in set(Path("/tmp").glob("ray_ssh_*")) - ssh_dirs_before:
            shutil.rmtree(directory, ignore_errors=True)
    assert_nothing_left()


def require_test_hosts() -> None:
    """Skip with the reason where test hosts cannot be made; fail instead under .ci/run, where
    the hosts tests must run."""
    try:
        testhosts.check_can_make_hosts()
    except testhosts.HostsError as error:
        if os.environ.get("RAYAPP_REQUIRE_TEST_HOSTS"):
            pytest.fail(f"RAYAPP_REQUIRE_TEST_HOSTS is set, and {error}")
        pytest.skip(str(error))


def assert_nothing_left() -> None:
    """Nothing the test hosts had is left: namespaces, links, their directory, sshd and Ray
    processes (their namespaces are gone, so any left would show in the machine's own process
    list)."""
    assert testhosts.leftovers() == []
    assert not testhosts.STATE_DIR.exists()
    left = [
        f"{pid}: {cmd}"
        for pid, cmd in ((pid, netns.cmdline(pid)) for pid in _all_pids())
        if cmd and (str(testhosts.STATE_DIR) in cmd or "198.18.0." in cmd)
    ]
    assert left == [], f"processes of the test hosts are left: {left}"


GCS_RECONNECT_TIMEOUT_S = 10
"""Ray's gcs_rpc_server_reconnect_timeout_s on the test hosts (Ray's default: 60 s)."""


def shorten_gcs_reconnect_timeout(host: TestHost) -> None:
    """How long a Ray process on `host` goes on once its connection to the head's GCS has failed
    before it exits: 10 s instead of Ray's 60, set in the host's environment as a site's admin
    would (onprem.yaml stays as users get it). After `ray down` closed the head's connections, a
    local provider's worker raylets exit only once this has passed, and the `ray down` test waits
    for them. (A host cut off from the network is another matter: its connections stall rather
    than fail, and its raylet ends once it hears, after the cut heals, that it was declared
    dead.)"""
    bashrc = host.path("/root/.bashrc")
    existing = bashrc.read_text() if bashrc.exists() else ""
    # First: Debian's .bashrc returns early in a shell that is not interactive.
    line = f"export RAY_gcs_rpc_server_reconnect_timeout_s={GCS_RECONNECT_TIMEOUT_S}\n"
    bashrc.write_text(line + existing)


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def assert_trained_across_hosts(cluster: Cluster, run, nodes: int) -> list[str]:
    """The run's facts from the MLflow server: finished, `nodes` distinct hosts, Gloo on eth0."""
    assert run.info.status == "FINISHED", run.info.status
    ips = run.data.tags[TAG_NODE_IPS].split(",")
    assert len(ips) == nodes and len(set(ips)) == nodes, ips
    assert set(ips) <= {host.address for host in cluster.ray_hosts}, ips
    # Every rank's Gloo bound the interface holding its node's Ray address, not loopback (where
    # the host name points) nor the second interface of the host that has two.
    assert run.data.tags[TAG_SOCKET_IFNAMES].split(",") == ["eth0"] * nodes, run.data.tags
    return ips


def started_run(cluster: Cluster, experiment: str, timeout: float = 120):
    """The experiment's one run once the job's driver has opened it on the server (with the
    tags of where its ranks run)."""
    client = cluster.mlflow()

    def opened():
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id]) if found else []
        return runs[0] if runs and TAG_NODE_IPS in runs[0].data.tags else None

    return wait_until(opened, timeout, f"a run of {experiment} on the server", interval=1)


def wait_for_checkpoint(cluster: Cluster, run, epoch: int, timeout: float = 120) -> None:
    """Until the run's checkpoint of `epoch` is on the shared storage: training is under way
    (the server hears of epochs later, paced by rank 0's outbox)."""
    shared = cluster.host(WORKER).path(STORAGE)
    pattern = f"*-{run.info.run_id[:8]}/checkpoint_epoch_{epoch:06d}"
    wait_until(lambda: any(shared.glob(pattern)), timeout, f"checkpoint {pattern}", interval=0.2)


def checkpoint_dirs(cluster: Cluster, run) -> list[Path]:
    """The run's checkpoints as a worker host sees the shared directory."""
    shared = cluster.host(WORKER).path(STORAGE)
    # Directories only: Ray Train keeps its checkpoint_manager_snapshot.json beside them.
    return sorted(
        path for path in shared.glob(f"*-{run.info.run_id[:8]}/checkpoint_*") if path.is_dir()
    )


def last_checkpoint(cluster: Cluster, run) -> int:
    """The latest epoch of the run's checkpoints on the shared storage (Ray Train deletes older
    ones), -1 before the first."""
    epochs = [path.name.removeprefix("checkpoint_epoch_") for path in checkpoint_dirs(cluster, run)]
    return max((int(epoch) for epoch in epochs if epoch.isdigit()), default=-1)
