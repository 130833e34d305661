"""An embedded multi-node Ray cluster on this machine.

Each node is a `ray start --block` process with its own loopback IP (127.0.0.2, 127.0.0.3, …),
so Ray sees N distinct nodes and Ray Train assigns node_rank 0..N-1 as it would across machines.
127.0.0.1 itself is not used: Ray rewrites it to the machine's outward address.

Each node runs in a process session of its own; teardown signals exactly those sessions, so
no other Ray cluster on the machine is touched. A guard process (rayapp.launch.cluster_guard)
stops the nodes if the process that started them dies without stopping them (SIGKILL, OOM).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rayapp.errors import RayappError
from rayapp.launch import ray_auth
from rayapp.launch.cluster_guard import ClusterGuard
from rayapp.launch.node_env import dashboard_temp_env
from rayapp.launch.processes import STOP_TIMEOUT_S, descendants, kill_and_wait, start_time

# Ray enables token authentication for local clusters. One token per driver process: Ray's
# client caches the token it first loads, so every embedded cluster this process starts
# (a sweep starts several) must share it.
_PROCESS_TOKEN = secrets.token_hex(32)
FIRST_NODE_IP_SUFFIX = 2
NODE_START_TIMEOUT_S = 120.0
OBJECT_STORE_BYTES = 256 * 2**20
# On SIGTERM, `ray start --block` first drains its node for up to 30 s (for Ray Serve). The head
# never finishes draining (the GCS keeps it busy), so every stop() sat out STOP_TIMEOUT_S and
# SIGKILLed the head's daemons: 15 s per submit, on clusters that serve no traffic.
_NO_DRAIN_ON_SIGTERM = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# The GCS declares a node dead after `failure_threshold` missed health checks, one per period:
# 3 s x 5 by default. A lost node's raylet refuses the check at once, so a shorter period finds it
# in about 5 s; until then Ray Train, restarting after the failed collective, may place a worker
# on the dead node and lose a second attempt to it. A live but busy node still has 5 chances.
_FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000"}


def node_ip(index: int) -> str:
    return f"127.0.0.{FIRST_NODE_IP_SUFFIX + index}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ray_executable() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


@dataclass
class EmbeddedCluster:
    """Usage::

    with EmbeddedCluster(nodes=2, cpus_per_node=1) as cluster:
        cluster.prepare_client()
        ray.init(address=cluster.address, _node_ip_address=cluster.head_ip)
        cluster.wait_for_nodes()
    """

    nodes: int
    cpus_per_node: int
    gpus_per_node: int = 0
    """This machine's GPUs, dealt out to the nodes in disjoint sets (CUDA_VISIBLE_DEVICES per
    node)."""
    include_dashboard: bool = False
    log_dir: Path | None = None
    token: str = _PROCESS_TOKEN
    """Ray's auth token for this cluster; a warm cluster has one of its own, kept in its state
    file."""
    address: str = ""
    dashboard_url: str | None = None
    _processes: list[subprocess.Popen] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _watchdog: threading.Thread | None = None
    _temp_dir: str | None = None
    _node_temp_dirs: list[str] = field(default_factory=list)
    _owns_log_dir: bool = False
    _guard: ClusterGuard | None = None

    @property
    def auth_env(self) -> dict[str, str]:
        """Environment a client needs to connect: set it in os.environ before ray.init()."""
        return auth_env(self.token)

    def prepare_client(self) -> None:
        """Point this process's Ray client at the cluster's token, before ray.init()."""
        use_token(self.token)

    @property
    def leaders(self) -> dict[int, str]:
        """The live `ray start --block` processes, pid -> start time (tells a reused pid apart)."""
        return {
            p.pid: started for p in self._processes if (started := start_time(p.pid)) is not None
        }

    @property
    def temp_dirs(self) -> list[str]:
        return [d for d in [self._temp_dir, *self._node_temp_dirs] if d]

    def detach(self) -> None:
        """Forget the nodes without stopping them: they run on after this process exits (a warm
        cluster), and :func:`rayapp.launch.processes.stop_leaders` stops them later from any
        process."""
        self._release_guard()
        self._processes.clear()
        self._temp_dir, self._node_temp_dirs, self._owns_log_dir = None, [], False

    @property
    def head_ip(self) -> str:
        return node_ip(0)

    def __enter__(self) -> EmbeddedCluster:
        try:
            self.start()
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # Node logs are kept when something went wrong: the error message points at them.
        self.stop(keep_logs=exc_type is not None)

    def start(self) -> None:
        self._temp_dir = tempfile.mkdtemp(prefix="rayapp-")
        # Node logs outlive the cluster so that a failed start can still be read.
        self._owns_log_dir = self.log_dir is None
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="rayapp-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._guard = ClusterGuard(log_dir / "guard.log")
        self._guard.remove_on_exit(self._temp_dir)
        port = free_port()
        self.address = f"{self.head_ip}:{port}"
        # A dashboard port of our own even without the dashboard: Ray records it as the API
        # server's address, where Ray Train's placement-group cleaner asks once a second. At Ray's
        # default, 127.0.0.1:8265, a later plain `ray start --head` answered "not found" for our
        # controller and the cleaner removed a running training's placement group; here the
        # lookups are refused, which the cleaner takes for a State API not up yet.
        dashboard_port = free_port()
        head_args = [
            "--head",
            f"--port={port}",
            f"--temp-dir={self._temp_dir}",
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
        ]
        if self.include_dashboard:
            self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        self._start_node(0, head_args)
        self._wait_for_head()
        for index in range(1, self.nodes):
            self._start_node(index, [f"--address={self.address}"])

    def _node_log(self, index: int) -> Path:
        """Where node index's `ray start` writes its output; the log dir is set by start()."""
        assert self.log_dir is not None
        return self.log_dir / f"node-{index}.log"

    def _start_node(self, index: int, args: list[str]) -> None:
        # Each node gets its own dashboard-agent port (the default, 52365, would stop a second
        # cluster's agent) and, past the head, its own temp dir (nodes sharing one unpack a job's
        # working_dir into one place, replacing it under the running driver).
        args = [*args, f"--dashboard-agent-listen-port={free_port()}"]
        if index > 0:
            self._node_temp_dirs.append(tempfile.mkdtemp(prefix="rayapp-"))
            args.append(f"--temp-dir={self._node_temp_dirs[-1]}")
            if self._guard is not None:
                self._guard.remove_on_exit(self._node_temp_dirs[-1])
        command = [
            _ray_executable(),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={node_ip(index)}",
            f"--num-cpus={self.cpus_per_node}",
            f"--num-gpus={self.gpus_per_node}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            *args,
        ]
        log = open(self._node_log(index), "a")
        env = dict(
            os.environ,
            RAY_USAGE_STATS_ENABLED="0",
            **own_cluster_env(self.address),
            **self.auth_env,
            **_NO_DRAIN_ON_SIGTERM,
            **_FAST_NODE_DEATH,
        )
        if index == 0 and self.include_dashboard and self._temp_dir:
            env.update(dashboard_temp_env(self._temp_dir))  # its pymp-* dir goes with the cluster
        if self.gpus_per_node:
            first = index * self.gpus_per_node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(first + i) for i in range(self.gpus_per_node)
            )
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()
        if self._guard is not None:
            self._guard.watch_leader(process.pid)
        if index < len(self._processes):
            self._processes[index] = process  # a lost node started again
        else:
            self._processes.append(process)

    def restart_node(self, index: int) -> None:
        """Start worker node `index` again after it was lost, with the same IP and resources."""
        if not 0 < index < len(self._processes):
            raise ValueError(
                f"node index {index} is not a worker node of this cluster "
                f"(1..{len(self._processes) - 1})"
            )
        self._start_node(index, [f"--address={self.address}"])

    def exited_nodes(self) -> list[str]:
        """IPs of nodes whose `ray start` process has exited (killed, crashed, machine lost)."""
        return [
            node_ip(index)
            for index, process in enumerate(self._processes)
            if process.poll() is not None
        ]

    def keep_nodes_up(
        self,
        on_restart: Callable[[str], None],
        interval_s: float = 1.0,
        replace_after_s: float = 0.0,
    ) -> None:
        """Start again any worker node that goes away (every process of it killed, as when a machine
        of a real cluster is lost), replace_after_s later, as an autoscaler would bring a
        replacement: Ray Train, with failures left to recover from, then resumes from the last
        checkpoint on the full cluster (an elastic run goes on with the nodes left meanwhile, then
        grows back). The head holds the cluster's state (GCS) and is not replaced."""
        lost_since: dict[int, float] = {}

        def watch() -> None:
            while not self._stopping.wait(interval_s):
                for index in range(1, len(self._processes)):
                    process = self._processes[index]
                    if process.poll() is None or self._stopping.is_set():
                        continue
                    if index not in lost_since:
                        lost_since[index] = time.monotonic()
                        kill_and_wait(descendants([process.pid]), timeout_s=STOP_TIMEOUT_S)
                        later = f" in {replace_after_s:.0f} s" if replace_after_s else ""
                        on_restart(
                            f"node {node_ip(index)} was lost (its `ray start` exited with code "
                            f"{process.returncode}); starting it again{later}"
                        )
                    if time.monotonic() - lost_since[index] >= replace_after_s:
                        del lost_since[index]
                        if replace_after_s:
                            on_restart(f"node {node_ip(index)} is starting again")
                        self.restart_node(index)

        self._watchdog = threading.Thread(target=watch, name="rayapp-node-watchdog", daemon=True)
        self._watchdog.start()

    def _check_processes(self) -> None:
        for index, process in enumerate(self._processes):
            if process.poll() is not None:
                raise RayappError(
                    f"embedded Ray node {index} ({node_ip(index)}) exited with code "
                    f"{process.returncode}; see {self._node_log(index)}"
                )

    def _wait_for_head(self) -> None:
        """Wait until the head's GCS port accepts connections, so ray.init() does not hang on it."""
        host, port = self.address.split(":")
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_processes()
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise RayappError(
            f"embedded Ray head did not start within {NODE_START_TIMEOUT_S:.0f}s; "
            f"see {self.log_dir}"
        )

    def wait_for_nodes(self) -> None:
        """After ray.init(): poll until every node is alive; fail fast if a `ray start` process
        died."""
        import ray

        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_processes()
            if sum(1 for node in ray.nodes() if node["Alive"]) >= self.nodes:
                return
            time.sleep(0.3)
        raise RayappError(
            f"embedded Ray cluster did not reach {self.nodes} nodes within "
            f"{NODE_START_TIMEOUT_S:.0f}s; see logs in {self.log_dir}"
        )

    def stop(self, *, keep_logs: bool = False) -> None:
        """SIGTERM each `ray start --block` leader, which stops its own daemons in order (seconds;
        signalling the whole session instead makes each daemon drain on its own, ~30 s). Then
        SIGKILL whatever is left of each node's process group, and of every process that ran below
        the nodes when stop() began, and wait for them: nothing outlives the cluster."""
        self._stopping.set()  # no node is started again while the cluster stops
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
            self._watchdog = None
        # Taken before any signal: once a raylet is gone, its workers are re-parented and no longer
        # show as descendants of the node they belonged to.
        tree = descendants([process.pid for process in self._processes if process.poll() is None])
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in reversed(self._processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_session(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self._processes.clear()
        kill_and_wait(tree, timeout_s=STOP_TIMEOUT_S)
        self._release_guard()  # only now: should this process die while stopping, it finishes
        if self._owns_log_dir and not keep_logs and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        for directory in [self._temp_dir, *self._node_temp_dirs]:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
        self._temp_dir, self._node_temp_dirs = None, []

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release()
            self._guard = None


def own_cluster_env(address: str) -> dict[str, str]:
    """The addresses every process of a node's (workers included) takes for "the cluster" when
    Ray looks it up without one: the cluster's own GCS address, whatever the shell says.

    Ray Train's placement-group cleaner asks Ray's State API once a second, with no address,
    whether the training's controller is alive, and removes the training's placement group,
    killing its workers, as soon as the answer is "dead" or "not found". Without an address the
    State API (ray.dashboard.utils.get_address_for_submission_client) takes
    RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else the cluster the last plain `ray start` recorded
    in /tmp/ray. `ray start --head` tells its users to set RAY_API_SERVER_ADDRESS to their own
    cluster's dashboard: inherited by our nodes, that cluster, knowing none of our actors, would
    answer "not found" and the cleaner would end a running training. A gone cluster named there
    made each lookup wait out its timeout, and every run's end with it. Given a GCS address, Ray
    reads the API server's address from that cluster itself."""
    return {"RAY_API_SERVER_ADDRESS": address, "RAY_ADDRESS": address}


def auth_env(token: str) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def use_token(token: str) -> None:
    """Point this process's Ray client at a cluster's token, before ray.init().

    Ray caches auth state in the process after its first ray.init(); a second cluster in the
    same process (a sweep) is refused unless that cache is reset.
    """
    os.environ.update(auth_env(token))
    ray_auth.reload_settings(forget_token=True)


def _signal_session(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
