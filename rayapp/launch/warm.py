"""A warm embedded cluster: started once by `rayapp cluster up`, used by every later submit and
bench.

Starting an embedded cluster costs several seconds of each short job. A warm one keeps its
`ray start --block` nodes running after `rayapp cluster up` exits; a state file in the user's
cache directory records where it listens, its node processes (pid and start time, so a pid reused
after a reboot is not mistaken for a node) and its Ray auth token, so the file is the user's
alone (mode 0600). `submit` and `bench` with no --address use it when it is alive;
`rayapp cluster down` stops exactly the processes the file names.

Beside the nodes, `cluster up` starts a preloaded driver (rayapp.cli.preloaded) that submits and
benches start in; the record names it too, and its socket lies next to the record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rayapp.errors import RayappError
from rayapp.launch.cluster import EmbeddedCluster, auth_env, start_time, use_token
from rayapp.launch.processes import from_epoch_ms, stop_leaders
from rayapp.spec import SpecError

STATE_DIR_ENV = "RAYAPP_STATE_DIR"
STATE_FILE_NAME = "cluster.json"
DRIVER_LOG_NAME = "preloaded-driver.log"
DRIVER_SOCKET_NAME = "driver.sock"
PRELOADED_DRIVER = False
"""True in a command that runs in a child of the warm cluster's preloaded driver."""


def state_file() -> Path:
    """$RAYAPP_STATE_DIR/cluster.json, else $XDG_CACHE_HOME/rayapp/, else ~/.cache/rayapp/."""
    directory = os.environ.get(STATE_DIR_ENV)
    if not directory:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(cache, "rayapp")
    return Path(directory) / STATE_FILE_NAME


@dataclasses.dataclass(frozen=True)
class WarmCluster:
    address: str
    head_ip: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    token: str
    leaders: dict[int, str]
    """`ray start --block` processes: pid -> start time."""
    log_dir: str
    temp_dirs: list[str]
    started_at: float
    driver: dict[int, str] = dataclasses.field(default_factory=dict)
    """The preloaded driver's server process, pid -> start time; none when it did not start."""

    @property
    def alive(self) -> bool:
        return bool(self.leaders) and all(
            start_time(pid) == started for pid, started in self.leaders.items()
        )

    @property
    def auth_env(self) -> dict[str, str]:
        return auth_env(self.token)

    def prepare_client(self) -> None:
        use_token(self.token)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started_at))
        return (
            f"{self.nodes} node(s) x {self.cpus_per_node} CPU(s) at {self.address}, "
            f"up since {since}"
        )

    def check_fits(self, nodes: int) -> None:
        """A job may use the warm cluster's nodes or fewer of them, never more."""
        if nodes > self.nodes:
            raise SpecError(
                f"cluster.nodes: {nodes} is more than the warm cluster's {self.nodes} "
                f"node(s) ({self.address}); use --nodes {self.nodes} or fewer, or "
                f"`rayapp cluster down` and `rayapp cluster up --nodes {nodes}`"
            )


def driver_socket() -> Path:
    return state_file().with_name(DRIVER_SOCKET_NAME)


def driver_log(record: WarmCluster) -> Path:
    """Where the preloaded driver's server writes what it serves and declines."""
    return Path(record.log_dir) / DRIVER_LOG_NAME


def preloaded_driver_socket() -> Path | None:
    """The socket of the warm cluster's preloaded driver while it and the cluster are alive."""
    try:
        record = _read(state_file())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    path = driver_socket()
    if not (record.driver and _running(record.driver) and record.alive and path.exists()):
        return None
    return path


def attach_driver(record: WarmCluster, pid: int) -> WarmCluster:
    """Name the preloaded driver's server in the record, so `cluster down` stops it too."""
    started = start_time(pid)
    record = dataclasses.replace(record, driver={pid: started} if started else {})
    _write(record, state_file())
    return record


def stop_driver(driver: dict[int, str]) -> None:
    """SIGTERM the server alone, not its session: commands it started finish as they would."""
    for pid, started in driver.items():
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while _running(driver) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, started in driver.items():
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    driver_socket().unlink(missing_ok=True)


