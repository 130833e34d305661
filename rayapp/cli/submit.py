"""`rayapp submit` and `rayapp bench`: build the job spec from a YAML and flags, hand it to the
driver."""

from __future__ import annotations

import sys
from typing import Any

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors, quiet_library_logs
from rayapp.cli.flags import override_options, schedule_timeout_option
from rayapp.spec import JobSpec, SpecError
from rayapp.spec.overrides import overrides_from_flags, rows

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
    job_yaml: str | None, flags: dict[str, Any], script_args: tuple[str, ...] = ()
) -> JobSpec:
    """defaults < job YAML < flags; with no YAML, the defaults are the article's loop. The machine
    an embedded cluster would run on is checked here, before anything starts."""
    from rayapp.launch.preflight import check_local_machine
    from rayapp.spec.loader import build_spec, load_spec

    overrides = overrides_from_flags(flags)
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
    "--nodes", "node_list", required=True, help="Cluster sizes to run, comma-separated, e.g. 1,2,4."
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
    job_yaml: str, node_list: str, plot_path: str | None, schedule_timeout: float, **flags: Any
) -> None:
    """Run JOB_YAML once per cluster size and compare: nested MLflow runs, a table and a plot.

    All runs go into one experiment under a parent run; the parent gets the comparison
    (scaling.md/.csv/.json) and the plots (scaling.png: throughput, efficiency and where the
    time goes; time_breakdown.png: the last on its own) as artifacts.

    \b
    Examples:
      rayapp bench jobs/mlp_synthetic.yaml --nodes 1,2            # strong scaling
      rayapp bench jobs/seed_linear.yaml --nodes 1,2 --epochs 3   # the article's loop (weak)
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayapp.cli.progress import EpochPrinter
    from rayapp.driver.submit import SubmitOptions
    from rayapp.driver.sweep import parse_sizes, run_sweep
    from rayapp.reports.compare import render

    sizes = parse_sizes(node_list)
    # Validate every size up front, so a bad combination fails before any run starts.
    specs = {n: spec_from_flags(job_yaml, {**flags, "nodes": n}) for n in sizes}
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
        task = progress.add_task("", total=len(sizes))
        printer = EpochPrinter(specs[sizes[0]], console=progress.console)
        result = run_sweep(
            specs[sizes[0]],
            sizes,
            job_file=job_yaml,
            options=SubmitOptions(
                schedule_timeout_s=schedule_timeout,
                on_progress=printer.on_epoch,
                on_status=printer.on_status,
            ),
            on_size_start=lambda n: progress.update(task, description=f"{n} node(s)"),
            on_size_done=lambda n, r: progress.advance(task),
            plot_path=plot_path,
        )
    click.echo(
        render(result.summaries, "table"), nl=False
    )  # pre-rendered at full width; no re-wrapping
    console.print(
        f"parent run [bold]{result.parent_run_id}[/bold]; plot saved to {result.plot_path} "
        "and logged as scaling.png, beside time_breakdown.png"
    )
