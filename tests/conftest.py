"""Shared fixtures. Integration tests run the real CLI against a real embedded Ray cluster
(raylets on 127.0.0.2, 127.0.0.3, ...) and a real MLflow SQLite store in a temporary directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"

# `mlflow server` as the tests start it, lean for a small machine. One uvicorn worker: the default
# four, all starting at once on 2 cores, miss uvicorn's health pings and get killed and restarted
# ("Child process ... died") for a minute or more. No job runner: it starts eight huey consumer
# processes, each importing MLflow, for MLflow's GenAI jobs (scorers, trace archival), which
# rayapp's runs never use.
LEAN_MLFLOW_SERVER_ENV = {"MLFLOW_WORKERS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

# A warm cluster that the person running the tests keeps up (`rayapp cluster up`) must not serve
# the tests' jobs: the tests, and every rayapp they start, keep warm-cluster records of their own.
os.environ["RAYAPP_STATE_DIR"] = tempfile.mkdtemp(prefix="rayapp-test-state-")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    if not has_cuda():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # The tests that share the session's warm cluster run last, one after another, so its nodes
    # are up only while they run and never beside a test's own cluster.
    items.sort(key=lambda item: "warm_cluster" in item.fixturenames)


def run_rayapp(
    *args: str,
    cwd: Path,
    timeout: float = 600,
    env: dict | None = None,
    inherit_env: bool = True,
) -> subprocess.CompletedProcess:
    """The installed CLI in a child process, as a user would run it: in this process's environment
    with `env` on top, or, with inherit_env=False, in `env` alone (a test of another machine's
    user, whom a token or variable set here by an earlier in-process test must not reach)."""
    full_env = (
        {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} if inherit_env else {}
    )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rayapp", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


_STORE_TEMPLATE: list[Path] = []


def migrated_store(path: Path) -> str:
    """The URI of a new SQLite MLflow store at `path`, empty but with its schema in place: a copy
    of one made once per test session. A new database runs all of MLflow's migrations, which
    takes seconds each time; the copy is the same database, made in milliseconds."""
    import shutil

    if not _STORE_TEMPLATE:
        from mlflow.tracking import MlflowClient

        template = Path(tempfile.mkdtemp(prefix="rayapp-test-store-")) / "mlflow.db"
        MlflowClient(f"sqlite:///{template}").search_experiments()  # creates and migrates it
        _STORE_TEMPLATE.append(template)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_STORE_TEMPLATE[0], path)
    return f"sqlite:///{path}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A run's directory, holding the store rayapp uses by default (./mlflow.db), already made."""
    migrated_store(tmp_path / "mlflow.db")
    return tmp_path


