"""`rayapp schema`: the JSON Schema of a job file, for editors."""

from __future__ import annotations

import json

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors


@click.command(context_settings=CONTEXT_SETTINGS)
@friendly_errors
def schema() -> None:
    """Print the JSON Schema of a job YAML: every key, its type, range, choices and default.

    Editors with a YAML language server check and complete job files against it.

    \b
    Example:
      rayapp schema > rayapp-job.schema.json
      # then, as the first line of a job file:
      # yaml-language-server: $schema=rayapp-job.schema.json
    """
    from rayapp.spec.loader import job_schema

    click.echo(json.dumps(job_schema(), indent=2))
