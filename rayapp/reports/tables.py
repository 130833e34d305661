"""Tables of MLflow runs for the terminal."""

from __future__ import annotations

import statistics
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from rayapp.errors import RayappError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


def epoch_values(client: MlflowClient, run_id: str, key: str) -> list[float]:
    """A per-epoch metric in epoch order."""
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def steady_median(values: list[float]) -> float | None:
    """Median excluding the first epoch, which pays for warm-up (allocations, first collectives)."""
    steady = values[1:] if len(values) > 1 else values
    return statistics.median(steady) if steady else None


def recent_runs_table(
    tracking_uri: str, experiment: str, limit: int, console: Console | None = None
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise RayappError(
            f"experiment {experiment!r} does not exist in {tracking_uri}; run `rayapp submit` first"
        )
    runs = client.search_runs(
        [found.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit
    )
    table = Table(
        title=f"{experiment}: {len(runs)} most recent run(s)",
        caption="startup s: submission to the first training step (time_to_first_step_s)",
    )
    numeric = ("nodes", "world", "final loss", "median epoch s", "startup s", "total s")
    for column in (
        "run id",
        "name",
        "status",
        "started",
        "nodes",
        "world",
        "strategy",
        *numeric[2:],
    ):
        table.add_column(column, justify="right" if column in numeric else "left")
    for run in runs:
        params, metrics = run.data.params, run.data.metrics
        median = steady_median(epoch_values(client, run.info.run_id, "epoch_time_s"))
        table.add_row(
            run.info.run_id[:12],
            run.info.run_name or "",
            run.info.status,
            datetime.fromtimestamp(run.info.start_time / 1000).strftime("%Y-%m-%d %H:%M"),
            params.get("nodes", ""),
            params.get("world_size", ""),
            params.get("strategy", ""),
            f"{metrics['loss']:.5f}" if "loss" in metrics else "",
            f"{median:.3f}" if median is not None else "",
            # Logged once, at the first step; runs from before it was logged, and sweeps' parents,
            # lack it.
            f"{metrics['time_to_first_step_s']:.1f}" if "time_to_first_step_s" in metrics else "",
            f"{metrics['total_time_s']:.1f}" if "total_time_s" in metrics else "",
        )
    (console or wide_console()).print(table)


def wide_console(**options: Any) -> Console:
    """A terminal console as usual; when piped or captured, wide enough that rows do not wrap."""
    import sys

    return Console(**options) if sys.stdout.isatty() else Console(width=220, **options)
