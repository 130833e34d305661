"""benchmarks/preemptions.py on lines in the exact format
`perf script -F comm,tid,cpu,time,event,trace` writes.

The trace is written here because recording one needs perf and scheduler tracepoints, which a
test machine may lack; the lines are copied in shape from a real trace of a rayapp worker."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import preemptions  # noqa: E402


def switch(t: float, prev: tuple[str, int], state: str, nxt: tuple[str, int]) -> str:
    return (
        f"{prev[0]:>16} {prev[1]:5d} [000] {t:12.6f}:       sched:sched_switch: "
        f"prev_comm={prev[0]} prev_pid={prev[1]} prev_prio=135 prev_state={state} "
        f"==> next_comm={nxt[0]} next_pid={nxt[1]} next_prio=135"
    )


TRAIN_A, TRAIN_B = ("ray::RayTrainWo", 100), ("ray::RayTrainWo", 200)
MAIN = ("ray::RayTrainWo", 101)  # the worker's main thread: same name, hardly runs
POLL0, POLL1, GLOO = ("client.poll0", 102), ("client.poll1", 103), ("gloo_tcp_loop", 104)

TRACE = [
    switch(0.0, GLOO, "S", TRAIN_A),
    switch(0.4, TRAIN_A, "R", POLL0),  # preempted
    switch(0.41, POLL0, "S", TRAIN_A),
    switch(0.8, TRAIN_A, "R+", POLL1),  # preempted (R+ = runnable, preemption flag)
    switch(0.81, POLL1, "S", TRAIN_B),
    switch(1.2, TRAIN_B, "S", MAIN),  # went to sleep: not a preemption
    switch(1.21, MAIN, "S", TRAIN_B),
    switch(1.6, TRAIN_B, "R", GLOO),  # preempted
    switch(2.0, GLOO, "S", TRAIN_A),
]


def test_counts_preemptions_of_the_longest_running_threads_by_what_ran_next():
    result = preemptions.count(preemptions.parse(TRACE), "ray::RayTrainWo", threads=2)
    assert [tid for tid, _, _ in result.threads] == [100, 200]  # not the main thread 101
    assert result.window_s == pytest.approx(2.0)
    # 3 preemptions over 2 s, 2 threads
    assert result.per_thread_per_s == pytest.approx(0.75)
    assert dict(result.by_next) == pytest.approx({"client.poll": 0.5, "gloo_tcp_loop": 0.25})


def test_other_lines_are_ignored_and_an_empty_trace_is_an_error():
    lines = ["perf  1 [000] 1.0: sched:sched_wakeup: comm=x pid=1", *TRACE]
    assert len(preemptions.parse(lines)) == len(TRACE)
    with pytest.raises(ValueError, match="fewer than two"):
        preemptions.count(preemptions.parse(["nothing here"]), "x", threads=1)
    with pytest.raises(ValueError, match="no thread named 'python3'"):
        preemptions.count(preemptions.parse(TRACE), "python3", threads=2)
