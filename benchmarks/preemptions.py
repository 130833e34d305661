r"""Who takes the CPU from the training threads: preemptions counted from a `perf sched` trace.

`sched_probe.py` says how often a training thread is preempted; this says by what. Record the
scheduler's switch events during steady-state epochs, then hand the trace to this script with
the name the training threads carry (`ray::RayTrainWo` in rayapp's workers, `python3` in the
torchrun baseline's ranks):

    perf sched record -o sched.data -- sleep 4
    perf script -i sched.data -F comm,tid,cpu,time,event,trace \
        | python benchmarks/preemptions.py ray::RayTrainWo

The training threads are the THREADS threads (default 2, one per rank) with that name that ran
longest in the trace. A preemption is a switch away from one of them while it was still
runnable (prev_state R); the thread that ran next is what took the CPU. Needs Debian's
`linux-perf` and a kernel with scheduler tracepoints.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

_SWITCH = re.compile(
    r"\s([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+)"
    r" prev_prio=-?\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)"
)


@dataclass(frozen=True)
class Switch:
    time_s: float
    prev_name: str
    prev_tid: int
    prev_state: str
    next_name: str
    next_tid: int


@dataclass(frozen=True)
class Preemptions:
    threads: list[tuple[int, str, float]]
    """(tid, name, seconds run) of the training threads."""
    window_s: float
    per_thread_per_s: float
    by_next: list[tuple[str, float]]
    """(kind of thread that ran next, preemptions per second per training thread), most first."""


def parse(lines: Iterable[str]) -> list[Switch]:
    switches = []
    for line in lines:
        match = _SWITCH.search(line)
        if match:
            time_s, prev_name, prev_tid, state, next_name, next_tid = match.groups()
            switches.append(
                Switch(float(time_s), prev_name, int(prev_tid), state, next_name, int(next_tid))
            )
    return switches


def thread_kind(name: str) -> str:
    """Threads of one kind differ only by a number (client.poll0, client.poll1): count them
    together."""
    return re.sub(r"\d+", "", name)


def count(switches: list[Switch], name: str, threads: int) -> Preemptions:
    if len(switches) < 2:
        raise ValueError(
            "the trace holds fewer than two sched_switch events; "
            "was it recorded with `perf sched record`?"
        )
    ran: collections.Counter = collections.Counter()
    running_since: dict[int, float] = {}
    names: dict[int, str] = {}
    for switch in switches:
        if switch.prev_tid in running_since:
            ran[switch.prev_tid] += switch.time_s - running_since.pop(switch.prev_tid)
        running_since[switch.next_tid] = switch.time_s
        names[switch.prev_tid], names[switch.next_tid] = switch.prev_name, switch.next_name
    training = [tid for tid, _ in ran.most_common() if names[tid] == name][:threads]
    if not training:
        raise ValueError(f"no thread named {name!r} ran in the trace")
    window_s = switches[-1].time_s - switches[0].time_s
    by_next: collections.Counter = collections.Counter()
    for switch in switches:
        if switch.prev_tid in training and switch.prev_state.startswith("R"):
            by_next[thread_kind(switch.next_name)] += 1
    scale = 1.0 / (window_s * len(training))
    return Preemptions(
        threads=[(tid, names[tid], ran[tid]) for tid in training],
        window_s=window_s,
        per_thread_per_s=sum(by_next.values()) * scale,
        by_next=[(kind, n * scale) for kind, n in by_next.most_common()],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "name", help="the training threads' name as perf shows it, e.g. ray::RayTrainWo or python3"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="how many training threads (default: %(default)s)"
    )
    parser.add_argument("--top", type=int, default=15, help="rows to show (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        print(f"preemptions: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    try:
        result = count(parse(sys.stdin), args.name, args.threads)
    except ValueError as exc:
        print(f"preemptions: error: {exc}", file=sys.stderr)
        return 1
    shown = ", ".join(f"{tid} ({seconds:.2f} s on CPU)" for tid, _, seconds in result.threads)
    console = Console(highlight=False)
    console.print(
        f"{result.per_thread_per_s:.0f} preemptions/s per training thread over "
        f"{result.window_s:.1f} s; training threads {shown}"
    )
    table = Table()
    table.add_column("ran next", justify="left")
    table.add_column("per s per thread", justify="right")
    for kind, rate in result.by_next[: args.top]:
        table.add_row(kind, f"{rate:.1f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
