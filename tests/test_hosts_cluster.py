"""rayapp on separate hosts, as a user runs it: `ray up` of cluster_configs/onprem.yaml over SSH,
`rayapp submit` through the Ray Jobs API from this machine (the "laptop"), a real `mlflow server` on
another host, checkpoints on a directory shared by every host.

The hosts come from rayapp.launch.testhosts: network namespaces on one bridge (198.18.0.0/25),
each with a private /tmp, /dev/shm and home and its own sshd. Host 1 (a worker) has a second
interface that routes nowhere. They keep this machine's host name, which resolves to loopback
(as on stock Debian), so Gloo rendezvous only works over the interface rayapp pins it to.

Every verdict comes from the MLflow server's REST API and from the hosts (process lists, files
in their namespaces), not from rayapp's printout. The tests run in file order on one cluster: the
lost-node test takes a worker down, and the last one is `ray down`.
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
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, run_rayapp

from rayapp.launch import netns, testhosts
from rayapp.launch.testhosts import TestHost, TestHosts
from rayapp.tracking.run import TAG_RESUMED_FROM_EPOCH
from rayapp.train.socket_ifname import TAG_SOCKET_IFNAMES

pytestmark = pytest.mark.hosts

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
            timeout=timeout,
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    try:
        testhosts.check_can_make_hosts()
    except testhosts.HostsError as error:
        pytest.skip(str(error))
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
            env={**env, "HOME": "/root"},  # the host's own home
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
        if config is not None:
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
    # Nothing made here is left: namespaces, links, sshd and Ray processes (their namespaces are
    # gone, so any left would show in the machine's own process list).
    assert testhosts.leftovers() == []
    assert not testhosts.STATE_DIR.exists()
    left = [
        f"{pid}: {cmd}"
        for pid, cmd in ((pid, netns.cmdline(pid)) for pid in _all_pids())
        if cmd and (str(testhosts.STATE_DIR) in cmd or "198.18.0." in cmd)
    ]
    assert left == [], f"processes of the test hosts are left: {left}"


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def test_ray_up_starts_a_head_and_two_workers_over_ssh(cluster: Cluster):
    head = ray_processes(cluster.host(HEAD))
    assert any("gcs_server" in cmd for cmd in head.values()), head
    for index in (TWO_INTERFACES, WORKER):
        worker = ray_processes(cluster.host(index))
        assert any("raylet" in cmd for cmd in worker.values()), worker
        assert not any("gcs_server" in cmd for cmd in worker.values()), worker
    assert ray_processes(cluster.host(MLFLOW)) == {}
    # Node-local state stays on its node: the cluster's one session name, but each host has its
    # own /tmp/ray with its own session directory (the same path on every host, other directories).
    directories = []
    for host in cluster.ray_hosts:
        session = host.path("/tmp/ray") / os.readlink(
            host.path("/tmp/ray/session_latest")
        ).removeprefix("/tmp/ray/")
        status = session.stat()
        directories.append((status.st_dev, status.st_ino))
        assert (session / "logs").is_dir(), session
    assert len(set(directories)) == 3, directories
    # `ray up` ran the setup commands on every host: the environment file and the token.
    for host in cluster.ray_hosts:
        assert (
            "MLFLOW_TRACKING_URI=http://198.18.0.5:5000"
            in host.path("/root/.rayapp_env").read_text()
        )
        assert host.path("/root/.ray/auth_token").stat().st_mode & 0o777 == 0o600
    print(f"ray up until every raylet ran: {cluster.ray_up_s:.1f} s")


def assert_trained_across_hosts(cluster: Cluster, run, nodes: int) -> list[str]:
    """The run's facts from the MLflow server: finished, `nodes` distinct hosts, Gloo on eth0."""
    assert run.info.status == "FINISHED", run.info.status
    ips = run.data.tags["rayapp.node_ips"].split(",")
    assert len(ips) == nodes and len(set(ips)) == nodes, ips
    assert set(ips) <= {host.address for host in cluster.ray_hosts}, ips
    # Every rank's Gloo bound the interface holding its node's Ray address, not loopback (where
    # the host name points) nor the second interface of the host that has two.
    assert run.data.tags[TAG_SOCKET_IFNAMES].split(",") == ["eth0"] * nodes, run.data.tags
    return ips


def checkpoint_dirs(cluster: Cluster, run) -> list[Path]:
    """The run's checkpoints as a worker host sees the shared directory."""
    shared = cluster.host(WORKER).path(STORAGE)
    # Directories only: Ray Train keeps its checkpoint_manager_snapshot.json beside them.
    return sorted(
        path for path in shared.glob(f"*-{run.info.run_id[:8]}/checkpoint_*") if path.is_dir()
    )


