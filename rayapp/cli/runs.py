"""Reading runs back: `rayapp runs`, `rayapp compare`, `rayapp ui`, and `rayapp import-metrics`."""

from __future__ import annotations

import os
import sys

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors
from rayapp.cli.flags import shared_option, tracking_uri_option
from rayapp.errors import RayappError
from rayapp.spec import SpecError


@click.command(context_settings=CONTEXT_SETTINGS)
@shared_option(
    "--experiment", default="rayapp", show_default=True, help="MLflow experiment to list."
)
@tracking_uri_option
@click.option(
    "-n", "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Runs to show."
)
@friendly_errors
def runs(experiment: str, tracking_uri: str | None, limit: int) -> None:
    """Table of the most recent runs of an experiment.

    \b
    Example:
      rayapp runs --experiment rayapp -n 10
    """
    from rayapp.reports.tables import recent_runs_table
    from rayapp.tracking.run import resolve_tracking_uri

    recent_runs_table(resolve_tracking_uri(tracking_uri), experiment, limit)


@click.command(context_settings=CONTEXT_SETTINGS)
@tracking_uri_option
@click.option("--port", type=click.IntRange(1, 65535), default=5000, show_default=True)
@friendly_errors
def ui(tracking_uri: str | None, port: int) -> None:
    """Start the MLflow UI on 127.0.0.1 for the tracking store rayapp uses.

    \b
    Example:
      rayapp ui --port 5000     # then open http://127.0.0.1:5000
    """
    from rayapp.tracking.run import UI_TRAINING_VIEW, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if not uri.startswith(("sqlite:", "file:", "postgresql", "mysql", "mssql", "/")):
        raise RayappError(
            f"--tracking-uri {uri!r} is a tracking server already; open it in a browser instead"
        )
    click.echo(
        f"MLflow UI for {uri} on "
        f"http://127.0.0.1:{port}/#/experiments?{UI_TRAINING_VIEW} (Ctrl-C to stop)"
    )
    # One web worker and no background job runner: a local UI for one person needs no more, and
    # on a small machine the defaults (4 workers and a job runner) take half a minute to answer.
    os.environ.setdefault("MLFLOW_WORKERS", "1")
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    os.execv(sys.executable, command)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("run_ids", nargs=-1)
@shared_option(
    "--experiment", help="Compare the finished rayapp runs of this experiment (default: rayapp)."
)
@click.option("--parent", "parent_run_id", help="Only the child runs of this sweep's parent run.")
@tracking_uri_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json", "markdown"]),
    default="table",
    show_default=True,
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Also save the scaling plot PNG here: throughput, efficiency, where the time goes, "
    "and goodput.",
)
@friendly_errors
def compare(
    run_ids: tuple[str, ...],
    experiment: str | None,
    parent_run_id: str | None,
    tracking_uri: str | None,
    fmt: str,
    plot_path: str | None,
) -> None:
    """Compare runs: epoch time, speedup, scaling efficiency, comm share, and the ideal beside the
    measured.

    Beside them, what explains them: start-up times and each node's mean CPU use in the table,
    and with --plot, where a steady epoch's time goes (compute, comm, data, other) per run and
    where each run's wall time went (goodput: start-up, compute, comm, data, checkpoints,
    restarts, other).

    Runs of a `bench --grid` (its --parent) are also grouped by each axis of the grid: a table per
    axis (each value's mean over the other axes) and the best point per metric, below the table
    (table and markdown formats; the parent run holds them as grid.csv/grid.json); --plot then
    saves the grouped plot, and the scaling plot beside it as FILE-scaling.png when nodes is an
    axis.

    \b
    Examples:
      rayapp compare --experiment rayapp
      rayapp compare 3f2a... 9c1b... --format markdown
      rayapp compare --parent <sweep parent run id> --plot scaling.png
      rayapp compare --parent <grid parent run id> --plot grid.png
    """
    from rayapp.reports.compare import load_summaries
    from rayapp.reports.compare_table import render
    from rayapp.reports.grid import axes_of, grid_plot, load_grid_runs, render_grid
    from rayapp.tracking.run import resolve_tracking_uri

    if run_ids and (experiment or parent_run_id):
        raise SpecError("give RUN_IDs or --experiment/--parent, not both")
    uri = resolve_tracking_uri(tracking_uri)
    summaries = load_summaries(
        uri,
        experiment=experiment or "rayapp",
        run_ids=run_ids,
        parent_run_id=parent_run_id,
    )
    grid = load_grid_runs(uri, [summary.run_id for summary in summaries])
    # A sweep over nodes alone is the scaling comparison itself: nothing more to group.
    grouped = bool(grid) and axes_of(grid) != ["nodes"]
    click.echo(render(summaries, fmt), nl=False)
    if grouped and fmt in ("table", "markdown"):
        click.echo("\n" + render_grid(grid, fmt), nl=False)
    if plot_path:
        from pathlib import Path

        from rayapp.reports.plot import scaling_plot

        if not grouped:
            click.echo(f"plot saved to {scaling_plot(summaries, plot_path)}", err=True)
            return
        click.echo(f"grid plot saved to {grid_plot(grid, plot_path)}", err=True)
        if "nodes" in axes_of(grid):
            path = Path(plot_path)
            scaling = path.with_name(f"{path.stem}-scaling{path.suffix or '.png'}")
            click.echo(f"scaling plot saved to {scaling_plot(summaries, scaling)}", err=True)


@click.command("import-metrics", context_settings=CONTEXT_SETTINGS)
@click.argument("fallback_file", type=click.Path(exists=True, dir_okay=False))
@tracking_uri_option
@friendly_errors
def import_metrics(fallback_file: str, tracking_uri: str | None) -> None:
    """Deliver metrics a run saved while MLflow was unreachable.

    Values already in the run are skipped, so importing twice, or after a partial
    delivery, adds nothing twice. The file is renamed to *.imported afterwards.

    \b
    Example:
      rayapp import-metrics rayapp_results/seed_linear-1a2b3c4d/1a2b...e9.mlflow-fallback.jsonl \\
          --tracking-uri http://127.0.0.1:5000
    """
    from pathlib import Path

    from rayapp.tracking.outbox import import_fallback
    from rayapp.tracking.run import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    try:
        sent = import_fallback(Path(fallback_file), uri)
    except (OSError, ValueError, KeyError) as exc:
        raise RayappError(
            f"{fallback_file} is not a rayapp fallback file ({type(exc).__name__}: {exc})"
        ) from None
    except Exception as exc:  # the server is still unreachable, or refused a record
        raise RayappError(
            f"could not deliver to {uri}: {type(exc).__name__}; the file is left as it was"
        ) from None
    click.echo(f"delivered {sent} record(s) from {fallback_file} to {uri}")
