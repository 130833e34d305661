"""Scaling comparison of MLflow runs: speedup, efficiency, comm share, and the ideal beside the
measured.

Runs are grouped by what makes them comparable (job, scaling, strategy, backend); within a
group, the run with the smallest world size is the baseline. Steady-state figures are medians
over epochs, the first epoch excluded as warm-up. Beside them, what explains them: where a
steady epoch's time goes (compute, comm, data, other), how long start-up took, and how busy
each node's CPUs were.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rayapp.errors import RayappError
from rayapp.reports.run_figures import (
    cpu_by_node,
    efficiency,
    goodput,
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
    param_mb_per_rank: float
    """Parameters each rank holds: the whole model under DDP, a 1/N shard under FSDP."""
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
        param_mb_per_rank=metrics.get("param_bytes_per_rank", math.nan) / 2**20,
        **time_breakdown(client, run_id, epoch_time_s),
        startup_cluster_s=metrics.get("startup_cluster_s", math.nan),
        startup_workers_s=metrics.get("startup_workers_s", math.nan),
        time_to_first_step_s=metrics.get("time_to_first_step_s", math.nan),
        cpu_percent_by_node=cpu_by_node(client, run),
        **efficiency(client, run),
        **stragglers(client, run),
        **goodput(run),
    )


def _size_range(text: str, run_id: str, param: str) -> tuple[int | None, int]:
    """A size param: ``2`` -> (None, 2); an elastic run's ``1:2`` -> (1, 2)."""
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (None, int(low))
    except ValueError:
        raise RayappError(f"run {run_id} has {param} {text!r}, not a size rayapp logs") from None


def with_scaling(summaries: Iterable[RunSummary]) -> list[RunSummary]:
    """Fill speedup, efficiency and ideal times against each group's smallest run."""
    from dataclasses import replace

    summaries = list(summaries)
    baselines: dict[tuple[str, str, str, str, str], RunSummary] = {}
    for summary in sorted(summaries, key=lambda s: (s.world_size, s.epoch_time_s)):
        baselines.setdefault(summary.group, summary)
    result = []
    for summary in summaries:
        base = baselines[summary.group]
        if summary.elastic:  # no fixed size to scale from: the figures stand alone
            result.append(replace(summary, speedup=math.nan, efficiency=math.nan))
            continue
        workers_ratio = summary.world_size / base.world_size
        speedup = summary.samples_per_s / base.samples_per_s
        article = base.epoch_time_s / workers_ratio
        ideal = article if summary.scaling == "strong" else base.epoch_time_s
        result.append(
            replace(
                summary,
                speedup=speedup,
                efficiency=speedup / workers_ratio,
                ideal_epoch_s=ideal,
                article_epoch_s=article,
            )
        )
    return sorted(result, key=lambda s: (s.group, s.world_size))


