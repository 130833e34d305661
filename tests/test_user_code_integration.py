"""Users' own code on a real embedded 2-node cluster with real MLflow: the three ways in
(factories, an own loop, an unmodified torchrun script), each run from a copy of its example in
a temporary directory that is not on this process's sys.path, so the workers can only have the
code because it travelled with the job."""

from __future__ import annotations

import shutil
import sqlite3
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    REPO,
    kill_one_training_worker,
    load_logged_model,
    mlflow_client,
    only_run,
    run_rayapp,
    start_rayapp,
    wait_for_line,
)

from rayapp.tracking.backfill import read_history
from rayapp.tracking.run import TAG_ATTEMPTS, TAG_EARLY_STOPPED, TAG_RANK_EXIT_CODES
from rayapp.train.checkpoint import STOPPED_MARKER

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLES = REPO / "examples"


def example(name: str, tmp_path: Path) -> Path:
    copy = tmp_path / "code" / name
    shutil.copytree(EXAMPLES / name, copy)
    assert not any(str(copy).startswith(entry) for entry in sys.path if entry and entry != "/"), (
        sys.path
    )
    return copy


def steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_factories_train_a_cnn_on_digits(tmp_path, warm_cluster):
    code, workdir = example("cnn_digits", tmp_path), tmp_path / "run"
    workdir.mkdir()
    result = run_rayapp(
        "submit", "--nodes", "2", str(code / "job.yaml"), cwd=workdir, env=warm_cluster
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "your code travels to the workers from" in result.stdout
    client = mlflow_client(workdir)
    run = only_run(client, "cnn_digits")
    epochs = int(run.data.params["epochs"])
    assert steps(client, run.info.run_id, "test_accuracy") == list(range(epochs))
    assert run.data.metrics["test_accuracy"] >= 0.95
    assert run.data.params["model"].endswith(":build") or ":" in run.data.params["model"]
    # The model as an MLflow Model loads here, where the example's modules cannot be imported:
    # they were pickled with it.
    assert "not logged as an MLflow Model" not in result.stdout
    model = load_logged_model(workdir, f"runs:/{run.info.run_id}/model")
    (image,) = model.metadata.get_input_schema().inputs
    predicted = model.predict(np.zeros((3, *image.shape[1:]), dtype=np.float32))
    assert predicted.shape == (3, 10)


def test_own_loop_resumes_after_a_killed_worker_with_every_epoch_once(tmp_path, warm_cluster):
    code, workdir = example("char_gpt", tmp_path), tmp_path / "run"
    workdir.mkdir()
    epochs = 5
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        str(epochs),
        "--max-failures",
        "1",
        str(code / "job_tiny.yaml"),
        cwd=workdir,
        env=warm_cluster,
    )
    try:
        wait_for_line(process, f"epoch 2/{epochs}")
        kill_one_training_worker(warm_cluster.leaders)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    client = mlflow_client(workdir)
    run = only_run(client, "char_gpt")
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    for key in ("loss", "val_loss", "tokens_per_s", "epoch_time_s"):
        assert steps(client, run.info.run_id, key) == list(range(epochs)), key


def logged_script_epochs(db: Path) -> int:
    """How many script `loss` values the run holds so far (read while the job writes)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as connection:
            return connection.execute("SELECT COUNT(*) FROM metrics WHERE key = 'loss'").fetchone()[
                0
            ]
    except sqlite3.Error:
        return 0


def test_unmodified_torchrun_script_restarts_after_a_killed_worker_in_one_run(
    tmp_path, warm_cluster
):
    code, workdir = example("article_ddp", tmp_path), tmp_path / "run"
    workdir.mkdir()
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--max-failures",
        "1",
        "--script",
        str(code / "train.py"),
        "--",
        "--epochs",
        "6",
        "--steps",
        "300",
        cwd=workdir,
        env=warm_cluster,
    )
    try:
        wait_for_line(process, "training on 2 worker(s)")
        deadline = time.monotonic() + 300
        while logged_script_epochs(workdir / "mlflow.db") < 2:
            assert time.monotonic() < deadline and process.poll() is None, (
                "the script logged no epochs"
            )
            time.sleep(0.5)
        kill_one_training_worker(warm_cluster.leaders)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    client = mlflow_client(workdir)
    run = only_run(client)  # the restart stayed in the same run
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    assert run.data.tags[TAG_RANK_EXIT_CODES] == "0,0"
    assert run.data.params["script"] == "train.py"
    assert set(steps(client, run.info.run_id, "loss")) == set(range(6))


def test_a_rank_whose_script_fails_fails_the_run_with_its_stderr(tmp_path, warm_cluster):
    code, workdir = tmp_path / "code", tmp_path / "run"
    code.mkdir()
    workdir.mkdir()
    (code / "bad.py").write_text(
        textwrap.dedent("""
        import os, sys
        if os.environ["RANK"] == "1":
            print("loading shard", file=sys.stderr)
            print("FileNotFoundError: data/shard-1.bin", file=sys.stderr)
            sys.exit(3)
    """)
    )
    result = run_rayapp(
        "submit", "--nodes", "2", "--script", str(code / "bad.py"), cwd=workdir, env=warm_cluster
    )
    assert result.returncode == 1, result.stdout[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert (
        "bad.py exited with code 3 on rank 1" in message
        and "FileNotFoundError: data/shard-1.bin" in message
    )
    assert "Traceback" not in result.stderr
    run = only_run(mlflow_client(workdir))
    assert run.info.status == "FAILED"


EARLY_STOPPING_LOOP = """
import torch
from torch import nn


