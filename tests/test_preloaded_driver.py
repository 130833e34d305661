"""The preloaded driver's server forks only while it runs one thread; the command's signals
reach the child that runs it, or the command itself when the server declines.

A real server process (`python -m rayapp.cli.preloaded_server`) with its real imports, and
requests sent over its socket as the `rayapp` command sends them. No Ray cluster: whether the
server forks does not depend on one, and the command the child runs (`rayapp --version`) needs none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rayapp.launch.preloaded_signals import FORWARDED, Forwarder

# Loaded by the server at its start (PYTHONPATH): SIGUSR1 makes it start a second thread, as a
# library that starts a thread pool or a background thread would.
SITECUSTOMIZE = """
import signal, threading, time

def _start_a_thread(*_):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()

signal.signal(signal.SIGUSR1, _start_a_thread)
"""

CLIENT = """
import json, sys
from pathlib import Path
from rayapp.cli.preloaded import _request, receive_reply

first = _request(Path(sys.argv[1]), ["rayapp", "--version"], sigint_ignored=False)
if "pid" in first:
    first = {"pid": first["pid"], "exit": receive_reply(first["replies"]).get("exit")}
print(json.dumps(first), flush=True)
"""


def request_version(socket_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    """`rayapp --version` sent to the server; its first reply, with the child's exit status when
    it forked one, and everything printed on the command's standard output."""
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, str(socket_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    *printed, reply = result.stdout.splitlines()
    return json.loads(reply), "\n".join(printed)


def test_the_server_forks_with_one_thread_and_declines_with_two(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # the same for the server and its commands: no refusal for it
    socket_path = tmp_path / "driver.sock"
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "rayapp.cli.preloaded_server", str(socket_path)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not listen within 60 s"
            time.sleep(0.1)
        # torch, Ray Train and MLflow imported, and one thread: the command runs in a child.
        assert psutil.Process(server.pid).num_threads() == 1
        reply, printed = request_version(socket_path, env)
        assert reply["exit"] == 0 and reply["pid"] != server.pid, reply
        assert "rayapp, version" in printed

        os.kill(server.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while psutil.Process(server.pid).num_threads() != 2:
            assert time.monotonic() < deadline, "the server did not start its second thread"
            time.sleep(0.05)
        reply, printed = request_version(socket_path, env)
        assert reply == {
            "refused": "the preloaded driver runs 2 threads, and forking it is safe only with one"
        }
        assert printed == ""  # no child ran it; `rayapp` would now run it in its own process
        log.seek(0)
        assert "declined `--version`: the preloaded driver runs 2 threads" in log.read()
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()
    assert not socket_path.exists()  # SIGTERM ends it and removes its socket


@pytest.fixture
def handlers_kept():
    """This process's handlers of the forwarded signals, put back after the test."""
    kept = {signum: signal.getsignal(signum) for signum in FORWARDED}
    yield kept
    for signum, handler in kept.items():
        signal.signal(signum, handler)


def test_signals_before_the_child_is_known_are_held_then_forwarded(handlers_kept):
    """Ctrl-C or SIGTERM that comes while the server answers is neither lost nor handled here."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    forwarder = Forwarder()
    try:
        forwarder.install()
        signal.raise_signal(signal.SIGTERM)  # held: this process goes on
        assert child.poll() is None
        forwarder.forward_to(child.pid)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()


def test_a_held_ctrl_c_is_raised_here_when_the_command_runs_here(handlers_kept):
    forwarder = Forwarder()
    forwarder.install()
    signal.raise_signal(signal.SIGINT)  # held while the server was asked
    with pytest.raises(KeyboardInterrupt):
        forwarder.restore()  # it declined: the previous handler back, and the Ctrl-C with it
    assert signal.getsignal(signal.SIGINT) is handlers_kept[signal.SIGINT]
