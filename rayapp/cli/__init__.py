"""The `rayapp` command line. Thin: parse flags, build the spec, call the library."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional

import click

from rayapp.errors import RayappError
from rayapp.spec import BACKENDS, SCALINGS, STRATEGIES, SpecError
STRATEGIES = STRATEGIES.names()

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int) -> None:
    click.secho(f"rayapp: error: {message}", err=True, fg="red")
    sys.exit(code)


def friendly_errors(command: Callable) -> Callable:
    """One line for a person, never a traceback: bad input exits 2, failures 1, Ctrl-C 130."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except SpecError as exc:
            _fail(str(exc), EXIT_BAD_INPUT)
        except RayappError as exc:
            _fail(str(exc), EXIT_FAILED)
        except KeyboardInterrupt:
            _fail("interrupted; training stopped and the MLflow run marked KILLED", EXIT_INTERRUPTED)

    return wrapper


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="rayapp", prog_name="rayapp")
def main() -> None:
    """Run PyTorch distributed training on Ray, track it in MLflow, and measure how it scales.

    \b
    Examples:
      rayapp submit --nodes 2 jobs/seed_linear.yaml        # embedded 2-node cluster on this machine
      rayapp submit --nodes 4 --address HEAD:6379 jobs/mlp_synthetic.yaml
      rayapp runs                                          # recent runs as a table
      rayapp ui                                            # MLflow UI for the same store
    """


