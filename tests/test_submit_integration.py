"""`rayapp submit` end to end: a real embedded 2-node Ray cluster and a real MLflow SQLite store."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import JOBS, load_logged_model, mlflow_client, only_run, run_rayapp

from rayapp.spec.loader import load_spec
from rayapp.tracking.run import EPOCH_METRICS, TAG_CLUSTER, TAG_NODE_IDS, TAG_NODE_IPS
from rayapp.train.data import build_datasets

pytestmark = pytest.mark.integration

EXPECTED_PARAMS = {
    "job",
    "nodes",
    "workers_per_node",
    "world_size",
    "backend",
    "strategy",
    "epochs",
    "batch_size",
    "global_batch_size",
    "lr",
    "seed",
    "scaling",
}


def assert_one_value_per_epoch(client, run_id: str, epochs: int, keys=EPOCH_METRICS) -> None:
    for key in keys:
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(epochs)), f"{key}: logged at steps {steps}"


def test_seed_linear_on_two_nodes(workdir):
    result = run_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        "2",
        "--log-every-steps",
        "25",
        "--system-metrics-interval",
        "0.5",
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    # Progress on the submitting terminal: every epoch, then the run id.
    assert "epoch 1/2" in result.stdout and "epoch 2/2" in result.stdout
    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.run_id in result.stdout
    assert run.info.status == "FINISHED"

    params = run.data.params
    assert EXPECTED_PARAMS <= set(params)
    assert (params["job"], params["nodes"], params["world_size"], params["backend"]) == (
        "seed_linear",
        "2",
        "2",
        "gloo",
    )
    assert (params["batch_size"], params["global_batch_size"], params["scaling"]) == (
        "64",
        "128",
        "weak",
    )

    tags = run.data.tags
    node_ids = tags[TAG_NODE_IDS].split(",")
    assert len(node_ids) == 2 and len(set(node_ids)) == 2, node_ids
    assert sorted(tags[TAG_NODE_IPS].split(",")) == ["127.0.0.2", "127.0.0.3"]
    # Gloo is pinned to the interface holding each node's Ray address: loopback here.
    assert tags["rayapp.socket_ifnames"] == "lo,lo"
    assert tags[TAG_CLUSTER] == "local"
    assert "rayapp.torch_version" in tags and "rayapp.ray_version" in tags

    assert_one_value_per_epoch(client, run.info.run_id, 2)
    for key in (
        "total_time_s",
        "time_to_first_step_s",
        "mlflow_write_s",
        "mlflow_write_cpu_s",
        "mlflow_writes",
    ):
        assert run.data.metrics[key] > 0, key
    comm = [m.value for m in client.get_metric_history(run.info.run_id, "comm_time_s")]
    epoch = [m.value for m in client.get_metric_history(run.info.run_id, "epoch_time_s")]
    assert all(0 < c < e for c, e in zip(comm, epoch, strict=True)), (comm, epoch)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "state_dict")}
    assert "state_dict/model_state_dict.pt" in artifacts
    # The trained model as an MLflow Model, gathered to rank 0 and served by pyfunc.
    model = load_logged_model(workdir, f"runs:/{run.info.run_id}/model")
    assert model.predict(np.zeros((3, 10), dtype=np.float32)).shape == (3, 10)

    # Why a run scales or not: start-up phases, step-level metrics, each node's system metrics.
    for key in ("startup_cluster_s", "startup_workers_s"):
        assert 0 < run.data.metrics[key] < run.data.metrics["time_to_first_step_s"], key
    step_losses = client.get_metric_history(run.info.run_id, "step_loss")
    assert [m.step for m in step_losses] == list(
        range(25, 201, 25)
    )  # 100 steps an epoch, every 25th
    assert {
        m.step for m in client.get_metric_history(run.info.run_id, "step_samples_per_s")
    } == set(range(25, 201, 25))
    for ip in ("127.0.0.2", "127.0.0.3"):
        assert f"system/{ip}/cpu_utilization_percentage" in run.data.metrics, sorted(
            run.data.metrics
        )
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_digits_learns_real_data_with_two_workers_on_one_node(workdir):
    result = run_rayapp(
        "submit",
        "--nodes",
        "1",
        "--workers-per-node",
        "2",
        "--epochs",
        "8",
        "--register-model",
        "digits-mlp",
        str(JOBS / "digits_mlp.yaml"),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "workers landed on" not in result.stdout
    run = only_run(mlflow_client(workdir))
    assert run.data.metrics["test_accuracy"] > 0.85
    # The logged MLflow Model scores the test split as the run's last epoch did; the registry
    # holds it as version 1 of the name --register-model gave.
    assert "model registered: digits-mlp version 1" in result.stdout
    test_set = build_datasets(load_spec(str(JOBS / "digits_mlp.yaml"))).test
    inputs, labels = test_set[:]
    for uri in (f"runs:/{run.info.run_id}/model", "models:/digits-mlp/1"):
        scores = load_logged_model(workdir, uri).predict(inputs.numpy())
        accuracy = float((scores.argmax(axis=1) == labels.numpy()).mean())
        assert accuracy == pytest.approx(run.data.metrics["test_accuracy"], abs=0.01), uri
    assert (run.data.params["workers_per_node"], run.data.params["world_size"]) == ("2", "2")
    assert run.data.params["batch_size"] == "32"  # global batch 64 split over 2 workers
    node_ids = run.data.tags[TAG_NODE_IDS].split(",")
    assert len(node_ids) == 2 and len(set(node_ids)) == 1
