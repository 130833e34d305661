"""`rayapp doctor`: check the cluster's nodes and the links between them, as tables."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rayapp.cli.common import CONTEXT_SETTINGS, friendly_errors, quiet_library_logs
from rayapp.cli.flags import override_options
from rayapp.spec import SpecError
from rayapp.spec.overrides import rows

if TYPE_CHECKING:
    from rayapp.launch.doctor import Diagnosis, NodeFacts

DOCTOR_FLAGS = ("--nodes", "--address", "--storage-path", "--tracking-uri")


@click.command(context_settings=CONTEXT_SETTINGS)
@override_options(rows(*DOCTOR_FLAGS))
@click.option(
    "--quick",
    is_flag=True,
    help="Only the per-node checks (what `submit --preflight` runs), no pairwise all-reduce.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show Ray's logs.")
@friendly_errors
def doctor(quick: bool, verbose: bool, **flags: Any) -> None:
    """Check every node of the cluster and every pair of nodes before training.

    Per node: Python, Ray, torch, CUDA and NCCL versions, GPUs, free space on the storage path,
    and whether the storage path and the MLflow store are reachable from it. Per pair of nodes:
    an all-reduce (Gloo; NCCL on GPUs) with its latency and bandwidth. A pair or node far below
    the others is flagged; a failed check exits 1. With no --address, an embedded cluster of
    --nodes nodes (default 2) starts on this machine and stops at the end.

    \b
    Examples:
      rayapp doctor --nodes 2                       # embedded 2-node cluster on this machine
      rayapp doctor --address HEAD:6379 --storage-path /mnt/nfs/rayapp \\
        --tracking-uri http://MLFLOW:5000
      rayapp doctor --quick --address HEAD:6379     # the node checks only
    """
    from rayapp.cli.submit import spec_from_flags
    from rayapp.driver.session import ray_cluster
    from rayapp.driver.trainer import storage_path
    from rayapp.launch.doctor import diagnose
    from rayapp.tracking.run import credentials_from_env, resolve_tracking_uri
    from rayapp.train.socket_ifname import pin_socket_interfaces

    if flags.get("nodes") is None:
        flags["nodes"] = 2
    spec = spec_from_flags(None, flags)
    if spec.cluster.address and spec.cluster.address.startswith(("http://", "https://")):
        raise SpecError(
            f"--address: {spec.cluster.address!r} is a Jobs API URL; doctor connects to the "
            "cluster itself: give HEAD:6379 (the head's Ray port) or auto"
        )
    if not verbose:
        quiet_library_logs()
    console = Console(highlight=False)

    def status(message: str) -> None:
        console.print(f"[dim]rayapp:[/dim] {message}")

    with ray_cluster(spec, verbose=verbose, status=status):
        diagnosis = diagnose(
            storage_path(spec.cluster.storage_path),
            resolve_tracking_uri(spec.tracking.tracking_uri),
            credentials=credentials_from_env(),
            pairs=not quick,
            on_status=status,
            # Gloo/NCCL on the interface holding each node's Ray address, as in training.
            prepare_rank=pin_socket_interfaces,
        )
    console.print(nodes_table(diagnosis))
    if diagnosis.pairs:
        console.print(pairs_table(diagnosis))
    for problem in diagnosis.problems:
        console.print(f"[red]problem:[/red] {escape(problem)}")
    for pair in diagnosis.pairs:
        if pair.error:
            console.print(
                f"[red]failed:[/red] all-reduce {' - '.join(pair.nodes)}: {escape(pair.error)}"
            )
    for node in sorted(diagnosis.slow_nodes):
        console.print(f"[yellow]slow node:[/yellow] {node}: every pair with it is far below")
    if diagnosis.failed:
        sys.exit(1)
    console.print("[green]healthy[/green]" + (" (flags above)" if diagnosis.slow_pairs else ""))


def _size(count: int | None) -> str:
    return "-" if count is None else f"{count / 2**30:,.1f} GiB"


def _reach(facts: NodeFacts, directory: str | None) -> str:
    if directory is None:
        return "object store"
    return "[red]no[/red]" if directory in facts.report.unseen else "yes"


def nodes_table(diagnosis: Diagnosis) -> Table:
    table = Table(title=f"{len(diagnosis.nodes)} node(s)")
    for column in (
        "node",
        "Python",
        "Ray",
        "torch",
        "CUDA",
        "NCCL",
        "GPUs",
        "free on storage",
        "storage",
        "MLflow",
    ):
        table.add_column(column, justify="right" if column == "free on storage" else "left")
    for facts in diagnosis.nodes:
        packages = facts.report.packages
        answer = facts.report.tracking
        if answer is not None:  # a tracking server: what it answered this node
            failure = escape(str(answer.failure))
            mlflow = f"HTTP {answer.status}" if answer.status else f"[red]no: {failure}[/red]"
        else:  # a file store: whether this node sees the driver's marker beside it
            mlflow = _reach(facts, diagnosis.store_dir).replace("object store", "-")
        gpus = ", ".join(facts.gpus) if facts.gpus else "-"
        table.add_row(
            facts.ip + (" [yellow](slow)[/yellow]" if facts.ip in diagnosis.slow_nodes else ""),
            facts.report.python,
            packages.get("ray") or "[red]missing[/red]",
            packages.get("torch") or "[red]missing[/red]",
            facts.cuda or "-",
            facts.nccl or "-",
            gpus,
            _size(facts.free_bytes),
            _reach(facts, diagnosis.storage_dir),
            mlflow,
        )
    return table


def pairs_table(diagnosis: Diagnosis) -> Table:
    table = Table(
        title=f"all-reduce between each pair of nodes ({diagnosis.pairs[0].backend})",
        caption="latency: median of one-number all-reduces; bandwidth: 16 MiB all-reduces",
    )
    for column in ("pair", "latency ms", "bandwidth MB/s", ""):
        table.add_column(column, justify="left" if column in ("pair", "") else "right")
    for pair in diagnosis.pairs:
        name = " - ".join(pair.nodes)
        if pair.error is not None:
            # Errors quote Gloo's and NCCL's sources ("[/…/gloo/transport/tcp/pair.cc:152]"),
            # which rich would read as markup.
            table.add_row(name, "-", "-", f"[red]failed: {escape(pair.error)}[/red]")
            continue
        flag = (
            "[yellow]slow: far below the others[/yellow]"
            if pair.nodes in diagnosis.slow_pairs
            else "ok"
        )
        table.add_row(
            name,
            f"{(pair.latency_s or 0) * 1e3:.3f}",
            f"{(pair.bandwidth_bytes_s or 0) / 1e6:,.0f}",
            flag,
        )
    return table