def test_submit_trains_across_hosts_into_the_remote_mlflow_server(cluster: Cluster):
    result = cluster.submit(
        "--nodes", "2", "--epochs", "4", "--experiment", "hosts-digits", "jobs/digits_mlp.yaml"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = cluster.only_run("hosts-digits")
    assert_trained_across_hosts(cluster, run, nodes=2)
    assert run.data.metrics["test_accuracy"] >= 0.9, run.data.metrics
    history = cluster.mlflow().get_metric_history(run.info.run_id, "loss")
    assert sorted(point.step for point in history) == [0, 1, 2, 3]
    checkpoints = checkpoint_dirs(cluster, run)
    assert checkpoints, f"no checkpoint of run {run.info.run_id} under {STORAGE}"
    assert any(path.is_file() for path in checkpoints[-1].rglob("*"))


def test_users_code_directory_reaches_hosts_without_the_laptops_files(cluster: Cluster):
    # All three Ray hosts, so the one with two interfaces trains too.
    result = cluster.submit(
        "--nodes", "3", "--global-batch-size", "96", "--epochs", "2",  # 64 does not split in 3
        "--experiment", "hosts-cnn", "examples/cnn_digits/job.yaml",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = cluster.only_run("hosts-cnn")
    ips = assert_trained_across_hosts(cluster, run, nodes=3)
    assert cluster.host(TWO_INTERFACES).address in ips
    assert "test_accuracy" in run.data.metrics
    # Every rank imported the user's model factory on its own host (the run trained on all three),
    # from the job's upload that Ray unpacked into that host's private /tmp (and removes again once
    # the job has ended: the directory it unpacks into stays).
    for host in cluster.ray_hosts:
        session = host.path("/tmp/ray") / os.readlink(
            host.path("/tmp/ray/session_latest")
        ).removeprefix("/tmp/ray/")
        unpacked_into = session / "runtime_resources" / "working_dir_files"
        assert unpacked_into.is_dir(), f"no working_dir was unpacked on {host.address}"


def test_a_worker_host_lost_mid_run_resumes_from_the_shared_checkpoint(cluster: Cluster):
    experiment = "hosts-lost-node"
    submit = subprocess.Popen(
        [
            sys.executable, "-m", "rayapp", "submit", "--address", cluster.dashboard,
            "--tracking-uri", cluster.tracking_uri, "--storage-path", STORAGE,
            "--nodes", "2", "--epochs", "12", "--max-failures", "2", "--checkpoint-every", "1",
            "--experiment", experiment, "jobs/digits_mlp.yaml",
        ],
        cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        client = cluster.mlflow()

        def two_epochs_logged():
            found = client.get_experiment_by_name(experiment)
            runs = client.search_runs([found.experiment_id]) if found else []
            if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) >= 2:
                return runs[0]
            return None

        run = wait_until(two_epochs_logged, 180, "two logged epochs", interval=1)
        logged_before_loss = len(client.get_metric_history(run.info.run_id, "loss"))
        placed = run.data.tags["rayapp.node_ips"].split(",")
        victim = next(
            cluster.host(i) for i in (TWO_INTERFACES, WORKER) if cluster.host(i).address in placed
        )
        killed = ray_processes(victim)
        assert killed
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        output, _ = submit.communicate(timeout=240)
    finally:
        end_group(submit)
    assert submit.returncode == 0, output[-4000:]
    run = cluster.only_run(experiment)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rayapp.attempts"] == "2", run.data.tags
    assert_trained_across_hosts(cluster, run, nodes=2)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(point.step for point in history) == list(range(12)), history
    # It went on from the checkpoint in the shared storage, not from epoch 0: at least the epochs
    # logged before the loss had been checkpointed (--checkpoint-every 1), less the one in flight.
    resumed_from = int(run.data.tags[TAG_RESUMED_FROM_EPOCH])
    assert logged_before_loss - 2 <= resumed_from < 12, (logged_before_loss, resumed_from)


def test_ray_down_leaves_no_ray_process_on_any_host(cluster: Cluster):
    down = subprocess.run(
        [BIN / "ray", "down", "-y", str(cluster.config)],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    # `ray down` stops Ray on the head; a local provider's workers it only marks as terminated,
    # and their raylets (and agents) exit once they have lost the head for Ray's GCS reconnect
    # timeout (60 s). Ray's log monitor on a worker outlives them (measured: over 2 minutes);
    # it holds no port or resource, and the `ray stop` that begins worker_start_ray_commands
    # ends it at the next `ray up` (onprem.yaml says so).
    wait_until(lambda: ray_processes(cluster.host(HEAD)) == {}, 30, "Ray to stop on the head")
    for host in cluster.hosts.hosts:
        wait_until(
            lambda h=host: not [c for c in ray_processes(h).values() if "log_monitor" not in c],
            120,
            f"Ray to stop on {host.address}",
        )
