"""What does rayapp cost over plain torchrun + DDP, for the same workload and world size?

One run trains the job twice at the same world size (default 2 workers, Gloo on CPU):

1. torchrun: `torchrun --nproc-per-node W --master-addr 127.0.0.1 ... benchmarks/torchrun_ddp.py`, a plain
   DDP loop on exactly the same spec, data, model, optimizer, sampler and batches; no Ray, MLflow or
   checkpoints.
2. rayapp: `python -m rayapp submit --nodes 1 --workers-per-node W ...` on one embedded Ray node, as
   torchrun's single launch runs on one machine (`--layout node-per-worker`: W nodes of one worker each),
   with MLflow in a SQLite store in a temporary directory; `epoch_time_s` is read back from MLflow.

MLflow's cost is read from each rayapp run itself: rank 0 logs what its paced background writes took
(`mlflow_write_s`), which the script sets against the training loop's time (`total_time_s`). Apart from
the runs it also times the `RunLogger.log_epoch` call in the loop and one epoch's 7 metrics in a write of
their own against a SQLite store of the same kind, what an unpaced writer would cost. Then it prints the
comparison. Steady state = median
over the epochs after the first (warm-up). rayapp's `epoch_time_s` covers the step loop only; its wall
time per epoch, checkpoint and logging included, comes from the MLflow timestamps of consecutive epochs.
docs/benchmarks.md explains the figures and what they showed.

    python benchmarks/rayapp_vs_torchrun.py                       # jobs/mlp_synthetic.yaml, 2 workers, 6 epochs
    python benchmarks/rayapp_vs_torchrun.py --epochs 20 --json-out bench.json --wait-idle 300

Exit codes: 0 when both runs completed (whatever the verdicts), 1 when a step failed, 2 for bad
arguments, 130 on Ctrl-C. Every process a step starts is stopped before the script exits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from median_interval import median_interval, verdict_at_most  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "torchrun_ddp.py"
EXPERIMENT = "bench-overhead"
LOG_COST_EXPERIMENT = "bench-overhead-logcost"
TARGET_RATIO = 1.05
TARGET_LOG_SHARE = 0.01
PROG = "rayapp_vs_torchrun"
RAY_PROCESSES = "Ray daemons and actors"

console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 130)


class StepFailed(RuntimeError):
    """A step of the benchmark failed; the message is one line."""


# ---- processes -------------------------------------------------------------------------


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
            fields = text[text.rindex(")") + 2:].split()
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
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
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
            fields = text[text.rindex(")") + 2:].split()
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                try:
                    os.waitpid(int(proc_dir.name), os.WNOHANG)
                except ChildProcessError:
                    pass


class Step:
    """One child command in a session of its own, its output streamed to the terminal and a log file.

    Every process ever seen below this script while the step runs is remembered (with the CPU time it
    had used when last seen), so that none outlives the step, even those that leave the child's session
    (the embedded Ray nodes start sessions of their own) or lose their parent, and so that the step's
    CPU can be split by kind of process.
    """

    POLL_S = 1.0

    def __init__(self, name: str, command: list[str], *, env: dict, log_path: Path, timeout_s: float,
                 classify: Callable[[str], str]) -> None:
        self.name, self.command, self.env, self.log_path, self.timeout_s = name, command, env, log_path, timeout_s
        self.classify = classify
        self.seen: dict[tuple[int, str], Proc] = {}
        self.commands: dict[tuple[int, str], str] = {}
        self.process: Optional[subprocess.Popen] = None
        self.output: list[str] = []
        self.wall_s = self.foreign_cpu_s = 0.0
        self._before: dict[int, Proc] = {}
        self._others: dict[tuple[int, str], list[float]] = {}
        self.others_timeline: list[tuple[float, float]] = []
        """(wall clock, CPU seconds other processes had used since the step started), one point per poll."""
        self.own_timeline: list[tuple[float, dict[str, float]]] = []
        """(wall clock, CPU seconds the step's own processes had used, by kind of process), one point per poll."""
        self._echo = True

    def _observe(self) -> dict[int, Proc]:
        reap_orphans(keep=self.process.pid)
        table = processes()
        # Below this script rather than below the child: steps run one at a time, and orphans come here.
        for proc in descendants(os.getpid(), table):
            key = (proc.pid, proc.start)
            self.seen[key] = proc
            # Ray workers rename themselves (ray::RayTrainWorker) once they become an actor: keep the latest.
            self.commands[key] = command_line(proc.pid) or self.commands.get(key, "")
        own = {pid for pid, _ in self.seen} | {os.getpid()}
        for pid, proc in table.items():
            if pid not in own:
                earlier = self._before.get(pid)
                baseline = earlier.cpu_s if earlier and earlier.start == proc.start else 0.0
                self._others.setdefault((pid, proc.start), [baseline, 0.0])[1] = proc.cpu_s
        now = time.time()
        self.others_timeline.append((now, sum(latest - base for base, latest in self._others.values())))
        by_kind: dict[str, float] = {}
        for key, proc in self.seen.items():
            kind = self.classify(self.commands.get(key, ""))
            by_kind[kind] = by_kind.get(kind, 0.0) + proc.cpu_s
        self.own_timeline.append((now, by_kind))
        return table

    def others_share(self, start: float, end: float) -> Optional[float]:
        """Cores' worth of CPU other processes used between two wall-clock times (poll resolution)."""
        span = _span(self.others_timeline, start, end)
        return None if span is None else (span[1][1] - span[0][1]) / (span[1][0] - span[0][0])

    def own_share(self, start: float, end: float) -> dict[str, float]:
        """Cores' worth of CPU the step's own processes used between two wall-clock times, by kind."""
        span = _span(self.own_timeline, start, end)
        if span is None:
            return {}
        (t0, first), (t1, last) = span
        return {kind: (cpu - first.get(kind, 0.0)) / (t1 - t0) for kind, cpu in last.items()}

    def run(self) -> str:
        self._before, started = processes(), time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )
            reader = threading.Thread(target=self._pump, args=(log,), daemon=True)
            reader.start()
            deadline = started + self.timeout_s
            try:
                while self.process.poll() is None:
                    self._observe()
                    if time.monotonic() > deadline:
                        raise StepFailed(f"{self.name} did not finish within {self.timeout_s:.0f}s (log: {self.log_path})")
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
            raise StepFailed(f"{self.name} exited with code {self.process.returncode} (log: {self.log_path})")
        return "".join(self.output)

    def cpu_by_kind(self) -> dict[str, dict]:
        """CPU seconds (as last seen) and niceness of the step's processes, grouped by kind of process."""
        groups: dict[str, dict] = {}
        for key, proc in self.seen.items():
            group = groups.setdefault(self.classify(self.commands.get(key, "")), {"processes": 0, "cpu_s": 0.0, "nice": set()})
            group["processes"] += 1
            group["cpu_s"] += proc.cpu_s
            group["nice"].add(proc.nice)
        return {name: {**g, "nice": sorted(g["nice"])} for name, g in groups.items()}

    def _alive(self) -> list[int]:
        table = processes()
        return [pid for pid, start in self.seen if pid in table and table[pid].start == start]

    def _pump(self, log) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            log.write(line)
            log.flush()
            if self._echo:
                console.out(f"  {self.name} | {line.rstrip()}", style="dim", highlight=False)

    def stop(self) -> None:
        """Ctrl-C first (rayapp then stops its cluster and marks the run KILLED), then SIGKILL what is left."""
        if self.process is None:
            return
        self._echo = False  # its shutdown noise goes to the log file only
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
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
        """After the child has gone: give what it left a few seconds to exit (Ray workers notice their
        raylet is gone), then SIGKILL the rest, including processes started in the meantime."""
        for attempt in range(30):
            self._observe()
            alive = self._alive() + ([self.process.pid] if self.process.poll() is None else [])
            if not alive:
                break
            if attempt == 10:
                if announce:
                    console.print(f"[yellow]warning:[/yellow] {self.name} left {len(alive)} process(es) running; "
                                  "stopping them:")
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


