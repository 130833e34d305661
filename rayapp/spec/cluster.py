"""Where a job runs: how many Ray nodes (a fixed size, or an elastic range), workers on each,
the torch.distributed backend, the cluster's address and checkpoint storage."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from rayapp.spec.errors import SpecError
from rayapp.spec.fields import (
    SECTION_CONFIG,
    NonBlank,
    Number,
    WholeNumber,
    given_fields,
    section,
    with_fields,
)

Backend = Literal["auto", "nccl", "gloo", "mpi"]
BACKENDS: tuple[str, ...] = get_args(Backend)
NODES_TEXT = r"\s*(\d+)(?::(\d+))?\s*"
"""cluster.nodes as text: ``2``, or ``MIN:MAX`` (``1:2``) for elastic training."""


def _count_or_range(schema: dict[str, Any]) -> None:
    """cluster.nodes in a job file: a whole number, or MIN:MAX text (split before validation)."""
    count = {"type": schema.pop("type"), "minimum": schema.pop("minimum")}
    text = {"type": "string", "format": "node-range", "pattern": f"^{NODES_TEXT}$"}
    schema["anyOf"] = [count, text]


def size_label(low: int | None, high: int) -> str:
    """A size as rayapp logs it (the `nodes` and `world_size` params): ``2``, or elastic ``1:2``."""
    return str(high) if low is None else f"{low}:{high}"


@section("cluster")
@dataclass(frozen=True, kw_only=True, config=SECTION_CONFIG)
class ClusterSpec:
    nodes: WholeNumber = Field(
        default=1,
        ge=1,
        description="Ray nodes to spread workers over; MIN:MAX (e.g. 1:2, quoted or not) for "
        "elastic training, short for min_nodes: MIN, nodes: MAX.",
        json_schema_extra=_count_or_range,
    )
    min_nodes: WholeNumber | None = Field(
        default=None,
        ge=1,
        description="Elastic training: train with as few as this many nodes (also after one is "
        "lost) and grow back to `nodes` as nodes return; none: exactly `nodes`.",
    )
    resize_interval_s: Number = Field(
        default=60.0,
        gt=0,
        description="Elastic only: seconds between checks for returned nodes to grow onto (each "
        "growth restarts the workers from the last checkpoint).",
    )
    workers_per_node: WholeNumber = Field(
        default=1, ge=1, description="Training workers on each node."
    )
    backend: Backend = Field(
        default="auto", description="torch.distributed backend; auto: nccl on GPUs, gloo on CPUs."
    )
    cpus_per_worker: WholeNumber = Field(default=1, ge=1, description="CPUs reserved per worker.")
    address: NonBlank | None = Field(
        default=None,
        description="Existing Ray cluster: HOST:PORT or 'auto' to run here, http://HEAD:8265 to "
        "submit through the Ray Jobs API; none starts an embedded one.",
        examples=["HOST:PORT, ray://HOST:10001 or http://HOST:8265"],
    )
    storage_path: NonBlank = Field(
        default="rayapp_results",
        description="Checkpoint storage (default $RAYAPP_STORAGE_PATH, else rayapp_results); "
        "shared storage (NFS, s3://, gs://) on real clusters.",
    )
    max_failures: WholeNumber = Field(
        default=0,
        ge=0,
        description="Worker failures to recover from, restarting from the last checkpoint.",
    )
    working_dir: NonBlank | None = Field(
        default=None,
        description="Directory of your code, shipped to every worker; default: the job file's "
        "directory when the job names your code.",
    )

    @model_validator(mode="before")
    @classmethod
    def _split_node_range(cls, data: Any) -> Any:
        """``nodes: "1:2"`` (or ``--nodes 1:2``, or ``"2"`` from the command line) into whole
        numbers; N:N is a fixed size. Text that is neither is left for validation to reject."""
        fields = given_fields(data)
        if fields is None:
            return data
        nodes, min_nodes = fields.get("nodes"), fields.get("min_nodes")
        given = re.fullmatch(NODES_TEXT, nodes) if isinstance(nodes, str) else None
        low, high = given.groups() if given else (None, None)
        if low is not None and high is None:
            fields["nodes"] = int(low)
        elif low is not None and high is not None:
            if min_nodes is not None:
                raise SpecError(
                    f"cluster.nodes: {nodes!r} gives a minimum and so does cluster.min_nodes "
                    f"({min_nodes}); use one of them"
                )
            fields["nodes"], fields["min_nodes"] = int(high), int(low)
        if type(fields.get("min_nodes")) is int and fields.get("min_nodes") == fields.get("nodes"):
            fields["min_nodes"] = None
        return with_fields(data, fields)

    @model_validator(mode="after")
    def _range_is_ordered(self) -> ClusterSpec:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise SpecError(
                f"cluster.min_nodes: {self.min_nodes} is more than cluster.nodes {self.nodes}; "
                f"use --nodes MIN:MAX with MIN <= MAX, e.g. 1:{self.nodes}"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    @property
    def nodes_label(self) -> str:
        """``2``, or ``1:2`` when elastic, as the run's `nodes` param and `compare` show it."""
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
        if self.min_nodes is None:
            return self.max_failures
        return max(self.max_failures, self.nodes - self.min_nodes)
