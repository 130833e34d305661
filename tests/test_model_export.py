"""The trained model as an MLflow Model (rayapp.train.model_export), against a real MLflow SQLite
store: the signature and input example come from the job's data, runs:/ID/model loads with
mlflow.pyfunc and predicts, --register-model makes a registry version, and a model that cannot be
logged is one line at the terminal, not a failure. No Ray: the function runs where rank 0 does."""

from __future__ import annotations

import json
import queue
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import JOBS, migrated_store

from rayapp.spec.loader import build_spec, load_spec
from rayapp.train.config import WorkerConfig
from rayapp.train.data import build_datasets
from rayapp.train.model_export import (
    EXAMPLE_ROWS,
    exports_model,
    input_example,
    log_trained_model,
    log_trained_model_or_warn,
)
from rayapp.train.models import build_model


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh MLflow SQLite store and one open run in it, as the driver makes it."""
    import mlflow

    monkeypatch.chdir(tmp_path)  # mlflow's artifacts for a sqlite store land under ./mlartifacts
    uri = migrated_store(tmp_path / "mlflow.db")
    client = mlflow.MlflowClient(uri)
    experiment_id = client.create_experiment("export")
    run_id = client.create_run(experiment_id).info.run_id
    yield uri, run_id
    client.set_terminated(run_id)
    mlflow.set_tracking_uri(None)


def test_input_example_is_the_first_rows_of_the_test_set():
    spec = load_spec(str(JOBS / "digits_mlp.yaml"))
    test_set = build_datasets(spec).test
    example = input_example(test_set)
    assert example.shape == (EXAMPLE_ROWS, 64)
    assert example.dtype == np.float32
    np.testing.assert_array_equal(example[2], test_set[2][0].numpy())


def test_input_example_refuses_what_it_cannot_stack():
    with pytest.raises(ValueError, match="empty"):
        input_example([])
    with pytest.raises(TypeError, match="not tensors"):
        input_example([("text", 1)])


def test_only_models_rayapp_builds_are_exported():
    assert exports_model(build_spec({}, {}))
    assert not exports_model(build_spec({}, {"train.loop": "mytrain:train_loop"}))


def test_digits_model_loads_through_pyfunc_with_signature_and_example(store):
    import mlflow

    uri, run_id = store
    spec = load_spec(str(JOBS / "digits_mlp.yaml"), {"tracking.register_model": "digits-mlp"})
    model = build_model(spec)
    info = log_trained_model(spec, model.state_dict(), tracking_uri=uri, run_id=run_id)

    assert info.registered_model_version == 1
    loaded = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    inputs = loaded.metadata.get_input_schema().inputs
    assert [(spec_.type.name, spec_.shape) for spec_ in inputs] == [("float32", (-1, 64))]
    outputs = loaded.metadata.get_output_schema().inputs
    assert [spec_.shape for spec_ in outputs] == [(-1, 10)]

    rows = build_datasets(spec).test[:7][0]
    predicted = loaded.predict(rows.numpy())
    assert predicted.shape == (7, 10)
    with torch.no_grad():  # the logged weights are the ones given
        np.testing.assert_allclose(predicted, model(rows).numpy(), rtol=1e-5, atol=1e-6)

    local = mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model")
    example = mlflow.models.Model.load(local).load_input_example(local)
    np.testing.assert_array_equal(example, build_datasets(spec).test[:EXAMPLE_ROWS][0].numpy())
    # What `mlflow models serve` does with a request (its scoring server's own handler): the
    # saved serving example scores.
    from mlflow.pyfunc.scoring_server import invocations

    serving_input = (Path(local) / "serving_input_example.json").read_text()
    reply = invocations(
        serving_input, "application/json", loaded, loaded.metadata.get_input_schema()
    )
    assert reply.status == 200, reply.response
    assert np.asarray(json.loads(reply.response)["predictions"]).shape == (EXAMPLE_ROWS, 10)
    registered = mlflow.pyfunc.load_model("models:/digits-mlp/1")
    assert registered.predict(rows.numpy()).shape == (7, 10)


def test_factory_model_loads_without_the_jobs_files(store, tmp_path, monkeypatch):
    """A model.factory's module from the job's directory is pickled by value."""
    import mlflow

    uri, run_id = store
    (tmp_path / "tiny_net.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Doubler(torch.nn.Module):
                def __init__(self, width):
                    super().__init__()
                    self.linear = torch.nn.Linear(width, 3)

                def forward(self, x):
                    return 2 * self.linear(x)

            def build(width):
                return Doubler(width)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = build_spec(
        {
            "model": {"factory": "tiny_net:build", "args": {"width": 10}},
            "data": {"kind": "random", "features": 10, "targets": 3},
        },
        {},
    )
    log_trained_model(spec, build_model(spec).state_dict(), tracking_uri=uri, run_id=run_id)

    (tmp_path / "tiny_net.py").unlink()
    monkeypatch.delitem(sys.modules, "tiny_net")
    loaded = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    assert loaded.predict(np.zeros((4, 10), dtype=np.float32)).shape == (4, 3)


def test_a_model_that_cannot_be_logged_is_one_warning(store):
    uri, run_id = store
    spec = load_spec(str(JOBS / "digits_mlp.yaml"))
    progress: queue.Queue = queue.Queue()
    config = WorkerConfig(
        spec=spec, run_id=run_id, tracking_uri=uri, submitted_at=0.0, progress=progress
    )
    log_trained_model_or_warn(config, {"not.a.weight": torch.zeros(1)}, step=0)

    (item,) = [progress.get_nowait() for _ in range(progress.qsize())]
    message = item["message"]
    assert message.startswith("the trained model was not logged as an MLflow Model: ")
    assert "\n" not in message and "not.a.weight" in message


def test_register_model_flag_names_what_it_accepts():
    from rayapp.spec import SpecError

    with pytest.raises(SpecError, match=r"tracking.register_model: 'team/model' is not accepted"):
        build_spec({}, {"tracking.register_model": "team/model"})
