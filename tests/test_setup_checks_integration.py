"""Wrong setups of a real cluster, each one line before training: a real `mlflow server` that
refuses the Host header, a head address nothing answers at (a loopback port nobody listens on, and
an unassigned address in 198.18.0.0/24 inside a network namespace of the test's own, so no packet
leaves it), and the per-node checks run on a real multi-node Ray cluster."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOBS, MlflowServer, connect, run_rayapp

from rayapp.errors import RayappError
from rayapp.launch.cluster import EmbeddedCluster, free_port, node_ip
from rayapp.launch.jobs_api import REACH_TIMEOUT_S
from rayapp.launch.node_check import MARKER_PREFIX, NodeCheck, check_nodes, run_on_every_node

pytestmark = pytest.mark.integration

UNASSIGNED = "198.18.0.254"
"""In the benchmark-testing range; the namespace below holds 198.18.0.1/24 and no other address."""


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayapp: error: "), (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


def test_a_server_refusing_the_host_header_names_allowed_hosts(tmp_path):
    """MLflow 3 answers a Host outside --allowed-hosts with HTTP 403: not a credentials problem."""
    server = MlflowServer(tmp_path, extra_args=("--allowed-hosts", "mlflow.internal:5000"))
    server.start()
    try:
        result = run_rayapp(
            "submit",
            "--nodes",
            "1",
            "--epochs",
            "1",
            "--tracking-uri",
            server.uri,
            str(JOBS / "seed_linear.yaml"),
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        server.stop()
    assert result.returncode == 1
    line = one_error_line(result)
    host = server.uri.removeprefix("http://")
    assert f"refused the Host header '{host}' (HTTP 403: Invalid Host header" in line
    assert f"mlflow server --allowed-hosts {host}" in line
    assert "credentials" not in line and "MLFLOW_TRACKING_USERNAME" not in line
    assert "starting embedded" not in result.stdout  # refused before any cluster started


def test_a_head_nothing_listens_at_is_one_line(tmp_path):
    started = time.monotonic()
    result = run_rayapp(
        "submit",
        "--address",
        f"http://127.0.0.1:{free_port()}",
        "--tracking-uri",
        "http://127.0.0.1:5000",
        str(JOBS / "seed_linear.yaml"),
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 1
    assert "nothing answers there" in one_error_line(result)
    assert time.monotonic() - started < 30


@contextlib.contextmanager
def isolated_namespace():
    """A network namespace of the test's own whose one link is a veth pair with both ends inside
    it: 198.18.0.1/24 on one end, nothing on the other. 198.18.0.254 is pinned to a hardware
    address no interface has, so the connection attempts leave the first end and vanish unanswered
    (as behind a firewall that drops them); the namespace has no route anywhere else."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    name = f"rayapp-check-{secrets.token_hex(3)}"

    def ip(*args: str) -> str:
        return subprocess.run(
            ["ip", *args], check=True, capture_output=True, text=True, timeout=10
        ).stdout

    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
    try:
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "add", "check0", "type", "veth", "peer", "name", "check1")
        ip("-n", name, "addr", "add", "198.18.0.1/24", "dev", "check0")
        ip("-n", name, "link", "set", "check0", "up")
        ip("-n", name, "link", "set", "check1", "up")
        ip("-n", name, "neigh", "add", UNASSIGNED, "lladdr", "02:00:00:00:00:fe", "dev", "check0")
        routes = ip("-n", name, "route", "show")
        assert "default" not in routes and routes.strip().startswith("198.18.0.0/24"), routes
        yield name, ip
    finally:
        # Deleting the namespace deletes the veth pair inside it.
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)


def test_an_unassigned_head_address_times_out_in_seconds(tmp_path):
    with isolated_namespace() as (namespace, ip):
        started = time.monotonic()
        result = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                "-m",
                "rayapp",
                "submit",
                "--address",
                f"http://{UNASSIGNED}:8265",
                "--tracking-uri",
                "http://198.18.0.1:5000",
                str(JOBS / "seed_linear.yaml"),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
        )
        elapsed = time.monotonic() - started
        sent = ip("-n", namespace, "-s", "link", "show", "check0")
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"no answer from http://{UNASSIGNED}:8265 within {REACH_TIMEOUT_S:g} s" in line, line
    assert REACH_TIMEOUT_S <= elapsed < REACH_TIMEOUT_S + 30, elapsed
    # The connection attempts left by the namespace's one addressed interface, and nowhere else.
    tx_packets = int(sent.split("TX:")[1].split("\n")[1].split()[1])
    assert tx_packets > 0, sent


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import ray

    cluster = EmbeddedCluster(
        nodes=2, cpus_per_node=1, log_dir=tmp_path_factory.mktemp("check-logs")
    )
    cluster.start()
    try:
        connect(cluster)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


def test_every_node_reports_and_a_shared_path_passes(two_nodes, tmp_path):
    """On one machine every node sees the driver's files: the check passes, and leaves nothing."""
    storage = tmp_path / "checkpoints"
    store = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    server = MlflowServer(tmp_path)
    server.start()
    try:
        check_nodes(str(storage), store, credentials={})
        check_nodes(str(storage), server.uri, credentials={})
        reports = run_on_every_node(NodeCheck(tracking_uri=server.uri), {})
    finally:
        server.stop()
    assert [r.node_ip for r in reports] == [node_ip(0), node_ip(1)], reports
    assert all(r.tracking.status == 200 and r.packages["torch"] for r in reports), reports
    assert not list(storage.glob(f"{MARKER_PREFIX}*"))
    assert not list((tmp_path / "mlflow").glob(f"{MARKER_PREFIX}*"))


def test_a_tracking_server_no_node_reaches_fails_naming_each(two_nodes, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RayappError) as failure:
        check_nodes(str(tmp_path / "checkpoints"), uri, credentials={})
    line = str(failure.value)
    assert f"MLflow at {uri} cannot be reached from node(s)" in line
    for index in (0, 1):
        assert f"{node_ip(index)} (connection refused)" in line
    assert "every node can reach" in line and "\n" not in line


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python with the standard library only, as on a head node where nothing was installed."""
    directory = tmp_path_factory.mktemp("bare-venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=60
    )
    return directory / "bin" / "python"


def job_entry_on(python: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The job's entrypoint as Ray runs it on the head: rayapp importable only from the shipped
    copy (runtime_env py_modules puts its parent on PYTHONPATH)."""
    from rayapp.launch.remote_job import rayapp_package_copy

    shipped = Path(rayapp_package_copy(tmp_path)).parent
    (tmp_path / "job.yaml").write_text("name: seed_linear\n")
    return subprocess.run(
        [str(python), "-m", "rayapp.cli.job_entry", "submit", "job.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(shipped), **env},
    )


def test_a_head_without_ray_says_what_to_install(bare_python, tmp_path):
    from rayapp.launch.versions import SUBMITTED_WITH_ENV, this_environment

    laptop = this_environment()
    result = job_entry_on(bare_python, tmp_path, {SUBMITTED_WITH_ENV: json.dumps(laptop)})
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"({bare_python}) runs Python {laptop['python']} with Ray (none)" in line, line
    assert f"pip install 'ray[default,train]=={laptop['ray']}'" in line


def test_a_head_lacking_a_module_rayapp_imports_names_it(bare_python, tmp_path):
    result = job_entry_on(bare_python, tmp_path, {})
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"({bare_python}) has no module 'click', which rayapp imports" in line, line
    assert "pip install click" in line
