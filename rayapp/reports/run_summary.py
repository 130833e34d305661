"""One MLflow run's figures for the scaling comparison (:class:`RunSummary`), read from what
rayapp logged: steady-state medians over epochs (the first epoch excluded as warm-up), where a
steady epoch's time goes (compute, comm, data, other), start-up times, each node's CPU use, memory
and communication volume per rank, FLOP rates, the slowest rank, and goodput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayapp.errors import RayappError
from rayapp.reports.run_figures import (
    cpu_by_node,
    efficiency,
    goodput,
    links,
    stragglers,
    time_breakdown,
)
from rayapp.reports.tables import epoch_values, steady_median
from rayapp.spec.cluster import size_label

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    job: str
    nodes: int
    world_size: int
    backend: str
    strategy: str
    scaling: str
    epoch_time_s: float
    """Median epoch time, first epoch excluded."""
    samples_per_s: float
    """Median throughput, first epoch excluded."""
    comm_share: float
    """Median of comm_time_s / epoch_time_s (NaN where not measured, e.g. FSDP)."""
    peak_mem_mb: float
    param_bytes_per_rank: float
    """Bytes of parameters rank 0 holds: the whole model under DDP, a 1/N shard under FSDP, a
    1/workers_per_node shard under HSDP and tp (NaN where not logged)."""
    comm_bytes_per_step: float
    """Median over steady epochs of the bytes rank 0's collectives moved in one training step,
    counted from the collectives (NaN where not logged, e.g. a torchrun-style script)."""
    speedup: float = 1.0
    """Throughput relative to the group's smallest run."""
    efficiency: float = 1.0
    """throughput_N / (N / N_min * throughput_min): 1.0 is perfect scaling."""
    ideal_epoch_s: float = math.nan
    """What perfect scaling predicts: strong scaling t_min * N_min / N; weak scaling t_min
    (flat)."""
    article_epoch_s: float = math.nan
    """The article's expectation, t_min * N_min / N (time halves per doubling), whatever the
    scaling."""
    compute_s: float = math.nan
    """Median steady compute_time_s less comm_time_s where comm is measured: the step without its
    all-reduce."""
    comm_s: float = math.nan
    """Median steady comm_time_s (DDP's all-reduce span); NaN where not measured, then inside
    compute_s."""
    data_s: float = math.nan
    """Median steady data_time_s: waiting for batches."""
    other_s: float = math.nan
    """epoch_time_s less compute, comm and data, floored at 0: what no timer covers (sync, logging,
    ...)."""
    startup_cluster_s: float = math.nan
    """Submission until the cluster was up (started or connected)."""
    startup_workers_s: float = math.nan
    """Cluster up until every worker's loop had started."""
    time_to_first_step_s: float = math.nan
    """Submission until the first training step finished."""
    cpu_percent_by_node: dict[str, float] = field(default_factory=dict)
    """Mean of each node's system/<ip>/cpu_utilization_percentage samples (psutil's whole-machine
    figure, 100 = every core busy), by node IP in address order."""
    tflops_per_s: float = math.nan
    """Median steady model FLOP rate of all ranks together (TFLOP/s)."""
    mfu: float = math.nan
    """Median steady model FLOPs utilisation: tflops_per_s over the ranks' peak."""
    peak_tflops: float = math.nan
    peak_source: str = ""
    """Where the peak came from (tag rayapp.peak_tflops_source): table:<GPU> <precision>, or
    measured:matmul."""
    step_time_spread: float = math.nan
    """The slowest rank's median step time over the median rank's (1.0: all ranks alike)."""
    slowest_rank: int | None = None
    slowest_node: str = ""
    """The node (IP) the slowest rank ran on."""
    link_spread: float = math.nan
    """The slowest node's median link time over the median node's (3 nodes or more)."""
    slowest_link_node: str = ""
    """The node (IP) whose link was slowest (rayapp.train.link_probe)."""
    run_wall_s: float = math.nan
    """Submission until training ended, as the driver measured it."""
    goodput: float = math.nan
    """goodput_compute_s / run_wall_s: the share of the wall time that trained the model."""
    goodput_parts: dict[str, float] = field(default_factory=dict)
    """Where the wall time went, goodput_startup_s ... goodput_other_s (rayapp.train.goodput),
    in the order they stack; empty for a run that logged none."""
    min_nodes: int | None = None
    """An elastic run's fewest nodes (``nodes`` is then its most); None for a fixed size."""
    min_world_size: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    @property
    def nodes_label(self) -> str:
        return size_label(self.min_nodes, self.nodes)

    @property
    def straggler(self) -> str:
        """``1.42x rank 1 @ 127.0.0.3``: the step-time spread and the slowest rank's place."""
        if self.slowest_rank is None or math.isnan(self.step_time_spread):
            return "-"
        where = f" @ {self.slowest_node}" if self.slowest_node else ""
        return f"{self.step_time_spread:.2f}x rank {self.slowest_rank}{where}"

    @property
    def slow_link(self) -> str:
        """``9.80x @ 127.0.0.4``: the link-time spread and the node with the slowest link."""
        if not self.slowest_link_node or math.isnan(self.link_spread):
            return "-"
        return f"{self.link_spread:.2f}x @ {self.slowest_link_node}"

    @property
    def world_label(self) -> str:
        return size_label(self.min_world_size, self.world_size)

    @property
    def group(self) -> tuple[str, str, str, str, str]:
        """Runs compared with each other. An elastic run's world size changed while it ran, so it is
        compared only with runs of the same range, never taken for (or as the baseline of) fixed
        ones."""
        return (
            self.job,
            self.scaling,
            self.strategy,
            self.backend,
            f"elastic {self.nodes_label}" if self.elastic else "",
        )

    @property
    def time_parts(self) -> dict[str, float]:
        """The median steady epoch's parts, unmeasured ones as 0: they add up to epoch_time_s
        unless the parts alone exceed it (each is the slowest rank's, and those may differ)."""
        parts = {
            "compute": self.compute_s,
            "comm": self.comm_s,
            "data": self.data_s,
            "other": self.other_s,
        }
        return {name: 0.0 if math.isnan(value) else value for name, value in parts.items()}


