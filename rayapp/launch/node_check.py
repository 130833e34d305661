"""Checks run on every node of a real cluster before training, so a setup that only works on the
driver's machine fails in one line instead of mid-run.

On a cluster named by address the nodes may be other machines: a local --storage-path (say
/tmp/ckpt) or a SQLite MLflow store is then a different, empty directory on each of them, and a
tracking URI such as http://127.0.0.1:5000 means each node itself. The driver writes a marker file
into every directory that must be shared and runs one small task pinned to each alive node
(Ray's NodeAffinitySchedulingStrategy), which reports whether it sees the markers, whether it
reaches the MLflow server, and which of the packages rayapp's workers import it has.

The task's module imports only the standard library at the top, so a node lacking torch or MLflow
still answers and says so. The embedded and warm clusters run on one machine and skip all this.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rayapp.errors import RayappError, cause_line

NODE_CHECK_TIMEOUT_S = 120.0
"""How long the nodes have to answer; a node's first task also unpacks the job's code there."""
MARKER_PREFIX = ".rayapp-shared-check-"
WORKER_PACKAGES = ("ray", "torch", "mlflow")
"""What rayapp's workers import besides rayapp itself (which travels with a Jobs API job)."""
OBJECT_STORE_HINT = "--storage-path s3://BUCKET/rayapp (or gs://BUCKET/rayapp)"


@dataclass(frozen=True)
class NodeReport:
    """What one node said about itself."""

    node_ip: str
    python: str
    executable: str
    packages: dict[str, str | None]
    """Version of each of WORKER_PACKAGES, None when the node's Python lacks it."""
    unseen: tuple[str, ...] = ()
    """The checked directories whose marker this node cannot see."""
    tracking: Any = None
    """The MLflow server's answer to this node (a ServerAnswer), None when not checked."""


@dataclass(frozen=True)
class NodeCheck:
    """What to check on every node."""

    markers: dict[str, str] = field(default_factory=dict)
    """directory -> the marker file's name written there by the driver."""
    tracking_uri: str | None = None
    """A tracking server's URI to reach from every node; None for none."""


def storage_directory(storage: str) -> str | None:
    """The directory a local (or file://) storage path names; None for an object store (s3://,
    gs://, ...), which every node reaches by itself."""
    if "://" not in storage:
        return storage
    return urlparse(storage).path if storage.startswith("file://") else None


def store_directory(tracking_uri: str) -> str | None:
    """The directory of a file-based MLflow store (sqlite:///..., file:..., a path); None for a
    tracking server."""
    scheme = urlparse(tracking_uri).scheme.lower()
    if scheme == "sqlite":
        return str(Path(tracking_uri.removeprefix("sqlite:///")).parent)
    if scheme == "file":
        return urlparse(tracking_uri).path
    return tracking_uri if scheme == "" or len(scheme) == 1 else None


def inspect_node(node_ip: str, check: NodeCheck, credentials: Mapping[str, str]) -> NodeReport:
    """Run on the node itself (a Ray task pinned there)."""
    import importlib.metadata
    import os
    import platform
    import sys

    packages: dict[str, str | None] = {}
    for name in WORKER_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    unseen = tuple(
        directory
        for directory, marker in check.markers.items()
        if not os.path.exists(os.path.join(directory, marker))
    )
    answer = None
    if check.tracking_uri:
        from rayapp.tracking.access import ask_server

        answer = ask_server(check.tracking_uri, credentials)
    return NodeReport(
        node_ip=node_ip,
        python=platform.python_version(),
        executable=sys.executable,
        packages=packages,
        unseen=unseen,
        tracking=answer,
    )


# ---- what the reports mean: one line, or None when all is well -----------------------------


def storage_problem(
    storage: str, directory: str, driver_ip: str, reports: list[NodeReport]
) -> str | None:
    blind = [report.node_ip for report in reports if directory in report.unseen]
    if not blind:
        return None
    return (
        f"--storage-path {storage!r} is not shared storage: node(s) {', '.join(blind)} cannot see "
        f"a file the driver on {driver_ip} wrote there, so their checkpoints would land on their "
        "own disks; use a directory every node mounts (NFS) or an object store: "
        f"{OBJECT_STORE_HINT}"
    )