class WarmClusterEnv(dict):
    """The environment that points rayapp at the session's warm cluster (pass it as env=), its
    record (address, auth token), and its node processes (`ray start --block`), below which its
    jobs' workers run."""

    record: Any
    leaders: list[int]

    def training_workers(self) -> list[int]:
        return [
            pid
            for leader in self.leaders
            for pid in descendants(leader)
            if "RayTrainWorker" in cmdline(pid)
        ]


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises_in_tests() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in this process, as in a terminal, even when pytest was
    started in the background (which starts with SIGINT ignored): the signal-handling tests send
    themselves SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def warm_cluster(tmp_path_factory) -> Iterator[WarmClusterEnv]:
    """A warm cluster (`rayapp cluster up`, 2 nodes) shared by the tests whose jobs need no cluster
    of their own: pass it to run_rayapp / start_rayapp as env and the command uses it as a user's
    later submits do. Its record lies in a state dir of its own, so the commands of every other
    test still start their own cluster. Started by the first test that asks for it, stopped with
    `rayapp cluster down` at the end of the session."""
    from rayapp.launch import warm

    env = WarmClusterEnv({warm.STATE_DIR_ENV: str(tmp_path_factory.mktemp("warm-state"))})
    directory = tmp_path_factory.mktemp("warm-cluster")
    up = run_rayapp("cluster", "up", "--nodes", "2", cwd=directory, env=env, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        with _environment(env):
            record = warm.find()
        assert record is not None, up.stdout
        env.record, env.leaders = record, list(record.leaders)
        yield env
    finally:
        down = run_rayapp("cluster", "down", cwd=directory, env=env, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def kill_one_training_worker(roots: list[int]) -> None:
    """SIGKILL the newest Ray Train worker process below roots (a rayapp process that started its
    own cluster, or a warm cluster's nodes): one of the running job's, not of a job that ended."""
    import signal

    import psutil

    workers = [
        pid for root in roots for pid in descendants(root) if "RayTrainWorker" in cmdline(pid)
    ]
    assert workers, f"no RayTrainWorker process found below {roots}"
    os.kill(max(workers, key=lambda pid: psutil.Process(pid).create_time()), signal.SIGKILL)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def connect(cluster) -> None:
    """Make this process a driver of a started EmbeddedCluster, once all its nodes are alive.

    ray.shutdown() disconnects again; the cluster itself is stopped by cluster.stop()."""
    import ray

    cluster.prepare_client()
    ray.init(address=cluster.address, _node_ip_address=cluster.head_ip, log_to_driver=False)
    cluster.wait_for_nodes()


def mlflow_client(workdir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")


def load_logged_model(workdir: Path, model_uri: str, loader: Any = None) -> Any:
    """An MLflow Model from workdir's store (``runs:/ID/model``, ``models:/NAME/VERSION``),
    through `loader` (default mlflow.pyfunc.load_model)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    try:
        return (loader or mlflow.pyfunc.load_model)(model_uri)
    finally:
        mlflow.set_tracking_uri(None)


def only_run(client, experiment: str = "rayapp"):
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} was not created"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected one run, found {len(runs)}"
    return runs[0]


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children started in new sessions included)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:  # pid itself has gone
        return []


def cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie has exited). Yields the CPU first, so that a test polling it in
    a loop leaves the processes it waits for room to run on this small machine."""
    import psutil

    os.sched_yield()
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def start_rayapp(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """The CLI as a running child whose output lines the test can wait for."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env.update(env or {}, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "rayapp", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        preexec_fn=_sigint_as_in_a_terminal,
    )


def _sigint_as_in_a_terminal() -> None:
    """A shell without job control starts background commands with SIGINT ignored, and Python keeps
    an inherited SIG_IGN; reset it so a test's SIGINT is a terminal's Ctrl-C wherever the suite
    runs."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float = 300) -> list[str]:
    """Read output until a line contains needle; fail with the output so far if it never comes.

    The lines are read by a helper thread with plain blocking readline(). select() on the pipe would
    not do: readline() pulls every line that has arrived into the file object's buffer but returns
    one, and select() then waits for new bytes while those lines sit unread, so the test falls
    further behind with every burst of output and can see a line only after the run has ended."""
    import threading

    seen: list[str] = []
    ended = threading.Event()

    def read() -> None:
        try:
            for line in process.stdout:
                seen.append(line)
                if needle in line:
                    return
        finally:
            ended.set()

    threading.Thread(target=read, name="wait_for_line", daemon=True).start()
    # on a timeout the reader is left blocked; the caller's cleanup kills the process, which ends it
    if ended.wait(timeout) and seen and needle in seen[-1]:
        return list(seen)
    raise AssertionError(f"never saw {needle!r}; output:\n{''.join(seen)[-3000:]}")


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 with a SQLite store, that a test can stop and restart."""

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        *,
        app_name: str | None = None,
        env: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        from rayapp.launch.cluster import free_port

        self.app_name, self.env = app_name, env or {}
        self.extra_args = extra_args
        """More `mlflow server` flags, e.g. ("--allowed-hosts", "mlflow.internal")."""
        self.directory = directory
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> MlflowServer:
        import time
        import urllib.request

        log = open(self.directory / "mlflow-server.log", "a")
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.directory / 'server.db'}",
                "--artifacts-destination",
                str(self.directory / "artifacts"),
                "--workers",
                "1",
                *(["--app-name", self.app_name] if self.app_name else []),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.directory,  # where basic-auth keeps its user database
            env={**os.environ, **LEAN_MLFLOW_SERVER_ENV, **self.env},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
            if self._process.poll() is not None:
                break
        raise AssertionError(
            f"mlflow server did not start; see {self.directory / 'mlflow-server.log'}"
        )

    def stop(self) -> None:
        import signal

        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # its own session: only what it started
        except ProcessLookupError:
            pass
        self._process.wait(timeout=30)
        self._process = None
