"""The network interface Gloo and NCCL rendezvous over: the one holding the node's Ray address.

Left alone, Gloo binds to the address the host name resolves to. On stock Debian/Ubuntu (and
many other machines) that is loopback (``127.0.1.1 <hostname>`` in /etc/hosts), so a rank
advertises 127.0.0.1 to the others and the process group times out
(``Gloo connectFullMesh failed ... remote=[127.0.0.1]``). NCCL's bootstrap picks an interface by
its own rules, which may be one the other nodes cannot reach. Ray already knows the right
address, the node's: every worker pins both libraries to the interface that holds it.

:func:`pin_socket_interfaces` runs on every worker before Ray Train forms the process group
(rayapp.train.torch_config). Variables the user set are kept.
"""

from __future__ import annotations

import os
import socket

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
TAG_SOCKET_IFNAMES = "rayapp.socket_ifnames"
"""The run's tag: the interface each rank's Gloo/NCCL use, in rank order (as rayapp.node_ips)."""


def interface_holding(address: str) -> str | None:
    """The name of the network interface that holds `address` (IPv4 or IPv6), or None.

    An address an interface holds outright wins; failing that, the interface whose network
    contains it: loopback answers for all of 127.0.0.0/8 while listing only 127.0.0.1."""
    import ipaddress

    import psutil

    wanted = ipaddress.ip_address(address.split("%")[0])
    containing: str | None = None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family not in (socket.AF_INET, socket.AF_INET6) or not entry.netmask:
                continue
            held = ipaddress.ip_address(entry.address.split("%")[0])
            if held == wanted:
                return str(name)
            if held.version != wanted.version:
                continue
            prefix = bin(int(ipaddress.ip_address(entry.netmask))).count("1")
            network = ipaddress.ip_network(f"{held}/{prefix}", strict=False)
            if containing is None and prefix > 0 and wanted in network:
                containing = str(name)
    return containing


def pin_socket_interfaces() -> None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, where unset, to the interface holding this
    node's Ray address. Never raises: Gloo's own choice is still right on many machines."""
    try:
        import ray

        name = interface_holding(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - see the docstring
        return
    if name is None:  # an address behind NAT that no interface here holds: leave the libraries be
        return
    for variable in SOCKET_IFNAME_VARS:
        os.environ.setdefault(variable, name)


def socket_ifnames() -> str:
    """What this process's Gloo/NCCL will use, for the run's record: "eth0", or "gloo:a/nccl:b"
    when the user set them apart, or "" when neither is set."""
    gloo, nccl = (os.environ.get(variable, "") for variable in SOCKET_IFNAME_VARS)
    return gloo if gloo == nccl else f"gloo:{gloo}/nccl:{nccl}"
