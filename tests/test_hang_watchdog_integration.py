"""The hang watchdog on a real embedded 2-node cluster: rank 1 of a user's loop stops in
time.sleep inside epoch 1 while rank 0 waits for it in DDP's gradient all-reduce. The verdict is
read from the MLflow store (artifacts, tags) and from the processes left, not only from the
printout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import alive, descendants, mlflow_client, only_run, start_rayapp, wait_for_line

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_TIMEOUT_S = 20
LOOP = """
import time
from pathlib import Path

import torch
from torch import nn


def train_loop(ctx):
    model = ctx.prepare(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = ctx.loader(data, batch_size=8)
    for epoch in ctx.epochs(model, optimizer):
        for step, (inputs, targets) in enumerate(ctx.batches(loader)):
            if epoch == 1 and step == 3 and ctx.rank == 1:
                Path(ctx.args["stall_file"]).write_text(str(time.time()))
                time.sleep(10**6)
            with ctx.compute():
                loss = nn.functional.mse_loss(model(inputs), targets)
                ctx.backward(loss)
                ctx.step(optimizer)
            time.sleep(0.02)
        ctx.log_epoch({"loss": ctx.mean(loss.detach())})
"""


def test_a_rank_stuck_in_sleep_is_named_its_stacks_logged_and_nothing_left(tmp_path: Path):
    code, workdir = tmp_path / "code", tmp_path / "run"
    code.mkdir()
    workdir.mkdir()
    stall_file = tmp_path / "stalled_at"
    (code / "hangloop.py").write_text(LOOP)
    (code / "job.yaml").write_text(
        "name: hang\n"
        "train:\n"
        "  loop: hangloop:train_loop\n"
        "  epochs: 3\n"
        f"  args: {{stall_file: {str(stall_file)!r}}}\n"
        "checkpoint: {every_epochs: 1}\n"
    )
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--hang-timeout",
        str(HANG_TIMEOUT_S),
        str(code / "job.yaml"),
        cwd=workdir,
    )
    started: list[int] = []
    submitted_at = time.time()
    try:
        seen = wait_for_line(process, "epoch 1/3", timeout=180)
        first_epoch_at = time.time()
        started = descendants(process.pid)  # the cluster's processes, workers included
        output, _ = process.communicate(timeout=150)
        ended_at = time.time()
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(seen) + output
    assert process.returncode == 1, output[-3000:]
    stalled_at = float(stall_file.read_text())
    print(
        f"first epoch {first_epoch_at - submitted_at:.1f} s after submitting, stall "
        f"{stalled_at - first_epoch_at:.1f} s later, exit {ended_at - stalled_at:.1f} s after it"
    )
    assert ended_at - stalled_at < 90, f"ended {ended_at - stalled_at:.0f} s after the stall"
    assert [pid for pid in started if alive(pid)] == [], "processes left after the run"

    client = mlflow_client(workdir)
    run = only_run(client, "rayapp")
    rank1_node = run.data.tags["rayapp.node_ips"].split(",")[1]  # node IPs in rank order
    last_line = output.strip().splitlines()[-1]
    assert "hung" in last_line and f"rank 1 (node {rank1_node})" in last_line, last_line
    assert run.info.status == "FAILED"
    assert run.data.tags["rayapp.failure"] == "hang"
    assert run.data.tags["rayapp.hung_ranks"] == "1"
    assert run.data.tags["rayapp.hung_nodes"] == rank1_node
    names = {a.path for a in client.list_artifacts(run.info.run_id, "hang")}
    assert names == {"hang/rank0.txt", "hang/rank1.txt"}
    local = Path(client.download_artifacts(run.info.run_id, "hang", str(tmp_path / "stacks")))
    rank1 = (local / "rank1.txt").read_text()
    assert "time.sleep(10**6)" in rank1 and "train_loop" in rank1, rank1
    rank0 = (local / "rank0.txt").read_text()
    assert "backward" in rank0 or "all_reduce" in rank0, rank0