def tracking_problem(
    tracking_uri: str, driver_ip: str, reports: list[NodeReport], credentials: Mapping[str, str]
) -> str | None:
    from rayapp.tracking.access import is_server_uri, refusal

    if not is_server_uri(tracking_uri):
        directory = store_directory(tracking_uri)
        blind = [r.node_ip for r in reports if directory is not None and directory in r.unseen]
        if not blind:
            return None
        return (
            f"the MLflow store {tracking_uri} is a file on {driver_ip} that node(s) "
            f"{', '.join(blind)} cannot see (rank 0 logs from its own node); pass --tracking-uri "
            "with an MLflow server at an address every node can reach (http://MLFLOW_HOST:5000)"
        )
    for report in reports:
        if report.tracking is None:
            continue
        problem = refusal(tracking_uri, report.tracking, credentials)
        if problem:
            return f"{problem} (asked from node {report.node_ip})"
    silent = [r for r in reports if r.tracking is not None and r.tracking.status is None]
    if not silent:
        return None
    where = ", ".join(f"{r.node_ip} ({r.tracking.failure})" for r in silent)
    host = urlparse(tracking_uri).hostname or ""
    loopback = (
        f"; {host} is each node itself, not this machine"
        if host in ("localhost", "::1") or host.startswith("127.")
        else ""
    )
    return (
        f"MLflow at {tracking_uri} cannot be reached from node(s) {where}{loopback}; pass "
        "--tracking-uri with an address every node can reach (the server's host name or IP on "
        "the cluster's network)"
    )


def packages_problem(driver: NodeReport, reports: list[NodeReport]) -> str | None:
    """A node without a package the workers import, or with a Python or Ray other than the
    driver's."""
    for report in reports:
        missing = [name for name, version in report.packages.items() if version is None]
        if missing:
            pins = " ".join(
                f"{name}=={driver.packages[name]}" if driver.packages.get(name) else name
                for name in missing
            )
            return (
                f"node {report.node_ip} ({report.executable}, Python {report.python}) lacks "
                f"{' and '.join(missing)}, which rayapp's workers import; install there: "
                f"pip install {pins} (the driver's versions)"
            )
        differs = [
            f"{name} {report_version} (driver: {driver_version})"
            for name, report_version, driver_version in (
                ("Python", _minor(report.python), _minor(driver.python)),
                ("Ray", report.packages.get("ray"), driver.packages.get("ray")),
            )
            if report_version != driver_version
        ]
        if differs:
            return (
                f"node {report.node_ip} ({report.executable}) runs {' and '.join(differs)}; "
                "install the same Python and Ray on every node"
            )
    return None


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# ---- the driver's side ---------------------------------------------------------------------


@contextlib.contextmanager
def markers_in(directories: list[str]) -> Iterator[dict[str, str]]:
    """A fresh marker file in each directory, removed afterwards."""
    name = f"{MARKER_PREFIX}{secrets.token_hex(6)}"
    written: dict[str, str] = {}
    try:
        for directory in directories:
            Path(directory).mkdir(parents=True, exist_ok=True)
            Path(directory, name).write_text("written by rayapp's driver before training\n")
            written[directory] = name
        yield written
    finally:
        for directory in written:
            with contextlib.suppress(OSError):
                Path(directory, name).unlink()


def check_nodes(storage: str, tracking_uri: str, *, credentials: Mapping[str, str]) -> None:
    """Raise RayappError with one line when a node cannot see the storage path or the MLflow
    store, cannot reach the MLflow server, or lacks what the workers import."""
    import ray

    from rayapp.tracking.access import is_server_uri

    driver_ip = ray.util.get_node_ip_address()
    storage_dir = storage_directory(storage)
    shared = [d for d in (storage_dir, store_directory(tracking_uri)) if d is not None]
    with markers_in(shared) as markers:
        check = NodeCheck(
            markers=markers, tracking_uri=tracking_uri if is_server_uri(tracking_uri) else None
        )
        reports = run_on_every_node(check, credentials)
    driver = inspect_node(driver_ip, NodeCheck(), {})
    for problem in (
        packages_problem(driver, reports),
        storage_problem(storage, storage_dir, driver_ip, reports) if storage_dir else None,
        tracking_problem(tracking_uri, driver_ip, reports, credentials),
    ):
        if problem:
            raise RayappError(problem)


def run_on_every_node(check: NodeCheck, credentials: Mapping[str, str]) -> list[NodeReport]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(inspect_node)
    pending = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        ref = task.options(scheduling_strategy=strategy).remote(
            node["NodeManagerAddress"], check, dict(credentials)
        )
        pending[ref] = node["NodeManagerAddress"]
    done, late = ray.wait(list(pending), num_returns=len(pending), timeout=NODE_CHECK_TIMEOUT_S)
    for ref in late:
        ray.cancel(ref, force=True)
    if late:
        raise RayappError(
            f"node(s) {', '.join(pending[ref] for ref in late)} did not run rayapp's check within "
            f"{NODE_CHECK_TIMEOUT_S:.0f} s (a Ray worker could not start there); see the node's "
            "logs in /tmp/ray/session_latest/logs"
        )
    reports = []
    for ref in done:
        try:
            reports.append(ray.get(ref))
        except Exception as exc:  # the job's environment failed to set up there, or the task died
            raise RayappError(
                f"node {pending[ref]} failed rayapp's check before training: {cause_line(exc)}"
            ) from None
    return sorted(reports, key=lambda report: report.node_ip)
