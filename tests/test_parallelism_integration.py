"""Strategies ddp, fsdp, hsdp, tp and pp train the same model on the same data to the same loss, on
2 nodes x 2 workers (Gloo, CPUs); and `rayapp submit --strategy hsdp` and `--strategy tp` land runs
that record the mesh, the memory per rank and the communication per step.

One Ray cluster of two 2-CPU nodes (`rayapp cluster up`) serves two real submits of a small MLP job:
- hsdp, with tests/parallel_equivalence_loop.py as its loop: hsdp trains through rayapp's
  TrainContext, then ddp, fsdp, tp and pp train in the same workers, on the same batches and mesh;
- tp, with rayapp's built-in loop.
With a fixed seed, fp32 and the same global batch of the same samples each step, every strategy
computes the same averaged gradient: only float rounding (sums taken in another order) separates
their losses, so after a few epochs they agree to TOLERANCE, and the test names any that drifts.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from conftest import REPO, mlflow_client, run_rayapp

from rayapp.tracking.run import TAG_MESH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 3
TOLERANCE = 1e-4
"""Relative difference allowed between a strategy's per-epoch loss and ddp's (fp32 rounding)."""
MESH = "replicate=2,shard=2"

JOB = {
    "name": "parallelism",
    "model": {"kind": "mlp", "hidden": [64, 64, 64]},  # 4 Linear layers: pp's 4 stages, tp's pairs
    "data": {"kind": "synthetic", "features": 32, "targets": 8, "num_samples": 1024},
    "train": {
        "epochs": EPOCHS,
        "global_batch_size": 64,
        "lr": 0.01,
        "optimizer": "adam",
        "seed": 0,
        "scaling": "strong",
    },
    "cluster": {"nodes": 2, "workers_per_node": 2},
    "checkpoint": {"every_epochs": EPOCHS},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of its own: the session's warm cluster offers one CPU per node, these need two."""
    workdir = tmp_path_factory.mktemp("parallelism")
    env = {"RAYAPP_STATE_DIR": str(workdir / "state")}
    up = run_rayapp(
        "cluster", "up", "--nodes", "2", "--cpus-per-node", "2", cwd=workdir, env=env, timeout=180
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield workdir, env
    finally:
        down = run_rayapp("cluster", "down", cwd=workdir, env=env, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def submit(cluster, strategy: str, **train) -> object:
    workdir, env = cluster
    job = {**JOB, "train": {**JOB["train"], **train}}
    directory = workdir / strategy
    directory.mkdir()
    (directory / "job.yaml").write_text(yaml.safe_dump(job))
    shutil.copy(REPO / "tests" / "parallel_equivalence_loop.py", directory)
    result = run_rayapp(
        "submit", "--strategy", strategy, "--experiment", strategy, str(directory / "job.yaml"),
        "--tracking-uri", f"sqlite:///{workdir / 'mlflow.db'}", cwd=workdir, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"{strategy}: {result.stderr[-3000:]}"
    client = mlflow_client(workdir)
    (run,) = client.search_runs([client.get_experiment_by_name(strategy).experiment_id])
    return client, run


@pytest.fixture(scope="module")
def hsdp(cluster):
    return submit(cluster, "hsdp", loop="parallel_equivalence_loop:train_loop")


def history(client, run, key: str) -> list[float]:
    metrics = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    return [m.value for m in metrics]


def test_ddp_fsdp_hsdp_tp_and_pp_reach_the_same_loss(hsdp):
    client, run = hsdp
    reference = history(client, run, "ddp_loss")
    assert len(reference) == EPOCHS and reference[-1] < 0.7 * reference[0], reference
    curves = {"hsdp": history(client, run, "loss")}
    curves.update({s: history(client, run, f"{s}_loss") for s in ("fsdp", "tp", "pp")})
    drifting = {
        strategy: curve
        for strategy, curve in curves.items()
        if curve != pytest.approx(reference, rel=TOLERANCE)
    }
    assert not drifting, f"drift from ddp's loss {reference} beyond {TOLERANCE:g}: {drifting}"


def test_hsdp_run_records_its_mesh_memory_and_communication(hsdp):
    _, run = hsdp
    assert run.info.status == "FINISHED"
    assert run.data.params["strategy"] == "hsdp"
    assert run.data.params["mesh"] == MESH and run.data.tags[TAG_MESH] == MESH
    metrics = run.data.metrics
    ddp_bytes = metrics["ddp_param_bytes_per_rank"]
    # Sharded over the 2 workers of a node; ddp holds the whole model on every rank.
    assert metrics["param_bytes_per_rank"] <= 0.55 * ddp_bytes
    # Counted from the collectives: beside the cross-node all-reduce of its shard's gradients,
    # hsdp all-gathers every layer's parameters and reduce-scatters their gradients.
    assert metrics["comm_bytes_per_step"] > ddp_bytes


def test_tp_submit_lands_a_run_with_ddps_loss(cluster, hsdp):
    client, tp = submit(cluster, "tp")
    assert tp.info.status == "FINISHED"
    assert tp.data.params["mesh"] == MESH and tp.data.tags[TAG_MESH] == MESH
    # The built-in loop, on the data the hsdp run's ddp trained on: the same loss.
    assert history(client, tp, "loss") == pytest.approx(
        history(client, hsdp[1], "ddp_loss"), rel=TOLERANCE
    )
    metrics = tp.data.metrics
    assert metrics["param_bytes_per_rank"] < hsdp[1].data.metrics["ddp_param_bytes_per_rank"]
    assert metrics["comm_bytes_per_step"] > 0
