"""Where a job runs: how many Ray nodes (a fixed size, or an elastic range), workers on each,
the torch.distributed backend, the cluster's address and checkpoint storage."""

from __future__ import annotations

from dataclasses import dataclass

from rayapp.spec.checks import check_one_of, check_positive_int
from rayapp.spec.errors import SpecError

BACKENDS = ("auto", "nccl", "gloo", "mpi")


def size_label(low: int | None, high: int) -> str:
    """A size as rayapp logs it (the `nodes` and `world_size` params): ``2``, or an elastic ``1:2``."""
    return str(high) if low is None else f"{low}:{high}"


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    nodes: int = 1
    """Ray nodes the workers are spread over (embedded: raylets started on this machine).
    ``"MIN:MAX"`` (quoted in YAML, or ``--nodes 1:2``) is shorthand for ``min_nodes: MIN, nodes: MAX``."""
    min_nodes: int | None = None
    """Elastic training (Ray Train's elastic ScalingConfig): training starts, and goes on after a
    node is lost, with as few as this many nodes, and grows back to ``nodes`` as nodes return.
    None: exactly ``nodes``."""
    resize_interval_s: float = 60.0
    """Elastic only: seconds between Ray Train's checks for returned nodes to grow onto (each
    growth restarts the workers from the last checkpoint)."""
    workers_per_node: int = 1
    backend: str = "auto"
    """torch.distributed backend; `auto` picks nccl on GPUs and gloo on CPUs."""
    cpus_per_worker: int = 1
    address: str | None = None
    """Existing Ray cluster (`ray://`, `HOST:PORT`, or a Jobs API `http://HOST:8265`); none: embedded cluster."""
    storage_path: str = "rayapp_results"
    """Where Ray Train keeps checkpoints; must be shared storage (NFS, s3://, gs://) on a real cluster."""
    max_failures: int = 0
    """Worker failures Ray Train recovers from (restarting from the last checkpoint)."""
    working_dir: str | None = None
    """Directory shipped to every worker (Ray runtime_env working_dir) so they import your code
    from it; none: the job file's directory when the job names your code, else nothing."""

    def __post_init__(self) -> None:
        self._split_node_range()
        check_positive_int("cluster.nodes", self.nodes)
        if self.min_nodes is not None:
            check_positive_int("cluster.min_nodes", self.min_nodes)
            if self.min_nodes > self.nodes:
                raise SpecError(
                    f"cluster.min_nodes: {self.min_nodes} is more than cluster.nodes {self.nodes}; "
                    f"use --nodes MIN:MAX with MIN <= MAX, e.g. 1:{self.nodes}"
                )
            if self.min_nodes == self.nodes:
                object.__setattr__(self, "min_nodes", None)  # N:N is a fixed size
        if (
            isinstance(self.resize_interval_s, bool)
            or not isinstance(self.resize_interval_s, (int, float))
            or not self.resize_interval_s > 0
        ):
            raise SpecError(
                f"cluster.resize_interval_s: {self.resize_interval_s!r} is not accepted; use seconds > 0"
            )
        check_positive_int("cluster.workers_per_node", self.workers_per_node)
        check_positive_int("cluster.cpus_per_worker", self.cpus_per_worker)
        check_one_of("cluster.backend", self.backend, BACKENDS)
        if (
            isinstance(self.max_failures, bool)
            or not isinstance(self.max_failures, int)
            or self.max_failures < 0
        ):
            raise SpecError(
                f"cluster.max_failures: {self.max_failures!r} is not accepted; use a whole number >= 0"
            )
        if not isinstance(self.storage_path, str) or not self.storage_path:
            raise SpecError(
                f"cluster.storage_path: {self.storage_path!r} is not accepted; use a directory or URI"
            )
        if self.working_dir is not None and (
            not isinstance(self.working_dir, str) or not self.working_dir.strip()
        ):
            raise SpecError(
                f"cluster.working_dir: {self.working_dir!r} is not accepted; use a directory path"
            )
        if self.address is not None and (
            not isinstance(self.address, str) or not self.address.strip()
        ):
            raise SpecError(
                f"cluster.address: {self.address!r} is not accepted; use HOST:PORT, ray://HOST:10001 or http://HOST:8265"
            )

    def _split_node_range(self) -> None:
        """``nodes: "1:2"`` (or ``--nodes 1:2``, or ``"2"`` from the command line) into whole numbers."""
        if not isinstance(self.nodes, str):
            return
        text = self.nodes.strip()
        low, sep, high = text.partition(":")
        if not sep and text.lstrip("-").isdigit():  # a whole number, checked as one below
            object.__setattr__(self, "nodes", int(text))
            return
        if not (sep and low.isdigit() and high.isdigit()):
            raise SpecError(
                f"cluster.nodes: {self.nodes!r} is not accepted; use a whole number >= 1, "
                "or MIN:MAX (e.g. 1:2) for elastic training"
            )
        if self.min_nodes is not None:
            raise SpecError(
                f"cluster.nodes: {self.nodes!r} gives a minimum and so does cluster.min_nodes "
                f"({self.min_nodes}); use one of them"
            )
        object.__setattr__(self, "nodes", int(high))
        object.__setattr__(self, "min_nodes", int(low))

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    @property
    def nodes_label(self) -> str:
        """``2``, or ``1:2`` for an elastic run: as the run's `nodes` param and `compare` show it."""
        return size_label(self.min_nodes, self.nodes)

    @property
    def world_label(self) -> str:
        return size_label(self.min_world_size if self.elastic else None, self.world_size)

    @property
    def world_size(self) -> int:
        """Workers at full size (an elastic run may train on fewer for a while)."""
        return self.nodes * self.workers_per_node

    @property
    def min_world_size(self) -> int:
        return (self.min_nodes or self.nodes) * self.workers_per_node

    @property
    def failures_allowed(self) -> int:
        """Ray Train's failure budget. Elastic runs lose a node as a worker-group failure and then
        go on with fewer: at least one failure for each node above the minimum."""
        return (
            max(self.max_failures, self.nodes - self.min_nodes)
            if self.elastic
            else self.max_failures
        )
