"""The two runs of a pair, torchrun's and rayapp's, what each measured, and what MLflow costs
rank 0."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.overhead.common import (
    BASELINE,
    EXPERIMENT,
    LOG_COST_EXPERIMENT,
    RAY_PROCESSES,
    REPO,
    StepFailed,
    console,
)
from benchmarks.overhead.processes import wait_until_idle
from benchmarks.overhead.step import Step
from rayapp.launch.cluster import free_port
from rayapp.reports.tables import steady_median
from rayapp.tracking.logger import RunLogger
from rayapp.tracking.outbox import Record, deliver
from rayapp.tracking.run import EPOCH_METRICS, TAG_ATTEMPTS, WRITE_COST_METRICS, close_run, open_run


def run_pair(args, pair_dir: Path, commands: list[str], spec, index: int) -> dict:
    """One torchrun run and one rayapp run; odd pairs start with rayapp, so slow drift of the
    machine does not always favour the same side."""
    label = f"pair {index + 1}/{args.pairs}: " if args.pairs > 1 else ""
    order = ("torchrun", "rayapp") if index % 2 == 0 else ("rayapp", "torchrun")
    results: dict = {}
    for position, side in enumerate(order, start=1):
        wait_until_idle(args.wait_idle)
        if side == "torchrun":
            console.print(
                f"[bold]{label}{position}/2 torchrun[/bold] ({args.workers} processes, plain DDP)"
            )
            results["torchrun"], results["torchrun_step"] = run_torchrun(
                args, pair_dir, commands if index == 0 else [], spec.cluster.cpus_per_worker
            )
        else:
            layout = (
                f"one embedded Ray node, {args.workers} workers"
                if args.layout == "one-node"
                else f"embedded {args.workers}-node Ray cluster"
            )
            console.print(f"[bold]{label}{position}/2 rayapp submit[/bold] ({layout})")
            tracking_uri, run_id, results["rayapp_step"] = run_rayapp(
                args, pair_dir, commands if index == 0 else []
            )
            results["tracking_uri"] = tracking_uri
            results["rayapp"] = read_rayapp_run(tracking_uri, run_id, args.epochs)
    baseline, rayapp = results["torchrun"], results["rayapp"]
    torchrun_epoch, rayapp_epoch = (
        steady_median(baseline["epoch_time_s"]),
        steady_median(rayapp["epoch_time_s"]),
    )
    if args.pairs > 1:
        console.print(
            f"{label}torchrun {torchrun_epoch:.4f} s, rayapp {rayapp_epoch:.4f} s, "
            f"ratio {rayapp_epoch / torchrun_epoch:.3f}"
        )
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
        "max_loss_diff": max(
            abs(a - b) for a, b in zip(baseline["loss"], rayapp["loss"], strict=True)
        ),
        **write_cost(rayapp, args.epochs),
        "cpu_during_torchrun": cpu_note(
            results["torchrun_step"],
            (baseline["epoch_end_unix"][0], baseline["epoch_end_unix"][-1]),
        ),
        "cpu_during_rayapp": cpu_note(
            results["rayapp_step"], (rayapp["logged_at_s"][0], rayapp["logged_at_s"][-1])
        ),
    }


def write_cost(rayapp: dict, epochs: int) -> dict:
    """What rank 0's MLflow writes cost in the run itself, from the metrics it logs about them
    (rayapp.tracking.run.WRITE_COST_METRICS), as shares of its training loop's time."""
    write_s, write_cpu_s, writes = (
        WRITE_COST_METRICS  # mlflow_write_s, mlflow_write_cpu_s, mlflow_writes
    )
    logged = rayapp["metrics_of_last_epoch"]
    if write_s not in logged:
        raise StepFailed(
            f"rayapp's run {rayapp['run_id']} has no {write_s} metric; "
            "this rayapp does not measure its writes"
        )
    loop_s = rayapp["total_time_s"]
    return {
        "log_share": logged[write_s] / loop_s,
        "log_cpu_share": logged[write_cpu_s] / loop_s,
        "log_write_s_per_epoch": logged[write_s] / epochs,
        "log_writes_per_epoch": logged[writes] / epochs,
    }


def intervals(points: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(points)]


def shown(command: list[str], env: dict) -> str:
    """The command as a person would retype it, with any Ray / torch / OMP settings it inherits."""
    settings = [
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(env.items())
        if k.startswith(("RAY_", "TORCH_", "OMP_", "MLFLOW_")) and k != "RAY_USAGE_STATS_ENABLED"
    ]
    return " ".join([*settings, shlex.join(command)])