def summarize_run(client: MlflowClient, run: Run) -> RunSummary:
    run_id = run.info.run_id
    params = run.data.params
    missing = [key for key in ("job", "nodes", "world_size") if key not in params]
    if missing:
        raise RayappError(
            f"run {run_id} has no {', '.join(missing)} param(s); it was not logged by rayapp"
        )
    epoch_times = epoch_values(client, run_id, "epoch_time_s")
    if not epoch_times:
        raise RayappError(
            f"run {run_id} ({run.info.run_name}) logged no epoch_time_s; did it finish an epoch?"
        )
    comm_times = epoch_values(client, run_id, "comm_time_s")
    # No comm_time_s at all where communication is not measured (a script's own loop): no shares.
    shares = [c / e for c, e in zip(comm_times, epoch_times, strict=False) if e > 0]
    memory = epoch_values(client, run_id, "peak_mem_mb")
    epoch_time_s = steady_median(epoch_times)
    assert epoch_time_s is not None  # epoch_times is not empty
    comm_share = steady_median(shares)
    metrics = run.data.metrics  # once-per-run figures; runs from before they were logged lack them
    min_nodes, nodes = _size_range(params["nodes"], run_id, "nodes")
    min_world, world = _size_range(params["world_size"], run_id, "world_size")
    return RunSummary(
        run_id=run_id,
        job=params["job"],
        nodes=nodes,
        world_size=world,
        min_nodes=min_nodes,
        min_world_size=min_world,
        backend=params.get("backend", ""),
        strategy=params.get("strategy", ""),
        scaling=params.get("scaling", ""),
        epoch_time_s=epoch_time_s,
        samples_per_s=steady_median(epoch_values(client, run_id, "samples_per_s")) or math.nan,
        comm_share=math.nan if comm_share is None else comm_share,
        peak_mem_mb=max(memory) if memory else math.nan,
        param_bytes_per_rank=metrics.get("param_bytes_per_rank", math.nan),
        comm_bytes_per_step=_steady(epoch_values(client, run_id, "comm_bytes_per_step")),
        **time_breakdown(client, run_id, epoch_time_s),
        startup_cluster_s=metrics.get("startup_cluster_s", math.nan),
        startup_workers_s=metrics.get("startup_workers_s", math.nan),
        time_to_first_step_s=metrics.get("time_to_first_step_s", math.nan),
        cpu_percent_by_node=cpu_by_node(client, run),
        **efficiency(client, run),
        **stragglers(client, run),
        **links(client, run),
        **goodput(run),
    )


def _size_range(text: str, run_id: str, param: str) -> tuple[int | None, int]:
    """A size param: ``2`` -> (None, 2); an elastic run's ``1:2`` -> (1, 2)."""
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (None, int(low))
    except ValueError:
        raise RayappError(f"run {run_id} has {param} {text!r}, not a size rayapp logs") from None


def _steady(values: list[float]) -> float:
    """The steady median of a per-epoch metric; NaN for one the run never logged."""
    median = steady_median(values)
    return math.nan if median is None else median
