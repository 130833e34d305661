"""Options declared once. Spec overrides come from the one table in :mod:`rayapp.spec.overrides`;
options several commands share (the MLflow store, the experiment, the Jobs API address) are
declared here and applied by name, so each has one spelling and one help text."""

from __future__ import annotations

from collections.abc import Callable

import click

from rayapp.spec.overrides import BY_FLAG, OVERRIDES, Override


def _option(row: Override, **changes) -> Callable:
    if row.type is bool:  # --compile / --no-compile; unset keeps the job YAML's value
        settings = {"default": None, "help": row.full_help, **changes}
        return click.option(f"{row.flag}/--no-{row.flag[2:]}", row.dest, **settings)
    settings = {"type": row.type, "default": None, "help": row.full_help, **changes}
    return click.option(row.flag, row.dest, **settings)


def override_options(rows: tuple[Override, ...] = OVERRIDES) -> Callable:
    """Click options for spec overrides, one per row, in the table's order."""

    def decorate(command: Callable) -> Callable:
        for row in reversed(rows):
            command = _option(row)(command)
        return command

    return decorate


def shared_option(flag: str, **changes) -> Callable:
    """A spec override's option on a command that reads rather than runs jobs (runs, compare, ui):
    the same flag, type and help, with `changes` (a default, a help of its own)."""
    return _option(BY_FLAG[flag], **changes)


tracking_uri_option = shared_option("--tracking-uri")


def dashboard_address_option(command: Callable) -> Callable:
    """The Jobs API URL of `rayapp status/logs/stop` (submit's --address is a spec override)."""
    from rayapp.launch.jobs_api import DEFAULT_DASHBOARD_ADDRESS, default_address

    return click.option(
        "--address",
        default=default_address,
        show_default=f"$RAY_ADDRESS if it is http(s), else {DEFAULT_DASHBOARD_ADDRESS}",
        help="The cluster's Ray Jobs API (dashboard) URL.",
    )(command)


def schedule_timeout_option(command: Callable) -> Callable:
    return click.option(
        "--schedule-timeout",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="Seconds to wait for the cluster to have enough nodes (autoscaling) before failing.",
    )(command)
