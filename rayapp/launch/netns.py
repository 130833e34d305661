"""Linux network namespaces, bridges, veth pairs and processes, by name and pid: what the test
hosts (rayapp.launch.testhosts) are made of. Root only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rayapp.errors import RayappError


class HostsError(RayappError):
    """The test hosts cannot be made here (not root, namespaces forbidden, a tool missing)."""


def make_bridge(name: str, address: str | None) -> None:
    run_checked(["ip", "link", "add", name, "type", "bridge"])
    if address:
        run_checked(["ip", "addr", "add", address, "dev", name])
    # Nothing that comes in on it is routed on (whatever the machine's ip_forward), and no
    # address of another network is answered for on it.
    for setting, value in (("forwarding", "0"), ("proxy_arp", "0")):
        Path(f"/proc/sys/net/ipv4/conf/{name}/{setting}").write_text(value)
    run_checked(["ip", "link", "set", name, "up"])


def add_veth(netns: str, outer: str, bridge: str, inner: str) -> None:
    run_checked(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", netns])
    run_checked(["ip", "link", "set", outer, "master", bridge, "up"])


def netns_pids(name: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def list_netns() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    result = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return [line.split(":")[1].strip().split("@")[0] for line in result.stdout.splitlines()]


def end_processes(pids: list[int], *, expect: str | None = None, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after grace_s, each pid (only if its command mentions `expect`)."""
    alive = [pid for pid in pids if cmdline(pid) is not None]
    if expect is not None:
        alive = [pid for pid in alive if expect in (cmdline(pid) or "")]
    for pid in alive:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if is_running(pid)]
    for pid in alive:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def run_checked(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip() or f"exit code {result.returncode}"
        if "Operation not permitted" in reason:
            raise HostsError(
                f"namespaces or links are forbidden here: `{' '.join(argv)}`: {reason}"
            )
        raise HostsError(f"`{' '.join(argv)}` failed: {reason}")


HOLDER_MARK = "rayapp-testhost-init"
"""In every holder's command line, so a leftover one is recognised."""
# The holder is the host's init (pid 1 of its pid namespace): it reaps the orphans that daemons
# such as `ray start` leave, and its end ends every process of the host.
_INIT = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
open(sys.argv[1], "w").close()
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(1)
"""


def start_holder(name: str, setup: list[str], *, ready: Path, timeout_s: float = 20.0) -> int:
    """The init process of a host: in network namespace `name`, and in a mount and a pid
    namespace of its own (so `ray stop` on the host sees only the host's processes), after the
    shell commands in `setup` ran there. Returns its pid (as this machine numbers it) once
    `ready` exists. Mounts made in the private mount namespace never show outside it and vanish
    with it; when it ends the kernel ends every process of its pid namespace."""
    script = " && ".join([*setup, f'exec "$0" -c "$1" "$2" {HOLDER_MARK}'])
    launcher = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{name}", "--", "unshare", "--mount", "--pid", "--fork"]
        + ["--mount-proc", "--propagation", "private", "--", "/bin/sh", "-c", script]
        + [sys.executable, _INIT, str(ready)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if launcher.poll() is not None:
            error = (launcher.stderr.read() if launcher.stderr else b"").decode().strip()
            reason = error.splitlines()[-1] if error else "no reason given"
            raise HostsError(
                f"could not make test host {name}: {reason} (are mount or pid namespaces "
                "forbidden here?)"
            )
        if time.monotonic() > deadline:
            raise HostsError(f"test host {name} was not ready after {timeout_s:g} s")
        time.sleep(0.05)
    # unshare --fork waits for its one child: the init
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return int(children[0])
