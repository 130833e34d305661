"""Pipeline parallelism (strategy pp) on a real 2-node embedded cluster, through the CLI.

Two runs of jobs/mlp_pipeline.yaml (2 stages, one per node, 8 micro-batches of a 256-sample batch):
GPipe, and 1F1B with one stage worker SIGKILLed mid-run (--max-failures 1). Both must log, epoch
by epoch, the loss a single process gets training the same model on the same micro-batches with
plain torch: the pipeline computes the same gradients, and the resumed run restores both stages
and their optimizers exactly from the DCP checkpoint.

A third run, on a cluster of its own (2 nodes x 2 workers), trains a pipeline per node, the nodes
data-parallel, and has a stage worker SIGKILLed mid-run: it resumes from the checkpoint, where each
stage's copies in both pipelines are one entry, and still logs that single process's losses.
"""

from __future__ import annotations

import math
import signal
import subprocess

import mlflow.pytorch
import pytest
import torch
from conftest import (
    JOBS,
    kill_one_training_worker,
    load_logged_model,
    mlflow_client,
    only_run,
    run_rayapp,
    start_rayapp,
    wait_for_line,
)

from rayapp.spec.loader import load_spec
from rayapp.tracking.run import (
    EPOCH_METRICS,
    TAG_ATTEMPTS,
    TAG_MESH,
    TAG_RESUMED_FROM_EPOCH,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = JOBS / "mlp_pipeline.yaml"
EPOCHS = 3


def reference_losses(epochs: int) -> list[float]:
    """Each epoch's mean loss of one process training the job's model on the same batches, each
    cut into the same micro-batches, their gradients averaged: what the pipeline computes."""
    from rayapp.train.data import build_datasets, build_loader, shard_sampler
    from rayapp.train.models import build_loss, build_model, build_optimizer

    spec = load_spec(JOB, {"train.epochs": epochs})
    pipe = spec.train.pipeline
    assert pipe is not None  # a pp job's spec has its pipeline section
    microbatches = pipe.microbatches
    loader = build_loader(spec, build_datasets(spec).train, rank=0, world_size=1)
    model = build_model(spec)
    optimizer, loss_fn = build_optimizer(spec, model), build_loss(spec)
    losses = []
    for epoch in range(epochs):
        shard_sampler(loader).set_epoch(epoch)
        total = []
        for inputs, targets in loader:
            parts = [
                loss_fn(model(x), y)
                for x, y in zip(
                    inputs.chunk(microbatches), targets.chunk(microbatches), strict=True
                )
            ]
            (torch.stack(parts).sum() / microbatches).backward()
            optimizer.step()
            optimizer.zero_grad()
            total.append(torch.stack(parts).mean().item())
        losses.append(sum(total) / len(total))
    return losses


def history(client, run, key):
    return [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    ]


def test_gpipe_matches_one_process_and_halves_parameters_per_rank(workdir, warm_cluster):
    result = run_rayapp("submit", "--epochs", str(EPOCHS), str(JOB), cwd=workdir, env=warm_cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.data.params["strategy"] == "pp" and run.data.params["world_size"] == "2"
    assert (
        run.data.params["batch_size"] == run.data.params["global_batch_size"] == "256"
    )  # one replica
    assert history(client, run, "loss") == pytest.approx(reference_losses(EPOCHS), rel=1e-4)

    # Each stage holds its own layers: rank 0 about half of what every DDP rank would hold (the
    # whole model).
    from rayapp.train.models import build_model

    whole = sum(p.numel() * p.element_size() for p in build_model(load_spec(JOB)).parameters())
    metrics = run.data.metrics
    assert 0.4 < metrics["param_bytes_per_rank"] / whole < 0.6, (
        metrics["param_bytes_per_rank"],
        whole,
    )
    assert metrics["stage_0_param_bytes"] + metrics["stage_1_param_bytes"] == whole
    assert metrics["pipeline_bubble_ideal"] == pytest.approx(1 / 9)  # (S-1)/(M+S-1), S=2, M=8
    for key in (
        "pipeline_bubble",
        "comm_time_s",
        "stage_0_compute_time_s",
        "stage_1_compute_time_s",
        "stage_0_peak_mem_mb",
        "stage_1_peak_mem_mb",
    ):
        values = history(client, run, key)
        assert len(values) == EPOCHS and all(math.isfinite(v) and v > 0 for v in values), (
            key,
            values,
        )
    assert all(b < 1 for b in history(client, run, "pipeline_bubble"))
    # samples counted once per pipeline, not once per stage
    samples = int(run.data.params["train_samples"])
    assert history(client, run, "samples_per_s")[-1] == pytest.approx(
        samples / metrics["epoch_time_s"], rel=1e-6
    )

    # The model artifact is the whole model, gathered from both stages; so is the MLflow Model.
    (path,) = workdir.glob("mlartifacts/*/artifacts/state_dict/model_state_dict.pt")
    whole = build_model(load_spec(JOB))
    whole.load_state_dict(torch.load(path))
    logged = load_logged_model(
        workdir, f"runs:/{run.info.run_id}/model", loader=mlflow.pytorch.load_model
    )
    inputs = torch.randn(4, whole[0].in_features)
    with torch.no_grad():
        torch.testing.assert_close(logged(inputs), whole.eval()(inputs))


def test_1f1b_resumes_after_a_stage_worker_is_killed(workdir, warm_cluster):
    epochs = 4
    process = start_rayapp(
        "submit",
        "--pp-schedule",
        "1f1b",
        "--epochs",
        str(epochs),
        "--max-failures",
        "1",
        str(JOB),
        cwd=workdir,
        env=warm_cluster,
    )
    try:
        wait_for_line(process, f"epoch 2/{epochs}")
        kill_one_training_worker(warm_cluster.leaders)
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]

    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.params["strategy"] == "pp"
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    for key in (*EPOCH_METRICS, "pipeline_bubble"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(epochs)), f"{key} logged at {steps}"
    # Both stages and their Adam states came back from the checkpoint: the curve is unbroken.
    assert history(client, run, "loss") == pytest.approx(reference_losses(epochs), rel=1e-4)


def stop(process: subprocess.Popen) -> None:
    """End a submit that is still running as Ctrl-C does, so it stops the embedded cluster it
    started; SIGKILL only if that does not end it within a minute."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


def test_a_pipeline_per_node_resumes_after_a_stage_worker_is_killed(workdir):
    """2 nodes x 2 workers: a 2-stage pipeline on each node, each on half of every batch, the
    stages' gradients averaged across the nodes. A stage worker killed in the third epoch: the
    run restarts once from its checkpoint (not from epoch 0), logs every epoch once, and its
    losses are still those of one process training on the whole batches, so both pipelines'
    stages and Adam states came back whole. The cluster is the run's own: the session's warm
    cluster offers one CPU per node, 2 workers per node need two. System metrics are off: their
    sampler's start on the second node is time this test need not spend."""
    epochs = 4
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--workers-per-node",
        "2",
        "--epochs",
        str(epochs),
        "--max-failures",
        "1",
        "--system-metrics-interval",
        "0",
        str(JOB),
        cwd=workdir,
    )
    try:
        # Every epoch is checkpointed, and rank 0 sends epoch 2's line only after Ray Train took
        # its report of epoch 1 (a rank's next report waits for that), with epoch 1's checkpoint:
        # the kill, in epoch 3, cannot send the restart back to a fresh start.
        wait_for_line(process, f"epoch 2/{epochs}")
        kill_one_training_worker([process.pid])
        output, _ = process.communicate(timeout=300)
    finally:
        stop(process)
    assert process.returncode == 0, output[-3000:]

    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.params["strategy"] == "pp" and run.data.params["world_size"] == "4"
    assert run.data.tags[TAG_MESH] == "replicate=2,shard=2"  # a pipeline per node
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    # The restart loaded a checkpoint (the tag is absent after a fresh start), and not the last:
    # it trained on from there.
    resumed_from = int(run.data.tags[TAG_RESUMED_FROM_EPOCH])  # counted from 0
    assert 0 <= resumed_from < epochs - 1, resumed_from
    for key in (*EPOCH_METRICS, "pipeline_bubble"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(epochs)), f"{key} logged at {steps}"
    # Global batch 256, 128 per pipeline in 8 micro-batches of 16: the gradient of the same
    # batch's mean loss as one process taking it in 8 micro-batches of 32.
    assert history(client, run, "loss") == pytest.approx(reference_losses(epochs), rel=1e-4)
