"""GPU paths: NCCL process groups, DDP and FSDP on CUDA, nn.DataParallel and the two-GPU model
split.

Marked `gpu`: skipped (by conftest) on machines without CUDA. They run the real CLI on the
embedded cluster, which deals the machine's GPUs out to its nodes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import JOBS, mlflow_client, only_run, run_rayapp

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_on_two_nodes(workdir, strategy):
    if gpus() < 2:
        pytest.skip("needs 2 GPUs: one per embedded node")
    result = run_rayapp(
        "submit",
        "--nodes",
        "2",
        "--strategy",
        strategy,
        "--epochs",
        "2",
        str(JOBS / "mlp_synthetic.yaml"),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = only_run(mlflow_client(workdir))
    assert run.data.params["backend"] == "nccl"
    assert run.data.metrics["peak_mem_mb"] > 0


@pytest.mark.parametrize("strategy", ["dp", "mp"])
def test_single_process_multi_gpu(workdir, strategy):
    if gpus() < 2:
        pytest.skip("needs 2 GPUs on one node")
    result = run_rayapp(
        "submit",
        "--nodes",
        "1",
        "--strategy",
        strategy,
        "--epochs",
        "3",
        str(JOBS / "digits_mlp.yaml"),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = only_run(mlflow_client(workdir))
    assert run.data.metrics["test_accuracy"] > 0.5


@pytest.mark.parametrize("strategy", ["hsdp", "tp"])
def test_mesh_strategies_on_nccl(workdir, strategy):
    # The mesh's shard dim is the workers of a node: 2 GPUs make one node of 2, 4 make 2 x 2.
    if gpus() < 2:
        pytest.skip("needs 2 GPUs: two workers of one node")
    nodes = 2 if gpus() >= 4 else 1
    result = run_rayapp(
        "submit", "--nodes", str(nodes), "--workers-per-node", "2", "--strategy", strategy,
        "--epochs", "2", str(JOBS / "mlp_synthetic.yaml"), cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = only_run(mlflow_client(workdir))
    assert run.data.params["backend"] == "nccl"
    assert run.data.params["mesh"] == f"replicate={nodes},shard=2"
    losses = [m.value for m in mlflow_client(workdir).get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 2 and losses[-1] < losses[0]
    # mlp_synthetic: 128 -> 512 -> 512 -> 16, fp32; both strategies split the first two layers.
    whole = 4 * (128 * 512 + 512 + 512 * 512 + 512 + 512 * 16 + 16)
    assert run.data.metrics["param_bytes_per_rank"] < 0.6 * whole
    assert run.data.metrics["comm_bytes_per_step"] > 0


@pytest.mark.parametrize("strategy", ["tp", "fsdp+tp"])
def test_tensor_parallel_in_fp16_with_clipping_and_compile(workdir, strategy):
    # fp16's gradient scaler and the global-norm clip over DTensor gradients on two meshes (the
    # split layers on the 2-D mesh, the whole last layer on the replicate dim); CPUs refuse fp16.
    if gpus() < 2:
        pytest.skip("needs 2 GPUs: two workers of one node")
    import yaml

    job = yaml.safe_load((JOBS / "mlp_synthetic.yaml").read_text())
    job["train"].update({"precision": "fp16", "grad_clip": 1.0, "compile": True})
    (workdir / "job.yaml").write_text(yaml.safe_dump(job))
    nodes = 2 if gpus() >= 4 else 1
    result = run_rayapp(
        "submit", "--nodes", str(nodes), "--workers-per-node", "2", "--strategy", strategy,
        "--epochs", "2", str(workdir / "job.yaml"), cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = only_run(mlflow_client(workdir))
    assert run.data.params["precision"] == "fp16"
    losses = [m.value for m in mlflow_client(workdir).get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 2 and losses[-1] < losses[0], losses
