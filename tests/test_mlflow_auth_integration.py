"""A real `mlflow server --app-name basic-auth`: credentials from the shell reach the workers, a
refused password fails before any cluster starts, and no secret lands where others can read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import JOBS, MlflowServer, run_rayapp

from rayapp.launch import warm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PASSWORD = "s3cret-Admin-pw-7f2c"  # distinctive, so a grep finds it wherever it leaks


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = MlflowServer(
        tmp_path_factory.mktemp("auth-mlflow"),
        app_name="basic-auth",
        env={
            "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-flask-key",
        },
    )
    server.start()
    yield server
    server.stop()


def credentials(password: str) -> dict[str, str]:
    return {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": password}


def test_a_refused_password_fails_before_any_cluster_starts(auth_server, tmp_path):
    result = run_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        "1",
        "--tracking-uri",
        auth_server.uri,
        str(JOBS / "seed_linear.yaml"),
        cwd=tmp_path,
        env=credentials("wrong-password"),
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert f"MLflow at {auth_server.uri} refused user 'admin' (HTTP 401)" in result.stderr
    assert (
        "starting embedded" not in result.stdout
        and "wrong-password" not in result.stdout + result.stderr
    )


def every_text_under(directory: Path) -> str:
    texts = []
    for path in directory.rglob("*"):
        if path.is_file():
            texts.append(path.read_bytes().decode(errors="replace"))
    return "\n".join(texts)


def test_credentials_reach_the_workers_and_no_secret_is_left_behind(
    auth_server, tmp_path, monkeypatch
):
    monkeypatch.setenv(warm.STATE_DIR_ENV, str(tmp_path / "state"))
    up = run_rayapp("cluster", "up", "--nodes", "2", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    record = warm.find()
    try:
        # The warm cluster's nodes were started without the MLflow password: the workers can only
        # have it because rayapp handed it to them.
        result = run_rayapp(
            "submit",
            "--nodes",
            "2",
            "--epochs",
            "2",
            "--tracking-uri",
            auth_server.uri,
            "--experiment",
            "auth",
            str(JOBS / "seed_linear.yaml"),
            cwd=tmp_path,
            env=credentials(PASSWORD),
        )
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        # The end-of-run hint is the run's page on the server, in MLflow's model-training view.
        assert f"view:  {auth_server.uri}/#/experiments/" in result.stdout
        assert "?workflowType=machine_learning" in result.stdout
        node_logs = every_text_under(Path(record.log_dir))
    finally:
        down = run_rayapp("cluster", "down", cwd=tmp_path)
    # Stopped, not taken for a stale record (which would leave its processes running).
    assert down.returncode == 0, down.stderr
    assert "stopping the warm cluster" in down.stdout + down.stderr, down.stdout + down.stderr
    assert not record.alive

    for name, value in credentials(PASSWORD).items():
        monkeypatch.setenv(name, value)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(auth_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("auth").experiment_id])
    assert run.info.status == "FINISHED"
    # Rank 0 logged every epoch itself, with the credentials it was given.
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1]

    artifacts = tmp_path / "artifacts"
    client.download_artifacts(run.info.run_id, "", str(artifacts.mkdir() or artifacts))
    places = {
        "params": json.dumps(run.data.params),
        "tags": json.dumps(run.data.tags),
        "artifacts (job_spec.json included)": every_text_under(artifacts),
        "rayapp's output": result.stdout + result.stderr,
        "checkpoints and Ray Train's results": every_text_under(tmp_path / "rayapp_results"),
        "the nodes' logs": node_logs,
    }
    assert (artifacts / "job_spec.json").exists()
    for secret_name, secret in (("MLflow password", PASSWORD), ("Ray auth token", record.token)):
        leaked = [place for place, text in places.items() if secret in text]
        assert not leaked, f"the {secret_name} is in: {', '.join(leaked)}"
