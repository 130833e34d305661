"""hsdp, tp and fsdp+tp without Ray: the spec's checks, the tensor-parallel plans, the collective
byte count, and real 4-rank Gloo process groups on a (replicate=2, shard=2) mesh, where each
strategy (and pp with a pipeline per node) trains to ddp's weights, with and without gradient
clipping, and an hsdp checkpoint resumes on a mesh of another shape."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO
from torch import nn

from rayapp.launch.cluster import free_port
from rayapp.spec import SpecError
from rayapp.spec.loader import build_spec
from rayapp.train.comm_bytes import CollectiveBytes, collective_bytes
from rayapp.train.tensor_parallel import TensorParallelError, plan_for, sequential_plan

# ---- the spec ----------------------------------------------------------------------------


def job(strategy: str, hidden: list[int], workers_per_node: int = 2) -> dict:
    return {
        "name": "mesh",
        "model": {"kind": "mlp", "hidden": hidden} if hidden else {"kind": "linear"},
        "train": {"strategy": strategy, "scaling": "strong", "global_batch_size": 64},
        "cluster": {"nodes": 2, "workers_per_node": workers_per_node},
    }


def test_under_tensor_parallelism_a_node_is_one_data_parallel_replica():
    for strategy, replicas in (("tp", 2), ("fsdp+tp", 2), ("hsdp", 4), ("ddp", 4)):
        spec = build_spec(job(strategy, [64, 64]), {})
        assert spec.data_parallel_size == replicas, strategy
        assert spec.batch_size_per_worker == 64 // replicas, strategy
        assert spec.global_batch_size == 64, strategy


@pytest.mark.parametrize(
    "strategy,hidden,workers,message",
    [
        (
            "tp",
            [],
            2,
            "train.strategy: 'tp' needs a model with a tensor-parallel plan; model.kind ",
        ),
        ("fsdp+tp", [62, 64], 4, "model.hidden: width 62 of [62, 64] does not divide by the "),
    ],
)
def test_a_built_in_model_tp_cannot_split_is_one_line(strategy, hidden, workers, message):
    with pytest.raises(SpecError) as caught:
        build_spec(job(strategy, hidden, workers), {})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_refuses_such_a_job_with_exit_2(tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "rayapp", "submit", "--strategy", "tp", "--nodes", "2",
         "--workers-per-node", "3", str(REPO / "jobs" / "mlp_synthetic.yaml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "width 512 of [512, 512] does not divide by the tensor-parallel size 3" in result.stderr
    assert "Traceback" not in result.stderr


def test_tensor_parallel_takes_clipping_bf16_compile_and_accumulation():
    document = job("fsdp+tp", [64, 64])
    document["train"].update(grad_clip=1.0, precision="bf16", compile=True, grad_accum_steps=2)
    for strategy in ("tp", "fsdp+tp"):
        train = build_spec(document, {"train.strategy": strategy}).train
        assert (train.grad_clip, train.precision, train.compile) == (1.0, "bf16", True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU accepts fp16")
def test_fp16_under_tensor_parallelism_on_cpus_is_one_line_exit_2():
    from click.testing import CliRunner

    from rayapp.cli import main

    result = CliRunner().invoke(
        main,
        ["submit", str(REPO / "jobs" / "mlp_synthetic.yaml"), "--nodes", "2",
         "--workers-per-node", "2", "--strategy", "fsdp+tp", "--precision", "fp16"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "rayapp: error: train.precision: 'fp16' is not accepted on CPUs (no CUDA GPU here; fp16 "
        "needs loss scaling on a GPU); use bf16, which CPUs run, or fp32"
    ]


# ---- plans -------------------------------------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def test_the_mlps_linear_layers_pair_column_then_row_wise():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = sequential_plan(mlp())
    assert list(plan) == ["0", "2"]  # the odd last Linear stays whole
    assert isinstance(plan["0"], ColwiseParallel) and isinstance(plan["2"], RowwiseParallel)


def test_models_without_a_plan_or_with_a_width_that_does_not_divide_are_one_line():
    with pytest.raises(TensorParallelError, match=r"^model Bilinear has no tensor-parallel plan"):
        plan_for(nn.Bilinear(2, 2, 2), 2)
    with pytest.raises(TensorParallelError) as caught:
        plan_for(mlp(), 3)
    assert str(caught.value).startswith("layer '0' (Linear) has 16 features to split column-wise")


def test_char_gpt_brings_its_own_plan():
    sys.path.insert(0, str(REPO / "examples" / "char_gpt"))
    try:
        from gpt import CharGPT, GPTConfig
    finally:
        sys.path.pop(0)
    model = CharGPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    plan = plan_for(model, 4)
    assert sorted(plan) == ["blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0", "blocks.1.mlp.2"]
    with pytest.raises(TensorParallelError, match="'blocks.0.mlp.0'"):
        plan_for(model, 5)


def test_collective_bytes_counts_the_whole_buffer():
    shard, full = torch.zeros(4), torch.zeros(16)
    assert collective_bytes("_allgather_base_", (full, shard)) == 64
    assert collective_bytes("_reduce_scatter_base_", (shard, full)) == 64
    assert collective_bytes("allreduce_", ([full, shard], object())) == 80
    assert collective_bytes("all_gather_into_tensor", (shard, 4, "group")) == 64


# ---- real process groups -----------------------------------------------------------------

STEPS = 3


def spec_for(strategy: str, nodes: int = 2):
    return build_spec(
        job(strategy, [16, 16]) | {"cluster": {"nodes": nodes, "workers_per_node": 2}}
    )


CLIP = 0.05
"""A gradient-norm limit the test's steps exceed (their norms are near 1), so clipping changes
them."""


def train(
    strategy: str, rank: int, mesh, clip: float | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """STEPS Adam steps on a fixed global batch of 16, each rank on its data-parallel share, the
    gradients' global norm clipped to `clip` (train.grad_clip) if given; returns the model,
    optimizer and the last step's collective bytes."""
    from rayapp.train.stepping import clip_grad_norm
    from rayapp.train.strategies import apply_strategy

    spec = spec_for(strategy)
    model = apply_strategy(spec, mlp(), torch.device("cpu"), mesh).model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 4)
    replicas = spec.data_parallel_size
    share = rank if replicas == 4 else mesh.get_local_rank("replicate")
    size = 16 // replicas
    for _ in range(STEPS):
        counter = CollectiveBytes()
        with counter:
            rows = slice(share * size, (share + 1) * size)
            loss = nn.functional.mse_loss(model(inputs[rows]), targets[rows])
            loss.backward()
            if clip is not None:
                clip_grad_norm(list(model.parameters()), clip)
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer, counter.total


