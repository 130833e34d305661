"""A preloaded driver beside the warm cluster: `rayapp submit` and `rayapp bench` start in a process
that has already imported torch, Ray Train and MLflow.

A warm submit of a short job spends about 3.5 s, a quarter of the command, importing torch (for
TorchTrainer), Ray Train, MLflow and its SQLAlchemy store before the job reaches Ray. `rayapp
cluster up` starts a server beside the nodes (rayapp.cli.preloaded_server): it imports them once
and waits on a Unix socket in the state directory. The `rayapp` command, finding it, sends its
arguments, working directory, environment and umask, and its standard streams themselves (the
descriptors, SCM_RIGHTS: a terminal stays a terminal), and the server forks a child that becomes
that command. The command waits and exits with the child's status; Ctrl-C, SIGTERM and SIGHUP
sent to it reach the child, and a child whose command is gone (killed) is sent SIGTERM, so it
ends its run as a stopped one.
Each command gets a new process: nothing of one run is left for the next, and commands sent at
the same time each get their own.

A fork is safe only in a process with a single thread, so the server does nothing but import and
wait on its socket, and counts its threads before every fork, declining with more than one
(rayapp.cli.preloaded_server says how its imports are kept from starting any). Every signal of
the three processes is handled in rayapp.launch.preloaded_signals.

The server is used only when the child would run the same code under the same settings as the
command itself: the same Python and interpreter flags, rayapp and the preloaded libraries unchanged
on disk since the server started, and the same values of the environment variables those libraries
read when imported (RAY_*, TORCH*, CUDA*, OMP_*, PYTHON*, ...). Otherwise the command says why and
runs in its own process as usual. This is the pattern of Python's multiprocessing forkserver and
its preload list, for a command line instead of a pool.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rayapp.launch.preloaded_signals import Forwarder

PRELOAD = (
    # What a submit or bench imports before its job reaches Ray, slowest first (-X importtime).
    "rayapp.driver.submit",  # torch, via TorchTrainer
    "rayapp.driver.sweep",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "ray.train.torch",
    "ray.dag.compiled_dag_node",
    "rayapp.cli.app",
)
IMPORT_TIME_ENV_PREFIXES = (
    "RAY_",
    "TORCH",
    "PYTORCH_",
    "CUDA",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "PYTHON",
    "LD_",
    "SQLALCHEMY",
)
"""Variables the preloaded libraries (or Python) may read once, when imported: a child forked from
the server would see the server's values in them, not the command's. (MLflow reads its own when
used.)"""
STREAM_ENV = ("PYTHONUNBUFFERED", "PYTHONIOENCODING")
"""Read by Python at start for its standard streams only, which the child sets up as the
command's."""
COMMANDS = ("submit", "bench")
"""The commands that run a job on the warm cluster; every other one is quick in its own process."""
START_TIMEOUT_S = 120.0
EXIT_WAIT_S = 30.0
_MESSAGE_BYTES = 1 << 20


# -- starting the server (rayapp.cli.preloaded_server) ---------------------------------------------


def start(socket_path: Path, log_path: Path, env: dict[str, str]) -> int:
    """Start the server in a session of its own, in the environment `env`; its pid.
    :func:`wait_ready` waits for its socket."""
    socket_path.unlink(missing_ok=True)
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rayapp.cli.preloaded_server", str(socket_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    return process.pid


