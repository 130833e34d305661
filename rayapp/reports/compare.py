"""Scaling comparison of MLflow runs: speedup, efficiency, comm share, and the ideal beside the measured.

Runs are grouped by what makes them comparable (job, scaling, strategy, backend); within a
group, the run with the smallest world size is the baseline. Steady-state figures are medians
over epochs, the first epoch excluded as warm-up.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

from rayapp.errors import RayappError
from rayapp.reports.tables import epoch_values, steady_median


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
    """What perfect scaling predicts: strong scaling t_min * N_min / N; weak scaling t_min (flat)."""
    article_epoch_s: float = math.nan
    """The article's expectation, t_min * N_min / N (time halves per doubling), whatever the scaling."""

    @property
    def group(self) -> tuple[str, str, str, str]:
        return (self.job, self.scaling, self.strategy, self.backend)


def summarize_run(client, run) -> RunSummary:
    run_id = run.info.run_id
    params = run.data.params
    missing = [key for key in ("job", "nodes", "world_size") if key not in params]
    if missing:
        raise RayappError(f"run {run_id} has no {', '.join(missing)} param(s); it was not logged by rayapp")
    epoch_times = epoch_values(client, run_id, "epoch_time_s")
    if not epoch_times:
        raise RayappError(f"run {run_id} ({run.info.run_name}) logged no epoch_time_s; did it finish an epoch?")
    comm_times = epoch_values(client, run_id, "comm_time_s")
    shares = [c / e for c, e in zip(comm_times, epoch_times) if e > 0]
    memory = epoch_values(client, run_id, "peak_mem_mb")
    return RunSummary(
        run_id=run_id,
        job=params["job"],
        nodes=int(params["nodes"]),
        world_size=int(params["world_size"]),
        backend=params.get("backend", ""),
        strategy=params.get("strategy", ""),
        scaling=params.get("scaling", ""),
        epoch_time_s=steady_median(epoch_times),
        samples_per_s=steady_median(epoch_values(client, run_id, "samples_per_s")) or math.nan,
        comm_share=steady_median(shares) if shares else math.nan,
        peak_mem_mb=max(memory) if memory else math.nan,
        param_mb_per_rank=run.data.metrics.get("param_bytes_per_rank", math.nan) / 2**20,
    )


def with_scaling(summaries: Iterable[RunSummary]) -> list[RunSummary]:
    """Fill speedup, efficiency and ideal times against each group's smallest run."""
    from dataclasses import replace

    summaries = list(summaries)
    baselines: dict[tuple, RunSummary] = {}
    for summary in sorted(summaries, key=lambda s: (s.world_size, s.epoch_time_s)):
        baselines.setdefault(summary.group, summary)
    result = []
    for summary in summaries:
        base = baselines[summary.group]
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
    experiment: Optional[str] = None,
    run_ids: Iterable[str] = (),
    parent_run_id: Optional[str] = None,
) -> list[RunSummary]:
    """Runs named by id, or the finished rayapp runs of an experiment (children of parent_run_id if given)."""
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
    ("run_id", "run", "{:.12}"),
]


def _cell(value, fmt: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def render(summaries: list[RunSummary], fmt: str) -> str:
    """fmt: table (rich), markdown, csv or json."""
    if fmt == "json":
        return json.dumps([asdict(s) for s in summaries], indent=2, default=str)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[name for name, _, _ in COLUMNS])
        writer.writeheader()
        for summary in summaries:
            writer.writerow({name: getattr(summary, name) for name, _, _ in COLUMNS})
        return buffer.getvalue()
    rows = [[_cell(getattr(s, name), f) for name, _, f in COLUMNS] for s in summaries]
    headers = [title for _, title, _ in COLUMNS]
    if fmt == "markdown":
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Scaling comparison (medians, first epoch excluded)", caption=CAPTION)
    for _, title, f in COLUMNS:
        table.add_column(title, justify="left" if f == "{}" or title == "run" else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(record=True, width=220)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


CAPTION = (
    "ideal: perfect scaling for the run's mode (strong: time / N, weak: flat). "
    "article: the article's expectation, time halving per doubling. "
    "efficiency = throughput_N / (N/N_min x throughput_min)."
)
