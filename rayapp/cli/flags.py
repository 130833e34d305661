"""Options declared once. Spec overrides come from the spec's fields through the table in
:mod:`rayapp.spec.overrides`; options several commands share (the MLflow store, the experiment,
the Jobs API address) are declared here and applied by name, so each has one spelling and one
help text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from rayapp.spec.overrides import BY_FLAG, OVERRIDES, Override


class SpecValue(click.ParamType):
    """A spec field's value on the command line: text read as the field's type where it can be,
    else passed on as given, so that the spec rejects it with the same one line, naming the field
    and what it accepts, as a bad value in a job file (``--epochs ten``, ``--nodes 1:2`` is a
    range the spec reads)."""

    def __init__(self, read: Callable[[str], Any], name: str) -> None:
        self.read = read
        self.name = name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self.read(value) if isinstance(value, str) else value
        except ValueError:
            return value


class SpecChoice(click.Choice):
    """A ``Literal`` field's values, listed in help and offered by shell completion; any other
    value goes on to the spec, which names the field and its choices in one line."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value


def _type(row: Override) -> click.ParamType:
    if row.choices:
        return SpecChoice(row.choices)
    if row.type in (int, float):
        return SpecValue(row.type, "integer" if row.type is int else "float")
    return click.STRING


def _option(row: Override, **changes: Any) -> Callable[[Any], Any]:
    if row.type is bool:  # --compile / --no-compile; unset keeps the job YAML's value
        settings = {"default": None, "help": row.full_help, **changes}
        return click.option(f"{row.flag}/--no-{row.flag[2:]}", row.dest, **settings)
    settings = {
        "type": _type(row),
        "default": None,
        "help": row.full_help,
        # a command that reads the flag as a type of its own (cluster up --nodes) shows that type
        "metavar": None if "type" in changes else row.metavar,
        **changes,
    }
    return click.option(row.flag, row.dest, **settings)


def override_options(rows: tuple[Override, ...] = OVERRIDES) -> Callable[[Any], Any]:
    """Click options for spec overrides, one per row, in the table's order."""

    def decorate(command: Any) -> Any:
        for row in reversed(rows):
            command = _option(row)(command)
        return command

    return decorate


def shared_option(flag: str, **changes: Any) -> Callable[[Any], Any]:
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
