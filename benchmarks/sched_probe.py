"""How the Linux scheduler treats the training processes: run time, run-queue wait, switches.

Where `python -m benchmarks.overhead` shows *that* an epoch is slower, this shows part of *why*: for
every thread of the processes whose command line contains PATTERN, over a window of S seconds,
the share of the window it ran, the share it spent runnable but waiting for a CPU (run-queue
wait, from /proc/PID/task/TID/schedstat), and how often per second it was preempted
(involuntary switches) or went to sleep (voluntary switches). Start a run, wait for its
steady-state epochs, then in another shell:

    python benchmarks/sched_probe.py RayTrainWorker 10        # rayapp's training workers
    python benchmarks/sched_probe.py torchrun_ddp.py 10       # the torchrun baseline's

Linux only; needs schedstats (present in /proc on common distribution kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class ThreadSample:
    pid: int
    name: str
    run_ns: int
    wait_ns: int
    involuntary: int
    voluntary: int


def _switches(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def matching_pids(pattern: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                command = (
                    Path(f"/proc/{entry}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
            except OSError:
                continue
            if pattern in command:
                found.append(int(entry))
    return found


def sample(pids: list[int]) -> dict[int, ThreadSample]:
    threads = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process has exited
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                run_ns, wait_ns, _ = map(int, Path(f"{base}/schedstat").read_text().split())
                name = Path(f"{base}/comm").read_text().strip()
                status = Path(f"{base}/status").read_text()
            except (OSError, ValueError):
                continue
            threads[int(tid)] = ThreadSample(
                pid,
                name,
                run_ns,
                wait_ns,
                _switches(status, "nonvoluntary_ctxt_switches"),
                _switches(status, "voluntary_ctxt_switches"),
            )
    return threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "pattern", help="substring of the processes' command lines, e.g. RayTrainWorker"
    )
    parser.add_argument(
        "seconds", type=float, nargs="?", default=10.0, help="window length (default: %(default)s)"
    )
    parser.add_argument(
        "--min-run",
        type=float,
        default=0.01,
        help="hide threads that ran less than this share of the window (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        print(f"sched_probe: error: seconds must be > 0, got {args.seconds}", file=sys.stderr)
        return 2
    pids = matching_pids(args.pattern)
    if not pids:
        print(
            f"sched_probe: error: no running process has {args.pattern!r} in its command line",
            file=sys.stderr,
        )
        return 1
    before = sample(pids)
    time.sleep(args.seconds)
    after = sample(pids)

    table = Table(
        title=f"{len(pids)} process(es) matching {args.pattern!r}, {args.seconds:g} s window"
    )
    for column in ("pid", "thread", "ran", "run-queue wait", "preempted /s", "slept /s"):
        table.add_column(column, justify="left" if column == "thread" else "right")
    ran_total = wait_total = 0.0
    for tid, now in sorted(after.items(), key=lambda item: (item[1].pid, -item[1].run_ns)):
        then = before.get(tid)
        if then is None:
            continue
        ran = (now.run_ns - then.run_ns) / 1e9 / args.seconds
        wait = (now.wait_ns - then.wait_ns) / 1e9 / args.seconds
        if ran < args.min_run:
            continue
        ran_total, wait_total = ran_total + ran, wait_total + wait
        table.add_row(
            str(now.pid),
            now.name,
            f"{ran:.1%}",
            f"{wait:.1%}",
            f"{(now.involuntary - then.involuntary) / args.seconds:.0f}",
            f"{(now.voluntary - then.voluntary) / args.seconds:.0f}",
        )
    table.add_section()
    table.add_row("", "all shown", f"{ran_total:.1%}", f"{wait_total:.1%}", "", "")
    Console(highlight=False).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
