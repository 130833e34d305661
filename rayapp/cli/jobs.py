"""`rayapp status`, `rayapp logs`, `rayapp stop`: follow jobs submitted with `rayapp submit --address http://...`.

They talk to the cluster's Ray Jobs API (the dashboard, port 8265), locally or through the SSH
tunnel `ray dashboard cluster_configs/<cloud>.yaml` opens.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Optional

import click

from rayapp.cli import CONTEXT_SETTINGS, EXIT_INTERRUPTED, friendly_errors, main
from rayapp.launch.jobs_api import DEFAULT_DASHBOARD_ADDRESS, STOP_TIMEOUT_S, default_address, normalize_address, one_line

STATUS_COLOURS = {"SUCCEEDED": "green", "FAILED": "red", "STOPPED": "yellow", "RUNNING": "cyan", "PENDING": "blue"}


def _address_option(command):
    return click.option(
        "--address",
        default=default_address,
        show_default=f"$RAY_ADDRESS if it is http(s), else {DEFAULT_DASHBOARD_ADDRESS}",
        help="The cluster's Ray Jobs API (dashboard) URL.",
    )(command)


def _when(ms: Optional[int], short: bool = False) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000).strftime("%m-%d %H:%M:%S" if short else "%Y-%m-%d %H:%M:%S")


def _duration(start_ms: Optional[int], end_ms: Optional[int]) -> str:
    if not start_ms:
        return "-"
    seconds = ((end_ms or datetime.now().timestamp() * 1000) - start_ms) / 1000
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id", required=False)
@_address_option
@click.option("-n", "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Jobs to list.")
@friendly_errors
def status(submission_id: Optional[str], address: str, limit: int) -> None:
    """Status of a submitted job, or a table of the cluster's recent jobs.

    \b
    Examples:
      rayapp status --address http://127.0.0.1:8265            # recent jobs, newest first
      rayapp status rayapp-seed_linear-1a2b3c4d                  # one job: status and message
      RAY_ADDRESS=http://127.0.0.1:8265 rayapp status
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from rayapp.launch.jobs_api import connect, job_info, list_submissions

    address = normalize_address(address)
    client = connect(address)
    console = Console(highlight=False)
    if submission_id:
        info = job_info(client, submission_id, address)
        state = str(info.status)
        console.print(f"job [bold]{submission_id}[/bold]: [{STATUS_COLOURS.get(state, 'white')}]{state}[/]")
        if info.message:
            console.print(f"  message:    {one_line(info.message)}", markup=False)
        console.print(f"  started:    {_when(info.start_time)}   ended: {_when(info.end_time)}   "
                      f"({_duration(info.start_time, info.end_time)})")
        console.print(f"  entrypoint: {info.entrypoint}", markup=False)
        if state in ("PENDING", "RUNNING"):
            console.print(f"  follow:     rayapp logs {submission_id} -f --address {address}", markup=False)
        return
    jobs = list_submissions(client, address)[:limit]
    if not jobs:
        console.print(f"no jobs submitted to {address} yet")
        return
    if not console.is_terminal:  # piped into grep or a file: one whole line per job
        console = Console(highlight=False, width=max(console.width, 200))
    table = Table(title=f"jobs on {address}", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("submission id", no_wrap=True, min_width=max(len(job.submission_id) for job in jobs))
    table.add_column("status", no_wrap=True, min_width=9)
    table.add_column("start", no_wrap=True, min_width=14)
    table.add_column("end", no_wrap=True, min_width=14)
    table.add_column("entrypoint", overflow="ellipsis", no_wrap=True, ratio=1)
    for job in jobs:
        state = str(job.status)
        table.add_row(
            job.submission_id,
            f"[{STATUS_COLOURS.get(state, 'white')}]{state}[/]",
            _when(job.start_time, short=True),
            _when(job.end_time, short=True),
            job.entrypoint,
        )
    console.print(table)


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends (Ctrl-C stops following, not the job).")
@_address_option
@friendly_errors
def logs(submission_id: str, follow: bool, address: str) -> None:
    """Output of a submitted job (its driver: status lines and one line per epoch).

    \b
    Examples:
      rayapp logs rayapp-seed_linear-1a2b3c4d
      rayapp logs rayapp-seed_linear-1a2b3c4d -f --address http://127.0.0.1:8265
    """
    from rayapp.launch.jobs_api import connect, print_logs, stream_logs

    address = normalize_address(address)
    client = connect(address)
    if not follow:
        print_logs(client, submission_id, address)
        return
    try:
        stream_logs(client, submission_id, address)
    except KeyboardInterrupt:
        click.echo(f"\nstopped following; job {submission_id} is not affected (rayapp stop {submission_id} stops it)")
        sys.exit(EXIT_INTERRUPTED)


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id")
@_address_option
@click.option("--timeout", type=click.FloatRange(min=1), default=STOP_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the job to be STOPPED.")
@friendly_errors
def stop(submission_id: str, address: str, timeout: float) -> None:
    """Stop a submitted job and wait until it is STOPPED.

    The job's driver is interrupted (SIGINT, as Ctrl-C would), so it aborts training, closes its
    MLflow run and releases its workers; it is killed if it has not exited within 30 s.

    \b
    Examples:
      rayapp stop rayapp-seed_linear-1a2b3c4d
      rayapp stop rayapp-seed_linear-1a2b3c4d --address http://127.0.0.1:8265 --timeout 120
    """
    from rayapp.launch.jobs_api import TERMINAL_STATUSES, connect, job_info, stop_job

    address = normalize_address(address)
    client = connect(address)
    before = str(job_info(client, submission_id, address).status)
    if before in TERMINAL_STATUSES:
        click.echo(f"job {submission_id} already ended {before}; nothing to stop")
        return
    click.echo(f"stopping job {submission_id} ...")
    final = stop_job(client, submission_id, address, timeout_s=timeout)
    click.echo(f"job {submission_id} {final}")
