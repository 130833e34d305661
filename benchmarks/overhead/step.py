"""One step of the benchmark: a child command run to its end, its output streamed, its CPU split by
kind of process, and nothing it started left running afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.overhead.common import REPO, StepFailed, console
from benchmarks.overhead.processes import Proc, command_line, descendants, processes, reap_orphans
from rayapp.launch.cluster import start_time


class Step:
    """One child command in a session of its own, its output streamed to the terminal and a log
    file.

    Every process ever seen below this script while the step runs is remembered (with the CPU time
    it had used when last seen), so that none outlives the step, even those that leave the child's
    session (the embedded Ray nodes start sessions of their own) or lose their parent, and so that
    the step's CPU can be split by kind of process.
    """

    POLL_S = 1.0

    def __init__(
        self,
        name: str,
        command: list[str],
        *,
        env: dict,
        log_path: Path,
        timeout_s: float,
        classify: Callable[[str], str],
    ) -> None:
        self.name, self.command, self.env, self.log_path, self.timeout_s = (
            name,
            command,
            env,
            log_path,
            timeout_s,
        )
        self.classify = classify
        self.seen: dict[tuple[int, str], Proc] = {}
        self.commands: dict[tuple[int, str], str] = {}
        self.process: subprocess.Popen | None = None
        self.output: list[str] = []
        self.wall_s = self.foreign_cpu_s = 0.0
        self._before: dict[int, Proc] = {}
        self._others: dict[tuple[int, str], list[float]] = {}
        self.others_timeline: list[tuple[float, float]] = []
        """(wall clock, CPU seconds other processes had used since the step started), one point per
        poll."""
        self.own_timeline: list[tuple[float, dict[str, float]]] = []
        """(wall clock, CPU seconds the step's own processes had used, by kind of process), one
        point per poll."""
        self._echo = True

    def _observe(self) -> dict[int, Proc]:
        reap_orphans(keep=self.process.pid)
        table = processes()
        # Below this script rather than below the child: steps run one at a time, and orphans come
        # here.
        for proc in descendants(os.getpid(), table):
            key = (proc.pid, proc.start)
            self.seen[key] = proc
            # Ray workers rename themselves (ray::RayTrainWorker) once they become an actor: keep
            # the latest.
            self.commands[key] = command_line(proc.pid) or self.commands.get(key, "")
        own = {pid for pid, _ in self.seen} | {os.getpid()}
        for pid, proc in table.items():
            if pid not in own:
                earlier = self._before.get(pid)
                baseline = earlier.cpu_s if earlier and earlier.start == proc.start else 0.0
                self._others.setdefault((pid, proc.start), [baseline, 0.0])[1] = proc.cpu_s
        now = time.time()
        self.others_timeline.append(
            (now, sum(latest - base for base, latest in self._others.values()))
        )
        by_kind: dict[str, float] = {}
        for key, proc in self.seen.items():
            kind = self.classify(self.commands.get(key, ""))
            by_kind[kind] = by_kind.get(kind, 0.0) + proc.cpu_s
        self.own_timeline.append((now, by_kind))
        return table

    def others_share(self, start: float, end: float) -> float | None:
        """Cores' worth of CPU other processes used between two wall-clock times (poll
        resolution)."""
        span = _span(self.others_timeline, start, end)
        return None if span is None else (span[1][1] - span[0][1]) / (span[1][0] - span[0][0])

    def own_share(self, start: float, end: float) -> dict[str, float]:
        """Cores' worth of CPU the step's own processes used between two wall-clock times, by
        kind."""
        span = _span(self.own_timeline, start, end)
        if span is None:
            return {}
        (t0, first), (t1, last) = span
        return {kind: (cpu - first.get(kind, 0.0)) / (t1 - t0) for kind, cpu in last.items()}

    def run(self) -> str:
        self._before, started = processes(), time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            reader = threading.Thread(target=self._pump, args=(log,), daemon=True)
            reader.start()
            deadline = started + self.timeout_s
            try:
                while self.process.poll() is None:
                    self._observe()
                    if time.monotonic() > deadline:
                        raise StepFailed(
                            f"{self.name} did not finish within {self.timeout_s:.0f}s (log: "
                            f"{self.log_path})"
                        )
                    time.sleep(self.POLL_S)
            except BaseException:
                self.stop()
                raise
            finally:
                reader.join(timeout=10)
        self.wall_s = time.monotonic() - started
        self._observe()
        self.foreign_cpu_s = self.others_timeline[-1][1]
        self._finish(announce=True)
        if self.process.returncode != 0:
            raise StepFailed(
                f"{self.name} exited with code {self.process.returncode} (log: {self.log_path})"
            )
        return "".join(self.output)

    def cpu_by_kind(self) -> dict[str, dict]:
        """CPU seconds (as last seen) and niceness of the step's processes, grouped by kind of
        process."""
        groups: dict[str, dict] = {}
        for key, proc in self.seen.items():
            group = groups.setdefault(
                self.classify(self.commands.get(key, "")),
                {"processes": 0, "cpu_s": 0.0, "nice": set()},
            )
            group["processes"] += 1
            group["cpu_s"] += proc.cpu_s
            group["nice"].add(proc.nice)
        return {name: {**g, "nice": sorted(g["nice"])} for name, g in groups.items()}

    def _alive(self) -> list[int]:
        return [pid for pid, start in self.seen if start_time(pid) == start]

    def _pump(self, log) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            log.write(line)
            log.flush()
            if self._echo:
                console.out(f"  {self.name} | {line.rstrip()}", style="dim", highlight=False)

    def stop(self) -> None:
        """Ctrl-C first (rayapp then stops its cluster and marks the run KILLED), then SIGKILL what
        is left."""
        if self.process is None:
            return
        self._echo = False  # its shutdown noise goes to the log file only
        previous = signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # a second Ctrl-C must not cut the clean-up short
        try:
            self._stop()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while self.process.poll() is None and time.monotonic() < deadline:
                self._observe()
                time.sleep(0.5)
        self._finish(announce=False)

    def _finish(self, *, announce: bool) -> None:
        """After the child has gone: give what it left a few seconds to exit (Ray workers notice
        their raylet is gone), then SIGKILL the rest, including processes started in the
        meantime."""
        for attempt in range(30):
            self._observe()
            alive = self._alive() + ([self.process.pid] if self.process.poll() is None else [])
            if not alive:
                break
            if attempt == 10:
                if announce:
                    console.print(
                        f"[yellow]warning:[/yellow] {self.name} left {len(alive)} process(es) "
                        "running; stopping them:"
                    )
                    for pid in alive:
                        console.print(f"  {pid} {command_line(pid)[:100]}", markup=False)
                self._kill(alive)
            elif attempt > 10:
                self._kill(alive)
            time.sleep(0.5)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        reap_orphans(keep=-1)

    @staticmethod
    def _kill(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _span(timeline: list, start: float, end: float) -> tuple | None:
    """The last poll at or before start and the first at or after end: the smallest span of polls
    that covers [start, end]; None when the polls do not cover it."""
    before = [point for point in timeline if point[0] <= start]
    after = [point for point in timeline if point[0] >= end]
    if not before or not after or end <= start:
        return None
    return before[-1], after[0]