def child_env() -> dict:
    """Both launchers pick the torch thread count themselves: Ray sets OMP_NUM_THREADS to a worker's
    CPUs (1 here), torchrun sets it to 1 when it starts more than one process. An inherited value
    would override both, so it is not passed on."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
    over its steady-state epochs (window, wall clock): on a 2-core machine anything else running
    skews the figures."""
    share = step.others_share(*window)
    if share is not None and share > 0.1:
        console.print(
            f"[yellow]warning:[/yellow] other processes kept {share:.0%} of a core busy during "
            f"{step.name}'s steady-state epochs; its figures are skewed"
        )
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
    launcher = (
        [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    command = [
        *launcher,
        "--nproc-per-node",
        str(args.workers),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(BASELINE.relative_to(REPO)),
        "--job",
        args.job,
        "--epochs",
        str(args.epochs),
        "--out",
        str(out),
        *(["--comm-clock", args.baseline_comm_clock] if args.baseline_comm_clock != "none" else []),
    ]
    env = child_env()
    if args.workers == 1 or cpus_per_worker != 1:
        # torchrun sets 1 only when it starts several processes; Ray sets the worker's CPUs: match
        # Ray.
        env["OMP_NUM_THREADS"] = str(cpus_per_worker)
    commands.append(shown(command, env))
    step = Step(
        "torchrun",
        command,
        env=env,
        log_path=tmp / "torchrun.log",
        timeout_s=args.step_timeout,
        classify=classify_torchrun,
    )
    try:
        step.run()
    except StepFailed:
        # The results file is written whole (rename) after the last epoch, so its presence means
        # every epoch ran. A non-zero exit after it is the process's teardown: with torch 2.13, Gloo
        # can abort at interpreter exit ("terminate called without an active exception"); the
        # baseline's barrier before destroy_process_group keeps that from happening, this keeps a
        # stray one from costing a run.
        if not out.exists() or step.process is None or step.process.returncode in (None, 0):
            raise
        console.print(
            "[yellow]warning:[/yellow] torchrun exited with code "
            f"{step.process.returncode} after writing its results (a teardown "
            f"abort at exit; log: {step.log_path}); the results are complete"
        )
    if not out.exists():
        raise StepFailed(f"torchrun finished but wrote no results to {out}")
    result = json.loads(out.read_text())
    threads = {t["torch_threads"] for t in result["threads_per_rank"]}
    if threads != {cpus_per_worker}:
        console.print(
            f"[yellow]warning:[/yellow] torchrun workers ran {sorted(threads)} torch threads, "
            f"rayapp's workers run {cpus_per_worker}; the comparison is not like for like"
        )
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
        sys.executable,
        "-m",
        "rayapp",
        "submit",
        *rayapp_layout(args),
        "--backend",
        "gloo",
        "--epochs",
        str(args.epochs),
        args.job,
        "--experiment",
        EXPERIMENT,
        "--tracking-uri",
        tracking_uri,
        "--storage-path",
        str(tmp / "results"),
    ]
    commands.append(shown(command, child_env()))
    step = Step(
        "rayapp",
        command,
        env=child_env(),
        log_path=tmp / "rayapp.log",
        timeout_s=args.step_timeout,
        classify=classify_rayapp,
    )
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
            raise StepFailed(
                f"rayapp's run {run_id} has {key} for steps {[m.step for m in metrics]}, "
                f"expected 0..{epochs - 1}"
            )
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


def time_log_epoch(
    tracking_uri: str, calls: int, sample: dict, tmp: Path
) -> dict[str, list[float]]:
    """What rank 0 spends per epoch on MLflow, against a fresh run in the same SQLite store.

    `call`: the `RunLogger.log_epoch` call in the training loop. `write`: the MLflow write itself.
    RunLogger hands records to a background sender (rayapp.tracking.outbox): the call only enqueues
    and the write runs on the sender thread, in the same one-CPU worker process as training: both
    count.
    """
    from mlflow.tracking import MlflowClient

    def new_run(name: str) -> str:
        return open_run(
            tracking_uri=tracking_uri,
            experiment=LOG_COST_EXPERIMENT,
            run_name=name,
            params={"calls": str(calls)},
            tags={},
        )

    metrics = {key: float(sample.get(key, 1.0)) for key in EPOCH_METRICS}
    run_id = new_run("log-epoch-call")
    logger = RunLogger(
        tracking_uri, run_id, fallback_path=str(tmp / "logcost.mlflow-fallback.jsonl")
    )
    logger.set_tags({TAG_ATTEMPTS: "1"})  # rank 0 has used its logger before its first epoch
    logger.log_epoch(0, metrics)
    call = []
    for epoch in range(1, calls + 1):
        started = time.perf_counter()
        logger.log_epoch(epoch, metrics)
        call.append(time.perf_counter() - started)
        time.sleep(0.05)  # epochs are apart; let a background sender deliver before the next call
    logger.close()
    close_run(tracking_uri, run_id, "FINISHED")

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
