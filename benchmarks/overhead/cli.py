"""The benchmark's flags, its pairs of runs, and the figures it reports and writes (`main`)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchmarks.overhead as package
from benchmarks.median_interval import median_interval, verdict_at_most
from benchmarks.overhead.common import (
    PROG,
    TARGET_LOG_SHARE,
    TARGET_RATIO,
    StepFailed,
    console,
    fail,
)
from benchmarks.overhead.processes import become_subreaper
from benchmarks.overhead.report import report
from benchmarks.overhead.runs import intervals, run_pair, time_log_epoch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description=package.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--job", default="jobs/mlp_synthetic.yaml", help="rayapp job YAML (default: %(default)s)"
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=6,
        help="epochs for both runs; the first is warm-up (default: %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=2, help="world size (default: %(default)s)")
    parser.add_argument(
        "--layout",
        choices=("one-node", "node-per-worker"),
        default="one-node",
        help="rayapp's workers on one embedded Ray node, one raylet and its daemons as on the one "
        "machine torchrun runs on; or one node each, Ray's per-node daemons once per worker, "
        "as W machines would run it (default: %(default)s)",
    )
    parser.add_argument(
        "--one-node",
        dest="layout",
        action="store_const",
        const="one-node",
        help="the same as --layout one-node",
    )
    parser.add_argument(
        "--baseline-comm-clock",
        choices=("none", "rayapp"),
        default="none",
        help="give the torchrun baseline rayapp's per-step comm clock, to separate what rayapp's "
        "comm timing costs from the rest (default: %(default)s)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="torchrun/rayapp pairs to run, alternating which goes first; the ratio verdict uses a "
        "95%% interval for the median of the pairs' ratios, which needs 6 or more; on a "
        "machine whose speed drifts, 20-30 (default: %(default)s)",
    )
    parser.add_argument(
        "--log-calls",
        type=int,
        default=20,
        help="timed MLflow log_epoch calls (default: %(default)s)",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=600,
        help="seconds each run may take (default: %(default)s)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to leave the cores alone "
        "(under a quarter of a core); 0 only checks and warns (default: %(default)s)",
    )
    parser.add_argument("--json-out", help="write the figures to this JSON file")
    parser.add_argument(
        "--keep-tmp", action="store_true", help="keep the temporary directory (logs, MLflow store)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from rayapp.spec import SpecError
    from rayapp.spec.loader import load_spec

    script_started = time.monotonic()
    become_subreaper()
    # Started in the background, a script inherits SIGINT ignored, and so would its children (rayapp
    # could then not be asked to stop cleanly). A handler of our own is reset to the default on
    # exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("mlflow", "alembic"):  # database set-up notes at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.epochs < 2 or args.workers < 1 or args.log_calls < 1 or args.pairs < 1:
        fail(
            "need --epochs >= 2 (the first is warm-up), --workers >= 1, --log-calls >= 1 and "
            f"--pairs >= 1; got --epochs {args.epochs} --workers {args.workers} "
            f"--log-calls {args.log_calls} --pairs {args.pairs}"
        )
        return 2
    args.job = str(Path(args.job).resolve())
    try:
        nodes = 1 if args.layout == "one-node" else args.workers
        spec = load_spec(
            args.job,
            {
                "cluster.nodes": nodes,
                "cluster.workers_per_node": args.workers // nodes,
                "train.epochs": args.epochs,
            },
        )
    except SpecError as exc:
        fail(str(exc))
        return 2
    if spec.train.strategy != "ddp":
        fail(
            f"train.strategy {spec.train.strategy!r}: "
            "the torchrun baseline is plain DDP; use a ddp job"
        )
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
        console.print(
            f"[bold]MLflow log_epoch cost[/bold] ({args.log_calls} calls, {last['tracking_uri']})"
        )
        log_cost = time_log_epoch(
            last["tracking_uri"],
            args.log_calls,
            last["rayapp"]["metrics_of_last_epoch"],
            last["dir"],
        )
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

    figures = collect_figures(args, spec, pairs, log_cost, commands, script_started)
    if args.json_out:  # first, so that the figures of a long run survive a fault in the report
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    report(figures, commands)
    console.print(f"benchmark took {figures['script_wall_s']:.0f}s")
    if args.json_out:
        console.print(f"figures written to {args.json_out}")
    return 0


def collect_figures(
    args: argparse.Namespace,
    spec,
    pairs: list[dict],
    log_cost: dict,
    commands: list[str],
    script_started: float,
) -> dict:
    """Every figure of the benchmark, as the report prints them and --json-out writes them: medians
    over the pairs, and the last pair's per-epoch lists and CPU split."""
    last = pairs[-1]
    baseline, rayapp = last["torchrun"], last["rayapp"]
    ratios = [pair["ratio"] for pair in pairs]
    ratio = statistics.median(ratios)
    ratio_interval = median_interval(ratios, 0.95)
    torchrun_epoch = statistics.median(pair["torchrun_epoch_s"] for pair in pairs)
    rayapp_epoch = statistics.median(pair["rayapp_epoch_s"] for pair in pairs)
    torchrun_walls = intervals(baseline["epoch_end_s"])
    rayapp_walls = intervals(rayapp["logged_at_s"])
    log_share = statistics.median(pair["log_share"] for pair in pairs)
    return {
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
        "pairs": [
            {k: v for k, v in pair.items() if k not in ("torchrun", "rayapp", "dir")}
            for pair in pairs
        ],
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
        # per pair, like the epoch figures: the last pair's walls against all pairs' epochs would
        # mix two machines' speeds
        "torchrun_wall_s": statistics.median(pair["torchrun_wall_s"] for pair in pairs),
        "rayapp_wall_s": statistics.median(pair["rayapp_wall_s"] for pair in pairs),
        "wall_ratio": statistics.median(
            pair["rayapp_wall_s"] / pair["torchrun_wall_s"] for pair in pairs
        ),
        "rayapp_wall_over_epoch_s": statistics.median(
            pair["rayapp_wall_s"] - pair["rayapp_epoch_s"] for pair in pairs
        ),
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
