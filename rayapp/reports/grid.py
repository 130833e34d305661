"""A benchmark grid's runs grouped by each axis: a table per axis (each value's mean over the points
that have it), the best point per metric, and a plot with one column of panels per axis.

A grid's child runs carry their point as tags (``rayapp.grid.<axis>`` = value, set by ``rayapp
bench --grid``); runs without them are no part of a grid and are left out here.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayapp.reports.tables import epoch_values, steady_median

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

TAG_GRID_AXES = "rayapp.grid_axes"
"""On a grid's parent run and its children: the axes' keys, comma-separated, in order."""
TAG_GRID_POINT = "rayapp.grid_point"
"""On a child run: its point, ``nodes=2 train.strategy=fsdp``."""
TAG_AXIS_PREFIX = "rayapp.grid."
"""On a child run, one tag per axis: ``rayapp.grid.nodes`` = ``2``."""
TAG_BEST_PREFIX = "rayapp.best."
"""On a grid's parent run, per metric: the best point's label and value."""

METRICS: dict[str, str] = {
    "samples_per_s": "max",
    "epoch_time_s": "min",
    "loss": "min",
    "test_accuracy": "max",
    "test_loss": "min",
    "peak_mem_mb": "min",
    "param_bytes_per_rank": "min",
    "comm_bytes_per_step": "min",
}
"""What a point is judged by, and which way is better: median steady throughput and epoch time
(first epoch excluded, as in the scaling table), the last epoch's loss and test figure, and what
the point costs each rank: its peak memory (the highest epoch's), the parameters it holds, and the
bytes one step's collectives move (median steady epoch), as rank 0 logged them."""
STEADY = ("samples_per_s", "epoch_time_s", "comm_bytes_per_step")
PEAK = ("peak_mem_mb",)


@dataclass(frozen=True)
class GridRun:
    run_id: str
    point: dict[str, str]
    """Axis key -> value as written."""
    metrics: dict[str, float]
    """The METRICS this run logged."""

    @property
    def label(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.point.items())


@dataclass(frozen=True)
class AxisRow:
    value: str
    runs: int
    means: dict[str, float]


@dataclass(frozen=True)
class Best:
    metric: str
    label: str
    value: float
    run_id: str


def grid_run(client: MlflowClient, run: Run) -> GridRun | None:
    """A run's point and figures; None for a run that is no grid point."""
    tags = run.data.tags
    axes = [key for key in tags.get(TAG_GRID_AXES, "").split(",") if key]
    if not axes or any(TAG_AXIS_PREFIX + key not in tags for key in axes):
        return None
    metrics: dict[str, float] = {}
    for name in METRICS:
        if name in STEADY:
            value = steady_median(epoch_values(client, run.info.run_id, name))
        elif name in PEAK:
            value = max(epoch_values(client, run.info.run_id, name), default=None)
        else:
            value = run.data.metrics.get(name)
        if value is not None and not math.isnan(value):
            metrics[name] = value
    point = {key: tags[TAG_AXIS_PREFIX + key] for key in axes}
    return GridRun(run_id=run.info.run_id, point=point, metrics=metrics)


def load_grid_runs(tracking_uri: str, run_ids: list[str]) -> list[GridRun]:
    """The grid points among these runs (others are left out)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = (grid_run(client, client.get_run(run_id)) for run_id in run_ids)
    return [run for run in found if run is not None]


def axes_of(runs: list[GridRun]) -> list[str]:
    """Every axis the runs vary, in the order the grid named them."""
    axes: list[str] = []
    for run in runs:
        axes += [key for key in run.point if key not in axes]
    return axes


def _value_order(value: str) -> tuple[Any, ...]:
    """Numbers in numeric order, other values after them as text: 1, 2, 10, bf16, fp32."""
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def group_by_axis(runs: list[GridRun]) -> dict[str, list[AxisRow]]:
    """For each axis, one row per value: how many points have it, and each metric's mean over
    them (the other axes averaged out)."""
    grouped: dict[str, list[AxisRow]] = {}
    for axis in axes_of(runs):
        values = sorted({run.point[axis] for run in runs if axis in run.point}, key=_value_order)
        rows = []
        for value in values:
            members = [run for run in runs if run.point.get(axis) == value]
            means = {
                name: statistics.fmean(run.metrics[name] for run in members if name in run.metrics)
                for name in METRICS
                if any(name in run.metrics for run in members)
            }
            rows.append(AxisRow(value=value, runs=len(members), means=means))
        grouped[axis] = rows
    return grouped


def best_points(runs: list[GridRun]) -> list[Best]:
    """The best point for each metric some run logged (max or min as METRICS says)."""
    found = []
    for name, direction in METRICS.items():
        having = [run for run in runs if name in run.metrics]
        if not having:
            continue
        pick = max if direction == "max" else min
        best = pick(having, key=lambda run: run.metrics[name])
        found.append(Best(name, best.label, best.metrics[name], best.run_id))
    return found


def _number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def render_grid(runs: list[GridRun], fmt: str) -> str:
    """fmt: table (plain text), markdown, csv or json."""
    grouped, best = group_by_axis(runs), best_points(runs)
    metrics = [name for name in METRICS if any(name in run.metrics for run in runs)]
    if fmt == "json":
        return json.dumps(
            {
                "axes": {
                    axis: [{"value": row.value, "runs": row.runs, **row.means} for row in rows]
                    for axis, rows in grouped.items()
                },
                "best": {
                    b.metric: {"point": b.label, "value": b.value, "run_id": b.run_id} for b in best
                },
                "points": [{"run_id": run.run_id, **run.point, **run.metrics} for run in runs],
            },
            indent=2,
        )
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["axis", "value", "runs", *metrics])
        for axis, rows in grouped.items():
            for row in rows:
                writer.writerow(
                    [axis, row.value, row.runs, *(row.means.get(name, "") for name in metrics)]
                )
        return buffer.getvalue()
    headers = ["value", "runs", *(f"{name} ({METRICS[name]})" for name in metrics)]
    sections = []
    for axis, rows in grouped.items():
        cells = [
            [
                row.value,
                str(row.runs),
                *(_number(row.means[n]) if n in row.means else "-" for n in metrics),
            ]
            for row in rows
        ]
        sections.append((f"by {axis} (mean over the other axes)", cells))
    best_lines = [
        f"best {b.metric} ({METRICS[b.metric]}): {b.label}  {_number(b.value)}  run {b.run_id}"
        for b in best
    ]
    if fmt == "markdown":
        out = []
        for title, cells in sections:
            out += [
                f"**{title}**",
                "",
                "| " + " | ".join(headers) + " |",
                "|" + "---|" * len(headers),
            ]
            out += ["| " + " | ".join(line) + " |" for line in cells]
            out.append("")
        out += [f"- {line}" for line in best_lines]
        return "\n".join(out) + "\n"
    out = []
    for title, cells in sections:
        widths = [max(len(str(c)) for c in column) for column in zip(headers, *cells, strict=True)]
        out.append(f"Grid {title}")
        out.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
        for line in cells:
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        out.append("")
    return "\n".join(out + best_lines) + "\n"


def grid_plot(runs: list[GridRun], path: str | Path) -> Path:
    """One column per axis, one row per metric: each value's mean as a bar, the best marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grouped = group_by_axis(runs)
    metrics = [name for name in METRICS if any(name in run.metrics for run in runs)]
    figure = Figure(
        figsize=(3.6 * max(len(grouped), 1), 2.6 * max(len(metrics), 1)), layout="constrained"
    )
    FigureCanvasAgg(figure)
    panels = figure.subplots(max(len(metrics), 1), max(len(grouped), 1), squeeze=False)
    for column, (axis, rows) in enumerate(grouped.items()):
        for row_index, name in enumerate(metrics):
            panel = panels[row_index][column]
            shown = [row for row in rows if name in row.means]
            heights = [row.means[name] for row in shown]
            bars = panel.bar([row.value for row in shown], heights, color="#4C72B0")
            if heights:
                pick = max if METRICS[name] == "max" else min
                bars[heights.index(pick(heights))].set_color("#DD8452")
            panel.set_title(f"{name} by {axis}", fontsize=9)
            panel.tick_params(labelsize=8)
    figure.suptitle("Grid: each axis's values, mean over the other axes (best in orange)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def best_tags(runs: list[GridRun]) -> dict[str, str]:
    """The parent run's tags naming the best point per metric: ``rayapp.best.samples_per_s`` =
    ``nodes=2 train.strategy=ddp (1234)``."""
    return {
        TAG_BEST_PREFIX + b.metric: f"{b.label} ({_number(b.value)})" for b in best_points(runs)
    }
