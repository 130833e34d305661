"""Isolated test hosts on one Linux machine, for rehearsing a `ray up` cluster config.

Each host is a network namespace joined to one bridge by a veth pair (the machine itself, "the
laptop", is the bridge's 198.18.0.1; hosts are 198.18.0.2, .3, ...), with a mount namespace of its
own in which /tmp, /dev/shm and root's home are private, and one shared directory
(:data:`SHARED_DIR`, standing in for NFS) is mounted at the same path on every host. Each runs
Debian's sshd accepting a key made for the set, so `ray up` reaches the hosts exactly as it reaches
machines. The hosts keep the machine's host name, which resolves to loopback as on stock
Debian/Ubuntu. One host may get a second interface on a second bridge that routes nowhere else.

A host lives as long as its holder, the init of its own pid namespace (so `ray stop` on a host
sees that host's processes only, and ending the holder ends them all); commands
enter it with ``nsenter``. Everything made is named with :data:`PREFIX` and recorded in a state
file, so :func:`down` (and the next :func:`up`) removes it even after a crash: every process in a
host's network namespace (by pid), the namespaces, the links, the directories.

Root only (namespaces, bridges and mounts need CAP_SYS_ADMIN and CAP_NET_ADMIN).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayapp.launch import netns, testhost_setup
from rayapp.launch.netns import HostsError
from rayapp.launch.testhost_setup import (
    BRIDGE,
    ISOLATED_BRIDGE,
    ISOLATED_OFFSET,
    LAPTOP_ADDRESS,
    PREFIX,
    PREFIX_LEN,
    SHARED_DIR,
    SSHD,
    SUBNET,
)

STATE_DIR = Path(os.environ.get("RAYAPP_TESTHOSTS_DIR", "/var/tmp/rayapp-testhosts"))
MAX_HOSTS = 100
SSH_OPTIONS = (
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "UserKnownHostsFile=/dev/null",
    "-o",
    "LogLevel=ERROR",
    "-o",
    "IdentitiesOnly=yes",
)
"""As Ray's command runner uses them: the hosts' keys are new for every set."""
_READY_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class TestHost:
    name: str
    """The network namespace (`ip netns exec NAME ...` works too)."""
    address: str
    holder_pid: int
    """The process that keeps the host's namespaces alive; commands enter them through it."""
    isolated_address: str | None = None
    """The second interface's address, on the bridge that routes to no other host."""

    __test__ = False  # not a pytest test class

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run inside this host (its network and mount namespaces)."""
        return ["nsenter", "-t", str(self.holder_pid), "-m", "-n", "-p", "--", *argv]

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A long-running command in this host, in a process group of its own."""
        return subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)

    def pids(self) -> list[int]:
        """Every process in this host (its network namespace), the holder included."""
        return netns.netns_pids(self.name)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every process in this host but the holder (and its launcher)."""
        found = {}
        for pid in self.pids():
            cmdline = netns.cmdline(pid)
            if cmdline is not None and netns.HOLDER_MARK not in cmdline:
                found[pid] = cmdline
        return found

    def path(self, inside: str | Path) -> Path:
        """The file at `inside` (a path as the host sees it) seen from the machine itself."""
        return Path(f"/proc/{self.holder_pid}/root") / Path(inside).relative_to("/")


@dataclass(frozen=True)
class TestHosts:
    hosts: list[TestHost]
    key: Path
    """Private key every host's sshd accepts for root."""
    shared_dir: Path = SHARED_DIR
    user: str = "root"

    __test__ = False

    def ssh(
        self, host: TestHost, command: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`command` run on `host` over SSH from the machine itself, as `ray up` would."""
        return subprocess.run(
            ["ssh", *SSH_OPTIONS, "-i", str(self.key), f"{self.user}@{host.address}", command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "hosts": [dataclasses.asdict(host) for host in self.hosts],
            "key": str(self.key),
            "shared_dir": str(self.shared_dir),
            "user": self.user,
        }


def check_can_make_hosts() -> None:
    """One line naming what is missing when hosts cannot be made on this machine."""
    if sys.platform != "linux":
        raise HostsError(f"test hosts need Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise HostsError(
            "test hosts need root (network namespaces, bridges, mounts); run with sudo"
        )
    for tool in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", SSHD):
        if shutil.which(tool) is None:
            raise HostsError(
                f"test hosts need {tool!r}, which is not installed; on Debian/Ubuntu: "
                "apt-get install iproute2 util-linux openssh-client openssh-server rsync"
            )


def up(
    count: int,
    *,
    isolated_interface_on: int | None = None,
    python_env: Path | None = None,
    owner_pid: int | None = None,
) -> TestHosts:
    """Make `count` hosts, removing any left by an earlier set first.

    isolated_interface_on: the index (0-based) of a host that also gets a second interface on a
    bridge of its own. python_env: a Python environment (default: the one running this) linked as
    ``~/rayapp-venv`` in every host's home, where onprem.yaml's setup finds Ray, torch and rayapp
    installed. owner_pid: a process that owns the set while it lives; another set may not replace
    it meanwhile. On any failure everything made so far is removed."""
    if not 1 <= count <= MAX_HOSTS:
        raise HostsError(f"--count {count} is not accepted; use 1 to {MAX_HOSTS}")
    if isolated_interface_on is not None and not 0 <= isolated_interface_on < count:
        raise HostsError(
            f"the host with two interfaces ({isolated_interface_on}) must be one of the {count} "
            "hosts"
        )
    check_can_make_hosts()
    _refuse_if_owned()
    down()
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    STATE_DIR.chmod(0o700)
    _write_state({"owner_pid": owner_pid, "hosts": [], "made_shared_dir": False})
    try:
        return _make(count, isolated_interface_on, python_env or Path(sys.prefix), owner_pid)
    except BaseException:
        down()
        raise


def load() -> TestHosts | None:
    """The set that is up now, or None."""
    state = _read_state()
    if not state or not state.get("hosts"):
        return None
    return TestHosts(
        hosts=[TestHost(**host) for host in state["hosts"]],
        key=Path(state["key"]),
        shared_dir=Path(state["shared_dir"]),
    )


def down() -> list[str]:
    """Remove every host, link and directory made here (also a crashed set's); what was removed."""
    removed: list[str] = []
    state = _read_state() or {}
    names = set(netns.list_netns()) | {host["name"] for host in state.get("hosts", [])}
    for name in sorted(names):
        if name.startswith(PREFIX):
            netns.end_processes(netns.netns_pids(name))
    for host in state.get("hosts", []):
        netns.end_processes([host["holder_pid"]], expect=netns.HOLDER_MARK)
    # The machine's ends of the veth pairs (and the bridges) first: deleting a namespace removes
    # its ends, and with them the pairs, only some time later.
    for link in netns.list_links():
        if link.startswith(PREFIX):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
            removed.append(f"link {link}")
    for name in sorted(names):
        if name.startswith(PREFIX) and name in netns.list_netns():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(f"namespace {name}")
    if state.get("made_shared_dir"):
        try:
            Path(state["shared_dir"]).rmdir()  # the mount point; its contents live in STATE_DIR
        except OSError:
            pass
    if STATE_DIR.exists():
        shutil.rmtree(STATE_DIR, ignore_errors=True)
        removed.append(f"directory {STATE_DIR}")
    return removed


def leftovers() -> list[str]:
    """Namespaces and links with this module's prefix that exist now."""
    return [name for name in netns.list_netns() + netns.list_links() if name.startswith(PREFIX)]


# -- making ------------------------------------------------------------------------------------


def _make(
    count: int, isolated_on: int | None, python_env: Path, owner_pid: int | None
) -> TestHosts:
    key = STATE_DIR / "id_ed25519"
    netns.run_checked(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rayapp-testhosts", "-f", str(key)]
    )
    host_key = STATE_DIR / "ssh_host_ed25519_key"
    netns.run_checked(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
    shared = STATE_DIR / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    made_shared_dir = not SHARED_DIR.exists()
    state: dict[str, Any] = {"owner_pid": owner_pid, "key": str(key), "hosts": []}
    state.update(shared_dir=str(SHARED_DIR), made_shared_dir=made_shared_dir)
    _write_state(state)

    netns.make_bridge(BRIDGE, f"{LAPTOP_ADDRESS}/{PREFIX_LEN}")
    if isolated_on is not None:
        # No address on the machine's side: nothing but its one host is on this network.
        netns.make_bridge(ISOLATED_BRIDGE, None)
    hosts: list[TestHost] = []
    for index in range(count):
        number = index + 2
        name = f"{PREFIX}h{number}"
        isolated = f"{SUBNET}.{ISOLATED_OFFSET + number}" if index == isolated_on else None
        testhost_setup.make_network(name, number, isolated)
        holder = testhost_setup.start_host_init(name, STATE_DIR / name, shared, python_env, key)
        host = TestHost(name, f"{SUBNET}.{number}", holder, isolated)
        hosts.append(host)
        state["hosts"] = [dataclasses.asdict(h) for h in hosts]
        _write_state(state)
        host.popen(
            testhost_setup.sshd_command(host.address, STATE_DIR / name, host_key),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(STATE_DIR / name / "sshd.log", "wb"),  # noqa: SIM115 - sshd keeps it
        )
    made = TestHosts(hosts=hosts, key=key)
    for host in hosts:
        _wait_for_ssh(made, host)
    return made


def _wait_for_ssh(hosts: TestHosts, host: TestHost) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        result = hosts.ssh(host, "true", timeout=10)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise HostsError(
                f"sshd on test host {host.address} did not accept the key: {result.stderr.strip()}"
            )
        time.sleep(0.2)


# -- removing ----------------------------------------------------------------------------------


def _refuse_if_owned() -> None:
    state = _read_state() or {}
    owner = state.get("owner_pid")
    if owner and owner != os.getpid() and netns.is_running(owner):
        raise HostsError(
            f"the test hosts are in use by process {owner}; wait for it to end, "
            "or run `rayapp hosts down` to remove them"
        )


def _state_file() -> Path:
    return STATE_DIR / "state.json"


def _read_state() -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(_state_file().read_text())
        return state
    except (OSError, ValueError):
        return None


def _write_state(state: dict[str, Any]) -> None:
    temporary = _state_file().with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=1))
    temporary.replace(_state_file())