def train_pp(rank: int, mesh) -> dict[str, torch.Tensor]:
    """The same steps under pp on the 2-D mesh: a pipeline of 2 stages per node (2 micro-batches
    each step), each pipeline on its node's half of the batch, the stages' gradients averaged
    across the nodes; returns the whole model, gathered from the stages."""
    from types import SimpleNamespace

    from rayapp.train.pipeline import StageClock, make_schedule, run_step
    from rayapp.train.pipeline_mesh import average_gradients, pipeline_place
    from rayapp.train.pipeline_split import split_model

    document = job("pp", [16, 16])
    document["train"]["pipeline"] = {"stages": 2, "microbatches": 2}
    spec = build_spec(document)
    place = pipeline_place(SimpleNamespace(spec=spec, world_size=4, rank=rank, mesh=mesh))
    assert (place.stage, place.replica) == (rank % 2, rank // 2)  # a pipeline per node
    device = torch.device("cpu")
    model = split_model(mlp(), 2)[place.stage]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    schedule = make_schedule(
        spec, model, nn.functional.mse_loss, rank=place.stage, device=device,
        clock=StageClock(device), group=place.pipeline_group,
    )  # fmt: skip
    torch.manual_seed(1)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 4)
    rows = slice(place.replica * 8, (place.replica + 1) * 8)
    for _ in range(STEPS):
        batch = [inputs[rows], targets[rows]] if place.first else {"target": targets[rows]}
        run_step(schedule, batch, first=place.first, last=place.last, device=device)
        average_gradients(model, place)
        optimizer.step()
        optimizer.zero_grad()
    parts: list = [None] * 4
    dist.all_gather_object(parts, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return {key: value for part in parts for key, value in part.items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from rayapp.train.checkpoint import full_model_state

    return {k.removeprefix("module."): v.clone() for k, v in full_model_state(model).items()}


def group(rank: int, world: int, port: int, out: dict, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from rayapp.train.checkpoint import load, save
        from rayapp.train.mesh import build_mesh

        mesh = build_mesh(world_size=world, workers_per_node=2, device=torch.device("cpu"))
        if world == 4:
            for strategy in ("ddp", "hsdp", "tp", "fsdp+tp"):
                model, optimizer, sent = train(strategy, rank, mesh)
                state = full_state(model)
                if rank == 0:
                    out[strategy], out[f"{strategy}_bytes"] = state, sent
                if strategy == "hsdp":
                    save(spec_for("hsdp"), directory, model, optimizer, {}, rank=rank)
            pp_state = train_pp(rank, mesh)
            if rank == 0:
                out["pp"] = pp_state
            # Clipped: under tp and fsdp+tp the gradients are DTensors on two meshes (the split
            # layers on the 2-D mesh, the last, whole one on its replicate dim alone).
            for strategy in ("ddp", "hsdp", "tp", "fsdp+tp"):
                state = full_state(train(strategy, rank, mesh, clip=CLIP)[0])
                if rank == 0:
                    out[f"{strategy}_clipped"] = state
        else:  # the hsdp checkpoint of a 2 x 2 mesh, resumed on a 1 x 2 one
            from rayapp.train.strategies import apply_strategy

            model = apply_strategy(spec_for("hsdp", 1), mlp(), torch.device("cpu"), mesh).model
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
            load(directory, model, optimizer, {})
            state = full_state(model)
            if rank == 0:
                out["resumed"] = state
                out["resumed_steps"] = [float(s["step"]) for s in optimizer.state.values()]
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 20-30 s: outside the README command's 15 minutes, run by .ci/run
def test_mesh_strategies_train_to_ddps_weights_and_hsdp_resumes_on_another_shape(tmp_path):
    directory = str(tmp_path / "checkpoint")
    Path(directory).mkdir()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(group, args=(4, free_port(), out, directory), nprocs=4, join=True)
        mp.spawn(group, args=(2, free_port(), out, directory), nprocs=2, join=True)
        out = dict(out)
    reference = out["ddp"]
    assert not torch.equal(reference["0.weight"], mlp().state_dict()["0.weight"])  # trained
    for strategy in ("hsdp", "tp", "fsdp+tp", "pp", "resumed"):
        assert out[strategy].keys() == reference.keys(), strategy
        for key, value in reference.items():
            torch.testing.assert_close(out[strategy][key], value, msg=f"{strategy} drifts: {key}")
    assert out["resumed_steps"] and all(step == STEPS for step in out["resumed_steps"])
    clipped = out["ddp_clipped"]
    assert not torch.allclose(clipped["0.weight"], reference["0.weight"])  # the clip bites
    for strategy in ("hsdp", "tp", "fsdp+tp"):
        for key, value in clipped.items():
            torch.testing.assert_close(
                out[f"{strategy}_clipped"][key], value, msg=f"{strategy} clips otherwise: {key}"
            )
    # ddp all-reduces each gradient once: the model's 4-byte parameters, counted from the
    # collective; hsdp adds its all-gathers and reduce-scatters.
    parameters = sum(p.numel() for p in mlp().parameters())
    assert out["ddp_bytes"] == 4 * parameters
    assert out["hsdp_bytes"] > out["ddp_bytes"] and out["tp_bytes"] > 0


def test_a_factory_model_tp_cannot_split_is_refused_before_anything_starts(tmp_path):
    from rayapp.train.user_code import check_user_code

    (tmp_path / "tp_models.py").write_text(
        "from torch import nn\n"
        "def odd(): return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))\n"
        "def planless(): return nn.Bilinear(2, 2, 2)\n"
    )
    for factory, message in (
        ("tp_models:odd", "layer '0' (Linear) has 6 features to split column-wise"),
        ("tp_models:planless", "model Bilinear has no tensor-parallel plan"),
    ):
        document = job("tp", [64]) | {"model": {"factory": factory}}
        document["cluster"]["workers_per_node"] = 4
        with pytest.raises(SpecError, match=re.escape(f"model.factory: {factory}: {message}")):
            check_user_code(build_spec(document, {}), tmp_path)
    sys.modules.pop("tp_models", None)
