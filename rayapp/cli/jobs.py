"""Jobs submitted through the Ray Jobs API: the terminal side of `rayapp submit --address http://...`
(streaming the job's output, Ctrl-C's "stop or detach?") and `rayapp status`, `rayapp logs`,
`rayapp stop`.

They talk to the cluster's Ray Jobs API (the dashboard, port 8265), locally or through the SSH
tunnel `ray dashboard cluster_configs/<cloud>.yaml` opens, through :mod:`rayapp.launch.jobs_api`.
"""

from __future__ import annotations

import re
import sys
from datetime import datetime
from typing import Any

import click

from rayapp.cli.common import CONTEXT_SETTINGS, EXIT_INTERRUPTED, friendly_errors
from rayapp.cli.flags import dashboard_address_option
from rayapp.errors import first_line
from rayapp.launch.jobs_api import (
    STOP_TIMEOUT_S,
    TERMINAL_STATUSES,
    connect,
    job_info,
    job_logs,
    list_submissions,
    normalize_address,
    stop_job,
    stream_logs,
    wait_for_terminal,
)
from rayapp.spec import JobSpec

STATUS_COLOURS = {
    "SUCCEEDED": "green",
    "FAILED": "red",
    "STOPPED": "yellow",
    "RUNNING": "cyan",
    "PENDING": "blue",
}


def _when(ms: int | None, short: bool = False) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000).strftime(
        "%m-%d %H:%M:%S" if short else "%Y-%m-%d %H:%M:%S"
    )


def _duration(start_ms: int | None, end_ms: int | None) -> str:
    if not start_ms:
        return "-"
    seconds = ((end_ms or datetime.now().timestamp() * 1000) - start_ms) / 1000
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id", required=False)
@dashboard_address_option
@click.option(
    "-n", "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Jobs to list."
)
@friendly_errors
def status(submission_id: str | None, address: str, limit: int) -> None:
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

    address = normalize_address(address)
    client = connect(address)
    console = Console(highlight=False)
    if submission_id:
        info = job_info(client, submission_id, address)
        state = str(info.status)
        console.print(
            f"job [bold]{submission_id}[/bold]: [{STATUS_COLOURS.get(state, 'white')}]{state}[/]"
        )
        if info.message:
            console.print(f"  message:    {first_line(info.message)}", markup=False)
        console.print(
            f"  started:    {_when(info.start_time)}   ended: {_when(info.end_time)}   "
            f"({_duration(info.start_time, info.end_time)})"
        )
        console.print(f"  entrypoint: {info.entrypoint}", markup=False)
        if state in ("PENDING", "RUNNING"):
            console.print(
                f"  follow:     rayapp logs {submission_id} -f --address {address}", markup=False
            )
        return
    jobs = list_submissions(client, address)[:limit]
    if not jobs:
        console.print(f"no jobs submitted to {address} yet")
        return
    if not console.is_terminal:  # piped into grep or a file: one whole line per job
        console = Console(highlight=False, width=max(console.width, 200))
    table = Table(title=f"jobs on {address}", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column(
        "submission id", no_wrap=True, min_width=max(len(job.submission_id) for job in jobs)
    )
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


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id")
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep streaming until the job ends (Ctrl-C stops following, not the job).",
)
@dashboard_address_option
@friendly_errors
def logs(submission_id: str, follow: bool, address: str) -> None:
    """Output of a submitted job (its driver: status lines and one line per epoch).

    \b
    Examples:
      rayapp logs rayapp-seed_linear-1a2b3c4d
      rayapp logs rayapp-seed_linear-1a2b3c4d -f --address http://127.0.0.1:8265
    """
    address = normalize_address(address)
    client = connect(address)
    if not follow:
        _write(job_logs(client, submission_id, address))
        return
    try:
        stream_logs(client, submission_id, address, _write)
    except KeyboardInterrupt:
        click.echo(
            f"\nstopped following; job {submission_id} is not "
            f"affected (rayapp stop {submission_id} stops it)"
        )
        sys.exit(EXIT_INTERRUPTED)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("submission_id")
@dashboard_address_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=STOP_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait for the job to be STOPPED.",
)
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
    address = normalize_address(address)
    client = connect(address)
    before = str(job_info(client, submission_id, address).status)
    if before in TERMINAL_STATUSES:
        click.echo(f"job {submission_id} already ended {before}; nothing to stop")
        return
    click.echo(f"stopping job {submission_id} ...")
    final = stop_job(client, submission_id, address, timeout_s=timeout)
    click.echo(f"job {submission_id} {final}")


