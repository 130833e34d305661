"""`rayapp submit` and `rayapp bench`: build the job spec from a YAML and flags, hand it to the
driver."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors, quiet_library_logs
from rayapp.cli.flags import override_options, schedule_timeout_option
from rayapp.spec import JobSpec, SpecError
from rayapp.spec.overrides import overrides_from_flags, rows

if TYPE_CHECKING:
    from rayapp.driver.grid import Axis

YAML_SUFFIXES = (".yaml", ".yml")
# What a sweep varies or shares; --nodes is the sweep's own list of sizes.
BENCH_FLAGS = (
    "--scaling",
    "--epochs",
    "--workers-per-node",
    "--strategy",
    "--backend",
    "--global-batch-size",
    "--precision",
    "--compile",
    "--experiment",
    "--tracking-uri",
    "--address",
    "--storage-path",
    "--pp-stages",
    "--microbatches",
    "--pp-schedule",
)


def spec_from_flags(
    job_yaml: str | None,
    flags: dict[str, Any],
    script_args: tuple[str, ...] = (),
    fields: Mapping[str, Any] | None = None,
) -> JobSpec:
    """defaults < job YAML < flags < `fields` (``section.name`` overrides: a grid point's); with
    no YAML, the defaults are the article's loop. The machine an embedded cluster would run on
    is checked here, before anything starts."""
    from rayapp.launch.preflight import check_local_machine
    from rayapp.spec.loader import build_spec, load_spec

    overrides = {**overrides_from_flags(flags), **(fields or {})}
    if script_args:
        overrides["train.script_args"] = tuple(script_args)
    default_name = "seed_linear"
    if flags.get("script"):
        default_name = flags["script"].rsplit("/", 1)[-1].removesuffix(".py") or "script"
    spec = (
        load_spec(job_yaml, overrides)
        if job_yaml
        else build_spec({}, overrides, default_name=default_name)
    )
    check_local_machine(spec)
    return spec


def split_arguments(
    arguments: tuple[str, ...], script: str | None
) -> tuple[str | None, tuple[str, ...]]:
    """JOB_YAML, then (with --script) the script's own arguments, which follow `--`."""
    if not arguments:
        return None, ()
    job_yaml, rest = (
        (arguments[0], arguments[1:]) if arguments[0].endswith(YAML_SUFFIXES) else (None, arguments)
    )
    if rest and not script:
        raise SpecError(
            f"{rest[0]!r}: unexpected argument; give one "
            "JOB_YAML (arguments after -- are for --script)"
        )
    return job_yaml, rest


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument(
    "arguments", nargs=-1, type=click.UNPROCESSED, metavar="[JOB_YAML] [-- SCRIPT_ARGS]"
)
@override_options()
@schedule_timeout_option
@click.option("-v", "--verbose", is_flag=True, help="Show Ray and worker logs.")
@click.option(
    "--detach/--wait",
    "--no-wait/ ",
    default=False,
    help=(
        "With a Jobs API address (http://HEAD:8265): "
        "return once submitted instead of streaming logs."
    ),
)
@click.option(
    "--preflight",
    is_flag=True,
    help="Before training, check every node as `rayapp doctor --quick` does (versions, GPUs, "
    "storage path, MLflow) and fail in one line on a problem.",
)
@click.option(
    "--parent-run-id", hidden=True, help="Nest the MLflow run under this parent (used by bench)."
)
@friendly_errors
def submit(
    arguments: tuple[str, ...],
    schedule_timeout: float,
    verbose: bool,
    detach: bool,
    preflight: bool,
    parent_run_id: str | None,
    **flags: Any,
) -> None:
    """Train JOB_YAML with Ray Train (TorchTrainer) and log it to MLflow.

    Flags override the job YAML, which overrides the defaults. With no --address,
    an embedded Ray cluster of --nodes raylets starts on this machine and stops at the end.
    Your own model, data, loss or loop are named in the job YAML by import path (module:function);
    the job file's directory goes with the job to every worker. With --script, every worker runs
    that torchrun-style script instead; its own arguments follow --.

    \b
    Examples:
      rayapp submit --nodes 2 jobs/seed_linear.yaml
      rayapp submit --nodes 2 --epochs 3 --experiment trial jobs/mlp_synthetic.yaml
      rayapp submit --nodes 2 --strategy fsdp --precision bf16 jobs/digits_mlp.yaml
      rayapp submit --nodes 2 examples/cnn_digits/job.yaml          # your model and data by factory
      rayapp submit --nodes 2 --script examples/article_ddp/train.py -- --epochs 3
      rayapp submit --address http://127.0.0.1:8265 --nodes 2 \\
        --tracking-uri http://MLFLOW:5000 jobs/seed_linear.yaml
    """
    from rayapp.cli.progress import EpochPrinter
    from rayapp.driver.submit import SubmitOptions
    from rayapp.driver.submit import submit as run_job

    job_yaml, script_args = split_arguments(arguments, flags.get("script"))
    spec = spec_from_flags(job_yaml, flags, script_args)
    if not verbose:
        quiet_library_logs()
    if spec.cluster.address and spec.cluster.address.startswith(("http://", "https://")):
        from rayapp.cli.jobs import submit_remote

        sys.exit(
            submit_remote(
                spec, job_yaml=job_yaml, detach=detach, schedule_timeout_s=schedule_timeout
            )
        )
    printer = EpochPrinter(spec)
    result = run_job(
        spec,
        SubmitOptions(
            job_file=job_yaml,
            schedule_timeout_s=schedule_timeout,
            verbose=verbose,
            parent_run_id=parent_run_id,
            preflight=preflight,
            on_progress=printer.on_epoch,
            on_status=printer.on_status,
        ),
    )
    printer.done(result)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_yaml", type=click.Path(dir_okay=False))
@click.option(
    "--grid",
    "grid_axes",
    multiple=True,
    metavar="KEY=V1,V2",
    help="An axis of the grid: a flag's name (nodes, strategy, precision, ...) or a spec field "
    "(section.name, as `rayapp schema` lists them) and its values. Repeat for more axes; every "
    "combination runs.",
)
@click.option(
    "--nodes",
    "node_list",
    metavar="N1,N2,...",
    help="Cluster sizes to run, comma-separated, e.g. 1,2,4: the same as --grid nodes=1,2,4.",
)
@override_options(rows(*BENCH_FLAGS))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Where to save the scaling plot PNG.",
)
@schedule_timeout_option
@friendly_errors
def bench(
    job_yaml: str,
    grid_axes: tuple[str, ...],
    node_list: str | None,
    plot_path: str | None,
    schedule_timeout: float,
    **flags: Any,
) -> None:
    """Run JOB_YAML once per point of a grid and compare: nested MLflow runs, tables and plots.

    Each --grid KEY=V1,V2 is an axis; every combination of their values runs, one after another,
    each a child run (tagged with its point) of one parent run. The parent gets the comparison
    grouped by each axis (grid.md/.csv/.json, grid.png) and the best point per metric as tags
    (rayapp.best.<metric>); with nodes among the axes also the scaling comparison
    (scaling.md/.csv/.json, scaling.png: throughput, efficiency and where the time goes;
    time_breakdown.png: the last on its own). Every point is validated before the first starts.

    \b
    Examples:
      rayapp bench jobs/mlp_synthetic.yaml --grid nodes=1,2            # strong scaling
      rayapp bench jobs/seed_linear.yaml --nodes 1,2 --epochs 3        # the same, older form
      rayapp bench jobs/mlp_synthetic.yaml --grid nodes=1,2,4 \\
        --grid train.strategy=ddp,fsdp --grid train.precision=fp32,bf16
      rayapp bench jobs/digits_mlp.yaml --grid lr=0.001,0.003 --grid model.hidden=[64],[128]
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayapp.cli.progress import EpochPrinter
    from rayapp.driver.grid import expand
    from rayapp.driver.submit import SubmitOptions
    from rayapp.driver.sweep import run_grid
    from rayapp.reports.compare_table import render
    from rayapp.reports.grid import render_grid

    axes = grid_from_options(grid_axes, node_list)
    # Every point's spec built (and so validated) up front: a bad value fails before any run.
    points = expand(axes, lambda fields: spec_from_flags(job_yaml, flags, fields=fields))
    quiet_library_logs()
    console = Console(highlight=False)
    with Progress(
        TextColumn("[bold]sweep[/bold] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} runs"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("", total=len(points))
        printer = EpochPrinter(points[0].spec, console=progress.console)
        result = run_grid(
            points,
            job_file=job_yaml,
            options=SubmitOptions(
                schedule_timeout_s=schedule_timeout,
                on_progress=printer.on_epoch,
                on_status=printer.on_status,
            ),
            on_point_start=lambda point: progress.update(task, description=point.label),
            on_point_done=lambda point, r: progress.advance(task),
            plot_path=plot_path,
        )
    keys = [axis.key for axis in axes]
    if "nodes" in keys:
        click.echo(
            render(result.summaries, "table"), nl=False
        )  # pre-rendered at full width; no re-wrapping
    if keys != ["nodes"]:
        click.echo(render_grid(result.grid, "table"), nl=False)
    logged = (
        "scaling.png, beside time_breakdown.png and grid.png" if "nodes" in keys else "grid.png"
    )
    console.print(
        f"parent run [bold]{result.parent_run_id}[/bold]; plot saved to {result.plot_path} "
        f"and logged as {logged}"
    )


def grid_from_options(grid_axes: tuple[str, ...], node_list: str | None) -> list[Axis]:
    """bench's axes: each --grid, and --nodes N1,N2 (the scaling sweep's form) as the nodes axis
    in front of them."""
    from rayapp.driver.grid import Axis, parse_axes
    from rayapp.driver.sweep import parse_sizes

    axes = parse_axes(grid_axes)
    if node_list is not None:
        if any(axis.field == "cluster.nodes" for axis in axes):
            raise SpecError(
                f"--nodes {node_list}: the node counts are also a --grid axis; give them once, "
                "as --grid nodes=1,2 or as --nodes 1,2"
            )
        sizes = parse_sizes(node_list)
        axes.insert(0, Axis("nodes", "cluster.nodes", tuple(map(str, sizes)), tuple(sizes)))
    if not axes:
        raise SpecError(
            "bench: nothing to vary; give --grid KEY=V1,V2 (e.g. --grid nodes=1,2,4) "
            "or --nodes 1,2,4"
        )
    return axes
