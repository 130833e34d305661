"""Strategy pp without Ray: the stage split, the spec's one-line errors, and two Gloo processes
that run the schedule, checkpoint their stages with DCP and resume."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from click.testing import CliRunner
from conftest import JOBS
from torch import nn

from rayapp.cli import main
from rayapp.spec.loader import build_spec, load_spec
from rayapp.train.pipeline import StageBatches, bubble_ideal
from rayapp.train.pipeline_split import balanced_split, layer_units, split_model

JOB = JOBS / "mlp_pipeline.yaml"


def brute_force_best(sizes, parts):
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), parts - 1):
        bounds = (0, *cuts, len(sizes))
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_covers_every_unit_once_with_the_smallest_largest_stage(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(0, 1000) for _ in range(rng.randint(2, 9))]
    parts = rng.randint(2, len(sizes))
    ranges = balanced_split(sizes, parts)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
    assert all(a < b for a, b in ranges) and all(
        prev[1] == nxt[0] for prev, nxt in itertools.pairwise(ranges)
    )
    assert max(sum(sizes[a:b]) for a, b in ranges) == brute_force_best(sizes, parts)


def test_balanced_split_refuses_more_parts_than_units():
    with pytest.raises(ValueError, match="cannot cut 2 layer unit"):
        balanced_split([1, 2], 3)


def test_mlp_split_keeps_every_layer_once_under_its_name_and_balances_parameters():
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 64),
    )
    for stages in (2, 3, 4):
        parts = split_model(model, stages)
        names = [name for part in parts for name, _ in part.named_children()]
        assert names == [name for name, _ in model.named_children()]  # each once, in order
        assert all(
            dict(part.named_children())[name] is model._modules[name]
            for part in parts
            for name, _ in part.named_children()
        )
        counts = [sum(p.numel() for p in part.parameters()) for part in parts]
        assert all(counts) and sum(counts) == sum(p.numel() for p in model.parameters())
        units = [
            sum(p.numel() for _, m in unit for p in m.parameters()) for unit in layer_units(model)
        ]
        assert max(counts) == brute_force_best(units, stages)
    # The stages chained are the model; their state dict keys are the model's.
    inputs = torch.randn(5, 64)
    parts = split_model(model, 2)
    assert torch.equal(parts[1](parts[0](inputs)), model(inputs))
    assert set(parts[0].state_dict()) | set(parts[1].state_dict()) == set(model.state_dict())


def test_parameterless_layers_stay_with_the_layer_before_them():
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Dropout(), nn.Linear(4, 2), nn.Tanh()
    )
    assert [[name for name, _ in unit] for unit in layer_units(model)] == [
        ["0", "1", "2", "3"],
        ["4", "5"],
    ]
    with pytest.raises(ValueError, match="2 layer"):
        split_model(model, 3)
    with pytest.raises(TypeError, match="nn.Sequential"):
        layer_units(nn.Linear(3, 3))


def test_stage_batches_give_inputs_to_the_first_stage_and_targets_to_the_last():
    loader = [[torch.ones(4, 3), torch.zeros(4, 1)]]
    assert StageBatches(loader, first=True, last=False).__iter__().__next__() is loader[0]
    assert torch.equal(
        next(iter(StageBatches(loader, first=False, last=True)))["target"], torch.zeros(4, 1)
    )
    assert next(iter(StageBatches(loader, first=False, last=False))) == {"target": None}
    assert bubble_ideal(2, 8) == pytest.approx(1 / 9) and bubble_ideal(4, 4) == pytest.approx(3 / 7)


def test_the_shipped_job_and_its_defaults():
    spec = load_spec(JOB)
    pipe = spec.train.pipeline
    assert (spec.train.strategy, pipe.stages, pipe.microbatches, pipe.schedule) == (
        "pp",
        2,
        8,
        "gpipe",
    )
    assert (spec.data_parallel_size, spec.batch_size_per_worker, spec.global_batch_size) == (
        1,
        256,
        256,
    )
    assert (
        spec.steps_per_epoch == spec.num_train_samples // 256
    )  # the stages share one replica's batches
    default = build_spec(
        {"model": {"kind": "mlp", "hidden": [8, 8]}}, {"train.strategy": "pp", "cluster.nodes": 3}
    )
    assert default.train.pipeline.stages == 3  # one stage per worker
    assert build_spec({}, {}).train.pipeline is None
    assert load_spec(JOB, {"train.strategy": "ddp"}).train.pipeline is None  # a pp job run as ddp
    assert (
        load_spec(JOB, {"train.pipeline.microbatches": 1}).train.pipeline.microbatches == 1
    )  # < stages: allowed


def test_a_pipeline_per_node_makes_the_nodes_data_parallel():
    spec = load_spec(JOB, {"cluster.workers_per_node": 2})  # stages 2 on 2 nodes x 2 workers
    assert (spec.world_size, spec.train.pipeline.stages, spec.data_parallel_size) == (4, 2, 2)
    assert (spec.batch_size_per_worker, spec.global_batch_size) == (128, 256)  # a pipeline's half
    assert spec.steps_per_epoch == spec.num_train_samples // 256
    whole = load_spec(JOB, {"cluster.workers_per_node": 2, "train.pipeline.stages": 4})
    assert (whole.data_parallel_size, whole.batch_size_per_worker) == (1, 256)


def invoke(*args):
    return CliRunner().invoke(main, ["submit", *map(str, args)])


@pytest.mark.parametrize(
    "args,message",
    [
        (
            [JOB, "--pp-stages", "1"],
            "train.pipeline.stages: 1 is not accepted; use a whole number >= 2",
        ),
        (
            [JOB, "--pp-stages", "4"],
            "train.pipeline.stages: 4 is not accepted with world_size 2 (nodes 2 * "
            "workers_per_node 1); strategy pp runs one stage per worker",
        ),
        ([JOB, "--nodes", "3"], "train.pipeline.stages: 2 is not accepted with world_size 3"),
        (
            [JOB, "--workers-per-node", "2", "--pp-stages", "3"],
            "train.pipeline.stages: 3 is not accepted with world_size 4 (nodes 2 * "
            "workers_per_node 2); strategy pp runs one stage per worker, in one pipeline over "
            "every worker (stages 4), or one pipeline per node with the nodes data-parallel "
            "(stages 2, the run's 2-D mesh): use stages 4 or 2, or 3 workers",
        ),
        (
            [JOB, "--nodes", "1", "--workers-per-node", "4"],
            "train.pipeline.stages: 2 is not accepted with world_size 4 (nodes 1 * "
            "workers_per_node 4); strategy pp runs one stage per worker, in one pipeline over "
            "every worker (stages 4): use stages 4, or 2 workers",
        ),
        (
            [JOB, "--microbatches", "0"],
            "train.pipeline.microbatches: 0 is not accepted; use a whole number >= 1",
        ),
        (
            [JOB, "--microbatches", "3"],
            "train.pipeline.microbatches: 3 does not divide the batch of 256",
        ),
        (
            [JOB, "--pp-schedule", "zb"],
            "train.pipeline.schedule: 'zb' is not accepted; use one of: gpipe, 1f1b",
        ),
        ([JOB, "--compile"], "train.compile: true is not accepted with train.strategy 'pp'"),
        (
            [JOB, "--precision", "fp16"],
            "train.precision: 'fp16' is not accepted with train.strategy 'pp'",
        ),
        (
            [JOB, "--log-every-steps", "5"],
            "tracking.log_every_steps: 5 is not accepted with train.strategy 'pp'",
        ),
        (
            [JOB, "--strategy", "ddp", "--microbatches", "4"],
            "train.pipeline: only for train.strategy pp, not 'ddp'",
        ),
        (
            [JOBS / "digits_mlp.yaml", "--strategy", "pp"],
            "train.strategy: 'pp' is not accepted with world_size 1",
        ),
        (
            [JOBS / "seed_linear.yaml", "--strategy", "pp", "--nodes", "2"],
            "model.kind: 'linear' with hidden [] has 1 layer(s) to split, "
            "fewer than train.pipeline.stages 2",
        ),
        (
            [JOBS / "digits_mlp.yaml", "--strategy", "pp", "--nodes", "3"],
            "model.kind: 'mlp' with hidden [128] has 2 layer(s) to split, "
            "fewer than train.pipeline.stages 3",
        ),
    ],
)
def test_bad_pipeline_settings_exit_2_with_one_line(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "train:\n  strategy: pp\n  pipeline:\n    stage: 2\n",
            "train.pipeline.stage: unknown key; accepted keys are stages",
        ),
        (
            "train:\n  strategy: pp\n  pipeline: 2\n",
            "train.pipeline: 2 is not accepted; use a mapping of stages",
        ),
        ("train:\n  pipeline: {microbatches: 4}\n", "train.pipeline: only for train.strategy pp"),
        (
            "model: {kind: mlp, hidden: [8]}\ntrain:\n  strategy: pp\n  grad_accum_steps: 2\n"
            "cluster: {nodes: 2}\n",
            "train.grad_accum_steps: 2 is not accepted with train.strategy 'pp'",
        ),
        (
            "model: {kind: mlp, hidden: [8]}\ntrain:\n  strategy: pp\n"
            "checkpoint: {format: full}\ncluster: {nodes: 2}\n",
            "checkpoint.format: 'full' is not accepted with train.strategy 'pp'",
        ),
    ],
)
def test_bad_pipeline_yaml_exit_2_with_one_line(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    result = invoke(path)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_submit_help_lists_the_pipeline_flags():
    output = CliRunner().invoke(main, ["submit", "-h"]).output
    assert all(flag in output for flag in ("--pp-stages", "--microbatches", "--pp-schedule"))
    assert all(
        flag in CliRunner().invoke(main, ["bench", "-h"]).output
        for flag in ("--pp-stages", "--microbatches")
    )


# ---- two real stages on Gloo, without Ray ----------------------------------------------


def one_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 128, generator=generator), torch.randn(16, 16, generator=generator)


def _two_stages(rank: int, port: int, directory: str, results) -> None:
    import torch.distributed as dist

    from rayapp.train import checkpoint
    from rayapp.train.models import build_loss, build_model, build_optimizer
    from rayapp.train.pipeline import StageClock, make_schedule, restore_hyperparameters, run_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = load_spec(JOB, {"train.pipeline.microbatches": 4, "train.pipeline.schedule": "1f1b"})
    clock, device = StageClock(torch.device("cpu")), torch.device("cpu")
    inputs, targets = one_batch()
    batch = [inputs, targets] if rank == 0 else {"target": targets}

    def trained(steps: int, resume: bool):
        model = split_model(build_model(spec), 2)[rank]
        optimizer = build_optimizer(spec, model)
        hyperparameters = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        if resume:
            checkpoint.load(directory, model, optimizer, {})
            restore_hyperparameters(optimizer, hyperparameters)
        schedule = make_schedule(
            spec, model, build_loss(spec), rank=rank, device=device, clock=clock
        )
        losses = []
        for _ in range(steps):
            clock.schedule.start()
            losses.append(
                float(run_step(schedule, batch, first=rank == 0, last=rank == 1, device=device))
            )
            clock.schedule.stop()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer, losses

    model, optimizer, straight = trained(3, resume=False)  # three steps in one go
    model, optimizer, first = trained(2, resume=False)  # two, a checkpoint, and one after resuming
    checkpoint.save(spec, directory, model, optimizer, {}, rank=rank)
    dist.barrier()
    _, _, after = trained(1, resume=True)
    schedule_s, compute_s = clock.figures()
    results.put((rank, straight, first + after, schedule_s, compute_s))
    dist.destroy_process_group()


def test_two_stages_train_like_one_process_and_resume_from_dcp(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    from rayapp.launch.cluster import free_port
    from rayapp.train.models import build_loss, build_model, build_optimizer

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        _two_stages, args=(free_port(), str(tmp_path), results), nprocs=2, start_method="spawn"
    )
    outcome = {rank: rest for rank, *rest in (results.get(), results.get())}

    spec = load_spec(JOB)
    model = build_model(spec)
    optimizer, loss_fn = build_optimizer(spec, model), build_loss(spec)
    inputs, targets = one_batch()
    expected = []
    for _ in range(3):
        parts = [
            loss_fn(model(x), y) for x, y in zip(inputs.chunk(4), targets.chunk(4), strict=True)
        ]
        (torch.stack(parts).sum() / 4).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(torch.stack(parts).mean().item())
    straight, resumed, schedule_s, compute_s = outcome[1]
    assert straight == pytest.approx(expected, rel=1e-5)
    assert resumed == pytest.approx(
        straight, rel=1e-6
    )  # the resumed stage and Adam state are exact
    assert outcome[0][0] == [0.0, 0.0, 0.0]  # only the last stage holds the loss
    assert 0 < compute_s < schedule_s
