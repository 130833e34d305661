"""Cold vs warm submit: what `rayapp cluster up` saves on a short job, measured in one run.

Alternates a cold submit (rayapp starts and stops its own embedded cluster) with a warm one (the
cluster `rayapp cluster up` left running), `--rounds` times each, on the same job, and prints the
wall time of the whole command and each start-up phase the run logged in MLflow
(`startup_cluster_s`, `startup_workers_s`, `time_to_first_step_s`), with the warm/cold ratio of the
medians, and the warm/cold ratio of each pair (one cold submit and the warm one after it) with
their median and range. Alternating spreads whatever else the machine does over both sides. Every
submit is a new `python -m rayapp` process. Each warm submit waits until the warm cluster is idle
(it has been up a while, as a warm cluster in use has: right after `cluster up` its nodes still
start their agents). A warm submit starts in the cluster's preloaded driver (rayapp.cli.preloaded)
unless it declines; each line says which.

    python benchmarks/warm_start.py  # seed_linear, 2 nodes, 3 epochs, 3 rounds
    python benchmarks/warm_start.py --rounds 5 --job jobs/mlp_synthetic.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayapp.tracking.run import STARTUP_METRICS

REPO = Path(__file__).resolve().parent.parent


def rayapp(*args: str, cwd: str, env: dict) -> tuple[float, str]:
    """Run the CLI; its wall time in seconds and its output. Fails loudly: a failed submit is no
    measurement."""
    started = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, "-m", "rayapp", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            stdout, stderr = process.communicate()
        except BaseException:  # the benchmark is stopped: so is the command, its run and cluster
            process.terminate()
            process.wait(timeout=120)
            raise
    if process.returncode != 0:
        sys.exit(f"rayapp {' '.join(args)} failed ({process.returncode}): {stderr.strip()[-500:]}")
    return time.perf_counter() - started, stdout + stderr


def newest_run_metrics(workdir: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("rayapp")
    assert experiment is not None, f"no experiment 'rayapp' in {workdir}/mlflow.db"
    (run,) = client.search_runs(
        [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1
    )
    return run.data.metrics


def settle(state_dir: str, window_s: float = 2.0, limit_s: float = 30.0) -> float:
    """Wait until the warm cluster's processes (its nodes' and its preloaded driver's) use under a
    tenth of a core over `window_s`, at most `limit_s`; the seconds waited. A warm cluster is one
    that has been up a while: right after `cluster up` its nodes still start their agents."""
    import psutil

    record = json.loads((Path(state_dir) / "cluster.json").read_text())
    roots = [*map(int, record["leaders"]), *map(int, record.get("driver", {}))]

    def cpu_seconds() -> float:
        total = 0.0
        for root in roots:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(root)
                for member in [process, *process.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = member.cpu_times()
                        total += times.user + times.system
        return total

    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        before = cpu_seconds()
        time.sleep(window_s)
        if cpu_seconds() - before < 0.1 * window_s:
            break
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(REPO / "jobs" / "seed_linear.yaml"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--no-preloaded-driver",
        action="store_true",
        help=(
            "warm cluster without its preloaded driver: "
            "every submit imports torch, Ray Train, MLflow"
        ),
    )
    args = parser.parse_args()
    # Stopped by `timeout` or a scheduler: the command under way is stopped (SIGTERM: it ends its
    # run and its own cluster), then the warm cluster (the `finally` below).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    up = (
        "cluster",
        "up",
        "--nodes",
        str(args.nodes),
        *(["--no-preloaded-driver"] if args.no_preloaded_driver else []),
    )

    workdir = tempfile.mkdtemp(prefix="rayapp-warm-bench-")
    # A state directory of this benchmark's own: a warm cluster the user keeps is neither used nor
    # stopped.
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["RAYAPP_STATE_DIR"] = os.path.join(workdir, "state")
    submit = ("submit", "--nodes", str(args.nodes), "--epochs", str(args.epochs), args.job)
    figures: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    up_s, _ = rayapp(*up, cwd=workdir, env=env)
    settle(env["RAYAPP_STATE_DIR"])
    try:
        for round_ in range(args.rounds):
            for kind in ("cold", "warm"):
                if kind == "cold":  # stop the warm one for the cold submit, then bring it back
                    rayapp("cluster", "down", cwd=workdir, env=env)
                wall, output = rayapp(*submit, cwd=workdir, env=env)
                if kind == "cold":
                    up_s, _ = rayapp(*up, cwd=workdir, env=env)
                    settled_s = settle(env["RAYAPP_STATE_DIR"])
                metrics = newest_run_metrics(workdir)
                figures[kind].append(
                    {"wall_s": wall, **{k: metrics.get(k, float("nan")) for k in STARTUP_METRICS}}
                )
                # A warm submit the preloaded driver declined (and said why) ran in its own process.
                how = " (preloaded driver)" if "from its preloaded driver" in output else ""
                if kind == "cold":
                    how = f", then the warm cluster up and settled in {up_s + settled_s:.0f} s"
                print(f"round {round_ + 1} {kind}: {wall:.1f} s{how}", flush=True)
    finally:
        rayapp("cluster", "down", cwd=workdir, env=env)
    report(figures, args, up_s)


def report(figures: dict, args: argparse.Namespace, up_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=(
            f"{Path(args.job).name}, {args.nodes} nodes, {args.epochs} epochs: "
            f"median of {args.rounds} submits each, {datetime.date.today()}, "
            f"{platform.node()} ({os.cpu_count()} cores)"
        )
    )
    for column in ("figure", "cold", "warm", "warm / cold"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for key in ("wall_s", *STARTUP_METRICS):
        cold = statistics.median(f[key] for f in figures["cold"])
        warm = statistics.median(f[key] for f in figures["warm"])
        table.add_row(key, f"{cold:.2f} s", f"{warm:.2f} s", f"{warm / cold:.2f}" if cold else "-")
    Console(width=160).print(table)
    ratios = [
        warm["wall_s"] / cold["wall_s"]
        for cold, warm in zip(figures["cold"], figures["warm"], strict=True)
    ]
    print(
        f"warm / cold wall time per pair: median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs "
        f"({', '.join(f'{ratio:.2f}' for ratio in ratios)})"
    )
    flag = " --no-preloaded-driver" if args.no_preloaded_driver else ""
    print(f"`rayapp cluster up --nodes {args.nodes}{flag}` itself: {up_s:.1f} s, paid once")


if __name__ == "__main__":
    main()