def train_loop(ctx):
    torch.manual_seed(0)
    model = ctx.prepare(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = ctx.loader(data, batch_size=32)
    for epoch in ctx.epochs(model, optimizer):
        for inputs, targets in ctx.batches(loader):
            with ctx.compute():
                loss = nn.functional.mse_loss(model(inputs), targets)
                ctx.backward(loss)
                ctx.step(optimizer)
        ctx.log_epoch({"loss": ctx.mean(loss.detach())})
        if epoch == ctx.args["stop_at"]:
            if ctx.args["how"] == "break":  # the same decision on every rank
                break
            if ctx.rank == 1:  # one rank's call is enough: the ranks agree at the epoch's end
                ctx.stop()
    if ctx.trained_model is None:
        raise RuntimeError("ctx.trained_model is None after the epochs loop")
"""


@pytest.mark.parametrize("how", ["break", "stop"])
def test_a_loop_that_stops_early_logs_and_checkpoints_its_last_epoch(tmp_path, warm_cluster, how):
    """A loop of 5 epochs stops at epoch 2: every rank breaks there, or rank 1 alone calls
    ctx.stop(). Either way epochs 0-2 are logged once each, epoch 2 is checkpointed, the loop finds
    ctx.trained_model set (and rayapp saves it), and the run is FINISHED, tagged early_stopped."""
    code, workdir = tmp_path / "code", tmp_path / "run"
    code.mkdir()
    workdir.mkdir()
    (code / "early.py").write_text(EARLY_STOPPING_LOOP)
    # Checkpoints every 2nd epoch: epoch 2 has one only because the loop stopped there.
    (code / "job.yaml").write_text(
        textwrap.dedent(f"""
        name: early_stop
        train: {{loop: "early:train_loop", args: {{stop_at: 2, how: {how}}}, epochs: 5}}
        checkpoint: {{every_epochs: 2}}
        cluster: {{nodes: 2}}
        tracking: {{system_metrics_s: 0}}
        """)
    )
    result = run_rayapp("submit", str(code / "job.yaml"), cwd=workdir, env=warm_cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "stopped early after epoch 3/5" in result.stdout
    client = mlflow_client(workdir)
    run = only_run(client)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_EARLY_STOPPED] == "true"
    for key in ("loss", "epoch_time_s", "samples_per_s"):
        assert steps(client, run_id, key) == [0, 1, 2], key  # each epoch once, none after it
    assert steps(client, run_id, "checkpoint_time_s") == [1, 2]
    assert steps(client, run_id, "total_time_s") == [2]
    # ctx.trained_model was set: rayapp saved the trained model from it (its state dict: a loop
    # of the user's own trains a model rayapp cannot rebuild as an MLflow Model)
    assert [a.path for a in client.list_artifacts(run_id, "state_dict")] == [
        "state_dict/model_state_dict.pt"
    ]
    assert client.list_artifacts(run_id, "model") == []
    (trial,) = (workdir / "rayapp_results").glob(f"early_stop-{run_id[:8]}")
    checkpoints = sorted(path.name for path in trial.glob("checkpoint_epoch_*"))
    assert checkpoints == ["checkpoint_epoch_000001", "checkpoint_epoch_000002"]
    last = trial / "checkpoint_epoch_000002"
    assert read_history(str(last))["epoch"] == 2
    assert (last / STOPPED_MARKER).exists()
