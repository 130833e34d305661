"""The processes on this machine, read from /proc (Linux): which are this benchmark's, how much CPU
the others use, and collecting the ones re-parented to it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.overhead.common import console


class Proc:
    """One line of /proc/PID/stat: what the benchmark needs to know about a process."""

    __slots__ = ("pid", "ppid", "start", "cpu_s", "nice")
    TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int, fields: list[str]) -> None:
        self.pid, self.ppid, self.start = pid, int(fields[1]), fields[19]
        self.cpu_s = (int(fields[11]) + int(fields[12])) / self.TICKS
        self.nice = int(fields[16])


def processes() -> dict[int, Proc]:
    """Every live process; a zombie (exited, not yet reaped) is not live."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X"):
                found[int(entry)] = Proc(int(entry), fields)
    return found


def descendants(root: int, table: dict[int, Proc]) -> list[Proc]:
    children: dict[int, list[Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child.pid)
    return found


def command_line(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        return ""


def foreign_cpu_s(before: dict[int, Proc], after: dict[int, Proc], own: set[int]) -> float:
    """CPU seconds that processes other than this benchmark's used between two snapshots (those that
    both started and ended in between are missed)."""
    total = 0.0
    for pid, proc in after.items():
        if pid in own or pid == os.getpid():
            continue
        earlier = before.get(pid)
        total += proc.cpu_s - (earlier.cpu_s if earlier and earlier.start == proc.start else 0.0)
    return total


def become_subreaper() -> None:
    """Orphans of this script's descendants are re-parented to it rather than to init, so a process
    whose parent has exited is still found below this script and stopped with its step."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap_orphans(keep: int) -> None:
    """Collect exited processes re-parented to this script (never `keep`, which Popen waits for)."""
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit() and int(proc_dir.name) != keep:
            try:
                text = (proc_dir / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                try:
                    os.waitpid(int(proc_dir.name), os.WNOHANG)
                except ChildProcessError:
                    pass


def other_cpu_share(window_s: float = 3.0) -> float:
    """Cores' worth of CPU that other processes use right now, averaged over window_s."""
    before = processes()
    time.sleep(window_s)
    return foreign_cpu_s(before, processes(), set()) / window_s


def wait_until_idle(wait_s: float, threshold: float = 0.25) -> None:
    """Before a step: give other work on this machine (tests, another cluster) up to wait_s to calm
    down to under `threshold` of a core, then go ahead with a warning."""
    deadline = time.monotonic() + wait_s
    announced = False
    while (share := other_cpu_share()) > threshold:
        if time.monotonic() >= deadline:
            console.print(
                f"[yellow]warning:[/yellow] other processes keep {share:.0%} of a core busy; "
                "they compete for the same cores and the figures will not be reliable"
            )
            return
        if not announced:
            console.print(
                f"other processes keep {share:.0%} of a core busy; "
                f"waiting up to {wait_s:.0f}s for them to calm down"
            )
            announced = True
