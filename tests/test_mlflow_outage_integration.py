"""A real `mlflow server` goes away during a run: training goes on, and no metric is lost or
doubled."""

from __future__ import annotations

import pytest
from conftest import JOBS, MlflowServer, run_rayapp, start_rayapp, wait_for_line
from mlflow.tracking import MlflowClient

from rayapp.tracking.outbox import GRACE_ENV
from rayapp.tracking.run import EPOCH_METRICS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 8


def assert_complete(client: MlflowClient, run) -> None:
    for key in EPOCH_METRICS:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(EPOCHS)), f"{key} logged at {steps}"
    assert "total_time_s" in run.data.metrics
    assert "state_dict/model_state_dict.pt" in {
        a.path for a in client.list_artifacts(run.info.run_id, "state_dict")
    }


def the_run(server: MlflowServer):
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("outage")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def submit_args(server: MlflowServer) -> list[str]:
    return [
        "submit",
        "--nodes",
        "2",
        "--epochs",
        str(EPOCHS),
        "--experiment",
        "outage",
        "--tracking-uri",
        server.uri,
        str(JOBS / "seed_linear.yaml"),
    ]


def test_server_down_mid_run_then_back_loses_nothing(tmp_path, warm_cluster):
    server = MlflowServer(tmp_path).start()
    # Epochs here take a fraction of a second, so training may end before the server is back;
    # a long grace keeps the job waiting for it rather than writing the fallback file.
    process = start_rayapp(
        *submit_args(server), cwd=tmp_path, env={GRACE_ENV: "180", **warm_cluster}
    )
    try:
        seen = wait_for_line(process, f"2/{EPOCHS}  loss")
        server.stop()
        seen += wait_for_line(
            process, f"5/{EPOCHS}  loss"
        )  # training went on while the server was down
        server.start()
        output, _ = process.communicate(timeout=300)
        output = "".join(seen) + output
        assert process.returncode == 0, output[-3000:]
        assert "MLflow at" in output and "not answering" in output
        assert not list(tmp_path.glob("rayapp_results/*/*.mlflow-fallback.jsonl"))
        client, run = the_run(server)
        assert run.info.status == "FINISHED"
        assert_complete(client, run)
    finally:
        if process.poll() is None:
            process.kill()
        server.stop()


def test_server_gone_until_the_end_leaves_a_fallback_file_to_import(tmp_path, warm_cluster):
    server = MlflowServer(tmp_path).start()
    process = start_rayapp(*submit_args(server), cwd=tmp_path, env={GRACE_ENV: "5", **warm_cluster})
    try:
        seen = wait_for_line(process, f"2/{EPOCHS}  loss")
        server.stop()
        output, _ = process.communicate(timeout=400)
        output = "".join(seen) + output
        assert process.returncode == 0, output[-3000:]
        assert "rayapp import-metrics" in output, output[-3000:]
        fallbacks = list(tmp_path.glob("rayapp_results/*/*.mlflow-fallback.jsonl"))
        assert len(fallbacks) == 1, output[-3000:]

        server.start()
        imported = run_rayapp(
            "import-metrics", str(fallbacks[0]), "--tracking-uri", server.uri, cwd=tmp_path
        )
        assert imported.returncode == 0, imported.stderr
        client, run = the_run(server)
        assert run.info.status == "FINISHED"
        assert_complete(client, run)
        again = run_rayapp(
            "import-metrics", str(fallbacks[0]), "--tracking-uri", server.uri, cwd=tmp_path
        )
        assert again.returncode != 0  # renamed to *.imported: nothing is delivered twice
    finally:
        if process.poll() is None:
            process.kill()
        server.stop()
