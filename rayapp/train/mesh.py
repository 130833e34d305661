"""The run's 2-D device mesh: dim ``replicate`` spans the nodes, dim ``shard`` the workers of one
node (nodes x cluster.workers_per_node).

Ray Train numbers its workers node by node (ranks 0..w-1 on the first node, w..2w-1 on the next),
so row i of the mesh is node i: whatever a strategy does over ``shard`` (HSDP's all-gathers and
reduce-scatters, tensor parallelism's all-reduces) stays on the node's own fast links, and only
``replicate`` (the gradient all-reduce between copies) crosses the network.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rayapp.spec.mesh import MESH_DIMS


def build_mesh(*, world_size: int, workers_per_node: int, device: torch.device) -> DeviceMesh:
    """The mesh over every rank of the process group (a collective: every rank calls it once)."""
    if world_size % workers_per_node:
        raise RuntimeError(
            f"the device mesh needs whole nodes: world size {world_size} is not a multiple of "
            f"cluster.workers_per_node {workers_per_node}"
        )
    return init_device_mesh(
        device.type, (world_size // workers_per_node, workers_per_node), mesh_dim_names=MESH_DIMS
    )


def describe(mesh: DeviceMesh) -> str:
    """``replicate=2,shard=2``: the mesh's dims and sizes, as the MLflow run records them."""
    names = mesh.mesh_dim_names or ()
    return ",".join(f"{name}={size}" for name, size in zip(names, mesh.shape, strict=True))
