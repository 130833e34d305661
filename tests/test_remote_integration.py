"""`rayapp submit --address http://...` end to end: a real Ray cluster with its dashboard (Jobs
API), Ray token authentication on, two raylets, and a real `mlflow server` the job's driver logs to.

The cluster and the server are started once for the module; the tests run in file order
(the status/logs test reads the job the submit test ran).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import JOBS, LEAN_MLFLOW_SERVER_ENV

from rayapp.launch.cluster import EmbeddedCluster, free_port
from rayapp.tracking.run import TAG_NODE_IDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 180
JOB_TIMEOUT_S = 420
SUBMISSION_ID = re.compile(r"submitted (rayapp-\S+) to ")

# What one test leaves for the next (pytest runs a module's tests in file order).
STATE: dict[str, str] = {}


def _get(url: str, token: str | None = None, timeout: float = 5) -> tuple[int, str]:
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def _wait_until(what: str, predicate, timeout: float, on_timeout=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"{what} not within {timeout:.0f}s {on_timeout()}")


def _alive_nodes(dashboard_url: str, token: str) -> int:
    code, body = _get(f"{dashboard_url}/api/v0/nodes?limit=100", token)
    if code != 200:
        return 0
    try:
        nodes = json.loads(body)["data"]["result"]["result"]
    except (ValueError, KeyError, TypeError):
        return 0
    return sum(1 for node in nodes if node.get("state") == "ALIVE")


def _stop_running_jobs(dashboard_url: str) -> None:
    """A job's driver runs in a session of its own, outside the nodes' sessions: stop it through
    the Jobs API before the cluster goes, so that no driver outlives the test."""
    from ray.job_submission import JobSubmissionClient

    with contextlib.suppress(Exception):
        client = JobSubmissionClient(dashboard_url)
        running = [
            job.submission_id
            for job in client.list_jobs()
            if job.submission_id and str(job.status) in ("PENDING", "RUNNING")
        ]
        for submission_id in running:
            client.stop_job(submission_id)
        _wait_until(
            "running jobs to stop",
            lambda: all(
                str(client.get_job_status(submission_id)) not in ("PENDING", "RUNNING")
                for submission_id in running
            ),
            60,
        )


@contextlib.contextmanager
def _mlflow_server(directory: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(directory / "mlflow-server.log", "w")
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{directory / 'mlflow.db'}",
        "--artifacts-destination",
        str(directory / "artifacts"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(LEAN_MLFLOW_SERVER_ENV)
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    log.close()
    try:
        yield url, process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(dashboard URL, MLflow server URL, cluster): a 2-node token-authenticated cluster and a
    tracking server."""
    directory = tmp_path_factory.mktemp("remote")
    saved_env = dict(os.environ)
    # The job's entrypoint runs `python` on the head node: this interpreter, as on a real cluster
    # where Ray was started from the environment rayapp is installed in.
    os.environ["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )
    cluster = EmbeddedCluster(
        nodes=2, cpus_per_node=1, include_dashboard=True, log_dir=directory / "ray-logs"
    )
    try:
        with _mlflow_server(directory) as (mlflow_url, mlflow_process):
            cluster.start()
            # Subprocesses (the CLI) and this process's Jobs client present the cluster's token.
            cluster.prepare_client()
            token = cluster.auth_env["RAY_AUTH_TOKEN"]
            _wait_until(
                "the dashboard with 2 alive nodes",
                lambda: _alive_nodes(cluster.dashboard_url, token) >= 2,
                START_TIMEOUT_S,
                lambda: f"(Ray logs in {cluster.log_dir})",
            )
            _wait_until(
                "the Jobs API",
                lambda: _get(f"{cluster.dashboard_url}/api/jobs/", token)[0] == 200,
                START_TIMEOUT_S,
            )
            _wait_until(
                "mlflow server /health",
                lambda: mlflow_process.poll() is None and _get(f"{mlflow_url}/health")[0] == 200,
                START_TIMEOUT_S,
                lambda: (directory / "mlflow-server.log").read_text()[-2000:],
            )
            try:
                yield cluster.dashboard_url, mlflow_url, cluster
            finally:
                _stop_running_jobs(cluster.dashboard_url)
    finally:
        cluster.stop()
        os.environ.clear()
        os.environ.update(saved_env)


def rayapp(
    *args: str,
    timeout: float = 120,
    env: dict | None = None,
    drop: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and k not in drop}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rayapp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def output(result: subprocess.CompletedProcess) -> str:
    return (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
        f"--- stderr\n{result.stderr[-4000:]}"
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayapp: error: "), output(result)
    return lines[0]


def mlflow_runs(mlflow_url: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_url)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"experiment {experiment!r} is not on the server"
    return client.search_runs([found.experiment_id])


@pytest.mark.parametrize("job", ["seed_linear", "mlp_synthetic", "digits_mlp"])
def test_the_cluster_runs_the_resolved_spec(job):
    """What the job's driver loads is the spec resolved here, flags included, pointed at its own
    cluster."""
    import dataclasses

    from rayapp.launch.remote_job import remote_job_yaml
    from rayapp.spec.loader import build_spec, load_spec, parse_job_yaml

    here = load_spec(
        JOBS / f"{job}.yaml",
        {
            "cluster.nodes": 2,
            "train.epochs": 3,
            "cluster.address": "http://h:8265",
            "tracking.tracking_uri": "http://mlflow:5000",
        },
    )
    there = build_spec(parse_job_yaml(remote_job_yaml(here, "http://mlflow:5000")))
    assert there.cluster.address == "auto"
    assert there == dataclasses.replace(
        here, cluster=dataclasses.replace(here.cluster, address="auto")
    )


def test_local_tracking_store_is_refused(tmp_path):
    """A SQLite store on the laptop is unreachable from a cluster: refused before anything is
    submitted."""
    refused = rayapp(
        "submit",
        "--address",
        "http://127.0.0.1:8265",
        "--tracking-uri",
        "sqlite:///mlflow.db",
        str(JOBS / "seed_linear.yaml"),
        cwd=tmp_path,
    )
    assert refused.returncode == 1, output(refused)
    line = one_error_line(refused)
    assert "sqlite:///" in line and "--tracking-uri http://" in line

    default = rayapp(
        "submit", "--address", "http://127.0.0.1:8265", str(JOBS / "seed_linear.yaml"), cwd=tmp_path
    )
    assert default.returncode == 1, output(default)
    assert "default MLflow store" in one_error_line(default)


def test_submit_streams_and_logs_to_the_tracking_server(stack, tmp_path):
    dashboard_url, mlflow_url, _ = stack
    result = rayapp(
        "submit",
        "--address",
        dashboard_url,
        "--nodes",
        "2",
        "--epochs",
        "2",
        "--tracking-uri",
        mlflow_url,
        str(JOBS / "seed_linear.yaml"),
        timeout=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert result.returncode == 0, output(result)
    match = SUBMISSION_ID.search(result.stdout)
    assert match, output(result)
    STATE["job"] = match.group(1)
    # The commands to follow it, then the job's own output streamed back, then the verdict.
    for command in ("rayapp status ", "rayapp logs ", "rayapp stop "):
        assert f"{command}{STATE['job']}" in result.stdout, output(result)
    assert "epoch 1/2" in result.stdout and "epoch 2/2" in result.stdout, output(result)
    assert f"job {STATE['job']} SUCCEEDED" in result.stdout, output(result)
    # rayapp went with the job, and the job's driver checked every node before training.
    from ray.job_submission import JobSubmissionClient

    runtime_env = JobSubmissionClient(dashboard_url).get_job_info(STATE["job"]).runtime_env
    shipped = runtime_env.get("py_modules") or []
    assert len(shipped) == 1 and shipped[0].startswith("gcs://"), runtime_env
    assert "checking from every node" in result.stdout, output(result)

    [run] = mlflow_runs(mlflow_url, "rayapp")
    assert run.info.status == "FINISHED"
    assert run.info.run_id in result.stdout
    assert run.data.params["nodes"] == "2" and run.data.params["world_size"] == "2"
    node_ids = run.data.tags[TAG_NODE_IDS].split(",")
    assert len(node_ids) == 2 and len(set(node_ids)) == 2, node_ids


def test_status_and_logs_of_the_finished_job(stack):
    dashboard_url, _, _ = stack
    if "job" not in STATE:
        pytest.skip("the submit test did not run a job")
    job = STATE["job"]

    table = rayapp("status", "--address", dashboard_url)
    assert table.returncode == 0, output(table)
    [row] = [line for line in table.stdout.splitlines() if job in line]
    assert "SUCCEEDED" in row, output(table)

    one = rayapp("status", job, "--address", dashboard_url)
    assert one.returncode == 0, output(one)
    assert job in one.stdout and "SUCCEEDED" in one.stdout, output(one)

    logs = rayapp("logs", job, "--address", dashboard_url)
    assert logs.returncode == 0, output(logs)
    assert "epoch 1/2" in logs.stdout and "epoch 2/2" in logs.stdout, output(logs)

    # $RAY_ADDRESS (a dashboard URL) stands in for --address.
    followed = rayapp("logs", job, "-f", env={"RAY_ADDRESS": dashboard_url})
    assert followed.returncode == 0 and "epoch 2/2" in followed.stdout, output(followed)

    unknown = rayapp("status", "rayapp-no-such-job", "--address", dashboard_url)
    assert unknown.returncode == 1, output(unknown)
    assert "no job 'rayapp-no-such-job'" in one_error_line(unknown)


def test_token_auth(stack, tmp_path):
    """No token: one line saying what to set. A token file alone (no RAY_AUTH_MODE) is enough."""
    dashboard_url, _, cluster = stack
    no_token = rayapp(
        "status",
        "--address",
        dashboard_url,
        env={"HOME": str(tmp_path)},
        drop=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"),
    )
    assert no_token.returncode == 1, output(no_token)
    assert "requires a token" in one_error_line(no_token)

    token_file = tmp_path / "auth_token"
    token_file.write_text(cluster.auth_env["RAY_AUTH_TOKEN"])
    token_file.chmod(0o600)
    with_file = rayapp(
        "status",
        "--address",
        dashboard_url,
        env={"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(token_file)},
        drop=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"),
    )
    assert with_file.returncode == 0, output(with_file)

    wrong = rayapp("status", "--address", dashboard_url, env={"RAY_AUTH_TOKEN": "0" * 64})
    assert wrong.returncode == 1, output(wrong)
    assert "rejected" in one_error_line(wrong)


def test_detach_then_stop(stack, tmp_path):
    dashboard_url, mlflow_url, _ = stack
    submitted = rayapp(
        "submit",
        "--address",
        dashboard_url,
        "--nodes",
        "2",
        "--epochs",
        "1000",
        "--experiment",
        "stopped",
        "--tracking-uri",
        mlflow_url,
        "--detach",
        str(JOBS / "seed_linear.yaml"),
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, output(submitted)
    job = SUBMISSION_ID.search(submitted.stdout).group(1)
    assert "epoch" not in submitted.stdout  # detached: nothing streamed

    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    # Training has started (an epoch line is in the job's output), so there is a run to mark KILLED.
    _wait_until(
        "the job's first epoch",
        lambda: re.search(r"epoch +1/1000 ", client.get_job_logs(job)),
        JOB_TIMEOUT_S / 2,
        lambda: f"status {client.get_job_status(job)}; logs:\n{client.get_job_logs(job)[-3000:]}",
    )
    assert str(client.get_job_status(job)) == "RUNNING"

    stopped = rayapp("stop", job, "--address", dashboard_url)
    assert stopped.returncode == 0, output(stopped)
    assert f"job {job} STOPPED" in stopped.stdout, output(stopped)
    assert str(client.get_job_status(job)) == "STOPPED"

    # The driver was interrupted (SIGINT), not killed outright: it marked its MLflow run KILLED.
    [run] = mlflow_runs(mlflow_url, "stopped")
    assert run.info.status == "KILLED", (
        f"run {run.info.status}; job output:\n{client.get_job_logs(job)[-3000:]}"
    )

    again = rayapp("stop", job, "--address", dashboard_url)
    assert again.returncode == 0 and "already ended STOPPED" in again.stdout, output(again)


def test_unreachable_address_is_one_line():
    result = rayapp("status", "--address", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1, output(result)
    assert "ray dashboard cluster_configs/" in one_error_line(result)