def wait_ready(socket_path: Path, pid: int, timeout_s: float = START_TIMEOUT_S) -> bool:
    """True once the server listens; False if it exited or did not listen in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if socket_path.exists():
            return True
        if os.waitpid(pid, os.WNOHANG)[0]:  # it exited (start() made it this process's child)
            return False
        time.sleep(0.05)
    return False


def interpreter_identity() -> dict:
    return {
        "executable": os.path.realpath(sys.executable),
        "version": sys.version,
        "flags": list(sys.flags),
        "warnoptions": sys.warnoptions,
        "xoptions": sorted(map(str, sys._xoptions.items())),
    }


def _origins() -> dict[str, str | None]:
    """Where this command would import rayapp and each preloaded library from (found, not
    loaded)."""
    import importlib.util

    origins = {}
    for name in sorted({name.split(".")[0] for name in PRELOAD}):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            origins[name] = spec.origin if spec else None
    return origins


def import_time_environment(environ: dict[str, str]) -> dict[str, str]:
    return {
        name: value
        for name, value in environ.items()
        if name.startswith(IMPORT_TIME_ENV_PREFIXES) and name not in STREAM_ENV
    }


# -- the command's side ---------------------------------------------------------------------------


def hand_over(argv: list[str], status: Callable[[str], None]) -> int | None:
    """Run this command in a child of the warm cluster's preloaded driver; its exit status, or
    None when there is no such server or it declines (the command then runs here)."""
    if len(argv) < 2 or argv[1] not in COMMANDS or "--help" in argv or "-h" in argv:
        return None
    from rayapp.launch import warm

    socket_path = warm.preloaded_driver_socket()
    if socket_path is None:
        return None
    forwarder = Forwarder()
    forwarder.install()
    first = _request(socket_path, argv, sigint_ignored=forwarder.sigint_ignored)
    if "pid" not in first:  # declined, or the server is gone (stopped, crashed): run here
        if "refused" in first:
            status(f"running without the warm cluster's preloaded driver: {first['refused']}")
        else:
            status(
                "running without the warm cluster's preloaded driver: it closed the connection "
                "unanswered (its preloaded-driver.log is in `rayapp cluster status`'s logs)"
            )
        forwarder.restore()  # a Ctrl-C that came meanwhile is raised here now
        return None
    child = first["pid"]
    forwarder.forward_to(child)
    exited = _exit_watch(child)
    last = receive_reply(first["replies"])
    _wait_until_gone(exited)
    if "exit" not in last:
        print(
            f"rayapp: the run's process {child} ended without an exit status (killed?)",
            file=sys.stderr,
        )
        return 1
    return last["exit"]


def _exit_watch(pid: int) -> int | None:
    """A descriptor that becomes readable when the process pid has exited (a pidfd: the server's
    child is not this command's, so waitpid cannot wait on it); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or a kernel without pidfds
        return None


def _wait_until_gone(exited: int | None, timeout_s: float = EXIT_WAIT_S) -> None:
    """The child sends its exit status just before it exits: the command returns once that
    process has gone too, as a command that ran in its own process would, so nothing of its run
    outlives it (a Ctrl-C'd run, a next command started at once)."""
    if exited is None:
        return
    try:
        select.select([exited], [], [], timeout_s)
    finally:
        os.close(exited)


def _request(socket_path: Path, argv: list[str], sigint_ignored: bool) -> dict:
    """Send the command to the server; its first reply (with the stream of later ones), or {}."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(socket_path))
        send_message(
            connection,
            {
                "argv": argv,
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "path": sys.path,
                "umask": _umask(),
                "interpreter": interpreter_identity(),
                "origins": _origins(),
                "streams": {
                    name: _stream_settings(getattr(sys, name))
                    for name in ("stdin", "stdout", "stderr")
                },
                "sigint_ignored": sigint_ignored,
            },
            descriptors=[0, 1, 2],
        )
        replies = connection.makefile("rb")
        first = receive_reply(replies)
    except (OSError, ValueError):
        connection.close()
        return {}
    if "pid" not in first:
        connection.close()
        return first
    return {**first, "replies": replies}  # the connection stays open: the child's exit comes by it


def _stream_settings(stream: io.TextIOWrapper | None) -> list:
    if stream is None:  # started with the descriptor closed: sending it fails first
        return ["utf-8", "strict", False]
    return [stream.encoding, stream.errors, bool(getattr(stream, "write_through", False))]


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# -- messages: one JSON line each; the first may carry descriptors --------------------------------


def send_message(
    connection: socket.socket, message: dict, descriptors: list[int] | None = None
) -> None:
    data = (json.dumps(message) + "\n").encode()
    if descriptors:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", descriptors))]
        sent = connection.sendmsg([data], ancillary)
        data = data[sent:]
    connection.sendall(data)


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """The request and the descriptors sent with it."""
    descriptors = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(
        _MESSAGE_BYTES, socket.CMSG_LEN(3 * descriptors.itemsize)
    )
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors.frombytes(payload[: len(payload) - len(payload) % descriptors.itemsize])
    while not data.endswith(b"\n"):
        more = connection.recv(_MESSAGE_BYTES)
        if not more:
            raise ValueError("the request ended early")
        data += more
    if len(descriptors) != 3:
        for descriptor in descriptors:
            os.close(descriptor)
        raise ValueError(f"{len(descriptors)} descriptors sent, 3 expected")
    return json.loads(data), list(descriptors)


def receive_reply(replies: io.BufferedReader) -> dict:
    """The next reply; {} when the other side closed first."""
    try:
        line = replies.readline()
        return json.loads(line) if line.endswith(b"\n") else {}
    except (OSError, ValueError):
        return {}
