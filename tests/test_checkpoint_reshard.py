"""A DCP checkpoint written by 2 FSDP ranks loads into 1 rank, and into DDP: resuming on another
world size or strategy gets the same weights and optimizer state. Real process groups (Gloo), no
Ray."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rayapp.launch.cluster import free_port
from rayapp.spec.loader import build_spec
from rayapp.train.checkpoint import load, save
from rayapp.train.strategies import apply_strategy


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def spec(strategy: str, world: int):
    return build_spec(
        {
            "name": "reshard",
            "train": {"strategy": strategy},
            "checkpoint": {"format": "dcp"},
            "cluster": {"nodes": world},
        }
    )


def trained(strategy: str, world: int, directory: str, rank: int):
    """One Adam step on a fixed batch, saved to `directory` with rayapp's checkpoint code."""
    model = apply_strategy(spec(strategy, world), build(), torch.device("cpu")).model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    save(spec(strategy, world), directory, model, optimizer, {}, rank=rank)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from rayapp.train.checkpoint import full_model_state

    return {k.removeprefix("module."): v.clone() for k, v in full_model_state(model).items()}


def group(rank: int, world: int, port: int, body, *args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, *args)
        # Every rank done before any tears down: Gloo can abort a rank whose peer destroyed the
        # group (and, on rank 0, the store) first ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_on_two(rank: int, directory: str, out: dict) -> None:
    model = trained("fsdp", 2, directory, rank)
    state = full_state(model)
    if rank == 0:
        out["saved"] = state


def load_on_one(rank: int, directory: str, out: dict) -> None:
    for strategy in ("fsdp", "ddp"):
        model = apply_strategy(spec(strategy, 1), build(), torch.device("cpu")).model
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        load(directory, model, optimizer, {})
        out[strategy] = full_state(model)
        out[f"{strategy}_steps"] = [float(s["step"]) for s in optimizer.state.values()]


def test_a_two_rank_fsdp_checkpoint_resumes_on_one_rank_with_fsdp_or_ddp(tmp_path):
    directory = str(tmp_path / "checkpoint")
    os.makedirs(directory)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(group, args=(2, free_port(), save_on_two, directory, out), nprocs=2, join=True)
        mp.spawn(group, args=(1, free_port(), load_on_one, directory, out), nprocs=1, join=True)
        out = dict(out)
    assert any(
        name.endswith(".distcp") for name in os.listdir(directory)
    )  # each rank wrote its shard
    fresh = build().state_dict()
    for strategy in ("fsdp", "ddp"):
        saved, loaded = out["saved"], out[strategy]
        assert saved.keys() == loaded.keys(), strategy
        for key in saved:
            torch.testing.assert_close(loaded[key], saved[key], msg=f"{strategy}: {key}")
        assert not torch.equal(
            fresh["0.weight"], loaded["0.weight"]
        )  # trained weights, not initial ones
        assert out[f"{strategy}_steps"] and all(
            step == 1.0 for step in out[f"{strategy}_steps"]
        )  # Adam's state


def save_async_then_train_on(rank: int, directory: str, out: dict) -> None:
    """checkpoint.async: the save returns after staging, training steps on while the write runs
    in the background, and the checkpoint holds the state of the moment it was taken."""
    from rayapp.train.checkpoint import BackgroundWrite

    async_spec = build_spec(
        {
            "name": "reshard",
            "train": {"strategy": "fsdp"},
            "checkpoint": {"format": "dcp", "async": True},
            "cluster": {"nodes": 2},
        }
    )
    model = apply_strategy(async_spec, build(), torch.device("cpu")).model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    background = BackgroundWrite()
    written = save(async_spec, directory, model, optimizer, {}, rank=rank, background=background)
    at_save = full_state(model)
    for _ in range(3):  # the next steps change every tensor the write is still reading
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
    background.wait()
    assert written is not None and written.done()
    after = full_state(model)  # a collective under FSDP: every rank
    if rank == 0:
        out["saved"], out["after"] = at_save, after


def test_an_async_save_holds_the_state_it_was_taken_at_while_training_goes_on(tmp_path):
    directory = str(tmp_path / "checkpoint")
    os.makedirs(directory)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(group, args=(2, free_port(), save_async_then_train_on, directory, out), nprocs=2)
        mp.spawn(group, args=(1, free_port(), load_on_one, directory, out), nprocs=1, join=True)
        out = dict(out)
    for key, saved in out["saved"].items():
        torch.testing.assert_close(out["fsdp"][key], saved, msg=key)
        assert not torch.equal(out["after"][key], saved), key  # training did move on
    assert out["fsdp_steps"] and all(step == 1.0 for step in out["fsdp_steps"])
