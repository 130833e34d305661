"""Ray Train's TorchConfig, with every worker's Gloo and NCCL pinned to the interface of its node's
Ray address before the process group forms (rayapp.train.socket_ifname says why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig

from rayapp.train.socket_ifname import pin_socket_interfaces

_RayTorchBackend: Any = TorchConfig().backend_cls
"""Ray Train's own backend for torch; its on_start forms the process group on every worker."""


class PinnedInterfaceBackend(_RayTorchBackend):  # type: ignore[misc]
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        # Gloo reads GLOO_SOCKET_IFNAME (NCCL's bootstrap NCCL_SOCKET_IFNAME) when the process
        # group is made, so every worker sets them first.
        worker_group.execute(pin_socket_interfaces)
        super().on_start(worker_group, backend_config)


@dataclass
class PinnedInterfaceTorchConfig(TorchConfig):
    """TorchConfig (backend, init_method, timeout_s as Ray's) whose backend pins the interface."""

    @property
    def backend_cls(self) -> type:
        return PinnedInterfaceBackend
