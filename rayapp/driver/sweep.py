"""A scaling sweep: the same job once per cluster size, as nested MLflow runs under one parent."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rayapp.driver.submit import SubmitOptions, SubmitResult, submit
from rayapp.reports.compare import RunSummary, load_summaries, render
from rayapp.reports.plot import scaling_plot, time_breakdown_plot
from rayapp.spec import JobSpec, SpecError
from rayapp.tracking.run import close_run, environment_tags, open_run, resolve_tracking_uri

PLOT_ARTIFACT = "scaling.png"
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
    specs = [
        dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, nodes=n)) for n in sizes
    ]
    tracking_uri = resolve_tracking_uri(base.tracking.tracking_uri)
    parent = open_run(
        tracking_uri=tracking_uri,
        experiment=base.tracking.experiment,
        run_name=f"bench-{base.name}-n{','.join(map(str, sizes))}",
        params={
            "job": base.name,
            "sweep_nodes": ",".join(map(str, sizes)),
            "scaling": base.train.scaling,
            "strategy": base.train.strategy,
            "workers_per_node": str(base.cluster.workers_per_node),
            "epochs": str(base.train.epochs),
        },
        tags={"rayapp.sweep": "true", **environment_tags(job_file)},
    )
    outcome, children = "FAILED", []
    try:
        for spec in specs:
            on_size_start(spec.cluster.nodes)
            child = submit(
                spec, dataclasses.replace(options, job_file=job_file, parent_run_id=parent)
            )
            children.append(child)
            on_size_done(spec.cluster.nodes, child)
        summaries = load_summaries(tracking_uri, run_ids=[c.run_id for c in children])
        plot_path = _log_report(tracking_uri, parent, summaries, plot_path)
        outcome = "FINISHED"
    except KeyboardInterrupt:
        outcome = "KILLED"
        raise
    finally:
        close_run(tracking_uri, parent, outcome)
    return SweepResult(
        parent_run_id=parent, children=children, summaries=summaries, plot_path=plot_path
    )


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