def _span(timeline: list, start: float, end: float) -> Optional[tuple]:
    """The last poll at or before start and the first at or after end: the smallest span of polls
    that covers [start, end]; None when the polls do not cover it."""
    before = [point for point in timeline if point[0] <= start]
    after = [point for point in timeline if point[0] >= end]
    if not before or not after or end <= start:
        return None
    return before[-1], after[0]


def run_pair(args, pair_dir: Path, commands: list[str], spec, index: int) -> dict:
    """One torchrun run and one rayapp run; odd pairs start with rayapp, so slow drift of the machine
    does not always favour the same side."""
    label = f"pair {index + 1}/{args.pairs}: " if args.pairs > 1 else ""
    order = ("torchrun", "rayapp") if index % 2 == 0 else ("rayapp", "torchrun")
    results: dict = {}
    for position, side in enumerate(order, start=1):
        wait_until_idle(args.wait_idle)
        if side == "torchrun":
            console.print(f"[bold]{label}{position}/2 torchrun[/bold] ({args.workers} processes, plain DDP)")
            results["torchrun"], results["torchrun_step"] = run_torchrun(
                args, pair_dir, commands if index == 0 else [], spec.cluster.cpus_per_worker)
        else:
            layout = (f"one embedded Ray node, {args.workers} workers" if args.layout == "one-node"
                      else f"embedded {args.workers}-node Ray cluster")
            console.print(f"[bold]{label}{position}/2 rayapp submit[/bold] ({layout})")
            tracking_uri, run_id, results["rayapp_step"] = run_rayapp(args, pair_dir, commands if index == 0 else [])
            results["tracking_uri"] = tracking_uri
            results["rayapp"] = read_rayapp_run(tracking_uri, run_id, args.epochs)
    baseline, rayapp = results["torchrun"], results["rayapp"]
    torchrun_epoch, rayapp_epoch = steady(baseline["epoch_time_s"]), steady(rayapp["epoch_time_s"])
    if args.pairs > 1:
        console.print(f"{label}torchrun {torchrun_epoch:.4f} s, rayapp {rayapp_epoch:.4f} s, "
                      f"ratio {rayapp_epoch / torchrun_epoch:.3f}")
    return {
        "dir": pair_dir,
        "first": order[0],
        "torchrun": baseline,
        "rayapp": rayapp,
        "tracking_uri": results["tracking_uri"],
        "torchrun_epoch_s": torchrun_epoch,
        "rayapp_epoch_s": rayapp_epoch,
        "ratio": rayapp_epoch / torchrun_epoch,
        "torchrun_wall_s": statistics.median(intervals(baseline["epoch_end_s"])),
        "rayapp_wall_s": statistics.median(intervals(rayapp["logged_at_s"])),
        "max_loss_diff": max(abs(a - b) for a, b in zip(baseline["loss"], rayapp["loss"])),
        **write_cost(rayapp, args.epochs),
        "cpu_during_torchrun": cpu_note(results["torchrun_step"], (baseline["epoch_end_unix"][0], baseline["epoch_end_unix"][-1])),
        "cpu_during_rayapp": cpu_note(results["rayapp_step"], (rayapp["logged_at_s"][0], rayapp["logged_at_s"][-1])),
    }


