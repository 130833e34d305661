"""DDP and FSDP on CPU/Gloo with 2 workers, and DDP's 1-vs-2-worker equivalence under a fixed global
batch.

One MLflow store holds three real runs of jobs/mlp_synthetic.yaml (strong scaling, global batch
256): DDP on 1 node, DDP on 2 nodes, FSDP on 2 nodes. The DDP 2-node run also checks the logged
FLOP rate against an independent count, and each rank's step times.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import yaml
from conftest import JOBS, mlflow_client, run_rayapp

from rayapp.reports.compare import load_summaries
from rayapp.tracking.run import TAG_NODE_IPS, TAG_PEAK_TFLOPS_SOURCE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_cluster):
    workdir = tmp_path_factory.mktemp("strategies")
    found = {}
    for label, args in {
        "ddp1": ["--nodes", "1", "--strategy", "ddp"],
        "ddp2": ["--nodes", "2", "--strategy", "ddp"],
        "fsdp2": ["--nodes", "2", "--strategy", "fsdp"],
    }.items():
        result = run_rayapp(
            "submit",
            *args,
            "--epochs",
            str(EPOCHS),
            "--experiment",
            label,
            str(JOBS / "mlp_synthetic.yaml"),
            cwd=workdir,
            env=warm_cluster,
        )
        assert result.returncode == 0, f"{label}: " + result.stderr[-3000:] + result.stdout[-3000:]
    client = mlflow_client(workdir)
    for label in ("ddp1", "ddp2", "fsdp2"):
        experiment = client.get_experiment_by_name(label)
        (found[label],) = client.search_runs([experiment.experiment_id])
    return client, found


def history(client, run, key):
    return [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    ]


def test_ddp_loss_falls(runs):
    client, found = runs
    losses = history(client, found["ddp2"], "loss")
    assert len(losses) == EPOCHS
    assert losses[-1] < 0.7 * losses[0], losses
    assert found["ddp2"].data.params["batch_size"] == "128"
    assert found["ddp2"].data.params["global_batch_size"] == "256"


def test_ddp_same_loss_curve_on_one_and_two_workers(runs):
    # Same global batch, same sample order: averaged gradients are the same, up to float rounding.
    client, found = runs
    one, two = history(client, found["ddp1"], "loss"), history(client, found["ddp2"], "loss")
    assert one == pytest.approx(two, rel=1e-4), (one, two)


def test_fsdp_trains_on_cpu_and_shards_parameters(runs):
    client, found = runs
    ddp, fsdp = found["ddp2"], found["fsdp2"]
    assert fsdp.info.status == "FINISHED"
    assert fsdp.data.params["strategy"] == "fsdp"
    assert history(client, fsdp, "loss") == pytest.approx(history(client, ddp, "loss"), rel=1e-3)
    # Each rank holds about half the parameters under FSDP (2 ranks), all of them under DDP.
    ratio = fsdp.data.metrics["param_bytes_per_rank"] / ddp.data.metrics["param_bytes_per_rank"]
    assert 0.45 < ratio < 0.55, ratio
    assert all(value > 0 for value in history(client, fsdp, "peak_mem_mb"))
    # FSDP has no DDP reducer to read comm time from: it is recorded as not measured, once per
    # epoch.
    comm = history(client, fsdp, "comm_time_s")
    assert len(comm) == EPOCHS and all(math.isnan(value) for value in comm)
    # The MLflow Model is the whole model, gathered from both shards: every parameter, and the
    # same function as DDP's model trained on the same batches.
    fsdp_model, ddp_model = (logged_model(client, run) for run in (fsdp, ddp))
    assert sum(p.numel() for p in fsdp_model.parameters()) == sum(
        p.numel() for p in ddp_model.parameters()
    )
    inputs = torch.randn(8, fsdp_model[0].in_features)
    with torch.no_grad():
        torch.testing.assert_close(fsdp_model(inputs), ddp_model(inputs), rtol=1e-2, atol=1e-3)


def logged_model(client, run):
    """The run's MLflow Model `model`, loaded as torch from where MLflow stored it."""
    import mlflow.pytorch

    (model,) = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string="name = 'model'"
    )
    assert model.source_run_id == run.info.run_id
    return mlflow.pytorch.load_model(model.artifact_location)


def test_ddp_flop_rate_matches_an_independent_count_and_names_every_ranks_step_times(runs):
    client, found = runs
    ddp = found["ddp2"]
    job = yaml.safe_load((JOBS / "mlp_synthetic.yaml").read_text())
    widths = [job["data"]["features"], *job["model"]["hidden"], job["data"]["targets"]]
    multiply_adds = sum(a * b for a, b in itertools.pairwise(widths))
    # 2 FLOPs per multiply-add, x3 for forward and backward, times the samples per second.
    independent = [
        2 * multiply_adds * 3 * samples_per_s / 1e12
        for samples_per_s in history(client, ddp, "samples_per_s")
    ]
    logged = history(client, ddp, "tflops_per_s")
    assert len(logged) == EPOCHS
    for ours, theirs in zip(logged, independent, strict=True):
        assert ours == pytest.approx(theirs, rel=0.2)
    peaks, mfu = history(client, ddp, "peak_tflops"), history(client, ddp, "mfu")
    assert all(peak > 0 for peak in peaks)
    assert mfu == pytest.approx([t / p for t, p in zip(logged, peaks, strict=True)])
    assert ddp.data.tags[TAG_PEAK_TFLOPS_SOURCE] == "measured:matmul"  # CPUs: no table
    for rank in (0, 1):  # each rank's own step times, every epoch; p95 at or above the median
        medians = history(client, ddp, f"rank{rank}_step_time_median_s")
        p95s = history(client, ddp, f"rank{rank}_step_time_p95_s")
        assert len(medians) == EPOCHS and all(
            0 < m <= p for m, p in zip(medians, p95s, strict=True)
        )
    assert "rank2_step_time_median_s" not in ddp.data.metrics
    # compare names the slower of the two ranks and the node it ran on
    uri = client.tracking_uri
    (summary,) = load_summaries(uri, run_ids=[ddp.info.run_id])
    assert summary.slowest_rank in (0, 1) and summary.step_time_spread >= 1.0
    assert summary.slowest_node == ddp.data.tags[TAG_NODE_IPS].split(",")[summary.slowest_rank]
    assert summary.mfu > 0
