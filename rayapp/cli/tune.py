"""`rayapp tune`: search a job's hyperparameters with Ray Tune; each trial is the job's
distributed training, in a child MLflow run of one parent run."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors, quiet_library_logs
from rayapp.cli.flags import override_options
from rayapp.spec.overrides import OVERRIDES, overrides_from_flags

# Every spec flag but the two a sweep sets per trial: the trial's nodes (--nodes-per-trial) and
# what it trains (a script has no per-epoch figures for a scheduler to compare).
TUNE_ROWS = tuple(row for row in OVERRIDES if row.flag not in ("--nodes", "--script"))


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_yaml", type=click.Path(dir_okay=False))
@click.option(
    "--param",
    "param_texts",
    multiple=True,
    metavar="FIELD=SPACE",
    help="A job field and its search space: choice(a,b,...), grid(a,b,...), uniform(low,high), "
    "loguniform(low,high), randint(low,high) (low <= n < high). Repeat for more fields.",
)
@click.option(
    "--samples",
    type=int,
    default=1,
    show_default=True,
    help="Trials to draw from the spaces (with grid spaces: for each grid point).",
)
@click.option(
    "--metric", required=True, help="The per-epoch metric trials are compared by (test_accuracy)."
)
@click.option("--mode", required=True, metavar="max|min", help="Whether higher or lower is better.")
@click.option(
    "--scheduler",
    default="fifo",
    show_default=True,
    metavar="fifo|asha",
    help="asha: stop weak trials after epoch 1, 2, 4, ... (each rung keeps the better half).",
)
@click.option(
    "--nodes-per-trial", type=int, default=1, show_default=True, help="Nodes each trial trains on."
)
@click.option(
    "--concurrent",
    type=int,
    default=2,
    show_default=True,
    help="Trials training at once; the embedded cluster gets nodes-per-trial x concurrent nodes.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue this job's newest unfinished sweep (Ctrl-C'd or failed) where it stopped.",
)
@override_options(TUNE_ROWS)
@click.option("-v", "--verbose", is_flag=True, help="Show Ray and worker logs.")
@friendly_errors
def tune(
    job_yaml: str,
    param_texts: tuple[str, ...],
    samples: int,
    metric: str,
    mode: str,
    scheduler: str,
    nodes_per_trial: int,
    concurrent: int,
    resume: bool,
    verbose: bool,
    **flags: Any,
) -> None:
    """Search JOB_YAML's hyperparameters with Ray Tune: every trial trains the job with Ray Train
    on --nodes-per-trial nodes, in a child MLflow run of one parent run.

    Spaces and flags are checked before anything starts. With --scheduler asha, trials that fall
    behind stop early (their runs tagged rayapp.early_stopped). At the end the best trial is
    tagged on the parent run, and a `rayapp submit` line that trains it again is printed.
    Ctrl-C saves the sweep; the same command with --resume continues it.

    \b
    Examples:
      rayapp tune jobs/digits_mlp.yaml --param train.lr="loguniform(1e-3,3e-1)" \\
        --samples 4 --epochs 3 --metric test_accuracy --mode max
      rayapp tune jobs/digits_mlp.yaml --param train.lr="loguniform(1e-4,1e-1)" \\
        --param model.hidden="choice([32],[64],[128])" --samples 8 --scheduler asha \\
        --metric test_accuracy --mode max --nodes-per-trial 1 --concurrent 2
    """
    from rayapp.cli.submit import spec_from_flags
    from rayapp.driver.tune import TuneOptions, check_options, run_tune
    from rayapp.driver.tune_space import parse_params

    params = parse_params(param_texts)
    spec = spec_from_flags(job_yaml, flags)
    options = TuneOptions(
        metric=metric,
        mode=mode,
        samples=samples,
        scheduler=scheduler,
        nodes_per_trial=nodes_per_trial,
        concurrent=concurrent,
        resume=resume,
        job_file=job_yaml,
        flag_overrides=overrides_from_flags(flags),
        verbose=verbose,
        on_status=click.echo,
    )
    check_options(spec, params, options)
    if not verbose:
        quiet_library_logs()
    with _trial_lines():
        result = run_tune(spec, params, options)
    click.echo(
        f"{result.trials} trial(s), {result.stopped_early} stopped early; parent run "
        f"{result.parent_run_id}\nbest: run {result.best_run_id}, {metric} "
        f"{result.best_value:.4g}, {result.best_config}\ntrain it again: {result.submit_line}"
    )


@contextlib.contextmanager
def _trial_lines() -> Iterator[None]:
    """The sweep's per-trial lines (epochs, early stops, failures) at this terminal."""
    log = logging.getLogger("rayapp.tune")

    class Echo(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            click.echo(record.getMessage())

    handler = Echo()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