# ---- measurements ----------------------------------------------------------------------


def write_cost(rayapp: dict, epochs: int) -> dict:
    """What rank 0's MLflow writes cost in the run itself, from the metrics it logs about them
    (rayapp.tracking.WRITE_COST_METRICS), as shares of its training loop's time."""
    logged = rayapp["metrics_of_last_epoch"]
    if "mlflow_write_s" not in logged:
        raise StepFailed(f"rayapp's run {rayapp['run_id']} has no mlflow_write_s metric; this rayapp does not measure its writes")
    loop_s = rayapp["total_time_s"]
    return {
        "log_share": logged["mlflow_write_s"] / loop_s,
        "log_cpu_share": logged["mlflow_write_cpu_s"] / loop_s,
        "log_write_s_per_epoch": logged["mlflow_write_s"] / epochs,
        "log_writes_per_epoch": logged["mlflow_writes"] / epochs,
    }


def steady(values: list[float]) -> float:
    """Median over the epochs after the first (warm-up)."""
    return statistics.median(values[1:])


def intervals(points: list[float]) -> list[float]:
    return [b - a for a, b in zip(points, points[1:])]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def shown(command: list[str], env: dict) -> str:
    """The command as a person would retype it, with any Ray / torch / OMP settings it inherits."""
    settings = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                if k.startswith(("RAY_", "TORCH_", "OMP_", "MLFLOW_")) and k != "RAY_USAGE_STATS_ENABLED"]
    return " ".join([*settings, shlex.join(command)])


