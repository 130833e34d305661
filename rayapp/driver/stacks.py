"""Reading a rank's Python stack, and ending its process, on the rank's own node.

A rank may run on another machine, so each is done by a small Ray task pinned to the rank's node
(NodeAffinitySchedulingStrategy, not soft) that needs no CPU slot: a hung job still holds every
slot. The stack comes from ``py-spy dump`` (it reads a process from outside, whatever it is
doing), else from the faulthandler dump the rank registered on a signal
(:mod:`rayapp.train.heartbeat`), for hosts where ptrace is not allowed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rayapp.driver.hang_verdict import with_source_lines
from rayapp.train.heartbeat import STACK_SIGNAL, stack_file

PY_SPY_TIMEOUT_S = 20.0
FAULTHANDLER_WAIT_S = 2.0
TASK_TIMEOUT_S = 45.0
"""How long the driver waits for every node's answer (a node's first task starts a worker)."""


def dump_stack(pid: int) -> str:
    """Every thread's Python stack in process `pid` on this node, as text."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        done = subprocess.run(
            [py_spy, "dump", "--full-filenames", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
            check=False,
        )
        if done.returncode == 0 and done.stdout.strip():
            return with_source_lines(done.stdout)
        py_spy_said = (done.stderr or done.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        py_spy_said = str(exc)
    return _faulthandler_dump(pid, f"py-spy could not read it ({py_spy_said[:300]})")


def _faulthandler_dump(pid: int, why: str) -> str:
    path = stack_file(pid)
    try:
        size_before = path.stat().st_size
        os.kill(pid, STACK_SIGNAL)
    except OSError as exc:
        return f"no stack for process {pid}: {why}; and no faulthandler dump ({exc})\n"
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    while time.monotonic() < deadline and path.stat().st_size == size_before:
        time.sleep(0.1)
    time.sleep(0.2)  # let the dump finish: it is written thread by thread
    with open(path) as handle:
        handle.seek(size_before)
        return f"# faulthandler dump of process {pid}; {why}\n{with_source_lines(handle.read())}"


def kill_process(pid: int) -> bool:
    """SIGKILL `pid` on this node; whether it was there to kill."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def on_each_rank_node(function: Any, ranks: Mapping[int, Mapping[str, Any]]) -> dict[int, Any]:
    """`function(pid)` run on each rank's node (ranks: rank -> its heartbeat report with node_id
    and pid); rank -> its result, or the exception that stopped it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=0)(function)
    refs = {
        rank: remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=where["node_id"], soft=False)
        ).remote(where["pid"])
        for rank, where in ranks.items()
    }
    results: dict[int, Any] = {}
    deadline = time.monotonic() + TASK_TIMEOUT_S
    for rank, ref in refs.items():
        try:
            results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as exc:  # the node is gone, or did not answer in time
            results[rank] = exc
            ray.cancel(ref, force=True)
    return results
