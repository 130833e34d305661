"""`rayapp hosts up|status|down`: isolated test hosts on this machine, to rehearse a `ray up`
cluster config (cluster_configs/onprem.yaml) before paying for machines."""

from __future__ import annotations

import click

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors
from rayapp.launch import testhosts


def _say(message: str) -> None:
    click.echo(f"rayapp: {message}")


@click.group(context_settings=CONTEXT_SETTINGS)
def hosts() -> None:
    """Isolated test hosts on this Linux machine, reachable over SSH like real machines (root only).

    Each host has its own network namespace on a bridge (198.18.0.2, .3, ...; this machine is
    198.18.0.1), its own /tmp, /dev/shm and home, an sshd that accepts a key made for the set,
    and /mnt/rayapp-shared shared by all (in place of NFS). This machine's Python environment is
    ~/rayapp-venv on every host, where onprem.yaml's setup finds Ray, torch and rayapp.

    \b
    Examples:
      sudo rayapp hosts up --count 3          # prints what to put in onprem.yaml
      ray up -y my-onprem.yaml && ray down -y my-onprem.yaml
      sudo rayapp hosts down
    """


@hosts.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--count",
    type=click.IntRange(min=1, max=testhosts.MAX_HOSTS),
    default=3,
    show_default=True,
    help="Hosts to make: the first is the head in the printed config, the rest workers.",
)
@friendly_errors
def up(count: int) -> None:
    """Make COUNT test hosts, replacing any made before, and print their addresses."""
    made = testhosts.up(count)
    head, workers = made.hosts[0], made.hosts[1:]
    _say(f"{count} test host(s) up; shared directory {made.shared_dir} on every host")
    for host in made.hosts:
        click.echo(
            f"  {host.address:<12}  ssh -i {made.key} {made.user}@{host.address}    "
            f"(a shell inside: nsenter -t {host.holder_pid} -m -n bash)"
        )
    click.echo("In cluster_configs/onprem.yaml (a copy), replace the CHANGE-ME values with:")
    click.echo(f"  head_ip: {head.address}")
    click.echo(f"  worker_ips: [{', '.join(host.address for host in workers)}]")
    click.echo(f"  ssh_user: {made.user}")
    click.echo(f"  ssh_private_key: {made.key}")
    click.echo("  MLflow: run `mlflow server` on a host (in its shell above) and name its address")
    click.echo("Remove them: rayapp hosts down")


@hosts.command(context_settings=CONTEXT_SETTINGS)
@friendly_errors
def status() -> None:
    """The test hosts that are up, and how many processes each runs."""
    made = testhosts.load()
    if made is None:
        _say("no test hosts are up (rayapp hosts up --count N makes them)")
        return
    for host in made.hosts:
        processes = host.processes()
        sshd = any("sshd" in command for command in processes.values())
        click.echo(
            f"  {host.address:<12}  {len(processes)} process(es), sshd {'up' if sshd else 'DOWN'}"
        )


@hosts.command(context_settings=CONTEXT_SETTINGS)
@friendly_errors
def down() -> None:
    """Remove every test host: its processes (Ray's included), namespaces, links and files."""
    testhosts.check_can_make_hosts()
    removed = testhosts.down()
    _say(f"removed {len(removed)} item(s)" if removed else "no test hosts were up")