def _running(processes: dict[int, str]) -> bool:
    return any(start_time(pid) == started for pid, started in processes.items())


def find(status: Callable[[str], None] = lambda _: None) -> WarmCluster | None:
    """The warm cluster when one is alive; a record whose processes are gone is removed, and
    said."""
    path = state_file()
    try:
        record = _read(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        path.unlink(missing_ok=True)
        status(f"removed an unreadable warm-cluster record {path} ({exc})")
        return None
    if record.alive:
        return record
    stop_driver(record.driver)
    stop_leaders(record.leaders)  # any node of it that is still up (one died, the rest did not)
    _forget(record, path)
    status(
        f"removed a stale warm-cluster record {path}: "
        "its nodes are gone (stopped, or the machine restarted)"
    )
    return None


def up(
    nodes: int,
    cpus_per_node: int,
    gpus_per_node: int = 0,
    status: Callable[[str], None] = lambda _: None,
) -> WarmCluster:
    """Start a warm cluster and record it; RayappError if one is running already."""
    running = find(status)
    if running is not None:
        raise RayappError(
            f"a warm cluster is already running: {running.describe()} "
            f"(record: {state_file()}); `rayapp cluster down` stops it"
        )
    import ray

    status(f"starting a warm Ray cluster: {nodes} node(s) x {cpus_per_node} CPU(s)")
    cluster = EmbeddedCluster(
        nodes=nodes,
        cpus_per_node=cpus_per_node,
        gpus_per_node=gpus_per_node,
        token=secrets.token_hex(32),
        # Ray's State API (the dashboard): Ray Train frees the CPUs of a training whose controller
        # was killed (a `rayapp tune` trial that ASHA stopped) only through it.
        include_dashboard=True,
    )
    try:
        cluster.start()
        cluster.prepare_client()
        ray.init(
            address=cluster.address,
            _node_ip_address=cluster.head_ip,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
        try:
            cluster.wait_for_nodes()
        finally:
            ray.shutdown()
        record = WarmCluster(
            address=cluster.address,
            head_ip=cluster.head_ip,
            nodes=nodes,
            cpus_per_node=cpus_per_node,
            gpus_per_node=gpus_per_node,
            token=cluster.token,
            leaders=cluster.leaders,
            log_dir=str(cluster.log_dir),
            temp_dirs=cluster.temp_dirs,
            started_at=time.time(),
        )
        _write(record, state_file())
    except BaseException:
        cluster.stop(keep_logs=True)
        raise
    cluster.detach()  # the nodes run on; the record is how they are found and stopped
    return record


def down(status: Callable[[str], None] = lambda _: None) -> WarmCluster | None:
    """Stop the warm cluster and remove its record; None when none was running."""
    record = find(status)
    if record is None:
        return None
    status(f"stopping the warm cluster: {record.describe()}")
    stop_driver(record.driver)
    stop_leaders(record.leaders)
    _forget(record, state_file())
    return record


def _forget(record: WarmCluster, path: Path) -> None:
    for directory in [*record.temp_dirs, record.log_dir]:
        shutil.rmtree(directory, ignore_errors=True)
    path.unlink(missing_ok=True)


def _read(path: Path) -> WarmCluster:
    values = json.loads(path.read_text())
    values["leaders"] = {
        int(pid): from_epoch_ms(started) for pid, started in values["leaders"].items()
    }
    values["driver"] = {
        int(pid): from_epoch_ms(started) for pid, started in values.get("driver", {}).items()
    }
    return WarmCluster(**values)


def _write(record: WarmCluster, path: Path) -> None:
    """Readable by the user alone: the record holds the cluster's auth token."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_suffix(".tmp")
    partial.unlink(missing_ok=True)  # os.open's mode applies only to a file it creates
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(dataclasses.asdict(record), handle, indent=2)
    os.replace(partial, path)  # whole or not at all: a reader never sees half a record