# ---- a submission through the Jobs API, followed from this terminal ---------------------


def submit_remote(
    spec: JobSpec, *, job_yaml: str | None, detach: bool, schedule_timeout_s: float
) -> int:
    """Submit `spec` to the Jobs API at spec.cluster.address, then follow it; returns the exit
    code."""
    from rayapp.launch import remote_job

    try:
        submission = remote_job.submit(
            spec, job_yaml=job_yaml, schedule_timeout_s=schedule_timeout_s
        )
    except KeyboardInterrupt:
        click.secho(
            "rayapp: error: interrupted while submitting; the job may have been submitted: "
            f"rayapp status --address {spec.cluster.address}",
            err=True,
            fg="red",
        )
        return EXIT_INTERRUPTED
    submission_id, address = submission.submission_id, submission.address
    click.secho(f"submitted {submission_id} to {address}", bold=True)
    click.echo(
        f"  job {spec.name!r}: {spec.world_size} worker(s) on {spec.cluster.nodes} node(s); "
        f"MLflow: {submission.tracking_uri}"
    )
    if submission.code_from:
        click.echo(f"  code: {submission.code_from} went with the job")
    if "://" not in spec.cluster.storage_path:
        click.echo(
            f"  note: checkpoints go to {spec.cluster.storage_path!r} on the cluster's nodes; on "
            "a multi-machine cluster pass shared storage, e.g. --storage-path s3://BUCKET/rayapp"
        )
    print_follow_commands(submission_id, address)
    if detach:
        return 0
    return follow(submission.client, submission_id, address)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_follow_commands(submission_id: str, address: str) -> None:
    click.echo(f"  status: rayapp status {submission_id} --address {address}")
    click.echo(f"  logs:   rayapp logs {submission_id} -f --address {address}")
    click.echo(f"  stop:   rayapp stop {submission_id} --address {address}")


def follow(client: Any, submission_id: str, address: str) -> int:
    """Stream the job's logs until it ends; 0 if it SUCCEEDED, else 1. Ctrl-C asks: stop or
    detach."""
    click.echo("streaming the job's output (Ctrl-C to stop or detach):")
    try:
        stream_logs(client, submission_id, address, _write)
        info = wait_for_terminal(client, submission_id, address, timeout_s=60.0)
    except KeyboardInterrupt:
        return on_interrupt(client, submission_id, address)
    status = str(info.status)
    if status == "SUCCEEDED":
        click.secho(f"job {submission_id} SUCCEEDED", fg="green")
        return 0
    if status not in TERMINAL_STATUSES:
        click.secho(
            f"rayapp: error: the log stream ended while job {submission_id} is still {status}; "
            f"follow it with rayapp logs {submission_id} -f --address {address}",
            err=True,
            fg="red",
        )
        return 1
    # Ray appends the driver's last output to the message; it has just been streamed above.
    message = re.sub(r",? *last available logs.*$", "", first_line(info.message or "")).rstrip(" :")
    detail = f": {message}" if message else ""
    click.secho(f"rayapp: error: job {submission_id} ended {status}{detail}", err=True, fg="red")
    return 1


def on_interrupt(client: Any, submission_id: str, address: str) -> int:
    """Ctrl-C while following a job: stop it, or leave it running (the default)."""
    click.echo("")
    if not sys.stdin.isatty():
        click.echo(
            "interrupted; no terminal to ask whether to stop it, "
            f"so job {submission_id} keeps running (detached)"
        )
        print_follow_commands(submission_id, address)
        return 0
    try:
        choice = click.prompt(
            f"interrupted: stop job {submission_id}, or detach and leave it running?",
            type=click.Choice(["detach", "stop"]),
            default="detach",
        )
    except (click.Abort, KeyboardInterrupt, EOFError):
        choice = "detach"
    if choice == "detach":
        click.echo(f"detached; job {submission_id} keeps running")
        print_follow_commands(submission_id, address)
        return 0
    click.echo(f"stopping job {submission_id} ...")
    try:
        status = stop_job(client, submission_id, address, timeout_s=STOP_TIMEOUT_S)
    except KeyboardInterrupt:
        click.echo(
            "not waiting; check that it stopped with rayapp "
            f"status {submission_id} --address {address}"
        )
        return EXIT_INTERRUPTED
    click.echo(f"job {submission_id} {status}")
    return EXIT_INTERRUPTED