def child_env() -> dict:
    """Both launchers pick the torch thread count themselves: Ray sets OMP_NUM_THREADS to a worker's CPUs
    (1 here), torchrun sets it to 1 when it starts more than one process. An inherited value would
    override both, so it is not passed on."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
            console.print(f"[yellow]warning:[/yellow] other processes keep {share:.0%} of a core busy; they compete "
                          "for the same cores and the figures will not be reliable")
            return
        if not announced:
            console.print(f"other processes keep {share:.0%} of a core busy; waiting up to {wait_s:.0f}s for them to calm down")
            announced = True


def classify_torchrun(command: str) -> str:
    if "bin/torchrun" in command or "torch.distributed.run" in command:
        return "torchrun launcher"
    return "training workers" if BASELINE.name in command else "other"


def classify_rayapp(command: str) -> str:
    if command.startswith("ray::RayTrainWorker"):
        return "training workers"
    return "rayapp driver" if "rayapp submit" in command else RAY_PROCESSES


def cpu_note(step: Step, window: tuple[float, float]) -> dict:
    """Where a step's CPU went, and how much other processes took meanwhile, over the whole step and
    over its steady-state epochs (window, wall clock): on a 2-core machine anything else running skews
    the figures."""
    share = step.others_share(*window)
    if share is not None and share > 0.1:
        console.print(f"[yellow]warning:[/yellow] other processes kept {share:.0%} of a core busy during {step.name}'s "
                      "steady-state epochs; its figures are skewed")
    return {
        "wall_s": step.wall_s,
        "own_cpu_s": step.cpu_by_kind(),
        "own_cores_in_steady_state": step.own_share(*window),
        "other_processes_cpu_s": step.foreign_cpu_s,
        "other_processes_cores_in_steady_state": share,
    }


def run_torchrun(args, tmp: Path, commands: list[str], cpus_per_worker: int) -> tuple[dict, Step]:
    out = tmp / "torchrun.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command = [
        *launcher, "--nproc-per-node", str(args.workers), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(BASELINE.relative_to(REPO)),
        "--job", args.job, "--epochs", str(args.epochs), "--out", str(out),
        *(["--comm-clock", args.baseline_comm_clock] if args.baseline_comm_clock != "none" else []),
    ]
    env = child_env()
    if args.workers == 1 or cpus_per_worker != 1:
        # torchrun sets 1 only when it starts several processes; Ray sets the worker's CPUs: match Ray.
        env["OMP_NUM_THREADS"] = str(cpus_per_worker)
    commands.append(shown(command, env))
    step = Step("torchrun", command, env=env, log_path=tmp / "torchrun.log", timeout_s=args.step_timeout,
                classify=classify_torchrun)
    try:
        step.run()
    except StepFailed:
        # The results file is written whole (rename) after the last epoch, so its presence means every
        # epoch ran. A non-zero exit after it is the process's teardown: with torch 2.13, Gloo can abort
        # at interpreter exit ("terminate called without an active exception"); the baseline's barrier
        # before destroy_process_group keeps that from happening, this keeps a stray one from costing a run.
        if not out.exists() or step.process is None or step.process.returncode in (None, 0):
            raise
        console.print(f"[yellow]warning:[/yellow] torchrun exited with code {step.process.returncode} after "
                      f"writing its results (a teardown abort at exit; log: {step.log_path}); the results are complete")
    if not out.exists():
        raise StepFailed(f"torchrun finished but wrote no results to {out}")
    result = json.loads(out.read_text())
    threads = {t["torch_threads"] for t in result["threads_per_rank"]}
    if threads != {cpus_per_worker}:
        console.print(f"[yellow]warning:[/yellow] torchrun workers ran {sorted(threads)} torch threads, "
                      f"rayapp's workers run {cpus_per_worker}; the comparison is not like for like")
    return result, step


def rayapp_layout(args) -> list[str]:
    """All W workers on one node, as torchrun's single launch runs them, or with --layout
    node-per-worker W nodes of one worker each, as W machines would run it."""
    if args.layout == "one-node":
        return ["--nodes", "1", "--workers-per-node", str(args.workers)]
    return ["--nodes", str(args.workers), "--workers-per-node", "1"]


def run_rayapp(args, tmp: Path, commands: list[str]) -> tuple[str, str, Step]:
    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    command = [
        sys.executable, "-m", "rayapp", "submit", *rayapp_layout(args),
        "--backend", "gloo", "--epochs", str(args.epochs), args.job,
        "--experiment", EXPERIMENT, "--tracking-uri", tracking_uri, "--storage-path", str(tmp / "results"),
    ]
    commands.append(shown(command, child_env()))
    step = Step("rayapp", command, env=child_env(), log_path=tmp / "rayapp.log", timeout_s=args.step_timeout,
                classify=classify_rayapp)
    output = step.run()
    match = re.search(r"MLflow run\s+([0-9a-f]{32})", output)
    if match:
        return tracking_uri, match.group(1), step
    from mlflow.tracking import MlflowClient  # fall back to the store: the experiment is fresh

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], max_results=2) if experiment else []
    if len(runs) != 1:
        raise StepFailed(f"cannot find rayapp's MLflow run in {tracking_uri}")
    return tracking_uri, runs[0].info.run_id, step


def read_rayapp_run(tracking_uri: str, run_id: str, epochs: int) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        raise StepFailed(f"rayapp's MLflow run {run_id} is {run.info.status}, not FINISHED")
    history = {}
    for key in ("epoch_time_s", "loss"):
        metrics = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        if [m.step for m in metrics] != list(range(epochs)):
            raise StepFailed(f"rayapp's run {run_id} has {key} for steps {[m.step for m in metrics]}, expected 0..{epochs - 1}")
        history[key] = metrics
    return {
        "run_id": run_id,
        "epoch_time_s": [m.value for m in history["epoch_time_s"]],
        "loss": [m.value for m in history["loss"]],
        # rank 0 stamps each epoch's metrics as it logs them, after the checkpoint and report:
        # consecutive stamps are one full epoch cycle (ms resolution).
        "logged_at_s": [m.timestamp / 1000 for m in history["loss"]],
        "total_time_s": run.data.metrics.get("total_time_s"),
        "metrics_of_last_epoch": {k: v for k, v in run.data.metrics.items()},
    }


def time_log_epoch(tracking_uri: str, calls: int, sample: dict, tmp: Path) -> dict[str, list[float]]:
    """What rank 0 spends per epoch on MLflow, against a fresh run in the same SQLite store.

    `call`: the `RunLogger.log_epoch` call in the training loop. `write`: the MLflow write itself.
    When RunLogger hands records to a background sender (rayapp.outbox), the call only enqueues and
    the write runs on the sender thread, in the same one-CPU worker process as training: both count.
    Without a sender the two are the same call.
    """
    import inspect

    from rayapp.tracking.run import EPOCH_METRICS, RunLogger, close_run, open_run

    def new_run(name: str) -> str:
        return open_run(tracking_uri=tracking_uri, experiment=LOG_COST_EXPERIMENT, run_name=name,
                        params={"calls": str(calls)}, tags={})

    metrics = {key: float(sample.get(key, 1.0)) for key in EPOCH_METRICS}
    run_id = new_run("log-epoch-call")
    extra = {"fallback_path": str(tmp / "logcost.mlflow-fallback.jsonl")} \
        if "fallback_path" in inspect.signature(RunLogger).parameters else {}
    logger = RunLogger(tracking_uri, run_id, **extra)
    logger.set_tags({"rayapp.attempts": "1"})  # rank 0 has used its logger before its first epoch
    logger.log_epoch(0, metrics)
    call = []
    for epoch in range(1, calls + 1):
        started = time.perf_counter()
        logger.log_epoch(epoch, metrics)
        call.append(time.perf_counter() - started)
        time.sleep(0.05)  # epochs are apart; let a background sender deliver before the next call
    if hasattr(logger, "close"):
        logger.close()
    close_run(tracking_uri, run_id, "FINISHED")
    try:
        from rayapp.tracking.outbox import Record, deliver
    except ImportError:  # RunLogger writes synchronously: the call is the write, all of it in the loop
        return {"call": call, "write": call, "write_cpu": call}

    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(tracking_uri), new_run("log-epoch-write")
    deliver(client, [Record("metrics", run_id, step=0, values=metrics)])
    write, write_cpu = [], []
    for epoch in range(1, calls + 1):
        started, started_cpu = time.perf_counter(), time.thread_time()
        deliver(client, [Record("metrics", run_id, step=epoch, values=metrics)])
        write_cpu.append(time.thread_time() - started_cpu)
        write.append(time.perf_counter() - started)
    close_run(tracking_uri, run_id, "FINISHED")
    return {"call": call, "write": write, "write_cpu": write_cpu}


# ---- report ----------------------------------------------------------------------------


def fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def verdict(ok: bool) -> str:
    return coloured("PASS" if ok else "MISS")


def coloured(verdict_text: str) -> str:
    colour = {"PASS": "green", "MISS": "red"}.get(verdict_text.split()[0], "yellow")
    return f"[{colour}]{verdict_text}[/{colour}]"


def report(figures: dict, commands: list[str]) -> None:
    f = figures
    nodes = f"{f['rayapp_nodes']} Ray node" + ("s" if f["rayapp_nodes"] > 1 else "")
    table = Table(title=f"rayapp vs torchrun: {f['job']}, {f['world_size']} workers on {nodes} (gloo, CPU), "
                        f"{f['epochs']} epochs x {f['steps_per_epoch']} steps, steady state = median of epochs 2..{f['epochs']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("result", justify="center")
    pairs = len(f["pairs"])
    over = f" (median of {pairs} pairs)" if pairs > 1 else ""
    table.add_row(f"torchrun median epoch s (step loop){over}", f"{f['torchrun_epoch_s']:.4f}", "", "")
    table.add_row(f"rayapp median epoch s (epoch_time_s){over}", f"{f['rayapp_epoch_s']:.4f}", "", "")
    ratio_label = "ratio rayapp / torchrun" + (" (median of the pairs' ratios)" if pairs > 1 else "")
    table.add_row(ratio_label,
                  f"{f['ratio']:.3f}", f"<= {TARGET_RATIO:.2f}", coloured(f["ratio_verdict"]))
    interval = f["ratio_interval"]
    if interval is not None:
        table.add_row(f"  {interval['coverage']:.1%} interval for that median (order statistics, any distribution)",
                      f"{interval['low']:.3f} .. {interval['high']:.3f}", f"<= {TARGET_RATIO:.2f}", "")
    elif pairs > 1:
        table.add_row("  interval for that median", "needs 6+ pairs", "", "")
    table.add_row("MLflow log_epoch call s/epoch (median)", f"{f['log_call_s']:.4f}", "", "")
    table.add_row(f"MLflow writes per epoch, paced{over}", f"{f['log_writes_per_epoch']:.2f}", "", "")
    table.add_row(f"MLflow write s/epoch, paced{over}", f"{f['log_write_s_per_epoch']:.4f}", "", "")
    table.add_row("log share of rayapp's training loop (writes' wall time)", f"{f['log_share']:.2%}", f"<= {TARGET_LOG_SHARE:.0%}",
                  verdict(f["log_share_pass"]))
    table.add_row("log share of rayapp's training loop (writes' CPU time)", f"{f['log_cpu_share']:.2%}", "", "[dim]info[/dim]")
    table.add_section()
    table.add_row(f"torchrun wall s/epoch (epoch end to epoch end){over}", f"{f['torchrun_wall_s']:.4f}", "", "")
    table.add_row(f"rayapp wall s/epoch incl. checkpoint+logging{over}", f"{f['rayapp_wall_s']:.4f}", "", "")
    table.add_row("ratio of wall s/epoch rayapp / torchrun" + (" (median of the pairs')" if pairs > 1 else ""), f"{f['wall_ratio']:.3f}", "none", "[dim]info[/dim]")
    console.print(table)
    if pairs > 1:
        by_pair = Table(title="pairs (the first of each pair ran first; the order alternates)")
        for column in ("pair", "first", "torchrun epoch s", "rayapp epoch s", "ratio", "Ray's own CPU (cores)",
                       "other CPU (cores)"):
            by_pair.add_column(column, justify="left" if column == "first" else "right")
        for number, pair in enumerate(f["pairs"], start=1):
            others = [pair[f"cpu_during_{side}"]["other_processes_cores_in_steady_state"] for side in ("torchrun", "rayapp")]
            ray_own = pair["cpu_during_rayapp"]["own_cores_in_steady_state"].get(RAY_PROCESSES)
            by_pair.add_row(str(number), pair["first"], f"{pair['torchrun_epoch_s']:.4f}", f"{pair['rayapp_epoch_s']:.4f}",
                            f"{pair['ratio']:.3f}", "-" if ray_own is None else f"{ray_own:.2f}",
                            " / ".join("-" if o is None else f"{o:.2f}" for o in others))
        console.print(by_pair)
        console.print("per-epoch, wall and CPU figures below are the last pair's")

    def fmt(values):
        return "  ".join(f"{v:.3f}" for v in values)

    console.print(f"per-epoch s  torchrun step loop: {fmt(f['torchrun_epochs'])}")
    console.print(f"             rayapp epoch_time_s: {fmt(f['rayapp_epochs'])}")
    console.print(f"             rayapp wall (epoch 2 on): {fmt(f['rayapp_walls'])}")
    console.print(f"MLflow: rank 0's background sender wrote {f['log_writes_per_epoch']:.2f} times per epoch, paced so that "
                  "each write carries every epoch queued since the last; the log share is the writes' wall time over "
                  "the training loop's (total_time_s), read from the run's own mlflow_write_s, median over pairs. "
                  f"One epoch's metrics in a write of their own, timed apart {len(f['log_one_epoch_writes'])} times: "
                  f"median {f['log_one_epoch_write_s'] * 1e3:.1f} ms (CPU {f['log_one_epoch_write_cpu_s'] * 1e3:.1f} ms), "
                  f"{f['log_one_epoch_write_s'] / f['rayapp_epoch_s']:.2%} of an epoch, what an unpaced sender would cost; "
                  f"log_epoch call median {f['log_call_s'] * 1e3:.2f} ms.")
    console.print(
        "rayapp's epoch_time_s stops the clock at the end of the step loop; its per-epoch checkpoint "
        "(full state dict, torch.save, ray.train.report) and MLflow write are excluded from it and show only "
        f"in the wall figure: {f['rayapp_wall_over_epoch_s']:.3f} s/epoch between the two (median over pairs)."
    )
    threads = ", ".join(f"rank {i}: torch {t['torch_threads']} thread(s), OMP_NUM_THREADS={t['OMP_NUM_THREADS']}"
                        for i, t in enumerate(f["torchrun_threads"]))
    console.print(f"threads  torchrun: {threads}; rayapp: Ray sets OMP_NUM_THREADS to the worker's CPUs "
                  f"({f['cpus_per_worker']}).")
    for name in ("torchrun", "rayapp"):
        cpu = f[f"cpu_during_{name}"]
        kinds = ", ".join(f"{kind} {g['cpu_s']:.1f} (nice {'/'.join(map(str, g['nice']))})"
                          for kind, g in sorted(cpu["own_cpu_s"].items(), key=lambda item: -item[1]["cpu_s"]))
        steady_share = cpu["other_processes_cores_in_steady_state"]
        console.print(f"CPU-s  {name} run ({cpu['wall_s']:.0f}s): {kinds}; other processes on the machine "
                      f"{cpu['other_processes_cpu_s']:.1f}"
                      + (f" ({steady_share:.0%} of a core during the steady-state epochs)" if steady_share is not None else ""))
    steady_cores = "; ".join(
        f"{name}: " + ", ".join(f"{kind} {cores:.2f}" for kind, cores in
                                sorted(f[f"cpu_during_{name}"]["own_cores_in_steady_state"].items(), key=lambda item: -item[1]))
        for name in ("torchrun", "rayapp"))
    console.print(f"cores  busy during the steady-state epochs, by kind of process: {steady_cores}")
    console.print(f"same workload: per-epoch loss differs by at most {f['max_loss_diff']:.2e} between the two")
    console.print("commands:")
    for command in commands:
        console.print(f"  {command}", markup=False)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/mlp_synthetic.yaml", help="rayapp job YAML (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs for both runs; the first is warm-up (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="world size (default: %(default)s)")
    parser.add_argument("--layout", choices=("one-node", "node-per-worker"), default="one-node",
                        help="rayapp's workers on one embedded Ray node, one raylet and its daemons as on the one "
                             "machine torchrun runs on; or one node each, Ray's per-node daemons once per worker, "
                             "as W machines would run it (default: %(default)s)")
    parser.add_argument("--one-node", dest="layout", action="store_const", const="one-node",
                        help="the same as --layout one-node")
    parser.add_argument("--baseline-comm-clock", choices=("none", "rayapp"), default="none",
                        help="give the torchrun baseline rayapp's per-step comm clock, to separate what rayapp's "
                             "comm timing costs from the rest (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=1,
                        help="torchrun/rayapp pairs to run, alternating which goes first; the ratio verdict uses a "
                             "95%% interval for the median of the pairs' ratios, which needs 6 or more; on a "
                             "machine whose speed drifts, 20-30 (default: %(default)s)")
    parser.add_argument("--log-calls", type=int, default=20, help="timed MLflow log_epoch calls (default: %(default)s)")
    parser.add_argument("--step-timeout", type=float, default=600, help="seconds each run may take (default: %(default)s)")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="S",
                        help="before each run, wait up to S seconds for other processes to leave the cores alone "
                             "(under a quarter of a core); 0 only checks and warns (default: %(default)s)")
    parser.add_argument("--json-out", help="write the figures to this JSON file")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory (logs, MLflow store)")
    args = parser.parse_args(argv)

    from rayapp.spec.loader import load_spec
    from rayapp.spec import SpecError

    script_started = time.monotonic()
    become_subreaper()
    # Started in the background, a script inherits SIGINT ignored, and so would its children (rayapp
    # could then not be asked to stop cleanly). A handler of our own is reset to the default on exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("mlflow", "alembic"):  # database set-up notes at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.epochs < 2 or args.workers < 1 or args.log_calls < 1 or args.pairs < 1:
        fail(f"need --epochs >= 2 (the first is warm-up), --workers >= 1, --log-calls >= 1 and --pairs >= 1; "
             f"got --epochs {args.epochs} --workers {args.workers} --log-calls {args.log_calls} --pairs {args.pairs}")
        return 2
    args.job = str(Path(args.job).resolve())
    try:
        nodes = 1 if args.layout == "one-node" else args.workers
        spec = load_spec(args.job, {"cluster.nodes": nodes, "cluster.workers_per_node": args.workers // nodes,
                                    "train.epochs": args.epochs})
    except SpecError as exc:
        fail(str(exc))
        return 2
    if spec.train.strategy != "ddp":
        fail(f"train.strategy {spec.train.strategy!r}: the torchrun baseline is plain DDP; use a ddp job")
        return 2

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="rayapp-bench-"))
    commands: list[str] = []
    ok = False
    try:
        pairs = []
        for index in range(args.pairs):
            pair_dir = tmp / f"pair-{index + 1}"
            pair_dir.mkdir()
            pairs.append(run_pair(args, pair_dir, commands, spec, index))
        last = pairs[-1]
        console.print(f"[bold]MLflow log_epoch cost[/bold] ({args.log_calls} calls, {last['tracking_uri']})")
        log_cost = time_log_epoch(last["tracking_uri"], args.log_calls, last["rayapp"]["metrics_of_last_epoch"], last["dir"])
    except StepFailed as exc:
        fail(str(exc))
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # anything unexpected still gets one line, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"{type(exc).__name__}: {first}")
        return 1
    else:
        ok = True
    finally:
        if (args.keep_tmp or not ok) and any(tmp.iterdir()):
            console.print(f"logs and MLflow store kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    baseline, rayapp = last["torchrun"], last["rayapp"]
    ratios = [pair["ratio"] for pair in pairs]
    ratio = statistics.median(ratios)
    ratio_interval = median_interval(ratios, 0.95)
    torchrun_epoch = statistics.median(pair["torchrun_epoch_s"] for pair in pairs)
    rayapp_epoch = statistics.median(pair["rayapp_epoch_s"] for pair in pairs)
    torchrun_walls = intervals(baseline["epoch_end_s"])
    rayapp_walls = intervals(rayapp["logged_at_s"])
    log_share = statistics.median(pair["log_share"] for pair in pairs)
    figures = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU used",
        "job": spec.name,
        "world_size": args.workers,
        "rayapp_nodes": 1 if args.layout == "one-node" else args.workers,
        "rayapp_layout": args.layout,
        "epochs": args.epochs,
        "steps_per_epoch": spec.steps_per_epoch,
        "batch_size_per_worker": spec.batch_size_per_worker,
        "baseline_comm_clock": args.baseline_comm_clock,
        "cpus_per_worker": spec.cluster.cpus_per_worker,
        "pairs": [{k: v for k, v in pair.items() if k not in ("torchrun", "rayapp", "dir")} for pair in pairs],
        "torchrun_epoch_s": torchrun_epoch,
        "rayapp_epoch_s": rayapp_epoch,
        "ratio": ratio,
        "ratio_interval": ratio_interval._asdict() if ratio_interval else None,
        "ratio_verdict": verdict_at_most(ratio_interval, ratio, TARGET_RATIO),
        "log_call_s": statistics.median(log_cost["call"]),
        # in the runs themselves, paced and batched as rank 0 writes them (median over pairs)
        "log_share": log_share,
        "log_share_pass": log_share <= TARGET_LOG_SHARE,
        "log_cpu_share": statistics.median(pair["log_cpu_share"] for pair in pairs),
        "log_write_s_per_epoch": statistics.median(pair["log_write_s_per_epoch"] for pair in pairs),
        "log_writes_per_epoch": statistics.median(pair["log_writes_per_epoch"] for pair in pairs),
        # one epoch's metrics in one unpaced write, timed apart from the runs: what pacing saves
        "log_one_epoch_write_s": statistics.median(log_cost["write"]),
        "log_one_epoch_write_cpu_s": statistics.median(log_cost["write_cpu"]),
        # per pair, like the epoch figures: the last pair's walls against all pairs' epochs would mix two machines' speeds
        "torchrun_wall_s": statistics.median(pair["torchrun_wall_s"] for pair in pairs),
        "rayapp_wall_s": statistics.median(pair["rayapp_wall_s"] for pair in pairs),
        "wall_ratio": statistics.median(pair["rayapp_wall_s"] / pair["torchrun_wall_s"] for pair in pairs),
        "rayapp_wall_over_epoch_s": statistics.median(pair["rayapp_wall_s"] - pair["rayapp_epoch_s"] for pair in pairs),
        "torchrun_epochs": baseline["epoch_time_s"],
        "rayapp_epochs": rayapp["epoch_time_s"],
        "torchrun_walls": torchrun_walls,
        "rayapp_walls": rayapp_walls,
        "rayapp_total_time_s": rayapp["total_time_s"],
        "log_epoch_calls": log_cost["call"],
        "log_one_epoch_writes": log_cost["write"],
        "torchrun_threads": baseline["threads_per_rank"],
        "max_loss_diff": max(pair["max_loss_diff"] for pair in pairs),
        "rayapp_run_id": rayapp["run_id"],
        "cpu_during_torchrun": last["cpu_during_torchrun"],
        "cpu_during_rayapp": last["cpu_during_rayapp"],
        "commands": commands,
        "script_wall_s": time.monotonic() - script_started,
    }
    if args.json_out:  # first, so that the figures of a long run survive a fault in the report
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    report(figures, commands)
    console.print(f"benchmark took {figures['script_wall_s']:.0f}s")
    if args.json_out:
        console.print(f"figures written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
