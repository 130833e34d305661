"""An unmodified torchrun-style script, run by every Ray Train worker in a child process.

The child gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
NODE_RANK/GROUP_RANK, MASTER_ADDR, MASTER_PORT), so the script's own
``dist.init_process_group()`` forms its group, with a rendezvous port of its own beside Ray
Train's. MLFLOW_TRACKING_URI and MLFLOW_RUN_ID point the script's ``mlflow.log_*`` calls at the
run rayapp opened. A rank whose script exits non-zero fails the job with that rank's last
stderr lines; a worker that dies (Ctrl-C, a lost node) takes its child with it.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from rayapp.tracking.run import TAG_RANK_EXIT_CODES
from rayapp.train.context import TrainContext

STDERR_LINES_KEPT = 3


def script_loop(ctx: TrainContext) -> None:
    """Run train.script with train.script_args on this rank; raise if any rank's script failed."""
    spec = ctx.spec
    ctx.begin_attempt()
    master = _rendezvous(ctx)
    env = {
        **os.environ,
        **torchrun_env(ctx, *master),
        "MLFLOW_TRACKING_URI": ctx.config.tracking_uri,
        "MLFLOW_RUN_ID": ctx.config.run_id,
    }
    assert spec.train.script is not None  # this loop runs only for a script job
    script = find_script(spec.train.script)
    started = time.perf_counter()
    # In the working dir, as torchrun runs a script where it was launched: relative paths the
    # script opens resolve as they did on the submitting machine.
    # Rank 0's stdout is also shown at the submitting terminal, as torchrun shows it.
    stdout = subprocess.PIPE if ctx.is_chief and ctx.config.progress is not None else None
    child = subprocess.Popen(
        [sys.executable, str(script), *spec.train.script_args],
        env=env,
        cwd=script.parent,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        preexec_fn=_die_with_parent,
    )
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES_KEPT)
    readers = [threading.Thread(target=_tee_stderr, args=(child, tail), daemon=True)]
    if stdout is not None:
        readers.append(
            threading.Thread(target=_echo_stdout, args=(child, ctx.config.echo), daemon=True)
        )
    for reader in readers:
        reader.start()
    code = child.wait()
    for reader in readers:
        reader.join(timeout=5)

    # -- every rank's outcome, in rank order
    outcomes: list = [None] * ctx.world_size
    dist.all_gather_object(outcomes, (code, list(tail)))
    ctx.logger.set_tags({TAG_RANK_EXIT_CODES: ",".join(str(c) for c, _ in outcomes)})
    ctx.logger.log_metrics({"script_time_s": time.perf_counter() - started})
    failed = [(rank, c, lines) for rank, (c, lines) in enumerate(outcomes) if c != 0]
    if failed:
        rank, c, lines = failed[0]
        said = " | ".join(line.strip() for line in lines if line.strip()) or "no stderr output"
        raise RuntimeError(
            f"{spec.train.script} exited with code {c} on rank {rank}"
            f"{f' (and {len(failed) - 1} other rank(s))' if len(failed) > 1 else ''}: {said}"
        )


def find_script(relative: str) -> Path:
    """The script in the job's unpacked working dir. Ray Train runs workers in the run's storage
    directory, not there, but puts the working dir on sys.path."""
    for entry in [os.getcwd(), *sys.path]:
        candidate = Path(entry or ".", relative)
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"{relative} is not in the job's working directory on this node")


def torchrun_env(ctx: TrainContext, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets for each rank."""
    import ray.train

    context = ray.train.get_context()
    node_rank = str(context.get_node_rank())
    return {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "NODE_RANK": node_rank,
        "GROUP_RANK": node_rank,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _rendezvous(ctx: TrainContext) -> tuple[str, int]:
    """Rank 0's node address and a port free there, told to every rank over Ray Train's group."""
    import ray

    found: list = [None]
    if ctx.rank == 0:
        address = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((address, 0))
            found[0] = (address, probe.getsockname()[1])
    dist.broadcast_object_list(found, src=0)
    return found[0]


def _tee_stderr(child: subprocess.Popen, tail: collections.deque) -> None:
    """Pass the script's stderr on to the worker's (Ray shows it with -v) and keep its last
    lines."""
    assert child.stderr is not None  # started with stderr=PIPE
    for line in child.stderr:
        sys.stderr.write(line)
        tail.append(line)


def _echo_stdout(child: subprocess.Popen, echo) -> None:
    """Rank 0's stdout into the worker's log and on to the submitting terminal."""
    assert child.stdout is not None  # started with stdout=PIPE
    for line in child.stdout:
        sys.stdout.write(line)
        try:
            echo(line)
        except Exception:  # the queue is gone (the job is ending): the worker's log keeps the line
            pass


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the worker process dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the embedded cluster still stops every process it started
        pass