def load_summaries(
    tracking_uri: str,
    *,
    experiment: str | None = None,
    run_ids: Iterable[str] = (),
    parent_run_id: str | None = None,
) -> list[RunSummary]:
    """Runs named by id, or the finished rayapp runs of an experiment (children of parent_run_id if
    given)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run_ids = list(run_ids)
    if run_ids:
        runs = []
        for run_id in run_ids:
            try:
                runs.append(client.get_run(run_id))
            except MlflowException:
                raise RayappError(f"run {run_id!r} does not exist in {tracking_uri}") from None
    else:
        found = client.get_experiment_by_name(experiment or "rayapp")
        if found is None:
            raise RayappError(f"experiment {experiment!r} does not exist in {tracking_uri}")
        query = "attributes.status = 'FINISHED' and params.world_size != ''"
        if parent_run_id:
            query += f" and tags.mlflow.parentRunId = '{parent_run_id}'"
        runs = client.search_runs([found.experiment_id], filter_string=query, max_results=1000)
        if not runs:
            raise RayappError(f"experiment {experiment!r} has no finished rayapp runs to compare")
    return with_scaling(summarize_run(client, run) for run in runs)


# ---- rendering -------------------------------------------------------------------------

COLUMNS = [
    ("job", "job", "{}"),
    ("nodes", "nodes", "{}"),
    ("world_size", "world", "{}"),
    ("backend", "backend", "{}"),
    ("strategy", "strategy", "{}"),
    ("scaling", "scaling", "{}"),
    ("epoch_time_s", "epoch s", "{:.3f}"),
    ("ideal_epoch_s", "ideal s", "{:.3f}"),
    ("article_epoch_s", "article s", "{:.3f}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.0%}"),
    ("comm_share", "comm share", "{:.0%}"),
    ("peak_mem_mb", "peak MB", "{:,.0f}"),
    ("param_mb_per_rank", "param MB/rank", "{:,.2f}"),
    ("tflops_per_s", "TFLOP/s", "{:.3g}"),
    ("mfu", "MFU", "{:.1%}"),
    ("goodput", "goodput", "{:.0%}"),
    ("straggler", "slowest rank", "{}"),
    ("startup_cluster_s", "cluster up s", "{:.1f}"),
    ("startup_workers_s", "workers up s", "{:.1f}"),
    ("time_to_first_step_s", "first step s", "{:.1f}"),
    ("cpu_percent_by_node", "cpu % per node", "{:.0f}"),
    ("run_id", "run", "{:.12}"),
]
CSV_ONLY = [
    "run_wall_s",
    "compute_s",
    "comm_s",
    "data_s",
    "other_s",
    "peak_tflops",
    "peak_source",
    "step_time_spread",
    "slowest_rank",
    "slowest_node",
]
"""The time breakdown's numbers: in CSV and JSON for whoever plots them again; the table has the
plot."""


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, dict):  # per node, side by side: "127.0.0.2: 87, 127.0.0.3: 85"
        return ", ".join(f"{node}: {_cell(number, fmt)}" for node, number in value.items()) or "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def _shown(summary: RunSummary, name: str) -> Any:
    """A column's value; sizes as their labels (an elastic run's ``1:2``)."""
    return {"nodes": summary.nodes_label, "world_size": summary.world_label}.get(
        name, getattr(summary, name)
    )


def _csv_value(value: Any) -> Any:
    # One cell per run, as the table writes it but a decimal finer; other values as they are.
    return _cell(value, "{:.1f}") if isinstance(value, dict) else value


def render(summaries: list[RunSummary], fmt: str) -> str:
    """fmt: table (rich), markdown, csv or json."""
    if fmt == "json":
        return json.dumps([asdict(s) for s in summaries], indent=2, default=str)
    if fmt == "csv":
        buffer = io.StringIO()
        names = [name for name, _, _ in COLUMNS] + CSV_ONLY
        writer = csv.DictWriter(buffer, fieldnames=names)
        writer.writeheader()
        for summary in summaries:
            writer.writerow({name: _csv_value(_shown(summary, name)) for name in names})
        return buffer.getvalue()
    rows = [[_cell(_shown(s, name), f) for name, _, f in COLUMNS] for s in summaries]
    headers = [title for _, title, _ in COLUMNS]
    if fmt == "markdown":
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    from rich.console import Console
    from rich.table import Table

    caption = CAPTION + (ELASTIC_CAPTION if any(s.elastic for s in summaries) else "")
    table = Table(title="Scaling comparison (medians, first epoch excluded)", caption=caption)
    for _, title, f in COLUMNS:
        table.add_column(
            title,
            justify="left"
            if f == "{}" or title in ("run", "cpu % per node", "slowest rank")
            else "right",
        )
    for row in rows:
        table.add_row(*row)
    # As wide as the table wants (at least 220): squeezed, rich would cut run ids and wrap the
    # per-node cells; whoever reads it in a narrower terminal can scroll or pick --format markdown.
    natural = Console(width=1000).measure(table).maximum
    console = Console(record=True, width=max(220, natural))
    with console.capture() as capture:
        console.print(table)
    return capture.get()


CAPTION = (
    "ideal: perfect scaling for the run's mode (strong: time / N, weak: flat). "
    "article: the article's expectation, time halving per doubling. "
    "efficiency = throughput_N / (N/N_min x throughput_min). "
    "cluster up s: submission to cluster up; workers up s: cluster up to every worker started; "
    "first step s: submission to the first step done. "
    "cpu % per node: the node's machine over the run, mean (100 = all its cores busy). "
    "MFU: TFLOP/s over the ranks' peak (GPU datasheet, else a measured matmul; see peak_source). "
    "goodput: the share of the run's wall time (submission to end) spent computing; the plot "
    "shows the rest (start-up, comm, data, checkpoints, restarts, other). "
    "slowest rank: its median step time (batch request to gradients ready) over the median "
    "rank's, and its node."
)
ELASTIC_CAPTION = (
    " nodes MIN:MAX: an elastic run, "
    "compared with none of fixed size (its world size per epoch is in MLflow)."
)