def quiet_library_logs() -> None:
    """MLflow announces database migrations and Ray its connections at INFO; a person needs neither."""
    import logging

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
    for name in ("mlflow", "alembic", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ---- submit ---------------------------------------------------------------------------


def _override_options(command: Callable) -> Callable:
    """Flags that override the job YAML; each one's help says which field."""
    options = [
        click.option("--nodes", type=int, help="Ray nodes to spread workers over [cluster.nodes]."),
        click.option("--workers-per-node", type=int, help="Training workers on each node [cluster.workers_per_node]."),
        click.option(
            "--backend",
            type=str,
            help=f"torch.distributed backend: {'|'.join(BACKENDS)}; auto = nccl on GPUs, gloo on CPUs [cluster.backend].",
        ),
        click.option("--strategy", type=str, help=f"Parallel strategy: {'|'.join(STRATEGIES)} [train.strategy]."),
        click.option("--scaling", type=str, help=f"{'|'.join(SCALINGS)} scaling [train.scaling]."),
        click.option("--epochs", type=int, help="Epochs to train [train.epochs]."),
        click.option("--batch-size", type=int, help="Per-worker batch, weak scaling [train.batch_size]."),
        click.option("--global-batch-size", type=int, help="Global batch, strong scaling [train.global_batch_size]."),
        click.option("--lr", type=float, help="Learning rate [train.lr]."),
        click.option("--seed", type=int, help="Seed for data, weights and shuffling [train.seed]."),
        click.option("--experiment", type=str, help="MLflow experiment name [tracking.experiment]."),
        click.option(
            "--tracking-uri",
            type=str,
            help="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db [tracking.tracking_uri].",
        ),
        click.option(
            "--address",
            type=str,
            help="Existing Ray cluster: HOST:PORT or 'auto' to run here, http://HEAD:8265 to submit through the "
            "Ray Jobs API; none starts an embedded one [cluster.address].",
        ),
        click.option("--storage-path", type=str, help="Checkpoint storage, shared on real clusters [cluster.storage_path]."),
        click.option("--max-failures", type=int, help="Worker failures to recover from [cluster.max_failures]."),
        click.option("--cpus-per-worker", type=int, help="CPUs reserved per worker [cluster.cpus_per_worker]."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


OVERRIDE_FIELDS = {
    "nodes": "cluster.nodes",
    "workers_per_node": "cluster.workers_per_node",
    "backend": "cluster.backend",
    "strategy": "train.strategy",
    "scaling": "train.scaling",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "global_batch_size": "train.global_batch_size",
    "lr": "train.lr",
    "seed": "train.seed",
    "experiment": "tracking.experiment",
    "tracking_uri": "tracking.tracking_uri",
    "address": "cluster.address",
    "storage_path": "cluster.storage_path",
    "max_failures": "cluster.max_failures",
    "cpus_per_worker": "cluster.cpus_per_worker",
}


def spec_from_flags(job_yaml: Optional[str], flags: dict[str, Any]):
    """defaults < job YAML < flags; with no YAML, the defaults are the article's loop."""
    from rayapp.spec.loader import build_spec, load_spec

    overrides = {OVERRIDE_FIELDS[name]: value for name, value in flags.items() if name in OVERRIDE_FIELDS}
    spec = load_spec(job_yaml, overrides) if job_yaml else build_spec({}, overrides, default_name="seed_linear")
    if not spec.cluster.address:  # the embedded cluster runs on this machine: check it here, before starting
        import torch
        import torch.distributed as dist

        if spec.cluster.backend == "nccl" and not torch.cuda.is_available():
            raise SpecError("cluster.backend: 'nccl' is not accepted on this machine (no CUDA GPU); use gloo or auto")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if spec.train.strategy in ("dp", "mp") and gpus < 2:
            raise SpecError(
                f"train.strategy: {spec.train.strategy!r} needs at least 2 CUDA GPUs on one node and this machine "
                f"has {gpus}; use ddp or fsdp (they run on CPUs too)"
            )
        if spec.cluster.backend == "mpi" and not dist.is_mpi_available():
            raise SpecError(
                "cluster.backend: 'mpi' is not available in this torch build (no MPI support); build PyTorch "
                "from source against an MPI library (USE_MPI=1), or use gloo (CPU) / nccl (GPU)"
            )
    return spec


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_yaml", required=False, type=click.Path(dir_okay=False))
@_override_options
@click.option(
    "--schedule-timeout",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to wait for the cluster to have enough nodes (autoscaling) before failing.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show Ray and worker logs.")
@click.option(
    "--detach/--wait", "--no-wait/ ", default=False,
    help="With a Jobs API address (http://HEAD:8265): return once submitted instead of streaming logs.",
)
@click.option("--parent-run-id", hidden=True, help="Nest the MLflow run under this parent (used by bench).")
@friendly_errors
def submit(job_yaml: Optional[str], schedule_timeout: float, verbose: bool, detach: bool, parent_run_id: Optional[str],
           **flags: Any) -> None:
    """Train JOB_YAML with Ray Train (TorchTrainer) and log it to MLflow.

    Flags override the job YAML, which overrides the defaults. With no --address,
    an embedded Ray cluster of --nodes raylets starts on this machine and stops at the end.

    \b
    Examples:
      rayapp submit --nodes 2 jobs/seed_linear.yaml
      rayapp submit --nodes 2 --epochs 3 --experiment trial jobs/mlp_synthetic.yaml
      rayapp submit --nodes 2 --strategy fsdp jobs/digits_mlp.yaml
      rayapp submit --address http://127.0.0.1:8265 --nodes 2 --tracking-uri http://MLFLOW:5000 jobs/seed_linear.yaml
    """
    from rayapp.driver.submit import SubmitOptions, submit as run_job
    from rayapp.cli.progress import EpochPrinter

    spec = spec_from_flags(job_yaml, flags)
    if not verbose:
        quiet_library_logs()
    if spec.cluster.address and spec.cluster.address.startswith(("http://", "https://")):
        from rayapp.launch.jobs_api import submit_remote

        sys.exit(submit_remote(spec, job_yaml=job_yaml, detach=detach, schedule_timeout_s=schedule_timeout))
    printer = EpochPrinter(spec)
    result = run_job(
        spec,
        SubmitOptions(
            job_file=job_yaml,
            schedule_timeout_s=schedule_timeout,
            verbose=verbose,
            parent_run_id=parent_run_id,
            on_progress=printer.on_epoch,
            on_status=printer.on_status,
        ),
    )
    printer.done(result)


# ---- runs and ui ----------------------------------------------------------------------


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("--experiment", default="rayapp", show_default=True, help="MLflow experiment to list.")
@click.option("--tracking-uri", help="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
@click.option("-n", "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Runs to show.")
@friendly_errors
def runs(experiment: str, tracking_uri: Optional[str], limit: int) -> None:
    """Table of the most recent runs of an experiment.

    \b
    Example:
      rayapp runs --experiment rayapp -n 10
    """
    from rayapp.reports.tables import recent_runs_table
    from rayapp.tracking.run import resolve_tracking_uri

    recent_runs_table(resolve_tracking_uri(tracking_uri), experiment, limit)


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("--tracking-uri", help="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
@click.option("--port", type=click.IntRange(1, 65535), default=5000, show_default=True)
@friendly_errors
def ui(tracking_uri: Optional[str], port: int) -> None:
    """Start the MLflow UI on 127.0.0.1 for the tracking store rayapp uses.

    \b
    Example:
      rayapp ui --port 5000     # then open http://127.0.0.1:5000
    """
    from rayapp.tracking.run import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if not uri.startswith(("sqlite:", "file:", "postgresql", "mysql", "mssql", "/")):
        raise RayappError(f"--tracking-uri {uri!r} is a tracking server already; open it in a browser instead")
    click.echo(f"MLflow UI for {uri} on http://127.0.0.1:{port} (Ctrl-C to stop)")
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    os.execv(sys.executable, command)


# Jobs API commands (status, logs, stop) live with the remote submission code.
from rayapp.cli import jobs  # noqa: E402,F401  (registers its commands on `main`)


# ---- bench and compare ----------------------------------------------------------------


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_yaml", type=click.Path(dir_okay=False))
@click.option("--nodes", "node_list", required=True, help="Cluster sizes to run, comma-separated, e.g. 1,2,4.")
@click.option("--scaling", type=str, help=f"{'|'.join(SCALINGS)} scaling [train.scaling].")
@click.option("--epochs", type=int, help="Epochs per run [train.epochs].")
@click.option("--workers-per-node", type=int, help="Training workers on each node [cluster.workers_per_node].")
@click.option("--strategy", type=str, help=f"{'|'.join(STRATEGIES)} [train.strategy].")
@click.option("--backend", type=str, help=f"{'|'.join(BACKENDS)} [cluster.backend].")
@click.option("--global-batch-size", type=int, help="Global batch, strong scaling [train.global_batch_size].")
@click.option("--experiment", type=str, help="MLflow experiment for the parent and child runs [tracking.experiment].")
@click.option("--tracking-uri", type=str, help="MLflow tracking URI [tracking.tracking_uri].")
@click.option("--address", type=str, help="Existing Ray cluster; none starts an embedded one per size [cluster.address].")
@click.option("--storage-path", type=str, help="Checkpoint storage [cluster.storage_path].")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Where to save the scaling plot PNG.")
@click.option("--schedule-timeout", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds to wait for enough nodes before each run fails.")
@friendly_errors
def bench(job_yaml: str, node_list: str, plot_path: Optional[str], schedule_timeout: float, **flags: Any) -> None:
    """Run JOB_YAML once per cluster size and compare: nested MLflow runs, a table and a plot.

    All runs go into one experiment under a parent run; the parent gets the comparison
    (scaling.md/.csv/.json) and the plot (scaling.png) as artifacts.

    \b
    Examples:
      rayapp bench jobs/mlp_synthetic.yaml --nodes 1,2            # strong scaling
      rayapp bench jobs/seed_linear.yaml --nodes 1,2 --epochs 3   # the article's loop (weak)
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayapp.reports.compare import render
    from rayapp.driver.submit import SubmitOptions
    from rayapp.cli.progress import EpochPrinter
    from rayapp.driver.sweep import parse_sizes, run_sweep

    sizes = parse_sizes(node_list)
    # Validate every size up front, so a bad combination fails before any run starts.
    specs = {n: spec_from_flags(job_yaml, {**flags, "nodes": n}) for n in sizes}
    quiet_library_logs()
    console = Console(highlight=False)
    with Progress(
        TextColumn("[bold]sweep[/bold] {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:
        task = progress.add_task("", total=len(sizes))
        printer = EpochPrinter(specs[sizes[0]], console=progress.console)
        result = run_sweep(
            specs[sizes[0]],
            sizes,
            job_file=job_yaml,
            options=SubmitOptions(
                schedule_timeout_s=schedule_timeout, on_progress=printer.on_epoch, on_status=printer.on_status
            ),
            on_size_start=lambda n: progress.update(task, description=f"{n} node(s)"),
            on_size_done=lambda n, r: progress.advance(task),
            plot_path=plot_path,
        )
    click.echo(render(result.summaries, "table"), nl=False)  # pre-rendered at full width; no re-wrapping
    console.print(f"parent run [bold]{result.parent_run_id}[/bold]; plot saved to {result.plot_path} and logged as scaling.png")


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("run_ids", nargs=-1)
@click.option("--experiment", help="Compare the finished rayapp runs of this experiment (default: rayapp).")
@click.option("--parent", "parent_run_id", help="Only the child runs of this sweep's parent run.")
@click.option("--tracking-uri", help="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "markdown"]), default="table", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Also save the scaling plot PNG here.")
@friendly_errors
def compare(run_ids: tuple[str, ...], experiment: Optional[str], parent_run_id: Optional[str], tracking_uri: Optional[str],
            fmt: str, plot_path: Optional[str]) -> None:
    """Compare runs: epoch time, speedup, scaling efficiency, comm share, and the ideal beside the measured.

    \b
    Examples:
      rayapp compare --experiment rayapp
      rayapp compare 3f2a... 9c1b... --format markdown
      rayapp compare --parent <sweep parent run id> --plot scaling.png
    """
    from rayapp.reports.compare import load_summaries, render
    from rayapp.tracking.run import resolve_tracking_uri

    if run_ids and (experiment or parent_run_id):
        raise SpecError("give RUN_IDs or --experiment/--parent, not both")
    summaries = load_summaries(
        resolve_tracking_uri(tracking_uri), experiment=experiment or "rayapp", run_ids=run_ids, parent_run_id=parent_run_id
    )
    click.echo(render(summaries, fmt), nl=False)
    if plot_path:
        from rayapp.reports.plot import scaling_plot

        click.echo(f"plot saved to {scaling_plot(summaries, plot_path)}", err=True)


@main.command("import-metrics", context_settings=CONTEXT_SETTINGS)
@click.argument("fallback_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--tracking-uri", help="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
@friendly_errors
def import_metrics(fallback_file: str, tracking_uri: Optional[str]) -> None:
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
        raise RayappError(f"{fallback_file} is not a rayapp fallback file ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the server is still unreachable, or refused a record
        raise RayappError(f"could not deliver to {uri}: {type(exc).__name__}; the file is left as it was") from None
    click.echo(f"delivered {sent} record(s) from {fallback_file} to {uri}")
