"""`rayapp cluster up|status|down`: a warm embedded cluster that later submits and benches reuse."""

from __future__ import annotations

import os

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors
from rayapp.cli.flags import shared_option

_ENVIRONMENT_AT_START = dict(os.environ)
"""The user's environment, before connecting to Ray adds its auth settings to os.environ: the
preloaded driver serves commands whose environment matches the one it was started in."""


def _say(message: str) -> None:
    click.echo(f"rayapp: {message}")


@click.group(context_settings=CONTEXT_SETTINGS)
def cluster() -> None:
    """A warm embedded Ray cluster on this machine, kept running between jobs.

    `rayapp submit` and `rayapp bench` with no --address use it while it runs, instead of
    starting (and stopping) a cluster of their own: seconds saved on every job.

    \b
    Examples:
      rayapp cluster up --nodes 2
      rayapp submit --nodes 2 jobs/seed_linear.yaml     # says "using the warm cluster"
      rayapp cluster status
      rayapp cluster down
    """


@cluster.command(context_settings=CONTEXT_SETTINGS)
@shared_option(
    "--nodes",
    type=int,
    default=2,
    show_default=True,
    help="Nodes to start: one raylet each, on 127.0.0.2, 127.0.0.3, ...",
)
@click.option(
    "--cpus-per-node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="CPUs each node offers to training workers.",
)
@click.option(
    "--preloaded-driver/--no-preloaded-driver",
    default=True,
    show_default=True,
    help="Keep a process with torch, Ray Train and MLflow imported for submits and benches to "
    "start in (about 0.5 GiB; saves their imports, 3.5 s of each command on 2 cores).",
)
@friendly_errors
def up(nodes: int, cpus_per_node: int, preloaded_driver: bool) -> None:
    """Start the warm cluster (exit 1 if one runs already)."""
    from rayapp.driver.trainer import local_gpus
    from rayapp.launch import warm
    from rayapp.spec import SpecError

    if nodes < 1:
        raise SpecError(f"--nodes: {nodes} is not accepted; use a whole number >= 1")
    record = warm.up(nodes, cpus_per_node, gpus_per_node=local_gpus() // nodes, status=_say)
    _say(f"warm cluster up: {record.describe()}")
    if preloaded_driver:
        _start_preloaded_driver(record)
    _say(f"record: {warm.state_file()}; stop it with `rayapp cluster down`")


def _start_preloaded_driver(record) -> None:
    """The server that later submits and benches start in, with torch, Ray Train and MLflow
    already imported (rayapp.cli.preloaded). The cluster is of use without it: a failure is said."""
    from rayapp.cli import preloaded
    from rayapp.launch import warm
    from rayapp.launch.cluster import start_time

    socket_path = warm.driver_socket()
    log_path = warm.driver_log(record)
    _say("starting the preloaded driver (torch, Ray Train, MLflow imported once for every submit)")
    pid = preloaded.start(socket_path, log_path, env=_ENVIRONMENT_AT_START)
    if preloaded.wait_ready(socket_path, pid):
        warm.attach_driver(record, pid)
        _say(f"preloaded driver ready: process {pid} (log: {log_path})")
    else:
        warm.stop_driver({pid: start_time(pid) or ""})
        _say(f"the preloaded driver did not start (see {log_path}); submits will start their own")


@cluster.command(context_settings=CONTEXT_SETTINGS)
@friendly_errors
def status() -> None:
    """Whether the warm cluster runs, and where."""
    from rayapp.launch import warm

    record = warm.find(status=_say)
    if record is None:
        _say("no warm cluster is running; `rayapp cluster up` starts one")
        return
    _say(f"warm cluster: {record.describe()}")
    _say(f"node processes: {', '.join(str(pid) for pid in record.leaders)}; logs: {record.log_dir}")
    if warm.preloaded_driver_socket() is not None:
        _say(
            f"preloaded driver: process {', '.join(str(pid) for pid in record.driver)}, "
            f"socket {warm.driver_socket()}"
        )
    else:
        _say("preloaded driver: not running (submits start their own)")


@cluster.command(context_settings=CONTEXT_SETTINGS)
@friendly_errors
def down() -> None:
    """Stop the warm cluster (exit 0 when none runs)."""
    from rayapp.launch import warm

    record = warm.down(status=_say)
    if record is None:
        _say("no warm cluster is running; nothing to stop")
        return
    _say("warm cluster stopped")
