"""Benchmark sweeps: the same job once per point of a grid (any spec fields or flags, see
:mod:`rayapp.driver.grid`; the scaling sweep is a grid over nodes alone), as nested MLflow runs
under one parent that holds the comparison."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rayapp.driver.grid import GridPoint, field_of
from rayapp.driver.submit import SubmitOptions, SubmitResult, submit
from rayapp.reports.compare import load_summaries
from rayapp.reports.compare_table import render
from rayapp.reports.grid import (
    TAG_GRID_AXES,
    GridRun,
    best_tags,
    grid_plot,
    load_grid_runs,
    render_grid,
)
from rayapp.reports.plot import scaling_plot, time_breakdown_plot
from rayapp.reports.run_summary import RunSummary
from rayapp.spec import JobSpec, SpecError
from rayapp.tracking.run import close_run, environment_tags, open_run, resolve_tracking_uri

PLOT_ARTIFACT = "scaling.png"
GRID_PLOT_ARTIFACT = "grid.png"
BREAKDOWN_ARTIFACT = "time_breakdown.png"
"""The breakdown panel of scaling.png on its own, named for the question it answers in the MLflow
UI."""


def parse_sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; one-line SpecError naming the bad piece otherwise."""
    sizes = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece.isdigit() or int(piece) < 1:
            raise SpecError(
                f"--nodes: {piece!r} in {text!r} is not accepted; "
                "use whole numbers >= 1, e.g. 1,2,4"
            )
        sizes.append(int(piece))
    if len(set(sizes)) != len(sizes):
        raise SpecError(f"--nodes: {text!r} repeats a size; give each size once, e.g. 1,2,4")
    return sorted(sizes)


@dataclass(frozen=True)
class SweepResult:
    parent_run_id: str
    children: list[SubmitResult]
    summaries: list[RunSummary]
    plot_path: Path
    grid: list[GridRun] = dataclasses.field(default_factory=list)
    """The children as grid points, for the grouped comparison."""


def node_points(base: JobSpec, sizes: list[int]) -> list[GridPoint]:
    """The old sweep, ``--nodes 1,2,4``, as a grid of one axis, ``nodes``."""
    return [
        GridPoint(
            (("nodes", str(n)),),
            dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, nodes=n)),
        )
        for n in sizes
    ]


def run_sweep(
    base: JobSpec,
    sizes: list[int],
    *,
    job_file: str | None = None,
    options: SubmitOptions = SubmitOptions(),
    on_size_start: Callable[[int], None] = lambda n: None,
    on_size_done: Callable[[int, SubmitResult], None] = lambda n, r: None,
    plot_path: str | Path | None = None,
) -> SweepResult:
    """Run `base` at each node count; the parent run gets the comparison table and plot."""
    return run_grid(
        node_points(base, sizes),
        job_file=job_file,
        options=options,
        on_point_start=lambda point: on_size_start(point.spec.cluster.nodes),
        on_point_done=lambda point, result: on_size_done(point.spec.cluster.nodes, result),
        plot_path=plot_path,
    )


