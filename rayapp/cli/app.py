"""The `rayapp` command group. Each command lives in the module of its stage; this one gathers
them."""

from __future__ import annotations

import click

from rayapp.cli import cluster, doctor, hosts, jobs, runs, schema, submit, tune
from rayapp.cli.common import CONTEXT_SETTINGS


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
      rayapp cluster up --nodes 2                          # a warm cluster later jobs reuse
    """


for command in (
    submit.submit,
    submit.bench,
    tune.tune,
    runs.runs,
    runs.compare,
    runs.ui,
    runs.import_metrics,
    jobs.status,
    jobs.logs,
    jobs.stop,
    cluster.cluster,
    schema.schema,
    hosts.hosts,
    doctor.doctor,
):
    main.add_command(command)
