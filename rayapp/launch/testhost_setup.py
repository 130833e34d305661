"""How one test host (rayapp.launch.testhosts) is made: its network, its init with private
mounts, its sshd. Root only."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from rayapp.launch import netns

PREFIX = "rayapp-th-"
"""Names of the namespaces and links made here start with it, and nothing else's (links are at
most 15 characters: rayapp-th-v101)."""
BRIDGE = PREFIX + "br0"
ISOLATED_BRIDGE = PREFIX + "br1"
SUBNET = "198.18.0"
"""198.18.0.0/15 is reserved for benchmark testing (RFC 2544): no real network uses it."""
LAPTOP_ADDRESS = f"{SUBNET}.1"
PREFIX_LEN = 25
"""Hosts use 198.18.0.0/25; the second interface, 198.18.0.128/25, which no other host routes to."""
ISOLATED_OFFSET = 128
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
"""Networks the machine itself may be on: unreachable from the hosts."""
REAL_HOME = Path("/root")
"""Root's home, which every host replaces with one of its own."""
REAL_TMP = Path("/tmp")
"""Which every host replaces with one of its own too."""
SHARED_DIR = Path("/mnt/rayapp-shared")
"""Mounted at this path on every host (onprem.yaml's NFS mount point)."""
SSHD = "/usr/sbin/sshd"


def make_network(name: str, number: int, isolated_address: str | None) -> None:
    netns.run_checked(["ip", "netns", "add", name])
    ns = ["ip", "-n", name]
    if isolated_address:
        # Made first, so it is the host's first interface: choosing "the first one that is not
        # loopback" would pick it, and fail.
        netns.add_veth(name, f"{PREFIX}i{number}", ISOLATED_BRIDGE, "eth1")
        netns.run_checked([*ns, "addr", "add", f"{isolated_address}/{PREFIX_LEN}", "dev", "eth1"])
        netns.run_checked([*ns, "link", "set", "eth1", "up"])
    netns.add_veth(name, f"{PREFIX}v{number}", BRIDGE, "eth0")
    netns.run_checked([*ns, "addr", "add", f"{SUBNET}.{number}/{PREFIX_LEN}", "dev", "eth0"])
    netns.run_checked([*ns, "link", "set", "eth0", "up"])
    netns.run_checked([*ns, "link", "set", "lo", "up"])
    # A default route on the bridge, with no gateway: Ray finds a node's address as the source
    # of the route to a public address, as on a real machine. Nothing answers for other
    # addresses there, and the machine forwards nothing from the bridges (_make_bridge).
    netns.run_checked([*ns, "route", "add", "default", "dev", "eth0"])
    for private in PRIVATE_NETWORKS:  # refused at once on the host itself
        netns.run_checked([*ns, "route", "add", "blackhole", private])


def start_host_init(name: str, home_of: Path, shared: Path, python_env: Path, key: Path) -> int:
    """The process whose namespaces are the host: a private /tmp, /dev/shm and home; the shared
    directory at SHARED_DIR. Mounts made in a private mount namespace vanish with it."""
    tmp, home = home_of / "tmp", home_of / "root"
    for directory in (tmp, home / ".ssh"):
        directory.mkdir(parents=True)
    tmp.chmod(0o1777)
    home.chmod(0o700)
    (home / ".ssh" / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    for dotfile in (".bashrc", ".profile"):
        skeleton = Path("/etc/skel") / dotfile
        if skeleton.exists():
            shutil.copy(skeleton, home / dotfile)
    # Ray, torch and rayapp "installed" on the host where onprem.yaml's setup looks for them.
    (home / "rayapp-venv").symlink_to(python_env)
    # An interpreter or checkout under root's own home (pyenv, uv) or under /tmp (a clone made
    # there) stays reachable, read-only, at its path, though both are private on a host.
    tmp_mounts = read_only_mounts(python_env, REAL_TMP, tmp)
    home_mounts = read_only_mounts(python_env, REAL_HOME, home)
    no_dns = home_of / "resolv.conf"
    no_dns.write_text("# test host: no name server\n")
    return netns.start_holder(
        name,
        [
            *tmp_mounts,
            f"mount --rbind {tmp} /tmp",
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
            *home_mounts,
            f"mount --rbind {home} {REAL_HOME}",
            # No name server: the hosts look nothing up beyond /etc/hosts.
            f"mount --bind {no_dns} /etc/resolv.conf",
            f"mkdir -p {SHARED_DIR}",
            f"mount --bind {shared} {SHARED_DIR}",
            "mkdir -p /run/sshd",
        ],
        ready=home_of / "ready",
    )


def needed_paths(python_env: Path) -> list[Path]:
    """What a host's processes run from: the interpreter's base, the environment, and rayapp's
    own source (an editable install's checkout), outermost only."""
    import rayapp

    paths = {
        Path(sys.base_prefix).resolve(),
        python_env.resolve(),
        Path(rayapp.__file__).resolve().parent.parent,
    }
    return sorted(p for p in paths if not any(p != o and p.is_relative_to(o) for o in paths))


def read_only_mounts(python_env: Path, real: Path, private: Path) -> list[str]:
    """The commands that show each needed path under `real` read-only inside `private`, which
    replaces `real` on the host (run before that replacement, which must be recursive)."""
    mounts = []
    for needed in needed_paths(python_env):
        if needed.is_relative_to(real):
            inside = private / needed.relative_to(real)
            inside.mkdir(parents=True, exist_ok=True)
            mounts += [f"mount --bind {needed} {inside}", f"mount -o remount,bind,ro {inside}"]
    return mounts


def sshd_command(address: str, home_of: Path, host_key: Path) -> list[str]:
    """Writes the host's sshd configuration; the command that runs its sshd."""
    config = home_of / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {address}",
                f"HostKey {host_key}",
                f"PidFile {home_of / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                # `ray up` opens many sessions at once; the default refuses some at random
                "MaxStartups 100",
                "MaxSessions 100",
                "AcceptEnv LANG LC_*",
                # The hosts reach no internet: Ray need not try to send usage statistics.
                "SetEnv RAY_USAGE_STATS_ENABLED=0",
                "",
            ]
        )
    )
    return [SSHD, "-D", "-e", "-f", str(config)]