def run_grid(
    points: list[GridPoint],
    *,
    job_file: str | None = None,
    options: SubmitOptions = SubmitOptions(),
    on_point_start: Callable[[GridPoint], None] = lambda point: None,
    on_point_done: Callable[[GridPoint, SubmitResult], None] = lambda point, result: None,
    plot_path: str | Path | None = None,
) -> SweepResult:
    """Run every point of a grid as a child run of one parent run, in order. The parent gets the
    grid's grouped comparison (grid.md/.csv/.json, grid.png, the best point per metric as tags)
    and, when nodes is an axis, the scaling table and plots; each child is tagged with its
    point."""
    from mlflow.tracking import MlflowClient

    base = points[0].spec
    axes = [key for key, _ in points[0].settings]
    values = {
        key: list(dict.fromkeys(text for p in points for k, text in p.settings if k == key))
        for key in axes
    }
    tracking_uri = resolve_tracking_uri(base.tracking.tracking_uri)
    params = {"job": base.name, "epochs": str(base.train.epochs)}
    # What every point shares, as the scaling sweep logged it; a field the grid varies is no
    # shared param.
    varied = {field_of(key) for key in axes}
    shared = {
        "train.scaling": ("scaling", base.train.scaling),
        "train.strategy": ("strategy", base.train.strategy),
        "cluster.workers_per_node": ("workers_per_node", str(base.cluster.workers_per_node)),
    }
    params.update({name: value for field, (name, value) in shared.items() if field not in varied})
    params.update({f"grid.{key}": ",".join(texts) for key, texts in values.items()})
    if axes == ["nodes"]:  # the scaling sweep's own name and param, as before grids
        params["sweep_nodes"] = ",".join(values["nodes"])
        run_name = f"bench-{base.name}-n{params['sweep_nodes']}"
    else:
        run_name = f"bench-{base.name}-grid-" + "-".join(axes)
    parent = open_run(
        tracking_uri=tracking_uri,
        experiment=base.tracking.experiment,
        run_name=run_name,
        params=params,
        tags={"rayapp.sweep": "true", TAG_GRID_AXES: ",".join(axes), **environment_tags(job_file)},
    )
    client = MlflowClient(tracking_uri)
    outcome, children = "FAILED", []
    try:
        for point in points:
            on_point_start(point)
            child = submit(
                point.spec, dataclasses.replace(options, job_file=job_file, parent_run_id=parent)
            )
            for key, value in point.tags.items():
                client.set_tag(child.run_id, key, value)
            children.append(child)
            on_point_done(point, child)
        summaries = load_summaries(tracking_uri, run_ids=[c.run_id for c in children])
        grid = load_grid_runs(tracking_uri, [c.run_id for c in children])
        # The plot saved here: scaling.png when nodes is an axis (as the scaling sweep did),
        # else grid.png.
        if "nodes" in axes:
            _log_grid_report(tracking_uri, parent, grid, local_copy=None)
            plot_path = _log_report(tracking_uri, parent, summaries, plot_path)
        else:
            plot_path = Path(plot_path or f"grid-{parent[:8]}.png")
            _log_grid_report(tracking_uri, parent, grid, local_copy=plot_path)
        outcome = "FINISHED"
    except KeyboardInterrupt:
        outcome = "KILLED"
        raise
    finally:
        close_run(tracking_uri, parent, outcome)
    return SweepResult(
        parent_run_id=parent,
        children=children,
        summaries=summaries,
        plot_path=plot_path,
        grid=grid,
    )


def _log_grid_report(
    tracking_uri: str, parent_run_id: str, grid: list[GridRun], *, local_copy: Path | None
) -> None:
    """The grouped comparison as artifacts of the parent run, the best points as its tags; the
    plot also saved to `local_copy`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    with tempfile.TemporaryDirectory() as directory:
        grid_plot(grid, Path(directory) / GRID_PLOT_ARTIFACT)
        for fmt, name in (("markdown", "grid.md"), ("csv", "grid.csv"), ("json", "grid.json")):
            (Path(directory) / name).write_text(render_grid(grid, fmt))
        client.log_artifacts(parent_run_id, directory)
        if local_copy is not None:
            local_copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(directory) / GRID_PLOT_ARTIFACT, local_copy)
    for key, value in best_tags(grid).items():
        client.set_tag(parent_run_id, key, value)


def _log_report(
    tracking_uri: str, parent_run_id: str, summaries: list[RunSummary], plot_path: str | Path | None
) -> Path:
    """Table (markdown/csv/json) and plots as artifacts of the parent run; the scaling plot also
    saved locally."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    plot_path = Path(plot_path or f"scaling-{parent_run_id[:8]}.png")
    with tempfile.TemporaryDirectory() as directory:
        scaling_plot(summaries, Path(directory) / PLOT_ARTIFACT)
        time_breakdown_plot(summaries, Path(directory) / BREAKDOWN_ARTIFACT)
        for fmt, name in (
            ("markdown", "scaling.md"),
            ("csv", "scaling.csv"),
            ("json", "scaling.json"),
        ):
            (Path(directory) / name).write_text(render(summaries, fmt))
        client.log_artifacts(parent_run_id, directory)
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(directory) / PLOT_ARTIFACT, plot_path)
    largest = max(summaries, key=lambda s: s.world_size)
    client.log_metric(parent_run_id, "efficiency_at_largest", largest.efficiency)
    client.log_metric(parent_run_id, "speedup_at_largest", largest.speedup)
    return plot_path
