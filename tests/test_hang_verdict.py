"""Reading a hang from stacks: real py-spy and faulthandler dumps of a real 2-process Gloo group
(no Ray) in which rank 0 waits in all_reduce and rank 1 sleeps; the timeout rule; the collective
timeout's explanation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rayapp.driver import stacks
from rayapp.driver.hang_verdict import judge, parse_threads, waiting_in
from rayapp.driver.watchdog import (
    DEFAULT_HANG_TIMEOUT_S,
    SIZED_FLOOR_S,
    explain_collective_timeout,
    hang_timeout_s,
    heartbeat_interval_s,
    is_hung,
)
from rayapp.spec.loader import build_spec

GROUP = """
import faulthandler, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

rank = int(sys.argv[1])
faulthandler.register(signal.SIGUSR2, file=open(sys.argv[3], "w"), all_threads=True)
dist.init_process_group(
    "gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
    timeout=timedelta(seconds=120),
)
print("ready", flush=True)
if rank == 1:
    time.sleep(10**6)
dist.all_reduce(torch.ones(4))
"""


@pytest.fixture(scope="module")
def stuck_group(tmp_path_factory):
    """Two real processes: rank 0 inside dist.all_reduce, rank 1 in time.sleep."""
    directory = tmp_path_factory.mktemp("group")
    script = directory / "group.py"
    script.write_text(GROUP)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                str(directory / "store"),
                str(directory / f"faulthandler{rank}.txt"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for process in processes:
            assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # rank 0 goes on into all_reduce
        yield processes, directory
    finally:
        for process in processes:
            process.kill()
            process.wait()


def where(process) -> dict:
    return {"pid": process.pid, "thread_id": process.pid, "node_ip": f"node-{process.pid}"}


def test_py_spy_stacks_name_the_sleeping_rank_and_the_collective(stuck_group):
    processes, _ = stuck_group
    dumps = {rank: stacks.dump_stack(p.pid) for rank, p in enumerate(processes)}
    ranks = {rank: where(p) for rank, p in enumerate(processes)}
    assert "time.sleep(10**6)" in dumps[1]  # the source line under the frame
    verdict = judge(dumps, ranks)
    assert verdict.hung_ranks == (1,)
    assert verdict.waiting_ranks == (0,)
    assert verdict.collective == "all_reduce"
    assert verdict.stands_apart
    assert f"rank 1 (node node-{processes[1].pid}) is not in the all_reduce" in verdict.summary()


def test_faulthandler_dumps_read_the_same(stuck_group):
    processes, directory = stuck_group
    dumps = {}
    for rank, process in enumerate(processes):
        path = directory / f"faulthandler{rank}.txt"
        before = path.stat().st_size
        os.kill(process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while path.stat().st_size == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        dumps[rank] = path.read_text()[before:]
    ranks = {rank: {**where(p), "thread_id": None} for rank, p in enumerate(processes)}
    # faulthandler names threads by pthread id: with none given, the dump's only thread is read
    assert [len(parse_threads(text)) for text in dumps.values()] == [1, 1]
    for rank in ranks:
        ranks[rank]["thread_ident"] = int(parse_threads(dumps[rank])[0].ident, 16)
    verdict = judge(dumps, ranks)
    assert (verdict.hung_ranks, verdict.collective) == ((1,), "all_reduce")


def test_a_rank_without_a_stack_is_a_culprit_and_same_waits_blame_no_rank():
    waiting = 'Thread 7 (idle): "TrainingThread(f)"\n    all_reduce (/x/torch/distributed/c.py:9)\n'
    ranks = {r: {"thread_id": 7, "node_ip": f"10.0.0.{r}"} for r in range(3)}
    gone = judge({0: waiting, 1: waiting}, ranks)
    assert gone.hung_ranks == (2,) and "no stack" in gone.where[2]
    same = judge({r: waiting for r in range(3)}, ranks)
    assert not same.stands_apart and same.hung_ranks == (0, 1, 2)
    assert "none stands apart" in same.summary()


def test_backward_under_ddp_counts_as_waiting():
    text = (
        'Thread 7 (idle): "TrainingThread(f)"\n'
        "    _engine_run_backward (/v/torch/autograd/graph.py:841)\n"
        "    backward (/v/torch/_tensor.py:625)\n"
        "    train_loop (/w/loop.py:12)\n"
    )
    assert waiting_in(parse_threads(text)[0]) == "backward (DDP's gradient all-reduce)"


def reports(*, epochs: int, gap: float, idle: tuple[float, ...]) -> dict:
    return {r: {"epochs": epochs, "longest_gap_s": gap, "idle_s": i} for r, i in enumerate(idle)}


def test_timeout_rule_given_default_and_sized():
    assert hang_timeout_s(20.0, reports(epochs=0, gap=0, idle=(0,))) == 20.0
    assert hang_timeout_s(None, reports(epochs=0, gap=9, idle=(0,))) == DEFAULT_HANG_TIMEOUT_S
    assert hang_timeout_s(None, reports(epochs=1, gap=0.5, idle=(0,))) == SIZED_FLOOR_S
    assert hang_timeout_s(None, reports(epochs=2, gap=90.0, idle=(0,))) == 900.0
    assert heartbeat_interval_s(20.0) == 2.5 and heartbeat_interval_s(None) == 5.0


def test_hung_only_when_no_rank_moved_for_the_timeout():
    assert is_hung(reports(epochs=1, gap=0, idle=(25, 21)), 20.0)
    assert not is_hung(reports(epochs=1, gap=0, idle=(25, 3)), 20.0)  # rank 1 still steps
    assert not is_hung({}, 20.0) and not is_hung(reports(epochs=1, gap=0, idle=(99,)), 0.0)


def test_a_gloo_timeout_is_explained_with_its_setting():
    spec = build_spec({}, {"train.collective_timeout_s": 30})
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Timed out waiting 30000ms for recv"
    explained = explain_collective_timeout(gloo, spec)
    assert explained.startswith(gloo) and "train.collective_timeout_s = 30 s" in explained
    assert explain_collective_timeout("ValueError: bad shape", spec) == "ValueError: bad shape"


def test_beats_note_when_each_rank_last_moved_and_forget_an_old_worker_group():
    from rayapp.driver.watchdog import Beats

    clock = [100.0]
    beats = Beats(clock=lambda: clock[0])
    beats.beat({"rank": 0, "token": "a", "marks": 5})
    beats.beat({"rank": 1, "token": "b", "marks": 5})
    clock[0] = 130.0
    beats.beat({"rank": 0, "token": "a", "marks": 5})  # alive, but no step finished
    beats.beat({"rank": 1, "token": "b", "marks": 6})
    assert {r: s["idle_s"] for r, s in beats.snapshot().items()} == {0: 30.0, 1: 0.0}
    beats.beat({"rank": 0, "token": "restarted", "marks": 0})  # a new worker group
    assert list(beats.snapshot()) == [0] and beats.snapshot()[0]["idle_s"] == 0.0


def test_a_rank_whose_heartbeat_stopped_is_silent_one_that_waits_is_not():
    from rayapp.driver.watchdog import Beats, silent_ranks

    clock = [100.0]
    beats = Beats(clock=lambda: clock[0])
    for rank in (0, 1):
        beats.beat({"rank": rank, "token": "a", "marks": 5})
    clock[0] = 125.0
    beats.beat({"rank": 0, "token": "a", "marks": 5})  # waits in a collective, still beating
    snapshot = beats.snapshot()  # rank 1: cut off since 100
    assert {r: (s["idle_s"], s["silent_s"]) for r, s in snapshot.items()} == {
        0: (25.0, 0.0),
        1: (25.0, 25.0),
    }
    assert silent_ranks(snapshot, heartbeat_s=2.5) == {1}
    assert silent_ranks(snapshot, heartbeat_s=10.0) == set()  # 25 s is under 3 beats of 10 s
    verdict = judge(
        {0: 'Thread 7 (idle): "TrainingThread(f)"\n    all_reduce (/x/torch/distributed/c.py:9)\n'},
        {0: {"thread_id": 7, "node_ip": "a"}, 1: {"node_ip": "b", "no_stack": "cut off"}},
    )
    assert verdict.hung_ranks == (1,) and verdict.where[1] == "cut off"


def test_a_silent_rank_is_the_culprit_whatever_the_others_are_caught_doing():
    # Rank 0 waits for the cut-off rank 1 in Ray Train's report, not in torch.distributed: by
    # the stacks alone neither stands apart, but only rank 1 stopped beating.
    in_report = (
        'Thread 7 (idle): "TrainingThread(f)"\n    report (/x/ray/train/v2/api/train_fn.py:3)\n'
    )
    ranks = {
        0: {"thread_id": 7, "node_ip": "198.18.0.2"},
        1: {"node_ip": "198.18.0.3", "silent": True, "no_stack": "no heartbeat for 30 s"},
    }
    verdict = judge({0: in_report}, ranks)
    assert verdict.hung_ranks == (1,) and verdict.waiting_ranks == (0,)
    assert verdict.culprits() == "rank 1 (node 198.18.0.3)"
    assert "no heartbeat for 30 s" in verdict.summary()
    # Every rank silent (the driver's own node cut off): none is singled out.
    for report in ranks.values():
        report.update(silent=True, no_stack="no heartbeat")
    assert judge({}, ranks).hung_ranks == (0, 1)


TIMING_OUT = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist

rank = int(sys.argv[1])
dist.init_process_group(
    "gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
    timeout=timedelta(seconds=3),
)
if rank == 1:
    time.sleep(30)
try:
    dist.all_reduce(torch.ones(4))
except Exception as exc:
    print([line for line in str(exc).splitlines() if line.strip()][-1], flush=True)
"""


def test_a_real_gloo_timeout_is_recognised_and_explained(tmp_path):
    script = tmp_path / "timing_out.py"
    script.write_text(TIMING_OUT)
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "store")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        error = processes[0].communicate(timeout=60)[0].strip()
    finally:
        for process in processes:
            process.kill()
            process.wait()
    spec = build_spec({}, {"train.collective_timeout_s": 3})
    assert error, "rank 0's all_reduce did not time out"
    assert explain_collective_timeout(error, spec) == (
        f"{error} (a collective waited past train.collective_timeout_s = 3 s for a peer rank "
        "that was lost or stuck)"
    )
